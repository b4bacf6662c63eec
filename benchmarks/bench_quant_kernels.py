"""Benchmark the fused quant kernels on the GPU: achieved TB/s vs the HBM copy bandwidth measured in the same run.

    python benchmarks/bench_quant_kernels.py [--rows 16384 --k 7168] [--out FILE]

(`benchmarks/run_device.sh bench` writes FILE as `benchmarks/results/<hw>-<date>/bench_quant_kernels.txt`.)

Prints the hardware fingerprint, the measured copy ceiling (torch clone of a
large buffer, read + write), and for each kernel the time, the bytes moved
(input read + FP8 data + fp32 scales written) and TB/s, next to the eager
torch path (formats library) that the kernel replaces.

Timing: `benchmarks.common.time_us` (median of CUDA-event reps, L2 flushed
before each, host time shielded). Every kernel is timed after a dirty flush
(a 256 MiB write, as `triton.testing.do_bench` flushes: the call also pays the
write-back of ~50 MB of L2 lines it never wrote; the TB/s shown first) and after
a clean one (a 256 MiB read).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Report, copy_ceiling, fingerprint, time_us  # noqa: E402


def bench(fn, reps: int = 30, flush: str = "dirty") -> float:
    """Median milliseconds per call (`common.time_us`: CUDA events, flushed L2, host time shielded)."""
    return time_us(fn, reps=reps, warmup=3, flush=flush) / 1e3


def main() -> None:
    """Run the benchmark and print achieved vs peak."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from engine.kernels.quant import (act_quant, act_quant_reference, rmsnorm_quant, rmsnorm_quant_reference,
                                      swiglu_quant, swiglu_quant_reference)

    rep = Report()
    say = rep.say
    say(json.dumps(fingerprint()))
    m, k = args.rows, args.k
    peak = copy_ceiling()["tbs"]
    say(f"HBM copy ceiling (read+write, 1 GiB clone): {peak:.2f} TB/s")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(k, device="cuda") + 0.5
    out_bytes = m * k * 1 + m * ((k + 127) // 128) * 4
    cases = [
        ("act_quant 1x128", lambda: act_quant(x), lambda: act_quant_reference(x), m * k * 2 + out_bytes),
        ("rmsnorm+quant 1-pass", lambda: rmsnorm_quant(x, w, 1e-5, single_pass=True),
         lambda: rmsnorm_quant_reference(x, w, 1e-5), m * k * 2 + k * 4 + out_bytes),
        ("rmsnorm+quant 2-pass", lambda: rmsnorm_quant(x, w, 1e-5, single_pass=False),
         lambda: rmsnorm_quant_reference(x, w, 1e-5), m * k * 2 + k * 4 + out_bytes),
        ("rmsnorm+quant default", lambda: rmsnorm_quant(x, w, 1e-5), None, m * k * 2 + k * 4 + out_bytes),
        ("swiglu+quant 1x128", lambda: swiglu_quant(x, u), lambda: swiglu_quant_reference(x, u),
         2 * m * k * 2 + out_bytes),
    ]
    mx_bytes = m * k * 1 + m * ((k + 31) // 32) * 4  # MXFP8: one fp32-held E8M0 scale per 32 elements
    cases += [
        ("act_quant mxfp8", lambda: act_quant(x, fmt="mxfp8"), lambda: act_quant_reference(x, "mxfp8"),
         m * k * 2 + mx_bytes),
        ("rmsnorm+quant mxfp8", lambda: rmsnorm_quant(x, w, 1e-5, fmt="mxfp8"),
         lambda: rmsnorm_quant_reference(x, w, 1e-5, "mxfp8"), m * k * 2 + k * 4 + mx_bytes),
        ("swiglu+quant mxfp8", lambda: swiglu_quant(x, u, fmt="mxfp8"), lambda: swiglu_quant_reference(x, u, "mxfp8"),
         2 * m * k * 2 + mx_bytes),
    ]
    # tiling sweep of the SwiGLU kernel (same bits for every tiling; the default is BM=16, 4 warps)
    for bm, nw in ((8, 4), (32, 4), (64, 8)):
        cases.append((f"swiglu+quant bm{bm}w{nw}", lambda bm=bm, nw=nw: swiglu_quant(x, u, bm=bm, num_warps=nw),
                      None, 2 * m * k * 2 + out_bytes))
    say(f"shape {m} x {k} bf16 in, e4m3 + fp32 scales out")
    say(f"{'kernel':22} {'ms':>8} {'TB/s':>7} {'% of copy':>9} | {'clean ms':>8} {'TB/s':>7} | {'eager ms':>9} "
        f"{'speed-up':>8}")
    for name, fn, ref, nbytes in cases:
        t = bench(fn)
        tc = bench(fn, flush="clean")
        te = bench(ref, reps=10) if ref is not None else float("nan")
        tbs = nbytes / (t * 1e-3) / 1e12
        say(f"{name:22} {t:8.3f} {tbs:7.2f} {100 * tbs / peak:8.1f}% | {tc:8.3f} {nbytes / (tc * 1e-3) / 1e12:7.2f} | "
            f"{te:9.3f} {te / t:7.1f}x")
    if args.out:
        Path(args.out).write_text("\n".join(rep.lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
