"""GEMMs on quantized operands: FP8 block scales (1x128 x 128x128), FP8 per-tensor, MX / NVFP4 weights.

Every wrapper computes ``out = x @ w.T (+ bias)`` for x (M, K) and w (N, K) (x may carry leading
dims: (..., K) -> (..., N)) with fp32 accumulation, and has a pure-torch ``*_reference`` beside it
that dequantizes both operands to fp32 and multiplies them (in float64, rounded to fp32, so no
TF32 setting can leak into the reference).

Operand layouts are those of :func:`engine.formats.quantize` (value = data * scale):

==================  =======================================  ===========================================
spec                data                                     scale
==================  =======================================  ===========================================
``e4m3:1x128`` (x)  (M, K) float8_e4m3fn                     (M, ceil(K/128)) fp32
``e4m3:128x128``    (N, K) float8_e4m3fn                     (ceil(N/128), ceil(K/128)) fp32
``e4m3:tensor``     (M, K) / (N, K) float8_e4m3fn            0-d fp32
``mxfp8`` (x)       (M, K) float8_e4m3fn                     (M, ceil(K/32)) fp32 (powers of two)
``mxfp8`` (w)       (N, K) float8_e4m3fn                     (N, ceil(K/32)) fp32 -> E8M0 codes at prep
``mxfp4`` (w)       (N, K) uint8, E2M1 code in the low       (N, ceil(K/32)) fp32 -> E8M0 codes at prep
                    nibble (one per byte) -> packed at prep
``nvfp4`` (w)       (N, K) uint8 E2M1 codes -> packed        (N, ceil(K/16)) fp32 (E4M3 values) -> E4M3
                                                             bytes at prep; 0-d fp32 ``tensor_scale``
==================  =======================================  ===========================================

Paths:

* :func:`fp8_block_linear`: M <= ``small_m`` -> the Triton split-K "swap-AB" kernel
  (``out^T = W @ x^T`` so the big N dimension fills the MMA rows; each 128-wide K group is one
  FP8 tensor-core dot promoted to fp32 and scaled by ``w_scale * x_scale``, DeepSeek-V3 style);
  larger M -> cuBLAS blockwise through ``torch.nn.functional.scaled_mm`` with the padding rules of
  H200_FACTS (M to a multiple of 4; K, N to multiples of 16; the weight scale padded to
  ``round_up(K/128, 4)`` rows with stride ``(1, that)``), falling back to the same Triton kernel
  with large tiles when ``scaled_mm`` is missing or refuses the shape.
* :func:`fp8_tensor_linear`: the same Triton kernel with broadcast (stride-0) scales for small M,
  cuBLAS tensor-wise FP8 otherwise.
* MX / NVFP4 weights: :func:`engine.kernels.gemm_mx.mx_linear`.

Split-K partial sums go to an fp32 buffer that a second kernel reduces in a fixed order (or, with
``fused_reduce``, the last split of each tile -- found with an arrival counter -- sums them in the
same order; no atomic accumulation either way), so a given (shape, device) always produces the same bits; at
M <= 16 / splits with 2 or 4 splits, on CUDA, the splits instead sit side by side in one program's MMA tile and are
summed in registers in the same order (`_fp8_sliced_gemm_kernel`: the same bits, without the partials' round trip).
The number of splits is a function of the shape, the SM count and the decode policy
(`engine.kernels.decode_plan.DecodePolicy`: measured entries per device and shape from
`engine/kernels/configs/<device>.json`, and the rules for other shapes; the tuning knobs are keyword arguments of
:func:`fp8_block_gemm_triton`). Every wrapper takes ``policy`` (default `DEFAULT_POLICY`). No wrapper synchronizes
the host.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernels.decode_plan import DecodePolicy
from engine.kernels.gemm_fp8 import FP8, _launch_fp8
from engine.kernels.options import DEFAULT_OPTIONS, KernelOptions
from engine.kernels.splitk import GROUP, _bad, _cdiv, _check_out, _round_up, _rows


_SCALED_MM = getattr(F, "scaled_mm", None)  # torch >= 2.10: explicit ScalingType API
_SCALING = getattr(F, "ScalingType", None)


def _check_fp8(t: torch.Tensor, name: str, spec: str) -> None:
    """FP8 E4M3 data check."""
    if t.dtype != FP8:
        raise _bad(f"{name} must be torch.float8_e4m3fn data (quantize with '{spec}'), got {t.dtype}")


# ============================================================================ FP8 block (1x128 x 128x128)
def _block_operands(x_data, x_scale, w_data, w_scale):
    """Validate block-scaled operands; return x (M, K), x_scale (M, Kb), w (N, K), w_scale (Nb, Kb), lead dims."""
    lead = tuple(x_data.shape[:-1])
    x = _rows(x_data, "x_data")
    m, k = x.shape
    kb = _cdiv(k, GROUP)
    _check_fp8(x, "x_data", "e4m3:1x128")
    _check_fp8(w_data, "w_data", "e4m3:128x128")
    if w_data.dim() != 2 or w_data.shape[1] != k:
        raise _bad(f"w_data must be (N, K={k}) to match x_data (..., {k}), got {tuple(w_data.shape)}")
    n = w_data.shape[0]
    ok = x_scale.dim() >= 1 and x_scale.shape[-1] == kb and x_scale.numel() == m * kb
    xs = x_scale.reshape(m, kb) if ok else None
    if xs is None or x_scale.dtype != torch.float32:
        raise _bad(f"x_scale must be fp32 of shape (..., ceil(K/128)={kb}) for x_data {tuple(x_data.shape)} "
                   f"(the e4m3:1x128 layout), got {tuple(x_scale.shape)} {x_scale.dtype}")
    nb = _cdiv(n, GROUP)
    if tuple(w_scale.shape) != (nb, kb) or w_scale.dtype != torch.float32:
        raise _bad(f"w_scale must be fp32 (ceil(N/128), ceil(K/128)) = ({nb}, {kb}) for w_data {tuple(w_data.shape)} "
                   f"(the e4m3:128x128 layout), got {tuple(w_scale.shape)} {w_scale.dtype}")
    return x, xs.contiguous(), w_data.contiguous(), w_scale.contiguous(), lead


def fp8_block_gemm_triton(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                          w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                          out_dtype: torch.dtype = torch.bfloat16, split_k: Optional[int] = None, *,
                          block_n: Optional[int] = None, num_warps: Optional[int] = None,
                          num_stages: Optional[int] = None, fused_reduce: Optional[bool] = None,
                          whole_k: Optional[int] = None, sliced: Optional[int] = None, wgmma: Optional[int] = None,
                          policy: Optional[DecodePolicy] = None,
                          options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """The Triton FP8 block-scaled GEMM for any M (decode tiles + split-K up to M = 64, 128x128 tiles above).

    x_data (..., K) fp8 + x_scale (..., ceil(K/128)); w_data (N, K) fp8 + w_scale (ceil(N/128),
    ceil(K/128)); bias (N,) or None -> (..., N) in out_dtype.

    Tuning knobs (None: the policy's decode entry for this device / shape when all are None, else its
    rules): ``split_k`` K splits (changes the fp32 summation order); ``block_n`` weight rows per
    program (16 / 32 / 64 / 128); ``num_warps``, ``num_stages`` (pipeline depth); ``fused_reduce``:
    the last split of each tile sums the partials (same bits as the separate reduce kernel, one launch
    fewer; fused calls must run in stream order, see `_tile_counters`); ``whole_k`` (True, or 2 / 4 groups per pipeline stage): no split-K at all, each
    program streams ``block_n`` (16 / 32 / 64, default 64) whole weight rows through the Gluon wgmma kernel of
    `engine.kernels.gemm_wgmma` -- the same bits as ``split_k=1, block_n=64`` on the H200 (CUDA compute
    capability 9.0, M <= 64, K a multiple of 16 up to 16384; elsewhere the split-K kernel with one split runs
    instead). Without knobs or an entry, calls with 33-64 rows take it on the H200 (`whole_k_at_bm64`); at
    M <= 32 it is slower than split-K there, and opt-in; ``sliced`` (2 / 4 / 8): split-K inside one program, the
    K slices side by side in one MMA tile and summed in registers (`_fp8_sliced_gemm_kernel`: the bits of
    ``split_k=sliced, block_n=64`` on the H200 without the partials' trip through memory; ``block_n`` is then the
    weight rows per slice, default 64 / sliced). On CUDA, split-K calls with 2 or 4 splits of 64-row tiles and
    M <= 16 / splits take it by themselves (`sliced_auto`); ``sliced=False`` keeps them on the split-K kernel;
    ``wgmma`` (True, or 2 / 4 groups per pipeline stage): the Gluon wgmma kernel of `engine.kernels.gemm_wgmma` with
    the activation rows on the wgmma's N side, 64-row weight tiles, ``split_k`` K splits (default: the split rule's)
    of whole pipeline stages and the same fused reduce -- the bits of ``split_k=S, block_n=64`` with the same K
    partition on the H200 (sm_90, M <= 64; elsewhere the split-K kernel runs); ``num_stages`` then counts its
    pipeline stages (default: `gemm_wgmma.swap_stages`). The H200's decode entries for the big Llama-3-8B
    decode shapes at BM 16 select it; ``wgmma=False`` keeps a call off it (and on the entry's split-K config).
    """
    x, xs, w, ws, lead = _block_operands(x_data, x_scale, w_data, w_scale)
    bias = _check_out(out_dtype, bias, w.shape[0])
    out = _launch_fp8(x, xs, (xs.stride(0), xs.stride(1)), w, ws, (ws.stride(0), ws.stride(1)),
                      bias, out_dtype, split_k, block_n, num_warps, num_stages, fused_reduce, whole_k=whole_k,
                      sliced=sliced, wgmma=wgmma, policy=policy, options=options)
    return out.reshape(*lead, w.shape[0])


def has_scaled_mm() -> bool:
    """Whether this torch has ``torch.nn.functional.scaled_mm`` with ``ScalingType`` (torch >= 2.10)."""
    return _SCALED_MM is not None and _SCALING is not None


def _pad2(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t (r, c) zero-padded to (rows, cols) (t itself when already that shape)."""
    if tuple(t.shape) == (rows, cols):
        return t
    out = torch.zeros((rows, cols), device=t.device, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def scaled_mm_blockwise(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                        w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                        out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """cuBLAS blockwise FP8 (1x128 activations x 128x128 weights) via ``F.scaled_mm``, padded.

    Padding (H200_FACTS): M to a multiple of 4 (cuBLAS blockwise refuses other M), K and N to
    multiples of 16 (zero data; the scale grids do not change), activation scales (Mp, Kb) with
    strides (1, Mp), weight scales padded to (round_up(Kb, 4), Nb) with strides (1, round_up(Kb, 4))
    -- without that padding the old API reads the wrong scales (tests/support/legacy_scaled_mm.py).
    Shapes as :func:`fp8_block_gemm_triton`. Raises RuntimeError (or what torch raises) when
    ``F.scaled_mm`` is missing or refuses the call; :func:`fp8_block_linear` catches that.
    """
    if not has_scaled_mm():
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm/ScalingType")
    x, xs, w, ws, lead = _block_operands(x_data, x_scale, w_data, w_scale)
    bias = _check_out(out_dtype, bias, w.shape[0])
    m, k = x.shape
    n = w.shape[0]
    kb, nb = _cdiv(k, GROUP), _cdiv(n, GROUP)
    mp, kp, np_ = _round_up(max(m, 1), 4), _round_up(k, 16), _round_up(n, 16)
    xp, wp = _pad2(x, mp, kp), _pad2(w, np_, kp)
    sa = torch.ones((kb, mp), device=x.device, dtype=torch.float32)
    sa[:, :m] = xs.t()
    kb4 = _round_up(kb, 4)
    sb = torch.ones((nb, kb4), device=x.device, dtype=torch.float32)
    sb[:, :kb] = ws
    out = _SCALED_MM(xp, wp.t(), sa.t(), _SCALING.BlockWise1x128, sb.t(), _SCALING.BlockWise128x128,
                     output_dtype=out_dtype)
    if (mp, np_) != (m, n):
        out = out[:m, :n].contiguous()
    if bias is not None:
        out = out.add_(bias.to(out_dtype))
    return out.reshape(*lead, n)


def fp8_block_linear(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                     small_m: int = 64, out_round: Optional[str] = None,
                     policy: Optional[DecodePolicy] = None, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for e4m3:1x128 activations and e4m3:128x128 weights.

    Args:
        x_data: (M, K) (or (..., K)) float8_e4m3fn; x_scale: (M, ceil(K/128)) fp32.
        w_data: (N, K) float8_e4m3fn; w_scale: (ceil(N/128), ceil(K/128)) fp32.
        bias: (N,) or None, added in fp32 (Triton) or to the rounded output (cuBLAS).
        out_dtype: bf16 / fp16 / fp32.
        out_round: "bf16" with out_dtype fp32: the output rounded to bf16 values, returned in fp32 (the
            Triton kernel rounds in its epilogue; cuBLAS writes bf16, widened after).
        small_m: M <= small_m runs the Triton decode kernel (cuBLAS FP8 is no faster than bf16
            there); larger M runs cuBLAS blockwise (:func:`scaled_mm_blockwise`), or the Triton
            kernel with large tiles when cuBLAS is missing / refuses (with a warning).
        policy: the decode plan (`engine.kernels.decode_plan.DecodePolicy`; default `DEFAULT_POLICY`).
        options: the backend's kernel variants (`engine.kernels.options.KernelOptions`: PDL).

    Returns:
        (M, N) (or (..., N)) in out_dtype.
    """
    x, xs, w, ws, lead = _block_operands(x_data, x_scale, w_data, w_scale)
    bias = _check_out(out_dtype, bias, w.shape[0])
    if out_round not in (None, "bf16") or (out_round is not None and out_dtype != torch.float32):
        raise _bad(f"out_round {out_round!r}: use None, or 'bf16' with out_dtype=torch.float32")
    if x.shape[0] > small_m and has_scaled_mm() and x.is_cuda:
        try:
            if out_round is not None:
                y = scaled_mm_blockwise(x, xs, w, ws, bias, torch.bfloat16).float()
                return y.reshape(*lead, w.shape[0])
            return scaled_mm_blockwise(x, xs, w, ws, bias, out_dtype).reshape(*lead, w.shape[0])
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            warnings.warn(f"fp8_block_linear: cuBLAS blockwise scaled_mm refused (M, K, N) = "
                          f"({x.shape[0]}, {x.shape[1]}, {w.shape[0]}): {str(exc).splitlines()[0]}; "
                          "using the Triton blockwise GEMM", RuntimeWarning, stacklevel=2)
    out = _launch_fp8(x, xs, (xs.stride(0), xs.stride(1)), w, ws, (ws.stride(0), ws.stride(1)),
                      bias, out_dtype, None, round_bf16=out_round is not None, policy=policy, options=options)
    return out.reshape(*lead, w.shape[0])


def _expand_block_scale(s: torch.Tensor, rows: int, cols: int, r: int, c: int) -> torch.Tensor:
    """Scale grid s (ceil(rows/r), ceil(cols/c)) broadcast to every element (rows, cols)."""
    return s.repeat_interleave(r, dim=0)[:rows].repeat_interleave(c, dim=1)[:, :cols]


def _ref_matmul(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype):
    """fp32 operands -> x @ w.T (+ bias) computed in float64, rounded to fp32, cast to out_dtype."""
    y = (x.double() @ w.double().t()).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_block_linear_reference(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                               w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                               out_dtype: torch.dtype = torch.bfloat16, small_m: int = 64) -> torch.Tensor:
    """Reference of :func:`fp8_block_linear`: dequantize both (data * scale, fp32), multiply, add bias."""
    x, xs, w, ws, lead = _block_operands(x_data, x_scale, w_data, w_scale)
    m, k = x.shape
    n = w.shape[0]
    xf = x.float() * _expand_block_scale(xs, m, k, 1, GROUP)
    wf = w.float() * _expand_block_scale(ws, n, k, GROUP, GROUP)
    return _ref_matmul(xf, wf, bias, out_dtype).reshape(*lead, n)


# ============================================================================ FP8 per-tensor
def _tensor_operands(x_data, x_scale, w_data, w_scale):
    """Validate per-tensor operands; return x (M, K), xs (1,), w (N, K), ws (1,), lead dims."""
    lead = tuple(x_data.shape[:-1])
    x = _rows(x_data, "x_data")
    _check_fp8(x, "x_data", "e4m3:tensor")
    _check_fp8(w_data, "w_data", "e4m3:tensor")
    if w_data.dim() != 2 or w_data.shape[1] != x.shape[1]:
        raise _bad(f"w_data must be (N, K={x.shape[1]}) to match x_data, got {tuple(w_data.shape)}")
    for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
        if s.numel() != 1 or s.dtype != torch.float32:
            raise _bad(f"{name} must be one fp32 scale (e4m3:tensor), got {tuple(s.shape)} {s.dtype}")
    return x, x_scale.reshape(1), w_data.contiguous(), w_scale.reshape(1), lead


def scaled_mm_tensorwise(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                         w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """cuBLAS tensor-wise FP8 (``F.scaled_mm`` when present, else ``torch._scaled_mm``), K and N
    zero-padded to multiples of 16. Shapes as :func:`fp8_tensor_linear`; raises when refused."""
    x, xs, w, ws, lead = _tensor_operands(x_data, x_scale, w_data, w_scale)
    bias = _check_out(out_dtype, bias, w.shape[0])
    m, k = x.shape
    n = w.shape[0]
    kp, np_ = _round_up(k, 16), _round_up(n, 16)
    xp, wp = _pad2(x, m, kp), _pad2(w, np_, kp)
    sa, sb = xs.reshape(()), ws.reshape(())
    if has_scaled_mm():
        out = _SCALED_MM(xp, wp.t(), sa, _SCALING.TensorWise, sb, _SCALING.TensorWise, output_dtype=out_dtype)
    else:
        out = torch._scaled_mm(xp, wp.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    if np_ != n:
        out = out[:, :n].contiguous()
    if bias is not None:
        out = out.add_(bias.to(out_dtype))
    return out.reshape(*lead, n)


def fp8_tensor_linear(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                      small_m: int = 64, policy: Optional[DecodePolicy] = None,
                      options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for per-tensor FP8 (e4m3:tensor) operands.

    x_data (M, K) (or (..., K)) float8_e4m3fn, x_scale one fp32; w_data (N, K), w_scale one fp32;
    bias (N,) or None -> (M, N) in out_dtype. M <= small_m: the Triton decode kernel with
    broadcast scales; else cuBLAS (:func:`scaled_mm_tensorwise`), Triton when that is refused.
    """
    x, xs, w, ws, lead = _tensor_operands(x_data, x_scale, w_data, w_scale)
    bias = _check_out(out_dtype, bias, w.shape[0])
    if x.shape[0] > small_m and x.is_cuda:
        try:
            return scaled_mm_tensorwise(x, xs, w, ws, bias, out_dtype).reshape(*lead, w.shape[0])
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
            warnings.warn(f"fp8_tensor_linear: cuBLAS tensor-wise FP8 refused (M, K, N) = "
                          f"({x.shape[0]}, {x.shape[1]}, {w.shape[0]}): {str(exc).splitlines()[0]}; "
                          "using the Triton GEMM", RuntimeWarning, stacklevel=2)
    out = _launch_fp8(x, xs, (0, 0), w, ws, (0, 0), bias, out_dtype, None, policy=policy, options=options)
    return out.reshape(*lead, w.shape[0])


def fp8_tensor_linear_reference(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                                w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                                out_dtype: torch.dtype = torch.bfloat16, small_m: int = 64) -> torch.Tensor:
    """Reference of :func:`fp8_tensor_linear`: dequantize both (fp32), multiply, add bias."""
    x, xs, w, ws, lead = _tensor_operands(x_data, x_scale, w_data, w_scale)
    return _ref_matmul(x.float() * xs, w.float() * ws, bias, out_dtype).reshape(*lead, w.shape[0])


__all__ = [
    "fp8_block_gemm_triton", "fp8_block_linear", "fp8_block_linear_reference", "fp8_tensor_linear",
    "fp8_tensor_linear_reference", "has_scaled_mm", "scaled_mm_blockwise",
    "scaled_mm_tensorwise",
]
