"""Operands, tolerances and launch stand-ins shared by the GEMM tests (engine/kernels/gemm.py, gemm_wgmma.py).

Error metric: relative Frobenius error ||out - ref||_F / ||ref||_F, where ref is the fp32 product of the dequantized
operands (computed in float64, see the `*_reference` functions). Tolerances:

* bf16 output: 1e-2 (bf16 rounding of the output alone is ~1e-3 rms);
* fp32 output: 2e-3 for FP8 tensor-core paths (Hopper FP8 MMA accumulates with reduced precision inside each
  128-wide K group before the fp32 promotion); 1e-4 for the MX kernel with exactly bf16-representable operands
  (bf16 MMA, fp32 accumulation); 1e-2 when fp32 activations are rounded to bf16 in the MX kernel (w4a16);
* under the Triton interpreter, whose dots multiply FP8 tiles exactly in fp32 (no reduced-precision tensor-core
  accumulation), 1e-5 for the FP8 kernels (`TOL_INTERPRETER`).

Data has per-block magnitudes spread over 2**-4 .. 2**4 so that every scale matters: a kernel that applies the scale
of the wrong block, or drops or repeats a K group, fails by orders of magnitude more than the tolerance.
"""

from __future__ import annotations

import torch

from tests.support.interpret import GPU_TEST_DEVICE

DEV = GPU_TEST_DEVICE  # "cpu" under TRITON_INTERPRET=1
TOL = {torch.bfloat16: 1e-2, torch.float32: 2e-3}
TOL_MX_EXACT_FP32 = 1e-4
TOL_MX_ROUNDED_X = 1e-2
TOL_INTERPRETER = 1e-5  # the interpreter: exact FP8 products, fp32 accumulation


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error (absolute when ref is all zeros)."""
    out, ref = out.float(), ref.float()
    den = ref.norm()
    return float((out - ref).norm() / den) if den > 0 else float((out - ref).norm())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same fp32 bit patterns (NaN payloads included)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def blocky(rows: int, cols: int, r: int, c: int, seed: int) -> torch.Tensor:
    """Gaussian (rows, cols) on DEV times a per-(r x c)-block magnitude 2**U{-4..4}."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, cols, device=DEV, generator=g)
    mag = torch.exp2(torch.randint(-4, 5, (-(-rows // r), -(-cols // c)), device=DEV, generator=g).float())
    return x * mag.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]


def block_operands(m: int, n: int, k: int, seed: int = 0):
    """e4m3:1x128 activations and e4m3:128x128 weights from the formats library: (x, x_scale, w, w_scale)."""
    from engine.formats import quantize

    xq = quantize(blocky(m, k, 1, 128, seed), "e4m3:1x128")
    wq = quantize(blocky(n, k, 128, 128, seed + 1), "e4m3:128x128")
    assert xq.data.dtype == torch.float8_e4m3fn and xq.scale.shape == (m, -(-k // 128))
    assert wq.data.dtype == torch.float8_e4m3fn and wq.scale.shape == (-(-n // 128), -(-k // 128))
    return xq.data, xq.scale, wq.data, wq.scale


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal fp32 tensor on DEV."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV)


class Launch:
    """Stands in for a Triton kernel: records the grid, arguments and meta of each launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((grid, args, meta))


def zero_operands(m: int = 3, n: int = 256, k: int = 1024):
    """All-zero FP8 operands with unit scales on the CPU, for dispatch tests that launch nothing."""
    x = torch.zeros(m, k).to(torch.float8_e4m3fn)
    w = torch.zeros(n, k).to(torch.float8_e4m3fn)
    return x, torch.ones(m, -(-k // 128)), w, torch.ones(-(-n // 128), -(-k // 128))
