"""Benchmark the quantized GEMMs on the GPU: achieved vs ceilings measured in the same run.

    python benchmarks/bench_gemm.py [--only prefill,decode,mx]   # writes $OUT/bench_gemm.{json,txt} when OUT is set

Sections (every case is independent: a failure is printed and the run continues):

1. ceilings: HBM copy bandwidth (1 GiB clone, read + write) and HBM read bandwidth (1 GiB, clean L2);
2. prefill 8192^3: FP8 block (1x128 x 128x128) through ``fp8_block_linear`` (cuBLAS blockwise,
   padded scales), the Triton blockwise fallback, per-tensor ``_scaled_mm``, bf16 ``torch.mm``
   (target >= 1200 TFLOP/s for FP8 block);
3. decode M = 1, 4, 16 at N x K = 28672x4096, 4096x14336, 7168x16384: the Triton small-M kernel
   vs bf16 cuBLAS ``F.linear`` and cuBLAS blockwise FP8 (M padded to 4): us, TB/s of weight bytes
   (FP8 data + fp32 scales; bf16: 2 bytes/weight), % of the read ceiling, speed-up vs bf16
   (targets >= 3.0 TB/s and >= 1.6x), back to back in a CUDA graph as the engine runs decode (the
   acceptance timing) and one call after a clean and after a dirty L2 flush (see Timing; `decode_section`);
   plus a split-K sweep at M = 1 for tuning;
4. MX / NVFP4 dequant-in-kernel GEMMs at 4096^3 (TFLOP/s) and M = 1, 4096x4096 (us, TB/s).

Timing: `benchmarks.common.time_us` (one call after an L2 flush, the host held back by a GPU sleep, CUDA events,
median of the reps) and `graph_us` (back to back in a CUDA graph over weight copies). A written ("dirty") flush leaves
~50 MB of modified lines in L2, whose write-back the timed call pays -- for a read-only decode GEMM that is a third of
its own traffic, which a real decode step does not have; the decode section shows both flushes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (COPY_BYTES, DEVICE, FLUSHES, GRAPH_ROTATE_BYTES, Report, copy_ceiling,  # noqa: E402
                               fingerprint, fp8_operand, graph_us, host_us, matmul_ceilings, read_ceiling, time_us)

DECODE_SHAPES = [(28672, 4096), (4096, 14336), (7168, 16384)]  # (N, K)
DECODE_M = [1, 4, 16]
PREFILL = 8192  # M = N = K of the prefill GEMMs
MX_SIZE = 4096  # N = K (and M of the large case) of the MX GEMMs
TARGET_PREFILL_TFLOPS = 1200.0
TARGET_DECODE_TBS = 3.0
TARGET_DECODE_SPEEDUP = 1.6


def fp8_block_operands(m: int, n: int, k: int, seed: int = 0):
    """Random e4m3:1x128 activations / e4m3:128x128 weights (values only need to be realistic, not quantized)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    xd, wd = fp8_operand(m, k, g), fp8_operand(n, k, g)
    xs = torch.rand(m, -(-k // 128), device=DEVICE, generator=g) * 1e-2 + 1e-3
    ws = torch.rand(-(-n // 128), -(-k // 128), device=DEVICE, generator=g) * 1e-3 + 1e-4
    return xd, xs, wd, ws


SECTIONS = ("prefill", "decode", "mx")


def main(argv: list[str] | None = None) -> int:
    """Run the ceilings and the chosen sections; print the tables; write JSON + text under $OUT."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    only = set(ap.parse_args(argv).only.split(","))
    if only - set(SECTIONS):
        ap.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}; choose from {SECTIONS}")
    from engine.kernels import gemm as G

    rep = Report()
    say = rep.say

    def case(section: str, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        r = rep.case(name, fn, section=section)
        if r is not None:
            r.update(section=section, case=name)
            rep.records.append(r)
        return r

    fp = fingerprint()
    say("# bench_gemm: quantized GEMMs, achieved vs ceilings measured in this run")
    say(json.dumps(fp))
    say(f"F.scaled_mm available: {G.has_scaled_mm()}")

    # ---------------------------------------------------------------- 1. ceilings
    say("\n## ceilings")
    r = case("ceiling", "hbm_copy", copy_ceiling)
    copy_tbs = r["tbs"] if r else float("nan")
    say(f"  HBM copy ({COPY_BYTES / 2**30:g} GiB clone, read+write): {copy_tbs:.2f} TB/s")
    r = case("ceiling", "hbm_read", read_ceiling)
    read_tbs = r["tbs"] if r else float("nan")
    if r:
        say(f"  HBM read ({COPY_BYTES / 2**30:g} GiB, clean L2): {read_tbs:.2f} TB/s (Triton stream "
            f"{r['triton_tbs']:.2f}, torch amax {r['amax_tbs']:.2f})")

    # ---------------------------------------------------------------- 2. prefill
    if "prefill" in only:
        prefill_section(say, case, G)
    if "decode" in only:
        decode_section(say, case, G, copy_tbs, read_tbs)
    if "mx" in only:
        mx_section(say, case, G, copy_tbs)
    rep.write("bench_gemm", {"fingerprint": fp, "copy_tbs": copy_tbs, "read_tbs": read_tbs, "rows": rep.records})
    return 0


def prefill_section(say, case, G) -> None:
    """FP8 block / per-tensor / bf16 GEMMs at PREFILL^3 (TFLOP/s)."""
    say(f"\n## prefill {PREFILL}^3 (TFLOP/s; target FP8 block >= {TARGET_PREFILL_TFLOPS:.0f})")
    m = n = k = PREFILL
    flops = 2.0 * m * n * k
    xd, xs, wd, ws = fp8_block_operands(m, n, k)
    prefill = {}

    def prefill_case(name, fn):
        def run():
            us = time_us(fn)
            return {"us": us, "tflops": flops / (us * 1e-6) / 1e12}
        r = case("prefill", name, run)
        if r:
            prefill[name] = r["tflops"]
            say(f"  {name:44} {r['us']:9.1f} us {r['tflops']:8.1f} TFLOP/s")

    ceil = matmul_ceilings(m, n, k, ("bf16", "fp8_tensor"))  # the ceilings: cuBLAS bf16 and per-tensor FP8

    def measured(c: dict) -> dict:
        if "error" in c:
            raise RuntimeError(c["error"])
        return dict(c)

    for kind, name in (("bf16", "bf16 torch.mm"), ("fp8_tensor", "fp8 per-tensor torch._scaled_mm")):
        r = case("prefill", name, lambda c=ceil[kind]: measured(c))
        if r:
            prefill[name] = r["tflops"]
            say(f"  {name:44} {r['us']:9.1f} us {r['tflops']:8.1f} TFLOP/s")
    prefill_case("fp8 block scaled_mm_blockwise (cuBLAS)", lambda: G.scaled_mm_blockwise(xd, xs, wd, ws))
    prefill_case("fp8 block fp8_block_linear", lambda: G.fp8_block_linear(xd, xs, wd, ws))
    prefill_case("fp8 block Triton fallback", lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws))
    blk = prefill.get("fp8 block fp8_block_linear")
    if blk is not None:
        ref = prefill.get("fp8 per-tensor torch._scaled_mm")
        say(f"  -> FP8 block {blk:.0f} TFLOP/s: {'MEETS' if blk >= TARGET_PREFILL_TFLOPS else 'BELOW'} target "
            f"{TARGET_PREFILL_TFLOPS:.0f}; {blk / prefill.get('bf16 torch.mm', float('nan')):.2f}x bf16"
            + (f"; {100 * blk / ref:.0f}% of per-tensor FP8" if ref else ""))



def decode_section(say, case, G, copy_tbs: float, read_tbs: float) -> None:
    """Decode-shaped GEMMs (M = 1, 4, 16): the Triton kernels vs bf16 cuBLAS and cuBLAS blockwise FP8.

    Each case is timed three ways: per call in a CUDA graph of 48 back-to-back calls that cycle through copies
    of the weights (GRAPH_ROTATE_BYTES in all, so no call finds its weights in L2), as the engine's captured
    decode step runs them -- the acceptance timing: launches overlap (PDL, back-to-back launches) for bf16 and
    FP8 alike; one call after a clean L2 flush (`common.evict_l2`), which adds each call's own launch and ramp, shown
    as well; and one call after a dirty flush, which also charges the call the write-back of ~50 MB of L2 lines
    it never wrote."""
    from engine.kernels import gemm_wgmma as gw
    from engine.kernels import decode_plan as P
    say(f"\n## decode (weight-bytes TB/s; ceilings: read {read_tbs:.2f} TB/s, copy {copy_tbs:.2f} TB/s; targets "
        f">= {TARGET_DECODE_TBS} TB/s and >= {TARGET_DECODE_SPEEDUP}x bf16, judged in the CUDA graph; one call "
        f"after a clean L2 flush shown as well)")
    say(f"  {'':17} {'one call, clean L2':^46} | {'one call, dirty L2':^26} | {'CUDA graph, back to back':^26} |")
    say(f"  {'N x K':13} {'M':>3} {'bf16 us':>8} {'TB/s':>5} {'fp8 us':>7} {'TB/s':>5} {'%read':>5} {'x bf16':>6} | "
        f"{'bf16 TB/s':>9} {'fp8 TB/s':>8} {'x bf16':>6} | {'bf16 TB/s':>9} {'fp8 TB/s':>8} {'x bf16':>6} | "
        f"{'cuBLAS blk x bf16':>17}  config")
    for n, k in DECODE_SHAPES:
        w16 = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
        _, _, wd, ws = fp8_block_operands(1, n, k, seed=n)
        fp8_bytes = wd.numel() + ws.numel() * 4
        for m in DECODE_M:
            xd, xs, _, _ = fp8_block_operands(m, 16, k, seed=m)
            x16 = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)

            def run(m=m, xd=xd, xs=xs, x16=x16, w16=w16, wd=wd, ws=ws, n=n, k=k):
                res = {"n": n, "k": k, "m": m}
                for fl in FLUSHES:
                    sfx = "" if fl == "clean" else "_dirty"
                    t16 = time_us(lambda: F.linear(x16, w16), flush=fl)
                    t8 = time_us(lambda: G.fp8_block_linear(xd, xs, wd, ws), flush=fl)
                    res.update({f"bf16_us{sfx}": t16, f"bf16_tbs{sfx}": n * k * 2 / (t16 * 1e-6) / 1e12,
                                f"fp8_us{sfx}": t8, f"fp8_tbs{sfx}": fp8_bytes / (t8 * 1e-6) / 1e12,
                                f"speedup_vs_bf16{sfx}": t16 / t8})
                # in a CUDA graph, back to back, each call on another copy of the weights (L2 holds none of it)
                c8, c16 = (max(2, -(-GRAPH_ROTATE_BYTES // b)) for b in (fp8_bytes, n * k * 2))
                w8s = [(wd, ws)] + [(wd.clone(), ws.clone()) for _ in range(c8 - 1)]
                w16s = [w16] + [w16.clone() for _ in range(c16 - 1)]
                g16 = graph_us([lambda w=w: F.linear(x16, w) for w in w16s], n=48)
                g8 = graph_us([lambda p=p: G.fp8_block_linear(xd, xs, *p) for p in w8s], n=48)
                del w8s, w16s
                res.update({"bf16_us_graph": g16, "bf16_tbs_graph": n * k * 2 / (g16 * 1e-6) / 1e12,
                            "fp8_us_graph": g8, "fp8_tbs_graph": fp8_bytes / (g8 * 1e-6) / 1e12,
                            "speedup_vs_bf16_graph": g16 / g8})
                h8 = host_us(lambda: G.fp8_block_linear(xd, xs, wd, ws))
                bm, bn, _, _ = P._tiles(m)
                pinned = P._decode_knobs(m, n, k, xd.device, {})  # the policy's decode entry, when one matches
                bn = pinned.get("block_n") or bn
                splits, _ = P._plan_split(m, n, -(-k // 128), bm, bn, xd.device, pinned.get("split_k"))
                if pinned:
                    cfg = f"entry {pinned}"
                elif n * k >= P.DEFAULT_POLICY.tune_min_weight:
                    cfg = f"split_k={splits} num_stages={P._decode_stages(-(-n // bn) * splits, P.sm_count(xd.device))}"
                else:
                    cfg = "fixed"
                try:
                    tcb = time_us(lambda: G.scaled_mm_blockwise(xd, xs, wd, ws), flush="clean")
                except Exception as exc:  # cuBLAS may refuse: the row still reports the Triton kernel
                    tcb = float("nan")
                    print(f"    cuBLAS blockwise M={m}: {str(exc).splitlines()[0]}")
                wgmma = m > 1 and bool(pinned.get("wgmma")) and gw.usable(
                    xd, wd, 64, pinned.get("num_stages") or gw.swap_stages(m, -(-k // 128), splits), gw.GPS,
                    splits, True)
                sliced = (m > 1 and not wgmma
                          and P._sliced_instead(xd, m, splits, bn, pinned.get("num_warps") or 4, pinned))
                res.update({"cublas_block_us": tcb, "cublas_speedup_vs_bf16": res["bf16_us"] / tcb,
                            "split_k": splits, "block_m": bm, "block_n": bn, "tuned_config": cfg, "fp8_host_us": h8,
                            "sliced": sliced, "wgmma": wgmma,
                            "gemv": m == 1 and P.DEFAULT_POLICY.gemv_m1,
                            "gemv_config": P._gemv_knobs(n, k, xd.device) or None})
                return res

            r = case("decode", f"{n}x{k} M={m}", run)
            if r:
                ok = r["fp8_tbs"] >= TARGET_DECODE_TBS and r["speedup_vs_bf16"] >= TARGET_DECODE_SPEEDUP
                ok_graph = (r["fp8_tbs_graph"] >= TARGET_DECODE_TBS
                            and r["speedup_vs_bf16_graph"] >= TARGET_DECODE_SPEEDUP)
                # meets_target: one call after a clean flush; meets_target_graph: the CUDA graph (the acceptance)
                r["meets_target"], r["meets_target_graph"] = ok, ok_graph
                kern = ((f"GEMV entry {r['gemv_config']}" if r["gemv_config"] else "GEMV") if r["gemv"] else
                        f"{'wgmma' if r.get('wgmma') else 'sliced' if r.get('sliced') else 'split'}={r['split_k']} "
                        f"BN={r['block_n']} "
                        f"{r['tuned_config']}")
                say(f"  {n:>5}x{k:<7} {m:>3} {r['bf16_us']:8.1f} {r['bf16_tbs']:5.2f} {r['fp8_us']:7.1f} "
                    f"{r['fp8_tbs']:5.2f} {100 * r['fp8_tbs'] / read_tbs:4.0f}% {r['speedup_vs_bf16']:5.2f}x | "
                    f"{r['bf16_tbs_dirty']:9.2f} {r['fp8_tbs_dirty']:8.2f} {r['speedup_vs_bf16_dirty']:5.2f}x | "
                    f"{r['bf16_tbs_graph']:9.2f} {r['fp8_tbs_graph']:8.2f} {r['speedup_vs_bf16_graph']:5.2f}x | "
                    f"{r['cublas_speedup_vs_bf16']:16.2f}x  {kern} host={r['fp8_host_us']:.0f}us "
                    f"graph {'ok' if ok_graph else 'BELOW'} (one call {'ok' if ok else 'BELOW'})")
        del w16, wd, ws

    say("\n## split-K sweep, fp8 Triton decode kernel, M = 1 (us; heuristic choice marked *)")
    for n, k in DECODE_SHAPES:
        _, _, wd, ws = fp8_block_operands(1, n, k, seed=n)
        xd, xs, _, _ = fp8_block_operands(1, 16, k, seed=1)
        splits_h, _ = P._plan_split(1, n, -(-k // 128), 16, 64, xd.device, None)
        parts = []
        for s in (1, 2, 4, 8, 16):
            r = case("splitk_sweep", f"{n}x{k} M=1 split={s}",
                     lambda s=s: {"us": time_us(lambda: G.fp8_block_gemm_triton(xd, xs, wd, ws, split_k=s)),
                                  "n": n, "k": k, "split_k": s})
            parts.append(f"{s}{'*' if s == splits_h else ''}: {r['us']:.1f}" if r else f"{s}: failed")
        say(f"  {n:>5}x{k:<7} " + "  ".join(parts))



def mx_section(say, case, G, copy_tbs: float) -> None:
    """MX / NVFP4 dequant-in-kernel GEMMs at MX_SIZE^3 (TFLOP/s) and M = 1 (weight TB/s)."""
    from engine.kernels import gemm_mx as GM
    say("\n## MX / NVFP4 dequant-in-kernel GEMMs (Triton; bf16 MMA, fp32 accumulation)")
    from engine.formats import quantize

    n = k = MX_SIZE
    g = torch.Generator(device=DEVICE).manual_seed(0)
    wsrc = torch.randn(n, k, device=DEVICE, generator=g)
    xsrc = torch.randn(MX_SIZE, k, device=DEVICE, generator=g)
    for xkind, wspec in [("mxfp8", "mxfp8"), ("bf16", "mxfp8"), ("bf16", "mxfp4"), ("bf16", "nvfp4")]:
        try:
            wp = GM.prepare_mx_weight(quantize(wsrc, wspec))
        except Exception as exc:
            say(f"  prepare {wspec} FAILED {exc}")
            continue
        for m in (MX_SIZE, 1):
            xm = xsrc[:m]
            if xkind == "mxfp8":
                q = quantize(xm, "mxfp8")
                args, kw = (q.data,), {"x_scale": q.scale}
            else:
                args, kw = (xm.to(torch.bfloat16),), {}

            def run(args=args, kw=kw, wp=wp, m=m):
                us = time_us(lambda: GM.mx_linear(*args, wp, **kw))
                return {"m": m, "n": n, "k": k, "us": us, "tflops": 2.0 * m * n * k / (us * 1e-6) / 1e12,
                        "weight_tbs": wp.nbytes / (us * 1e-6) / 1e12}

            r = case("mx", f"{xkind} x {wspec} M={m} N=K={n}", run)
            if r:
                say(f"  {r['case']:44} {r['us']:9.1f} us {r['tflops']:8.1f} TFLOP/s  weight {r['weight_tbs']:.2f} TB/s "
                    f"({100 * r['weight_tbs'] / copy_tbs:.0f}% of copy)")



if __name__ == "__main__":
    sys.exit(main())
