"""Benchmark the MoE experts on the GPU: grouped FP8 GEMMs and sorted vs unsorted dispatch, vs ceilings measured here.

    python benchmarks/bench_moe.py            # writes $OUT/bench_moe.{json,txt} when OUT is set

Part 1, grouped GEMM, 8 experts x 2048 tokens, K = N = 4096 (target >= 1000 TFLOP/s):
row-wise FP8 `torch._scaled_grouped_mm`, the Triton blockwise (1x128 x 128x128)
grouped kernel under a few tile configs, bf16 `torch._grouped_mm`; ceilings: a
dense row-wise FP8 `torch._scaled_mm` and a bf16 `mm` of the same total shape (`common.matmul_ceilings`).
Timing: `common.time_us` (CUDA events, L2 written before each call, host shielded; median).

Part 2, one MoE layer, top-8 routing of 1024 tokens over 64 experts (128
copies per expert, balanced), d = 2048, inter = 1408: the sorted dispatch
(`grouped_fp8_moe`: device sort, one gather, 3 grouped GEMMs, combine) next to
the unsorted one (`unsorted_fp8_moe`: a Python loop over experts with a mask,
nonzero and gather per expert), the dispatch (sort + permutation / masks +
gathers) timed on its own, and a bf16 `torch._grouped_mm` layer as the
reference point. Every case is caught on failure so the others still run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Report, fingerprint, matmul_ceilings, time_us  # noqa: E402

REPORT = Report()
say = REPORT.say
RESULTS: dict = {"grouped_gemm": [], "moe_layer": [], "dispatch": [], "errors": REPORT.records}


def bench(fn: Callable, reps: int = 25) -> float:
    """Median milliseconds per call (`common.time_us`: CUDA events, L2 written before each call, host shielded)."""
    return time_us(fn, reps=reps) / 1e3


def _block_weights(e: int, n: int, k: int, gen: torch.Generator):
    """Random block-quantized stacked expert weights (E, N, K): FP8 data + fp32 (E, N/128, K/128) scales.

    Built directly in the kernel layout (values ~ N(0, 1/K)) so the setup stays fast for 8 x 4096 x 4096.
    """
    from engine.kernels.moe import ExpertWeights

    w = torch.randn(e, n, k, device="cuda", generator=gen) / k ** 0.5
    blocks = w.view(e, n // 128, 128, k // 128, 128).abs().amax(dim=(2, 4))  # (E, N/128, K/128)
    scale = (blocks / 448.0).clamp_min(1e-12)
    data = (w / scale.repeat_interleave(128, 1).repeat_interleave(128, 2)).to(torch.float8_e4m3fn)
    return ExpertWeights(data.contiguous(), scale.float().contiguous()), w.to(torch.bfloat16)


def _act(m: int, k: int, gen: torch.Generator):
    """Random activations: 1x128 FP8 (data, scales) and the bf16 values."""
    from engine.kernels.quant import act_quant

    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    d, s = act_quant(x)
    return d, s, x


def ceilings(m: int, n: int, k: int) -> dict:
    """Dense row-wise FP8 `_scaled_mm` and bf16 mm of shape (m, n, k) in this run: TFLOP/s."""
    out = {}
    for kind, name, label in (("fp8_rowwise", "fp8_rowwise_scaled_mm", "FP8 row-wise _scaled_mm"),
                              ("bf16", "bf16_mm", "bf16 mm")):
        c = matmul_ceilings(m, n, k, (kind,))[kind]
        if "error" in c:
            say(f"  ceiling {label}: FAILED {c['error']}")
            continue
        out[name] = c["tflops"]
        say(f"  ceiling dense {label} {m}x{n}x{k}: {c['us']:.1f} us, {c['tflops']:.0f} TFLOP/s")
    return out


def part_grouped_gemm(gen: torch.Generator) -> None:
    """8 experts x 2048 tokens, K = N = 4096: one grouped projection, several implementations."""
    from engine.kernels.moe import grouped_gemm_block, grouped_gemm_rowwise, rowwise_expert_weights, tile_map

    e, per, n, k = 8, 2048, 4096, 4096
    m = e * per
    flops = 2.0 * m * n * k
    say(f"\n== grouped GEMM: {e} experts x {per} tokens, K = N = {n} (target >= 1000 TFLOP/s) ==")
    RESULTS["ceilings"] = ceil = ceilings(m, n, k)
    offsets = torch.arange(0, m + 1, per, device="cuda", dtype=torch.int32)
    w, wbf = _block_weights(e, n, k, gen)
    xd, xs, xb = _act(m, k, gen)

    def record(name: str, t: float, ceiling: str = "fp8_rowwise_scaled_mm") -> None:
        tf = flops / t / 1e9
        peak = ceil.get(ceiling)
        vs = f", {tf / peak:.2f}x dense {ceiling}" if peak else ""
        say(f"  {name:44s} {t * 1e3:8.1f} us  {tf:6.0f} TFLOP/s{vs}  [{'PASS' if tf >= 1000 else 'below'} 1000]")
        RESULTS["grouped_gemm"].append({"case": name, "us": t * 1e3, "tflops": tf, "target_tflops": 1000,
                                        "fraction_of_ceiling": tf / peak if peak else None})

    def rowwise():
        from engine.kernels.moe import rowwise_requant

        wr = rowwise_expert_weights(w)
        ar, sr = rowwise_requant(xd, xs)
        record("FP8 row-wise torch._scaled_grouped_mm", bench(lambda: grouped_gemm_rowwise(ar, sr, wr, offsets)))

    def triton_block(cfg: dict):
        def run():
            tiles = tile_map(offsets, m, cfg["BM"])
            record(f"FP8 blockwise Triton {cfg}",
                   bench(lambda: grouped_gemm_block(xd, xs, w, offsets, config=cfg, tiles=tiles)))
        return run

    def bf16():
        wt = wbf.transpose(1, 2)  # (E, K, N) view of the (E, N, K) weights
        record("bf16 torch._grouped_mm", bench(lambda: torch._grouped_mm(xb, wt, offs=offsets[1:])), "bf16_mm")

    REPORT.case("rowwise grouped", rowwise)
    for cfg in (dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=4),
                dict(BM=128, BN=256, GROUP_M=8, num_warps=8, num_stages=3),
                dict(BM=64, BN=256, GROUP_M=8, num_warps=4, num_stages=4)):
        REPORT.case(f"triton block {cfg}", triton_block(cfg))
    REPORT.case("bf16 grouped", bf16)


def _balanced_ids(tokens: int, experts: int, k: int, gen: torch.Generator):
    """Top-k routing with exactly tokens*k/experts copies per expert (distinct experts per token), random order."""
    ids = (torch.arange(tokens * k, device="cuda") % experts).view(tokens, k)  # (tokens, k), distinct per row
    ids = torch.randperm(experts, device="cuda", generator=gen)[ids]
    ids = ids[torch.randperm(tokens, device="cuda", generator=gen)]
    w = torch.rand(tokens, k, device="cuda", generator=gen)
    return w / w.sum(-1, keepdim=True), ids


def part_moe_layer(gen: torch.Generator) -> None:
    """64 experts x 128 copies (top-8 of 1024 tokens), d = 2048, inter = 1408: sorted vs unsorted dispatch."""
    from engine.kernels.moe import (FP8, combine, grouped_fp8_moe, permute_rows, rowwise_expert_weights,
                                    sort_by_expert, unsorted_fp8_moe)

    e, tokens, k, d, inter = 64, 1024, 8, 2048, 1408
    flops = 2.0 * tokens * k * 3 * d * inter
    say(f"\n== MoE layer: {tokens} tokens, top-{k} of {e} experts ({tokens * k // e} copies each), "
        f"d={d}, inter={inter} ==")
    weights, ids = _balanced_ids(tokens, e, k, gen)
    (wg, wgb), (wu, wub), (wd, wdb) = (_block_weights(e, inter, d, gen), _block_weights(e, inter, d, gen),
                                       _block_weights(e, d, inter, gen))
    xd, xs, xb = _act(tokens, d, gen)
    rw = {}

    def record(table: str, name: str, t: float, extra: str = "", **kw) -> None:
        tf = flops / t / 1e9
        say(f"  {name:46s} {t * 1e3:9.1f} us  {tf:6.0f} TFLOP/s{extra}")
        RESULTS[table].append({"case": name, "us": t * 1e3, "tflops": tf, **kw})

    def dispatch_sorted():
        t = bench(lambda: permute_rows(xd, xs, sort_by_expert(ids, e)))
        say(f"  dispatch, sorted (device sort + one gather of FP8 rows+scales): {t * 1e3:8.1f} us")
        RESULTS["dispatch"].append({"case": "sorted", "us": t * 1e3})

    def dispatch_unsorted():
        raw = xd.view(torch.uint8)

        def loop():
            for ex in range(e):
                tok, _ = torch.nonzero(ids == ex, as_tuple=True)
                if tok.numel():
                    raw.index_select(0, tok).view(FP8), xs.index_select(0, tok)
        t = bench(loop, reps=10)
        say(f"  dispatch, unsorted (per expert: mask, nonzero (sync), gather): {t * 1e3:8.1f} us")
        RESULTS["dispatch"].append({"case": "unsorted", "us": t * 1e3})

    def layer(name: str, fn: Callable, reps: int = 25):
        def run():
            fn()
            record("moe_layer", name, bench(fn, reps=reps))
        return run

    def bf16_layer():
        wgt, wut, wdt = (w.transpose(1, 2) for w in (wgb, wub, wdb))  # (E, K, N) views

        def run():
            plan = sort_by_expert(ids, e)
            xsb = xb.index_select(0, plan.token)
            offs = plan.offsets[1:]
            g = torch._grouped_mm(xsb, wgt, offs=offs)
            u = torch._grouped_mm(xsb, wut, offs=offs)
            a = (torch.nn.functional.silu(g.float()) * u.float()).to(torch.bfloat16)
            return combine(torch._grouped_mm(a, wdt, offs=offs), plan, weights)
        run()
        record("moe_layer", "bf16 torch._grouped_mm layer (sorted)", bench(run))

    REPORT.case("dispatch sorted", dispatch_sorted)
    REPORT.case("dispatch unsorted", dispatch_unsorted)
    REPORT.case("sorted block", layer("FP8 sorted, grouped Triton blockwise",
                                  lambda: grouped_fp8_moe(xd, xs, wg, wu, wd, weights, ids, mode="block")))
    REPORT.case("unsorted block", layer("FP8 unsorted, per-expert Triton blockwise",
                                    lambda: unsorted_fp8_moe(xd, xs, wg, wu, wd, weights, ids, mode="block"), 20))

    def rowwise_cases():
        rw["w"] = [rowwise_expert_weights(w) for w in (wg, wu, wd)]
        layer("FP8 sorted, grouped row-wise _scaled_grouped_mm",
              lambda: grouped_fp8_moe(xd, xs, *rw["w"], weights, ids, mode="rowwise"))()
        layer("FP8 unsorted, per-expert row-wise",
              lambda: unsorted_fp8_moe(xd, xs, *rw["w"], weights, ids, mode="rowwise"), 20)()

    REPORT.case("rowwise layer", rowwise_cases)
    REPORT.case("bf16 layer", bf16_layer)
    by = {r["case"]: r["us"] for r in RESULTS["moe_layer"]}
    disp = {r["case"]: r["us"] for r in RESULTS["dispatch"]}
    for kind in ("Triton blockwise", "row-wise"):
        s = [v for c, v in by.items() if c.startswith("FP8 sorted") and kind in c]
        u = [v for c, v in by.items() if c.startswith("FP8 unsorted") and kind in c]
        if s and u:
            say(f"  sorted vs unsorted ({kind}): {u[0] / s[0]:.1f}x faster sorted")
    if "sorted" in disp and "unsorted" in disp:
        for c, v in by.items():
            key = "sorted" if c.startswith("FP8 sorted") else "unsorted" if c.startswith("FP8 unsorted") else None
            if key:
                say(f"  dispatch share of '{c}': {disp[key] / v:.0%}")


def main() -> None:
    """Run both parts, print achieved vs ceilings, write $OUT/bench_moe.{json,txt}."""
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if not torch.cuda.is_available():
        print("bench_moe: needs a CUDA GPU")
        return
    RESULTS["hardware"] = fp = fingerprint()
    say("hardware: " + json.dumps(fp))
    gen = torch.Generator(device="cuda").manual_seed(0)
    REPORT.case("part 1", lambda: part_grouped_gemm(gen))
    REPORT.case("part 2", lambda: part_moe_layer(gen))
    REPORT.write("bench_moe", RESULTS)

if __name__ == "__main__":
    main()
