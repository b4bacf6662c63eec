"""GPU A/B (session 16): the MX kernel's NVFP4 E4M3 block scales decoded by bit arithmetic (`MX_SCALE_BITS = True`,
`_e4m3_to_f32`) vs the FP8 cast, per call in a CUDA graph over 4 weight copies, bf16 activations, M = 4 / 16; bf16 x
MXFP4 (E8M0 scales, not affected) as the control. Prints whether both give the same bits.

    python benchmarks/probe_nvfp4_scale_bits.py"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gemm import graph_us  # noqa: E402
from engine.formats import quantize  # noqa: E402
from engine.kernels import gemm as G  # noqa: E402


def main() -> int:
    print("MX_SPLIT_FILL", G.MX_SPLIT_FILL)
    for wspec in ("nvfp4", "mxfp4"):
        for n, k in ((4096, 14336), (28672, 4096), (4096, 4096)):
            g = torch.Generator(device="cuda").manual_seed(n + k)
            wps = [G.prepare_mx_weight(quantize(torch.randn(n, k, device="cuda", generator=g), wspec))
                   for _ in range(4)]
            for m in (4, 16):
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                res = {}
                outs = {}
                for bits in (False, True):
                    G.MX_SCALE_BITS = bits
                    outs[bits] = G.mx_linear(x, wps[0], out_dtype=torch.float32)
                    res[bits] = graph_us([lambda wp=wp: G.mx_linear(x, wp) for wp in wps])
                same = torch.equal(outs[False].view(torch.int32), outs[True].view(torch.int32))
                print(f"{wspec} {n}x{k} M={m}: cast {res[False]:8.2f} us, bits {res[True]:8.2f} us "
                      f"({wps[0].nbytes / res[True] / 1e6:.2f} TB/s), same bits {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
