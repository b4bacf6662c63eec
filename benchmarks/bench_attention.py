"""Benchmark the Triton attention kernels on the GPU against ceilings measured in the same run.

    python benchmarks/bench_attention.py [--batch 8 --context 32768 --prefill-len 4096]

* Paged decode attention, batch x context tokens, Llama-3-8B-shaped (32 query heads, 8 KV heads,
  head_dim 128), one query per sequence: FP8 KV (E4M3, per-head K scales, 1x128 V scales; V pages
  dimension-major, the default, and token-major) and bf16 KV, a few tile / split configurations each.
  Reports microseconds and TB/s of KV bytes read (data + scales) next to the HBM copy bandwidth
  (1 GiB clone, read + write) measured here, plus
  torch scaled_dot_product_attention on contiguous bf16 K/V as a baseline.
* Prefill flash attention, batch x 32 heads x prefill-len x 128, causal: TFLOP/s (causal FLOPs =
  2 * 2 * b * h * t * t * d / 2) for bf16 and FP8 inputs next to torch SDPA bf16 (flash backend).

Every case is timed independently (a failure prints and the run continues). Prints the hardware
fingerprint; writes bench_attention.{json,txt} under $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Report, copy_ceiling, fingerprint, time_us  # noqa: E402


def fill_cache(cache, batch: int, context: int, chunk: int = 4096) -> None:
    """Write `context` random tokens to sequences 0..batch-1 of layer 0, `chunk` tokens per write call."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in range(batch):
        cache.allocate(s, context)
    for start in range(0, context, chunk):
        t = min(chunk, context - start)
        for s in range(batch):
            k = torch.randn(1, cache.kv_heads, t, cache.head_dim, device="cuda", generator=g)
            v = torch.randn(1, cache.kv_heads, t, cache.head_dim_v, device="cuda", generator=g)
            cache.write(0, [s], [start], k, v)


def bench_decode(rep: Report, args, copy_tbs: float) -> None:
    """Paged decode attention, FP8 and bf16 KV, vs the copy ceiling and SDPA on contiguous bf16 K/V."""
    from engine.kernels.attention import flash_attention
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention

    b, ctx, h, hkv, d = args.batch, args.context, 32, 8, 128
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    rep.say(f"\n== paged decode attention: batch {b} x {ctx} context, {h} heads / {hkv} KV heads, d {d}, tq 1 ==")
    rep.say(f"{'cache':7} {'page':>4} {'block_n':>7} {'splits':>6} {'warps':>5} {'stages':>6} {'us':>9} "
            f"{'KV GB':>7} {'TB/s':>6} {'% copy':>7}")
    for dtype, name, layout in ((torch.float8_e4m3fn, "fp8", "dim"), (torch.float8_e4m3fn, "fp8-tok", "token"),
                                (torch.bfloat16, "bf16", "token")):
        page = args.page
        nblocks = b * (-(-ctx // page))
        try:
            cache = PagedKVCache(1, nblocks, page, hkv, d, dtype=dtype, max_seqs=b, device="cuda", v_layout=layout)
            t0 = time.time()
            fill_cache(cache, b, ctx)
            torch.cuda.synchronize()
            rep.say(f"({name} cache filled in {time.time() - t0:.1f} s)")
        except Exception as exc:
            rep.say(f"{name} cache: FAILED {type(exc).__name__}: {exc}")
            continue
        kv_bytes = cache.kv_bytes(b * ctx)
        # (block_n, num_splits, num_warps, num_stages; None: the wrapper's default); the first row is the
        # wrapper's defaults (FP8: dimension-major V pages, 2 warps, 5 stages, 8 splits here); fp8-tok
        # (token-major V pages) and bf16 are comparisons
        configs = [(64, None, None, None), (64, 4, 4, 5), (64, 16, 2, 5), (128, None, 2, 4), (32, 16, 1, 6),
                   (64, None, 4, 3), (128, 16, 8, 3)]
        if name != "fp8":
            configs = [(64, None, None, None), (64, 8, 2, 5)]
        for bn, splits, warps, stages in configs:
            label = f"decode {name} bn{bn} s{splits} w{warps} st{stages}"

            def one(bn=bn, splits=splits, warps=warps, stages=stages, label=label):
                fn = lambda: paged_decode_attention(q, cache, 0, block_n=bn, num_splits=splits,  # noqa: E731
                                                    num_warps=warps, num_stages=stages)
                fn()
                ms = time_us(fn, reps=50) / 1e3
                tbs = kv_bytes / (ms * 1e-3) / 1e12
                rep.say(f"{name:7} {page:4d} {bn:7d} {str(splits or 'auto'):>6} {str(warps or 'auto'):>5} "
                        f"{str(stages or 'auto'):>6} "
                        f"{ms * 1e3:9.1f} {kv_bytes / 1e9:7.3f} {tbs:6.2f} {100 * tbs / copy_tbs:6.1f}%")
                rep.records.append({"case": label, "dtype": name, "page": page, "block_n": bn, "splits": splits,
                                    "num_warps": warps, "num_stages": stages, "us": ms * 1e3,
                                    "kv_bytes": kv_bytes, "tb_s": tbs, "frac_copy": tbs / copy_tbs})

            rep.case(label, one)

        def check():
            out = paged_decode_attention(q, cache, 0)
            kd, ks, vd, vs = cache.gather(0, 0, dequantize=False)
            pos = torch.arange(ctx, device="cuda")
            pre = flash_attention(q[:1], kd, vd, pos[-1:], pos, k_scale=ks, v_scale=vs)
            err = ((out[:1] - pre).abs().max() / pre.abs().max()).item()
            rep.say(f"  {name}: decode vs prefill kernel on sequence 0, max rel err {err:.2e}")
            rep.records.append({"case": f"decode {name} check", "rel_err_vs_prefill": err})

        rep.case(f"decode {name} check", check)
        torch.cuda.empty_cache()

    def sdpa():
        k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        fn()
        ms = time_us(fn, reps=50) / 1e3
        nbytes = 2 * k.numel() * 2
        tbs = nbytes / (ms * 1e-3) / 1e12
        rep.say(f"torch SDPA bf16 contiguous K/V (enable_gqa): {ms * 1e3:.1f} us, {tbs:.2f} TB/s "
                f"({100 * tbs / copy_tbs:.1f}% of copy)")
        rep.records.append({"case": "decode sdpa bf16", "us": ms * 1e3, "kv_bytes": nbytes, "tb_s": tbs})

    rep.case("decode sdpa bf16", sdpa)


def bench_prefill(rep: Report, args) -> None:
    """Causal prefill flash attention TFLOP/s, bf16 and FP8 inputs, vs torch SDPA bf16."""
    from engine.formats import quantize
    from engine.kernels.attention import flash_attention

    b, h, t, d = args.batch, 32, args.prefill_len, 128
    flops = 4 * b * h * t * t * d / 2
    rep.say(f"\n== prefill flash attention: {b} x {h} heads x {t} x {d}, causal ({flops / 1e12:.2f} TFLOP) ==")
    q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, device="cuda")
    results: dict[str, float] = {}

    def record(name: str, ms: float) -> None:
        tf = flops / (ms * 1e-3) / 1e12
        results[name] = tf
        rep.say(f"{name:44} {ms:8.3f} ms {tf:7.1f} TFLOP/s")
        rep.records.append({"case": f"prefill {name}", "ms": ms, "tflops": tf})

    def sdpa():
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        fn()
        record("torch SDPA bf16 (is_causal)", time_us(fn, reps=100) / 1e3)

    rep.case("prefill sdpa", sdpa)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:1], k[:1], v[:1], is_causal=True)
    ref = ref.transpose(1, 2).reshape(1, t, h * d).float()
    for bm, bn, warps, stages in [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3)]:
        name = f"triton bf16 bm{bm} bn{bn} w{warps} st{stages}"

        def one(bm=bm, bn=bn, warps=warps, stages=stages, name=name):
            fn = lambda: flash_attention(q, k, v, pos, pos, block_m=bm, block_n=bn,  # noqa: E731
                                         out_dtype=torch.bfloat16, num_warps=warps, num_stages=stages)
            out = fn()
            err = ((out[:1].float() - ref).abs().max() / ref.abs().max()).item()
            record(name, time_us(fn, reps=100) / 1e3)
            rep.say(f"{'':44} max rel err vs SDPA {err:.1e}")

        rep.case(name, one)

    def fp8():
        qq = quantize(q.float(), "e4m3:token")
        kq = quantize(k.float().transpose(0, 1).reshape(h, -1), "e4m3:token")
        vq = quantize(v.float(), "e4m3:1x128")
        kd = kq.data.reshape(h, b, t, d).transpose(0, 1)
        ks = kq.scale.reshape(h)[None].expand(b, h)
        fn = lambda: flash_attention(qq.data, kd, vq.data, pos, pos, q_scale=qq.scale, k_scale=ks,  # noqa: E731
                                     v_scale=vq.scale, block_m=128, block_n=64, out_quant="e4m3:1x128",
                                     num_warps=8, num_stages=3)
        fn()
        record("triton FP8 in / FP8 1x128 out bm128 bn64", time_us(fn, reps=100) / 1e3)

    rep.case("prefill fp8", fp8)
    if "torch SDPA bf16 (is_causal)" in results:
        best = max((v_ for n, v_ in results.items() if n.startswith("triton bf16")), default=float("nan"))
        rep.say(f"best Triton bf16 / SDPA bf16: {best / results['torch SDPA bf16 (is_causal)']:.2f}x")


def main() -> int:
    """Run all cases; write $OUT/bench_attention.{json,txt}."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--page", type=int, default=64, help="KV cache block size (16/32/64/128/256)")
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    rep = Report()
    t_start = time.time()
    fp = fingerprint()
    rep.say(json.dumps(fp))
    copy_tbs = copy_ceiling()["tbs"]
    rep.say(f"HBM copy ceiling (read+write, 1 GiB clone): {copy_tbs:.2f} TB/s")
    if not args.skip_decode:
        bench_decode(rep, args, copy_tbs)
    if not args.skip_prefill:
        bench_prefill(rep, args)
    rep.say(f"\n(total {time.time() - t_start:.0f} s)")
    rep.write("bench_attention", {"fingerprint": fp, "copy_tb_s": copy_tbs, "results": rep.records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
