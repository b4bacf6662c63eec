"""GPU A/B of the MX dequant-in-kernel GEMM's code paths, which give the same bits by design: per call in a CUDA graph
over 4 weight copies (decode M: TB/s of weight + scale bytes; M > 64: TFLOP/s), the output bits of each variant
compared with the first's, and the rel-L2 error against `mx_linear_reference`.

Variants (module flags of engine.kernels.gemm):
  cast    NVFP4's E4M3 scales by the FP8 cast, one gathered scale load per element, the split-K reduce kernel
  bits    ... E4M3 scales decoded by bit arithmetic, `_e4m3_to_f32`
  rows    each row's block scales loaded as one tile per 64 columns, a chunk ahead, and spread by a reshape; E2M1
          decoded by shifts and one multiply; split-K partials summed by the last split (`MX_ROW_SCALES`,
          `MX_FUSED_REDUCE`)
  ptx-rk  `rows` with E2M1 decoded to bf16 by PRMT table lookups in inline PTX and scaled in bf16 (`MX_FP4_PTX`;
          FP8 weights as `rows`), and the reduce kernel
  ptx     `ptx-rk` with the fused reduce: the default

    python benchmarks/probe_mx_variants.py [--variants cast,bits,rows,ptx-rk,ptx] [--ms 1,4,16,512]
    python benchmarks/probe_mx_variants.py --variants cast,bits --pairs bf16:nvfp4,bf16:mxfp4 --ms 4,16"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gemm import graph_us  # noqa: E402
from engine.formats import quantize  # noqa: E402
from engine.kernels import gemm as G  # noqa: E402
from engine.kernels import decode_plan as P  # noqa: E402
from engine.kernels import gemm_mx as GM  # noqa: E402

VARIANTS = {"cast": dict(MX_SCALE_BITS=False, MX_ROW_SCALES=False, MX_FP4_PTX=False, MX_FUSED_REDUCE=False),
            "bits": dict(MX_SCALE_BITS=True, MX_ROW_SCALES=False, MX_FP4_PTX=False, MX_FUSED_REDUCE=False),
            "rows": dict(MX_SCALE_BITS=True, MX_ROW_SCALES=True, MX_FP4_PTX=False, MX_FUSED_REDUCE=True),
            "ptx-rk": dict(MX_SCALE_BITS=True, MX_ROW_SCALES=True, MX_FP4_PTX=True, MX_FUSED_REDUCE=False),
            "ptx": dict(MX_SCALE_BITS=True, MX_ROW_SCALES=True, MX_FP4_PTX=True, MX_FUSED_REDUCE=True)}
SHAPES = ((4096, 14336), (28672, 4096), (4096, 4096))


def _x(xkind: str, m: int, k: int, g: torch.Generator):
    """mx_linear activation arguments: bf16, or MXFP8 data + scales."""
    x = torch.randn(m, k, device="cuda", generator=g)
    if xkind == "mxfp8":
        q = quantize(x, "mxfp8")
        return (q.data,), {"x_scale": q.scale}
    return (x.to(torch.bfloat16),), {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="bits,rows,ptx-rk,ptx")
    ap.add_argument("--pairs", default="bf16:mxfp4,bf16:nvfp4,mxfp8:mxfp8")
    ap.add_argument("--ms", default="1,4,16,512")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    saved = {name: getattr(G, name) for flags in VARIANTS.values() for name in flags}
    print("MX_SPLIT_RULE", P.MX_SPLIT_RULE, "| variants", variants)
    try:
        for pair in args.pairs.split(","):
            xkind, wspec = pair.split(":")
            for n, k in SHAPES:
                g = torch.Generator(device="cuda").manual_seed(n + k)
                wps = [GM.prepare_mx_weight(quantize(torch.randn(n, k, device="cuda", generator=g), wspec))
                       for _ in range(4)]
                for m in (int(v) for v in args.ms.split(",")):
                    xa, kw = _x(xkind, m, k, g)
                    ref = GM.mx_linear_reference(*xa, wps[0], out_dtype=torch.float32, **kw)
                    cells, first = [], None
                    for v in variants:
                        for name, val in VARIANTS[v].items():
                            setattr(G, name, val)
                        out = GM.mx_linear(*xa, wps[0], out_dtype=torch.float32, **kw)
                        us = graph_us([lambda wp=wp: GM.mx_linear(*xa, wp, **kw) for wp in wps])
                        rate = (f"{wps[0].nbytes / us / 1e6:5.2f} TB/s" if m <= 64
                                else f"{2 * m * n * k / us / 1e6:6.1f} TFLOP/s")
                        err = ((out - ref).norm() / ref.norm()).item()
                        first = out if first is None else first
                        same = torch.equal(out.view(torch.int32), first.view(torch.int32))
                        cells.append(f"{v} {us:8.2f} us {rate} rel {err:.1e}{'' if same else ' BITS DIFFER'}")
                    print(f"{xkind} x {wspec} {n}x{k} M={m}: " + " | ".join(cells), flush=True)
                del wps
    finally:
        for name, val in saved.items():
            setattr(G, name, val)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
