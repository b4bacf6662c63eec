"""Benchmark of the format library: quantization error of every spec and accumulation error.

Usage::

    python benchmarks/bench_formats.py            # prints and writes
                                                  # benchmarks/results/cpu-<date>/bench_formats.txt
    python benchmarks/bench_formats.py --quick    # smaller shapes (smoke test)

Part 1: MSE and SQNR (dB) of each spec on Gaussian and heavy-tailed
(Student-t, df=3) data of shape (1024, 4096), plus saturation/underflow
fractions and quantize wall time.
Part 2: relative error of ``matmul_accum`` (fp32, tc14, tc14:promote128) vs
a float64 reference at K = 1024 .. 16384 with M = N = 64 FP8-valued inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks.common import fingerprint  # noqa: E402
from engine.formats import fake_quantize, matmul_accum, quantize  # noqa: E402

SPECS = ["bf16", "fp16", "e4m3:tensor", "e4m3:channel", "e4m3:1x128", "e4m3:1x128:pow2",
         "e4m3:128x128", "e5m2:tensor", "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4",
         "int8:channel", "int8:token"]
ACCUMS = ["fp32", "tc14", "tc14:promote128"]
KS = [1024, 2048, 4096, 8192, 16384]


def make_data(kind: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Gaussian or Student-t(df=3) float32 data."""
    torch.manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(shape)
    return torch.distributions.StudentT(3.0).sample(shape).to(torch.float32)


def quant_table(shape: tuple[int, int]) -> list[str]:
    """Markdown table of MSE / SQNR per spec for both distributions."""
    data = {k: make_data(k, shape, i) for i, k in enumerate(["gaussian", "student_t3"])}
    lines = ["| spec | Gaussian MSE | Gaussian SQNR dB | t3 MSE | t3 SQNR dB "
             "| t3 sat % | t3 underflow % | ms/quantize |",
             "|---|---|---|---|---|---|---|---|"]
    for spec in SPECS:
        row = [f"`{spec}`"]
        for kind, x in data.items():
            t0 = time.perf_counter()
            q = quantize(x, spec)
            y = q.dequantize()
            dt = (time.perf_counter() - t0) * 1e3
            err = (y.double() - x.double())
            mse = err.pow(2).mean().item()
            sig = x.double().pow(2).mean().item()
            sqnr = 10 * torch.log10(torch.tensor(sig / mse)).item() if mse > 0 else float("inf")
            row += [f"{mse:.3e}", f"{sqnr:.2f}"]
            if kind == "student_t3":
                st = q.stats()
                row += [f"{100 * st['saturation_frac']:.4f}", f"{100 * st['underflow_frac']:.4f}",
                        f"{dt:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def accum_table(m: int, n: int, ks: list[int]) -> list[str]:
    """Markdown table of accumulation-emulation relative error vs a float64 reference."""
    lines = ["| K | " + " | ".join(f"`{a}` rel err (Gauss)" for a in ACCUMS)
             + " | " + " | ".join(f"`{a}` max rel (uniform+)" for a in ACCUMS[1:]) + " |",
             "|---|" + "---|" * (2 * len(ACCUMS) - 1)]
    for k in ks:
        g = torch.Generator().manual_seed(k)
        a = fake_quantize(torch.randn(m, k, generator=g), "e4m3:1x128")
        b = fake_quantize(torch.randn(n, k, generator=g), "e4m3:128x128")
        ap = fake_quantize(torch.rand(m, k, generator=g), "e4m3:1x128")
        bp = fake_quantize(torch.rand(n, k, generator=g), "e4m3:128x128")
        ref = a.double() @ b.double().T
        refp = ap.double() @ bp.double().T
        row = [str(k)]
        for acc in ACCUMS:
            c = matmul_accum(a, b, acc).double()
            row.append(f"{((c - ref).norm() / ref.norm()).item():.3e}")
        for acc in ACCUMS[1:]:
            c = matmul_accum(ap, bp, acc).double()
            row.append(f"{((c - refp).abs() / refp).max().item():.3e}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


README_SECTION = """\
### Number formats (`engine/formats`)

Every quantization site goes through one bit-exact, pure-torch format library
(identical results on CPU and CUDA; GPU kernels are checked against it):

```python
from engine.formats import parse_spec, quantize, fake_quantize, matmul_accum
qt = quantize(x, "e4m3:1x128")       # QTensor: data (float8/uint8/int8), scale, spec, shape
y = qt.dequantize()                   # float32, x.shape
qt.stats()                            # saturation / underflow / subnormal fractions, scale histogram
```

Specs: `fp32 bf16 fp16`, `ELEM:{tensor,channel,token,RxC}[:pow2]` with
`ELEM` in `e4m3 e5m2 e2m1 int8` (e.g. `e4m3:1x128`, `e4m3:128x128`),
`mxfp8 mxfp8_e5m2 mxfp4` (OCP MX v1.0, E8M0 block scales) and `nvfp4`
(E2M1 + E4M3 16-block scale + fp32 tensor scale). Static / stage-wise
calibrated scales: `AmaxObserver`, `stage_scales`. Tensor-core accumulation
emulation: `matmul_accum(a, b, "tc14:promote128")`.
"""


def main(argv: list[str] | None = None) -> int:
    """Run both benchmark parts, print, and write the results file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  time.strftime("cpu-%Y-%m-%d", time.gmtime()), "bench_formats.txt"))
    args = ap.parse_args(argv)
    shape = (128, 512) if args.quick else (1024, 4096)
    ks = KS[:2] if args.quick else KS
    t0 = time.perf_counter()
    out = [README_SECTION,
           f"Quantization error, data shape {shape} (SQNR = 10 log10(sum x^2 / sum err^2)):", ""]
    out += quant_table(shape)
    out += ["", "Accumulation emulation vs float64 reference, M = N = 64, FP8 (e4m3) inputs; "
            "'rel err' = ||C - C_ref||_F / ||C_ref||_F on Gaussian data, 'max rel' = max "
            "elementwise |C - C_ref| / C_ref on uniform [0, 1) data:", ""]
    out += accum_table(64, 64, ks)
    out += ["", f"Hardware: {json.dumps(fingerprint('cpu'))}; torch threads {torch.get_num_threads()}; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (ms/quantize is wall time: it inflates on a "
            "shared machine)",
            f"Total benchmark wall time: {time.perf_counter() - t0:.1f} s"]
    text = "\n".join(out) + "\n"
    print(text)
    if not args.quick:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
