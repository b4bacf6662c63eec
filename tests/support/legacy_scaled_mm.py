"""A deliberately broken FP8 block GEMM, planted by the tests that show the harness catches it.

`legacy_scaled_mm_blockwise` is the old ``torch._scaled_mm`` call with the *unpadded* 1x128 x 128x128 scales
(x_scale (M, Kb) with strides (1, M); w_scale.t() (Kb, Nb) with strides (1, Kb)). On torch 2.11 + H200 it returns
relative errors of 0.38-0.53, with no exception, whenever K/128 is not a multiple of 4 (K = 640, 896, 1152, 1408):
cuBLAS reads the weight-scale grid with a leading dimension padded to a multiple of 4, i.e. the wrong scales.
`engine.kernels.gemm.scaled_mm_blockwise` pads correctly. `legacy_numerics` plants the call into the cuda-native
backend's FP8 block GEMMs above `small_m` (tests/engine/test_native_gpu.py: the three-way comparison blames it on
the kernel at the first GEMM); tests/engine/kernels/gemm/test_fp8_block.py shows the silent error directly.
Never production code.
"""

from __future__ import annotations

import types

import torch

from engine.kernels import gemm


def legacy_scaled_mm_blockwise(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                               w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """KNOWN-WRONG for K/128 % 4 != 0: the old unpadded ``torch._scaled_mm`` blockwise call (module docstring).
    Needs M % 4 == 0 and K, N multiples of 16 (it does no padding)."""
    x, xs, w, ws, _ = gemm._block_operands(x_data, x_scale, w_data, w_scale)
    sa = xs.t().contiguous().t()
    sb = ws.contiguous().t()
    return torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _legacy_fp8_block_linear(x_data, x_scale, w_data, w_scale, bias=None, out_dtype=torch.bfloat16, small_m=64,
                             out_round=None, **kw):
    """`gemm.fp8_block_linear`, except that calls above small_m take the legacy call (output in bf16 when the
    backend asks for bf16-rounded values, bias added after)."""
    if x_data.reshape(-1, x_data.shape[-1]).shape[0] <= small_m:
        return gemm.fp8_block_linear(x_data, x_scale, w_data, w_scale, bias=bias, out_dtype=out_dtype,
                                     small_m=small_m, out_round=out_round, **kw)
    dt = torch.bfloat16 if out_round == "bf16" else out_dtype
    y = legacy_scaled_mm_blockwise(x_data, x_scale, w_data, w_scale, out_dtype=dt)
    y = y if bias is None else y + bias.to(y.dtype)
    return y.float() if out_round == "bf16" else y


def legacy_numerics(recipe, **kernel_options):
    """A cuda-native backend whose FP8 block GEMMs above small_m run the legacy call (a planted kernel bug)."""
    from engine.backends.native import NativeNumerics

    nx = NativeNumerics(recipe, **kernel_options)
    kernels = {n: getattr(gemm, n) for n in gemm.__all__}
    kernels["fp8_block_linear"] = _legacy_fp8_block_linear
    nx._gemm_k = types.SimpleNamespace(**kernels)
    return nx
