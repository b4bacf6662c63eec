"""Triton flash attention (prefill, any tq) with FP8 inputs and FP8 output, plus the shared attention numerics.

The prefill kernel here and the paged decode kernel of `engine.kernels.paged_kv`
reproduce `Numerics.attention` on the dequantized inputs: causal
by absolute positions (key j is visible to query i iff k_pos[j] <= q_pos[i],
and with a sliding window W also k_pos[j] > q_pos[i] - W), GQA/MQA (query head
h reads KV head h // (heads / kv_heads)), scale 1/sqrt(dq) by default.

Numerics of the kernels:

* FP8 (E4M3) inputs are read as stored and widened to bf16 (exact: every E4M3
  value is a bf16 value); their scales are applied to the fp32 scores
  (q scale per row, K scale per key) and to V while it is widened.
* QK^T: products of bf16/fp16 operands accumulated in FP32 on the tensor cores;
  fp32 operands use `tf32x3` (fp32-level accuracy).
* Softmax in FP32, online (running max subtraction, exp2 with log2(e) folded
  into the scale); a row with no visible key gives NaN like torch.softmax
  of an all -inf row.
* PV: **P is cast to bf16 and V is dequantized tile-wise to bf16** (fp16 for
  fp16 V), accumulated in FP32. This is the kernels' one deviation from the
  FP32 emulation: expect a relative error of a few 2^-9 on the output.
* The FP32 output accumulator is normalised once at the end; the output is
  (batch, tq, heads*dv) fp32 or bf16, or E4M3 with 1x128 scales in the layout
  of `engine.formats.quantize(out, "e4m3:1x128")`, bit-exact against that
  quantization of the kernel's own fp32 output (fused into the epilogue when
  dv is 128 or 256, otherwise a second pass through `engine.kernels.quant.act_quant`).
* NaN in Q, K or V of a visible key propagates to the output.

The jit helpers below (online softmax step, V dequantization, FP8 epilogue) are
shared with the paged decode kernel.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels import kernel_device_ok
from engine.kernels.quant import _round_bf16

LOG2E = 1.4426950408889634
OUT_QUANT_SPECS = ("e4m3:1x128",)
_NEG_INF = float("-inf")


# ----------------------------------------------------------------- jit helpers
@triton.jit
def _keep_rounded(s, keep):
    """tl.where(keep, s, -inf) for a `keep` that is all true, as a barrier: without a select between them
    the compiler contracts the last scaling of the scores (s * row_scale) and the softmax's s - max into
    one FMA, whose unrounded product makes the row maximum's exp2 argument the product's rounding error
    instead of 0: harmless at ordinary magnitudes, exp2(+huge) = inf -> NaN for scores near 2**60
    (tests/engine/kernels/test_paged_kv.py::test_paged_decode_qk_fp16_is_exact_for_extreme_q). `keep` must not
    be a compile-time constant, or the select folds away."""
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _softmax_step(s, m_i, l_i, MASKED: tl.constexpr):
    """One online-softmax step on log2-domain scores s (BM, BN): returns (p, alpha, l_new, m_new)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:  # a row with no visible key so far keeps m = -inf: subtract 0 instead (exp2(-inf) = 0, no NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    alpha = tl.math.exp2(m_i - m_sub)
    p = tl.math.exp2(s - m_sub[:, None])
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _e4m3_scale(o):
    """Dynamic E4M3 scale of every row of o (R, W) fp32, as engine.formats computes it: amax / 448 (RN
    division), 1 for an all-zero row, NaN for a row holding a NaN (tl.max alone may drop NaNs)."""
    amax = tl.max(tl.abs(o), axis=1)
    scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(amax == 0.0, 1.0, scale)
    n_nan = tl.sum((o != o).to(tl.int32), axis=1)
    nan = tl.sum(tl.where(o != o, o, 0.0), axis=1)
    return tl.where(n_nan > 0, nan, scale)


@triton.jit
def _store_e4m3(o, scale, mask, data_off, out_ptr):
    """Store RNE(o / scale) as E4M3 (scale broadcastable to o); |o / scale| <= 448 for dynamic scales.

    Masked-out elements divide 1.0, not their value (they are not stored): the division's fast path hands a
    zero dividend to its slow path, and a decode tile's padding rows (12 of 16 for 4 query heads per KV head)
    are zeros (docs/design/performance.md#quantization-kernels)."""
    y = tl.div_rn(tl.where(mask, o, 1.0), scale)
    tl.store(out_ptr + data_off, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _store_e4m3_groups(o, mask, data_off, scale_off, out_ptr, scale_ptr):
    """E4M3 quantization of o (R, W) fp32 with one group per row, bit-exact with engine.formats (1x128
    groups, or per-token rows): data at data_off (R, W) where mask (R, W), scales at scale_off (R,) for the
    rows with any masked-in element. Masked-out elements must be 0 (they never raise an amax)."""
    scale = _e4m3_scale(o)
    _store_e4m3(o, scale[:, None], mask, data_off, out_ptr)
    tl.store(scale_ptr + scale_off, scale, mask=tl.max(mask.to(tl.int32), axis=1) > 0)


@triton.jit
def _store_output(o, rows, row_valid, col0, out_ptr, hp_ptr, osc_ptr, ROW_LEN, DV: tl.constexpr,
                  DV_P: tl.constexpr, OUT_MODE: tl.constexpr, STORE_HP: tl.constexpr):
    """Store o (R, DV_P) fp32 at out[row, col0:col0+DV] of a (rows, ROW_LEN) output.

    OUT_MODE 0: fp32, 1: bf16, 2: E4M3 1x128 groups (needs DV % 128 == 0 and col0 % 128 == 0), 3: o rounded
    to bf16 first (an attention output stored in bf16, then quantized for the next GEMM), then as 2;
    STORE_HP additionally writes the fp32 values (3: the bf16-rounded ones) to hp_ptr (same layout)."""
    cols = tl.arange(0, DV_P)
    off = rows.to(tl.int64)[:, None] * ROW_LEN + col0 + cols[None, :]  # (R, DV_P)
    mask = row_valid[:, None] & (cols[None, :] < DV)
    if OUT_MODE == 0:
        tl.store(out_ptr + off, o, mask=mask)
    elif OUT_MODE == 1:
        tl.store(out_ptr + off, o.to(tl.bfloat16), mask=mask)
    else:
        if OUT_MODE == 3:
            o = _round_bf16(o)
        G: tl.constexpr = DV // 128  # 1x128 groups per head
        R: tl.constexpr = o.shape[0]
        gi = tl.arange(0, G)
        soff = rows.to(tl.int64)[:, None] * (ROW_LEN // 128) + col0 // 128 + gi[None, :]  # (R, G)
        _store_e4m3_groups(tl.reshape(o, (R * G, 128)), tl.reshape(mask, (R * G, 128)),
                           tl.reshape(off, (R * G, 128)), tl.reshape(soff, (R * G,)), out_ptr, osc_ptr)
    if STORE_HP:
        tl.store(hp_ptr + off, o, mask=mask)


@triton.jit
def _load_v(v_ptrs, vs_rows, svs_g, mask_n, HAS_VS: tl.constexpr, V_GROUPS: tl.constexpr, DV: tl.constexpr,
            DV_P: tl.constexpr, PV_DTYPE: tl.constexpr):
    """Load a V tile (BN, DV_P) and dequantize it to PV_DTYPE; vs_rows (BN,) points at each token's first
    128-group scale, the next groups follow with stride svs_g."""
    cols = tl.arange(0, DV_P)
    v = tl.load(v_ptrs, mask=mask_n[:, None] & (cols[None, :] < DV), other=0.0)
    if HAS_VS:
        if V_GROUPS == 1:
            vs = tl.load(vs_rows, mask=mask_n, other=1.0)
            v = v.to(tl.float32) * vs[:, None]
        else:
            vs = tl.load(vs_rows[:, None] + (cols // 128)[None, :] * svs_g,
                         mask=mask_n[:, None] & (cols[None, :] < DV), other=1.0)
            v = v.to(tl.float32) * vs
    return v.to(PV_DTYPE)


@triton.jit
def _qk(q, k, FP32_QK: tl.constexpr):
    """Scores q (BM, D) @ k (BN, D)^T with FP32 accumulation (fp32 operands: tf32x3, ~fp32 accurate)."""
    if FP32_QK:
        return tl.dot(q, tl.trans(k), input_precision="tf32x3")
    else:
        return tl.dot(q, tl.trans(k))


# ------------------------------------------------------------ prefill kernel
@triton.jit
def _flash_phase(acc, l_i, m_i, q, q_pos, row_scale, k_base, v_base, ks_base, vs_base, kpos_ptr, lo, hi,
                 skt, skd, svt, svd, sks_t, svs_t, svs_g, window,
                 BN: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KS: tl.constexpr,
                 HAS_VS: tl.constexpr, V_GROUPS: tl.constexpr, DQ: tl.constexpr, DQ_P: tl.constexpr,
                 DV: tl.constexpr, DV_P: tl.constexpr, COMPUTE: tl.constexpr, PV_DTYPE: tl.constexpr,
                 FP32_QK: tl.constexpr):
    """Keys [lo, hi) in BN steps. MASKED=False only for full tiles visible to every query of the block."""
    dq = tl.arange(0, DQ_P)
    dv = tl.arange(0, DV_P)
    for start in range(lo, hi, BN):
        offs_n = start + tl.arange(0, BN)
        if MASKED:
            mask_n = offs_n < hi
        else:
            mask_n = offs_n >= 0
        on = offs_n.to(tl.int64)
        k = tl.load(k_base + on[:, None] * skt + dq[None, :] * skd, mask=mask_n[:, None] & (dq[None, :] < DQ),
                    other=0.0)
        s = _qk(q, k.to(COMPUTE), FP32_QK)  # (BM, BN) fp32
        if HAS_KS:
            ks = tl.load(ks_base + on * sks_t, mask=mask_n, other=1.0)
            s = s * ks[None, :]
        s = s * row_scale[:, None]  # softmax scale * log2(e) * q scale
        if MASKED:
            kp = tl.load(kpos_ptr + offs_n, mask=mask_n, other=0)
            vis = (kp[None, :] <= q_pos[:, None]) & mask_n[None, :]
            if HAS_WINDOW:
                vis = vis & (kp[None, :] > q_pos[:, None] - window)
            s = tl.where(vis, s, float("-inf"))
        else:
            s = _keep_rounded(s, mask_n[None, :])
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, MASKED)
        v = _load_v(v_base + on[:, None] * svt + dv[None, :] * svd, vs_base + on * svs_t, svs_g, mask_n,
                    HAS_VS, V_GROUPS, DV, DV_P, PV_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(PV_DTYPE), v)
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(q_ptr, k_ptr, v_ptr, qs_ptr, ks_ptr, vs_ptr, qpos_ptr, kpos_ptr, bounds_ptr,
                      out_ptr, hp_ptr, osc_ptr,
                      sqb, sqh, sqt, sqd, skb, skh, skt, skd, svb, svh, svt, svd,
                      sqsb, sqsh, sqst, sksb, sksh, skst, svsb, svsh, svst, svsg,
                      H, GROUP, TQ, NUM_MB, qk_scale, window,
                      DQ: tl.constexpr, DV: tl.constexpr, DQ_P: tl.constexpr, DV_P: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, HAS_QS: tl.constexpr, HAS_KS: tl.constexpr,
                      HAS_VS: tl.constexpr, V_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      COMPUTE: tl.constexpr, PV_DTYPE: tl.constexpr, FP32_QK: tl.constexpr,
                      OUT_MODE: tl.constexpr, STORE_HP: tl.constexpr):
    """Grid (query blocks, batch*heads). Three key phases from bounds[mb] = (lo, b, c, hi):
    [lo, b) masked, [b, c) full tiles unmasked, [c, hi) masked (see `_key_bounds`)."""
    mb = NUM_MB - 1 - tl.program_id(0)  # the longest (last) query blocks of a causal prefill start first
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = mb * BM + tl.arange(0, BM)
    mmask = offs_m < TQ
    om = offs_m.to(tl.int64)
    dq = tl.arange(0, DQ_P)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + om[:, None] * sqt + dq[None, :] * sqd,
                mask=mmask[:, None] & (dq[None, :] < DQ), other=0.0).to(COMPUTE)
    row_scale = tl.full((BM,), qk_scale, tl.float32)
    if HAS_QS:
        row_scale = row_scale * tl.load(qs_ptr + b.to(tl.int64) * sqsb + h.to(tl.int64) * sqsh + om * sqst,
                                        mask=mmask, other=1.0)
    q_pos = tl.load(qpos_ptr + offs_m, mask=mmask, other=0)
    lo = tl.load(bounds_ptr + mb * 4)
    b1 = tl.load(bounds_ptr + mb * 4 + 1)
    c1 = tl.load(bounds_ptr + mb * 4 + 2)
    hi = tl.load(bounds_ptr + mb * 4 + 3)
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    ks_base = ks_ptr + b.to(tl.int64) * sksb + hk.to(tl.int64) * sksh
    vs_base = vs_ptr + b.to(tl.int64) * svsb + hk.to(tl.int64) * svsh
    acc = tl.zeros((BM, DV_P), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    acc, l_i, m_i = _flash_phase(acc, l_i, m_i, q, q_pos, row_scale, k_base, v_base, ks_base, vs_base, kpos_ptr,
                                 lo, b1, skt, skd, svt, svd, skst, svst, svsg, window, BN, True, HAS_WINDOW,
                                 HAS_KS, HAS_VS, V_GROUPS, DQ, DQ_P, DV, DV_P, COMPUTE, PV_DTYPE, FP32_QK)
    acc, l_i, m_i = _flash_phase(acc, l_i, m_i, q, q_pos, row_scale, k_base, v_base, ks_base, vs_base, kpos_ptr,
                                 b1, c1, skt, skd, svt, svd, skst, svst, svsg, window, BN, False, HAS_WINDOW,
                                 HAS_KS, HAS_VS, V_GROUPS, DQ, DQ_P, DV, DV_P, COMPUTE, PV_DTYPE, FP32_QK)
    acc, l_i, m_i = _flash_phase(acc, l_i, m_i, q, q_pos, row_scale, k_base, v_base, ks_base, vs_base, kpos_ptr,
                                 c1, hi, skt, skd, svt, svd, skst, svst, svsg, window, BN, True, HAS_WINDOW,
                                 HAS_KS, HAS_VS, V_GROUPS, DQ, DQ_P, DV, DV_P, COMPUTE, PV_DTYPE, FP32_QK)
    o = acc / l_i[:, None]  # a row without any visible key: 0 / 0 = NaN, as in the emulation
    _store_output(o, b * TQ + offs_m, mmask, h * DV, out_ptr, hp_ptr, osc_ptr, H * DV, DV, DV_P,
                  OUT_MODE, STORE_HP)


# ----------------------------------------------------------------- wrappers
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
BLOCK_SIZES = (16, 32, 64, 128, 256)  # serving config "attention block size": 64 / 128 / 256


def _pow2(n: int) -> int:
    """Padded tile width of a head dim: next power of two, at least 16 (the tensor-core minimum)."""
    return max(16, triton.next_power_of_2(n))


def _compute_types(q_dtype: torch.dtype, k_dtype: torch.dtype, v_dtype: torch.dtype):
    """(QK operand type, fp32 QK?, PV operand type). E4M3 widens exactly to bf16 and fp16."""
    qk = {q_dtype, k_dtype} - {torch.float8_e4m3fn}
    if not qk or qk == {torch.bfloat16}:
        compute = tl.bfloat16
    elif qk == {torch.float16}:
        compute = tl.float16
    else:  # fp32 or mixed half types: fp32 operands (tf32x3)
        compute = tl.float32
    return compute, compute == tl.float32, (tl.float16 if v_dtype == torch.float16 else tl.bfloat16)


def _check_dtype(x: torch.Tensor, name: str) -> None:
    """Attention inputs are fp32 / bf16 / fp16 / float8_e4m3fn CUDA tensors (CPU under TRITON_INTERPRET=1)."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype} not supported; use one of {[str(d) for d in _DTYPES]}")
    if not kernel_device_ok(x):
        raise ValueError(f"{name}: the Triton attention kernels need CUDA tensors (got device {x.device})")


def _scale_view(s, shape: tuple[int, ...], name: str, device: torch.device) -> Optional[torch.Tensor]:
    """A fp32 scale broadcast (stride 0 where shared) to `shape` = (batch, heads, tokens[, groups]).

    Accepted: None, a number or one-element tensor (per tensor), (batch, heads) (per head),
    (batch, heads, tokens) and, for 4-D targets, (batch, heads, tokens, groups) or anything
    broadcastable to it; a trailing singleton dim is dropped for 3-D targets."""
    if s is None:
        return None
    t = torch.as_tensor(s, dtype=torch.float32, device=device)
    if t.numel() == 1:
        return t.reshape(()).expand(shape)
    if t.dim() == 2 and tuple(t.shape) == tuple(shape[:2]):
        t = t.reshape(*t.shape, *([1] * (len(shape) - 2)))  # per (batch, head)
    elif len(shape) == 3 and t.dim() == 4 and t.shape[-1] == 1:
        t = t[..., 0]
    elif len(shape) == 4 and t.dim() == 3:
        t = t[..., None]  # per token; one 128-group (or the same scale for every group)
    try:
        return torch.broadcast_to(t, shape)
    except RuntimeError as exc:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to {tuple(shape)} "
                         f"(batch, heads, tokens[, 128-groups]); pass one scale per tensor, per (batch, head) "
                         f"or per (batch, head, token)") from exc


def _strides(t: Optional[torch.Tensor], n: int) -> tuple[int, ...]:
    """Strides of an optional tensor (zeros when absent)."""
    return tuple(t.stride()) if t is not None else (0,) * n


def _key_bounds(q_pos: torch.Tensor, k_pos: torch.Tensor, block_m: int, block_n: int,
                window: Optional[int]) -> torch.Tensor:
    """Per query block (lo, b, c, hi) int32 (num_blocks, 4), computed on the device (no host sync).

    With non-decreasing k_pos: keys outside [lo, hi) are invisible to every query of the block, keys in
    [b, c) (a whole number of block_n tiles) are visible to all of them and skip the mask. Unsorted
    k_pos: (0, 0, 0, tk), i.e. every key through the masked path.
    """
    tq, tk = q_pos.numel(), k_pos.numel()
    nmb = triton.cdiv(tq, block_m)
    qp = q_pos.long()
    qp = torch.cat([qp, qp[-1:].expand(nmb * block_m - tq)]).view(nmb, block_m)  # (blocks, block_m)
    qmin, qmax = qp.amin(1), qp.amax(1)
    kp = k_pos.long().contiguous()
    hi = torch.searchsorted(kp, qmax, right=True)
    full_hi = torch.searchsorted(kp, qmin, right=True)
    if window is not None:
        lo = torch.searchsorted(kp, qmin - window, right=True)
        full_lo = torch.searchsorted(kp, qmax - window, right=True)
    else:
        lo = full_lo = torch.zeros_like(hi)
    b = torch.minimum(torch.maximum(full_lo, lo), hi)
    c = torch.maximum(torch.minimum(full_hi, hi), b)
    c = b + (c - b) // block_n * block_n
    bounds = torch.stack([lo, b, c, hi], dim=1)  # (blocks, 4)
    is_sorted = (kp[1:] >= kp[:-1]).all() if tk > 1 else torch.ones((), dtype=torch.bool, device=kp.device)
    fallback = torch.tensor([0, 0, 0, tk], device=kp.device).expand(nmb, 4)
    return torch.where(is_sorted, bounds, fallback).to(torch.int32).contiguous()


def _out_buffers(b: int, tq: int, h: int, dv: int, device, out_dtype, out_quant, return_hp, out_round=None):
    """(out, hp, scales, OUT_MODE, STORE_HP, second_pass) for the output modes documented in the module;
    out_round="bf16" (with out_quant) rounds the output to bf16 before quantizing it."""
    n = h * dv
    if out_round not in (None, "bf16") or (out_round is not None and out_quant is None):
        raise ValueError(f"out_round {out_round!r}: use None, or 'bf16' together with out_quant")
    if out_quant is None:
        if out_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"out_dtype {out_dtype}: use torch.float32 or torch.bfloat16 (or out_quant='e4m3:1x128')")
        out = torch.empty((b, tq, n), device=device, dtype=out_dtype)
        return out, out, out, (0 if out_dtype == torch.float32 else 1), False, False
    if out_quant not in OUT_QUANT_SPECS:
        raise ValueError(f"out_quant {out_quant!r} not supported; use one of {OUT_QUANT_SPECS}")
    if dv in (128, 256):  # 1x128 groups never straddle two heads: quantize in the epilogue
        out = torch.empty((b, tq, n), device=device, dtype=torch.float8_e4m3fn)
        scales = torch.empty((b, tq, n // 128), device=device, dtype=torch.float32)
        hp = torch.empty((b, tq, n), device=device, dtype=torch.float32) if return_hp else out
        return out, hp, scales, 2 if out_round is None else 3, return_hp, False
    if out_round is not None:  # the fp32 pass writes bf16 values (exact in fp32), the second pass quantizes them
        hp = torch.empty((b, tq, n), device=device, dtype=torch.bfloat16)
        return hp, hp, hp, 1, False, True
    hp = torch.empty((b, tq, n), device=device, dtype=torch.float32)
    return hp, hp, hp, 0, False, True


def _finish(out, hp, scales, out_quant, return_hp, second_pass):
    """Return value of the wrappers: the output tensor, or (data, scales[, fp32 output]) for out_quant."""
    if out_quant is None:
        return out
    if second_pass:
        from engine.kernels.quant import act_quant

        hp = hp.float()  # a bf16 (out_round) first pass: its values, exactly
        data, scales = act_quant(hp)
    else:
        data = out
    return (data, scales, hp) if return_hp else (data, scales)


def _launch(kernel, grid, args, kwargs, what: str):
    """Launch a kernel, turning Triton's out-of-resources error into advice."""
    try:
        kernel[grid](*args, **kwargs)
    except triton.runtime.errors.OutOfResources as exc:
        raise ValueError(f"{what}: tile configuration too large for this GPU ({exc}); use a smaller "
                         f"block_m / block_n or num_stages") from exc


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    *, scale: Optional[float] = None, sliding_window: Optional[int] = None, q_scale=None,
                    k_scale=None, v_scale=None, block_m: int = 64, block_n: int = 64,
                    out_quant: Optional[str] = None, out_dtype: torch.dtype = torch.float32, return_hp: bool = False,
                    num_warps: Optional[int] = None, num_stages: Optional[int] = None):
    """Flash attention (prefill or any tq) with `Numerics.attention` semantics. Reference: `flash_attention_reference`.

    q: (batch, heads, tq, dq), k: (batch, kv_heads, tk, dq), v: (batch, kv_heads, tk, dv), any strides;
    fp32 / bf16 / fp16 / float8_e4m3fn; dq, dv <= 256 (any size, e.g. 96, 192; MLA: dq != dv);
    kv_heads divides heads. q_pos (tq,), k_pos (tk,) integer absolute positions (k_pos non-decreasing
    lets whole tiles be skipped or run unmasked; any order is correct).
    Scales (fp32, dequantized value = stored value * scale): q_scale per tensor, (batch, heads) or
    (batch, heads, tq); k_scale per tensor, (batch, kv_heads) or (batch, kv_heads, tk); v_scale per
    tensor, (batch, kv_heads, tk) or (batch, kv_heads, tk, ceil(dv/128)) (the e4m3:1x128 layout).
    block_m / block_n: query / key tile (64, 128 or 256; 16 and 32 for tiny shapes).

    Returns (batch, tq, heads*dv) in out_dtype (fp32 or bf16); with out_quant="e4m3:1x128" returns
    (data float8_e4m3fn (batch, tq, heads*dv), scales fp32 (batch, tq, heads*dv/128)) plus the fp32
    output when return_hp=True (the values that were quantized).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(x, name)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, tokens, head_dim), got shape {tuple(x.shape)}")
    b, h, tq, dq = q.shape
    _, hkv, tk, dk = k.shape
    dv = v.shape[-1]
    if k.shape[0] != b or dk != dq or tuple(v.shape[:3]) != (b, hkv, tk):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match: need "
                         f"q (b, h, tq, d), k (b, hkv, tk, d), v (b, hkv, tk, dv)")
    if h % hkv:
        raise ValueError(f"kv_heads {hkv} must divide heads {h}")
    if max(dq, dv) > 256:
        raise ValueError(f"head dims up to 256 are supported (dq {dq}, dv {dv})")
    if block_m not in BLOCK_SIZES or block_n not in BLOCK_SIZES:
        raise ValueError(f"block_m {block_m} / block_n {block_n}: use one of {BLOCK_SIZES}")
    if q_pos.shape != (tq,) or k_pos.shape != (tk,):
        raise ValueError(f"q_pos {tuple(q_pos.shape)} / k_pos {tuple(k_pos.shape)} must be ({tq},) / ({tk},)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if tq == 0 or tk == 0 or b == 0:
        raise ValueError(f"empty attention (batch {b}, tq {tq}, tk {tk})")
    dev = q.device
    qs = _scale_view(q_scale, (b, h, tq), "q_scale", dev)
    ks = _scale_view(k_scale, (b, hkv, tk), "k_scale", dev)
    n_groups = triton.cdiv(dv, 128)
    vs = _scale_view(v_scale, (b, hkv, tk, n_groups), "v_scale", dev)
    q_pos = q_pos.to(device=dev, dtype=torch.int32).contiguous()
    k_pos = k_pos.to(device=dev, dtype=torch.int32).contiguous()
    bounds = _key_bounds(q_pos, k_pos, block_m, block_n, sliding_window)
    out, hp, osc, mode, store_hp, second = _out_buffers(b, tq, h, dv, dev, out_dtype, out_quant, return_hp)
    compute, fp32_qk, pv = _compute_types(q.dtype, k.dtype, v.dtype)
    dq_p, dv_p = _pow2(dq), _pow2(dv)
    if num_warps is None:
        num_warps = 4 if block_m <= 64 else 8
    if num_stages is None:
        tile = block_n * (dq_p * k.element_size() + dv_p * v.element_size())
        num_stages = 3 if tile <= 48 * 1024 else (2 if tile <= 96 * 1024 else 1)
    nmb = triton.cdiv(tq, block_m)
    qk_scale = (1.0 / math.sqrt(dq) if scale is None else float(scale)) * LOG2E
    args = (q, k, v, qs if qs is not None else out, ks if ks is not None else out, vs if vs is not None else out,
            q_pos, k_pos, bounds, out, hp, osc,
            *q.stride(), *k.stride(), *v.stride(), *_strides(qs, 3), *_strides(ks, 3), *_strides(vs, 4),
            h, h // hkv, tq, nmb, qk_scale, sliding_window or 0)
    kwargs = dict(DQ=dq, DV=dv, DQ_P=dq_p, DV_P=dv_p, BM=block_m, BN=block_n, HAS_QS=qs is not None,
                  HAS_KS=ks is not None, HAS_VS=vs is not None, V_GROUPS=n_groups,
                  HAS_WINDOW=sliding_window is not None, COMPUTE=compute, PV_DTYPE=pv, FP32_QK=fp32_qk,
                  OUT_MODE=mode, STORE_HP=store_hp, num_warps=num_warps, num_stages=num_stages)
    _launch(_flash_fwd_kernel, (nmb, b * h), args, kwargs, f"flash_attention(block_m={block_m}, block_n={block_n})")
    return _finish(out, hp, osc, out_quant, return_hp, second)


def dequantize(x: torch.Tensor, x_scale=None, groups: bool = False) -> torch.Tensor:
    """fp32 stored value times scale of one attention input (batch, heads, tokens, d): scales as in
    `flash_attention` (groups=True: V's per-128-group layout)."""
    b, hh, t, d = x.shape
    if groups:
        s = _scale_view(x_scale, (b, hh, t, triton.cdiv(d, 128)), "v_scale", x.device)
        return x.float() if s is None else x.float() * s.repeat_interleave(128, dim=-1)[..., :d]
    s = _scale_view(x_scale, (b, hh, t), "scale", x.device)
    return x.float() if s is None else x.float() * s[..., None]


def _emulated_attention(q, k, v, q_pos, k_pos, sliding_window, scale):
    """`Numerics.attention` of an all-fp32 recipe: the math every kernel is checked against."""
    from engine.numerics import Numerics
    from engine.recipe import load_recipe

    return Numerics(load_recipe("fp32")).attention(q, k, v, q_pos.long(), k_pos.long(), "attn",
                                                   sliding_window, scale)


def flash_attention_reference(q, k, v, q_pos, k_pos, *, scale=None, sliding_window=None, q_scale=None,
                              k_scale=None, v_scale=None) -> torch.Tensor:
    """FP32 `Numerics.attention` on the dequantized inputs: (batch, tq, heads*dv) fp32."""
    return _emulated_attention(dequantize(q, q_scale), dequantize(k, k_scale), dequantize(v, v_scale, groups=True),
                               q_pos, k_pos, sliding_window, scale)
