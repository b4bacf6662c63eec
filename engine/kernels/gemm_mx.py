"""MX / NVFP4 GEMMs: MXFP8 x MXFP8, and 16-bit activations x MXFP8 / MXFP4 / NVFP4 weights.

`mx_linear` is a dequant-in-kernel Triton GEMM (sm_90 cuBLAS has no MX / NVFP4 GEMM). Weights are repacked once by
`prepare_mx_weight` (two E2M1 codes per byte, 1-byte scale codes); activations are used as stored. Elements are
decoded and multiplied by their block scale into bf16 (exact for E2M1 x E8M0, E4M3 x E8M0 and E2M1 x E4M3 products,
except blocks so tiny (< ~2**-118) that the product underflows bf16), then multiplied on bf16 tensor cores with fp32
accumulation; 16-bit / fp32 activations are rounded to bf16 in the kernel (w4a16); the NVFP4 tensor scale is applied
to the fp32 accumulator. Split-K partials are reduced by `engine.kernels.splitk`. Operand layouts: the table in
`engine.kernels.gemm`. `mx_linear_reference` dequantizes both operands and multiplies them in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
import triton.language as tl

from engine.kernels import sm_count
from engine.kernels import splitk as sk
from engine.kernels.decode_plan import DEFAULT_POLICY, DecodePolicy, _plan_split, _tiles
from engine.kernels.gemm import _expand_block_scale, _pad2, _ref_matmul
from engine.kernels.gemm_fp8 import FP8
from engine.kernels.options import DEFAULT_OPTIONS, KernelOptions
from engine.kernels.splitk import (_bad, _cdiv, _check_out, _epilogue, _last_split_reduce, _round_up, _rows,
                                   _tile_counters)


MX_CHUNK = 128  # K columns per MX kernel step; prepared MX weights are padded to a multiple of it


@triton.jit
def _e2m1_to_f32(code):
    """E2M1 codes (int32, 0..15: sign, 2 exponent bits, 1 mantissa bit) -> fp32, via the fp32 bits."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))  # e==0: 0 or 0.5
    bits = bits | ((code >> 3) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_to_f32(code):
    """E8M0 codes (int32, 0..255) -> 2**(code-127) in fp32 (code 0: the subnormal 2**-127; 255: NaN)."""
    bits = tl.where(code == 0, 0x00400000, code << 23)
    bits = tl.where(code == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_to_f32(code):
    """E4M3 codes (int32, 0..255) -> their fp32 values by bit arithmetic (exponent bias 7 -> 127; exponent 0: m * 2**-9;
    S.1111.111: NaN), as `_e8m0_to_f32` does for E8M0."""
    e = (code >> 3) & 15
    m = code & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
    v = (mag.to(tl.int32, bitcast=True) | ((code >> 7) << 31)).to(tl.float32, bitcast=True)  # the sign, -0 included
    return tl.where((code & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _e2m1_nibble_to_f32(b, SHIFT: tl.constexpr):
    """The E2M1 code in bits SHIFT..SHIFT+3 of b (int32 bytes) -> fp32: its 3 magnitude bits placed at fp32 bits 22-24
    read as value * 2**-126 (code 1, 0.5, as the subnormal 2**-127), times 2**126 (exact: mul.f32 keeps subnormals);
    the sign bit moved to bit 31, so code 8 is -0."""
    bits = ((b << (22 - SHIFT)) & 0x01C00000) | ((b << (28 - SHIFT)) & -2147483648)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


# E2M1 magnitudes 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) as bf16: the high bytes and the low bytes, 8 entries of each in a
# pair of 32-bit PRMT tables (byte i of the pair = entry i).
_E2M1_BF16_HI = (0x3F3F3F00, 0x40404040)
_E2M1_BF16_LO = (0xC0800000, 0xC0804000)


@triton.jit
def _e2m1_bytes_to_bf16(b):
    """Packed E2M1 bytes b (uint8) -> (low nibbles, high nibbles) as exact bf16 (code 8: -0), by PRMT table lookups in
    inline PTX: per 4 bytes one mask, one shift, 4 lookups (4 codes each), 4 byte interleaves and the signs by 2 byte
    moves, 2 shifts and 4 and-ors; ~2.3 instructions per element against ~5 for `_e2m1_nibble_to_f32` and its
    rounding to bf16. The selector of a lookup is a code's 3 magnitude bits, so each 32-bit register of 4 bytes holds
    the selectors of its first two bytes in bits 0-15 and of its last two in bits 16-31. CUDA only."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 w, m, h, l, s, t;
        cvt.u32.u16 w, $2;
        and.b32 m, w, 0x7777;
        prmt.b32 h, 0x3F3F3F00, 0x40404040, m;
        prmt.b32 l, 0xC0800000, 0xC0804000, m;
        prmt.b32 $0, l, h, 0x6240;
        prmt.b32 $1, l, h, 0x7351;
        prmt.b32 s, w, 0, 0x1000;
        and.b32 t, s, 0x80008000;
        or.b32 $1, $1, t;
        shl.b32 t, s, 4;
        and.b32 t, t, 0x80008000;
        or.b32 $0, $0, t;
        }""",
        "=r,=r,h", [b], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def _scale_tile(rows, blk0, limit, ok, NB: tl.constexpr):
    """Scale entries blk0 .. blk0 + NB - 1 (those < limit) of each row (rows: (R,) pointers to the rows' scales), as
    stored: (R, NB) fp32 values, E8M0 codes or E4M3 scales. A separate load, so the kernel can issue it a chunk
    early."""
    blk = blk0 + tl.arange(0, NB)
    return tl.load(rows[:, None] + blk[None, :], mask=ok[:, None] & (blk < limit)[None, :], other=0.0)


@triton.jit
def _spread_scales(t, SB: tl.constexpr, KIND: tl.constexpr, DT: tl.constexpr):
    """A (R, NB) tile of `_scale_tile` as (R, NB * SB) values in DT, each scale repeated over its SB columns. KIND 0:
    fp32 values; 1: E8M0 codes; 2: E4M3 scales, decoded by bit arithmetic (`_e4m3_to_f32`).
    Exact in bf16: powers of two and E4M3 values are bf16 numbers."""
    if KIND == 0:
        v = t
    elif KIND == 1:
        v = _e8m0_to_f32(t.to(tl.int32))
    else:
        v = _e4m3_to_f32(t.to(tl.uint8, bitcast=True).to(tl.int32))
    v = v.to(DT)
    return tl.reshape(tl.broadcast_to(v[:, :, None], (v.shape[0], v.shape[1], SB)), (v.shape[0], v.shape[1] * SB))


@triton.jit
def _mx_weight_deq(wv, ws_rows, kk, n_ok, W_SB: tl.constexpr, W_E8M0: tl.constexpr):
    """Weight elements wv (BN, 64) fp32 times their block scales (gathered per column), as bf16. E4M3 scales (NVFP4)
    decode by bit arithmetic (`_e4m3_to_f32`)."""
    s = tl.load(ws_rows + (kk // W_SB)[None, :], mask=n_ok[:, None], other=0.0)
    if W_E8M0:
        sf = _e8m0_to_f32(s.to(tl.int32))
    else:
        sf = _e4m3_to_f32(s.to(tl.uint8, bitcast=True).to(tl.int32))
    return (wv * sf).to(tl.bfloat16)


@triton.jit
def _mx_act(x_rows, xs_rows, kk, m_ok, K, X_SCALED: tl.constexpr):
    """Activation columns kk (64,) of the BM rows as bf16: MX fp8 elements times their 1x32 fp32
    scales, or the 16/32-bit input rounded to bf16."""
    ok = m_ok[:, None] & (kk < K)[None, :]
    xv = tl.load(x_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
    if X_SCALED:
        xv = xv * tl.load(xs_rows + (kk // 32)[None, :], mask=ok, other=0.0)
    return xv.to(tl.bfloat16)


@triton.jit
def _chunk_scales(ws_n, xs_m, c, n_chunks, K, n_ok, m_ok, NBW: tl.constexpr, X_SCALED: tl.constexpr):
    """The `_scale_tile`s of 128-column chunk c: weight scales of its two 64-column halves (NBW per row each) and,
    with X_SCALED, the activations' 1x32 scales of both halves (else the weight tiles again, unused)."""
    ws_lo = _scale_tile(ws_n, c * 2 * NBW, n_chunks * 2 * NBW, n_ok, NBW)
    ws_hi = _scale_tile(ws_n, c * 2 * NBW + NBW, n_chunks * 2 * NBW, n_ok, NBW)
    if X_SCALED:
        xs_lo = _scale_tile(xs_m, c * 4, tl.cdiv(K, 32), m_ok, 2)
        xs_hi = _scale_tile(xs_m, c * 4 + 2, tl.cdiv(K, 32), m_ok, 2)
    else:
        xs_lo = ws_lo
        xs_hi = ws_hi
    return ws_lo, ws_hi, xs_lo, xs_hi


@triton.jit
def _mx_half(acc, w_vals, w_sc, x_sc, x_rows, k0, h, m_ok, K, W_SB: tl.constexpr, W_KIND: tl.constexpr,
             X_SCALED: tl.constexpr):
    """acc += (w_vals * weight scales) @ (x * x scales)^T over the 64 columns k0 + h (k0 a multiple of 64; w_sc, x_sc
    their `_scale_tile`s). Both products are exact in bf16 (E2M1 / E4M3 / E5M2 times a power of two or an E4M3 scale;
    MX fp8 times a power of two), so w_vals in bf16 (multiplied in bf16) or fp32 (in fp32, then rounded) give the same
    operand bits."""
    w = (w_vals * _spread_scales(w_sc, W_SB, W_KIND, w_vals.dtype)).to(tl.bfloat16)
    kk = k0 + h
    ok = m_ok[:, None] & (kk < K)[None, :]
    xv = tl.load(x_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
    if X_SCALED:
        xv = xv * _spread_scales(x_sc, 32, 0, tl.float32)
    return tl.dot(w, tl.trans(xv.to(tl.bfloat16)), acc)


@triton.jit(do_not_specialize=["M", "N", "n_chunks", "chunks_per_split", "stride_xsm", "stride_wsn"])
def _mx_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, ts_ptr, out_ptr, part_ptr, bias_ptr, cnt_ptr,
                    M, N, K, n_chunks, chunks_per_split, stride_xm, stride_xsm, stride_wn, stride_wsn,
                    BM: tl.constexpr, BN: tl.constexpr, X_SCALED: tl.constexpr, W_FP4: tl.constexpr,
                    W_SB: tl.constexpr, W_E8M0: tl.constexpr, HAS_TS: tl.constexpr,
                    USE_PART: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ROW_SCALES: tl.constexpr = True, FP4_PTX: tl.constexpr = False,
                    FUSED_REDUCE: tl.constexpr = False, RED: tl.constexpr = 4):
    """Grid (N tiles, M tiles, K splits). Per 128-column chunk: the weight's two 64-column halves
    (packed FP4: low / high nibbles of the same 64 bytes; FP8: two loads) are decoded, scaled
    into bf16 and multiplied with the matching activation halves: acc (BN, BM) += W_h @ X_h^T.
    ROW_SCALES: each row's block scales as one tile per half, loaded a chunk ahead (`_chunk_scales`) and spread over
    the columns (`_spread_scales`); FP4 decoded by `_e2m1_bytes_to_bf16` (FP4_PTX) or `_e2m1_nibble_to_f32`. Else one
    gathered scale load per element and `_e2m1_to_f32` (the slower path, kept for the A/B probe). FUSED_REDUCE: the
    last split of each tile sums the partials (`_last_split_reduce`)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    h = tl.arange(0, 64)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    ws_n = ws_ptr + offs_n.to(tl.int64) * stride_wsn
    ws_rows = ws_n[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    xs_m = xs_ptr + offs_m.to(tl.int64) * stride_xsm
    xs_rows = xs_m[:, None]
    c0 = pid_s * chunks_per_split
    c1 = tl.minimum(c0 + chunks_per_split, n_chunks)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    W_KIND: tl.constexpr = 1 if W_E8M0 else 2
    NBW: tl.constexpr = 64 // W_SB  # weight scales per row and 64-column half
    if ROW_SCALES:  # each chunk's scale tiles are loaded one chunk ahead
        ws_lo, ws_hi, xs_lo, xs_hi = _chunk_scales(ws_n, xs_m, c0, n_chunks, K, n_ok, m_ok, NBW, X_SCALED)
    for c in range(c0, c1):
        k_lo = c * 128 + h
        k_hi = k_lo + 64
        if ROW_SCALES:
            ws_lo_n, ws_hi_n, xs_lo_n, xs_hi_n = _chunk_scales(ws_n, xs_m, tl.minimum(c + 1, c1 - 1), n_chunks, K,
                                                               n_ok, m_ok, NBW, X_SCALED)
            if W_FP4:
                b = tl.load(w_rows + (c * 64 + h)[None, :], mask=n_ok[:, None], other=0)
                if FP4_PTX:
                    wl, wh = _e2m1_bytes_to_bf16(b)
                else:
                    wl = _e2m1_nibble_to_f32(b.to(tl.int32), 0)
                    wh = _e2m1_nibble_to_f32(b.to(tl.int32), 4)
            else:
                wl = tl.load(w_rows + k_lo[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
                wh = tl.load(w_rows + k_hi[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            acc = _mx_half(acc, wl, ws_lo, xs_lo, x_rows, c * 128, h, m_ok, K, W_SB, W_KIND, X_SCALED)
            acc = _mx_half(acc, wh, ws_hi, xs_hi, x_rows, c * 128 + 64, h, m_ok, K, W_SB, W_KIND, X_SCALED)
            ws_lo, ws_hi, xs_lo, xs_hi = ws_lo_n, ws_hi_n, xs_lo_n, xs_hi_n
        else:
            if W_FP4:
                b = tl.load(w_rows + (c * 64 + h)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
                w_lo = _e2m1_to_f32(b & 15)
                w_hi = _e2m1_to_f32(b >> 4)
            else:
                w_lo = tl.load(w_rows + k_lo[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
                w_hi = tl.load(w_rows + k_hi[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            w_lo = _mx_weight_deq(w_lo, ws_rows, k_lo, n_ok, W_SB, W_E8M0)
            acc = tl.dot(w_lo, tl.trans(_mx_act(x_rows, xs_rows, k_lo, m_ok, K, X_SCALED)), acc)
            w_hi = _mx_weight_deq(w_hi, ws_rows, k_hi, n_ok, W_SB, W_E8M0)
            acc = tl.dot(w_hi, tl.trans(_mx_act(x_rows, xs_rows, k_hi, m_ok, K, X_SCALED)), acc)
    _epilogue(acc, offs_n, offs_m, pid_s, M, N, out_ptr, part_ptr, bias_ptr, ts_ptr,
              USE_PART, HAS_BIAS, HAS_TS)
    if USE_PART and FUSED_REDUCE:
        _last_split_reduce(offs_n, offs_m, pid_n, pid_m, M, N, tl.num_programs(2), part_ptr, out_ptr, bias_ptr, ts_ptr,
                           cnt_ptr, BN, BM, HAS_BIAS, HAS_TS, False, RED)
# The backend's `KernelOptions` pick two variants of `_mx_gemm_kernel` (same bits): `mx_row_scales` loads each row's
# block scales as one tile per 64 columns, a chunk ahead, and decodes E2M1 by shifts and one multiply (`_chunk_scales`,
# `_spread_scales`, `_e2m1_nibble_to_f32`) instead of one gathered scale load per element and `_e2m1_to_f32`;
# `mx_fp4_ptx` (with row scales, on NVIDIA CUDA) decodes packed E2M1 to bf16 by PRMT table lookups in inline PTX
# (`_e2m1_bytes_to_bf16`) and multiplies by the block scales in bf16 (never under the CPU interpreter).


# ============================================================================ MX / NVFP4
@dataclass(frozen=True)
class MXWeight:
    """A kernel-ready MXFP8 / MXFP4 / NVFP4 weight (built once by :func:`prepare_mx_weight`).

    Attributes:
        kind: ``"mxfp8"``, ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"``.
        data: FP8 kinds: (N, Kp) float8 elements; FP4 kinds: (N, Kp/2) uint8, two E2M1 codes per
            byte: in each 128-column chunk c, byte c*64 + j holds column c*128 + j in its low
            nibble and column c*128 + 64 + j in its high nibble (the kernel's two K halves).
        scale: MX: (N, Kp/32) uint8 E8M0 codes; NVFP4: (N, Kp/16) float8_e4m3fn block scales.
        tensor_scale: NVFP4 (1,) fp32 per-tensor scale, else None.
        n, k: the logical weight shape (N, K); Kp = round_up(K, 128), padding is zero elements
            with unit scales.
    """

    kind: str
    data: torch.Tensor
    scale: torch.Tensor
    tensor_scale: Optional[torch.Tensor]
    n: int
    k: int

    @property
    def block(self) -> int:
        """Scale block length along K (32 for MX, 16 for NVFP4)."""
        return 16 if self.kind == "nvfp4" else 32

    @property
    def is_fp4(self) -> bool:
        """True for packed E2M1 data."""
        return self.kind in ("mxfp4", "nvfp4")

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for the whole weight (data + scales)."""
        return self.data.numel() * self.data.element_size() + self.scale.numel()


def prepare_mx_weight(q: Any) -> MXWeight:
    """Repack a weight QTensor (``mxfp8``, ``mxfp8_e5m2``, ``mxfp4`` or ``nvfp4``; data (N, K)) for :func:`mx_linear`.

    E2M1 codes are packed two per byte, fp32 scales become their 1-byte codes (E8M0 / E4M3:
    exact, taken from ``QTensor.scale_codes``), K is zero-padded to a multiple of 128.
    """
    spec = q.spec
    if spec.kind not in ("mx", "nvfp4"):
        raise _bad(f"prepare_mx_weight needs an mxfp8 / mxfp4 / nvfp4 weight QTensor, got spec {spec}")
    if q.data.dim() != 2:
        raise _bad(f"MX weight must be 2-D (N, K), got shape {tuple(q.data.shape)}")
    n, k = q.data.shape
    kp = _round_up(max(k, 1), MX_CHUNK)
    dev = q.data.device
    if spec.elem in ("e4m3", "e5m2"):
        data = _pad2(q.data, n, kp).contiguous()
    else:
        codes = _pad2(q.data.to(torch.uint8), n, kp).reshape(n, kp // MX_CHUNK, 2, MX_CHUNK // 2)
        data = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, kp // 2).contiguous()
    nvfp4 = spec.kind == "nvfp4"
    sb = 16 if nvfp4 else 32
    codes_s = q.scale_codes().reshape(n, -1)
    unit = 0x38 if nvfp4 else 127  # 1.0 in E4M3 / E8M0: padding must not be NaN (0 * NaN = NaN)
    scale = torch.full((n, kp // sb), unit, device=dev, dtype=torch.uint8)
    scale[:, : codes_s.shape[1]] = codes_s
    if nvfp4:
        scale = scale.view(FP8)
    ts = q.tensor_scale.reshape(1).to(torch.float32).contiguous() if nvfp4 else None
    return MXWeight(kind=str(spec), data=data, scale=scale.contiguous(), tensor_scale=ts, n=n, k=k)


def prepare_weight(q: Any) -> Optional[MXWeight]:
    """Kernel-ready form of a weight QTensor: MX / NVFP4 -> :class:`MXWeight`; FP8 block /
    per-tensor weights are used as stored (data + scale) and return None."""
    return prepare_mx_weight(q) if q.spec.kind in ("mx", "nvfp4") else None


def dequantize_mx_weight(w: MXWeight) -> torch.Tensor:
    """fp32 (N, K) values of a prepared weight (pure torch; equals the source ``QTensor.dequantize()``)."""
    from engine.formats import decode_codes

    kp = w.data.shape[1] * (2 if w.is_fp4 else 1)
    if w.is_fp4:
        p = w.data.reshape(w.n, kp // MX_CHUNK, MX_CHUNK // 2)
        elem = decode_codes(torch.stack((p & 15, p >> 4), dim=2).reshape(w.n, kp), "e2m1")
    else:
        elem = w.data.float()
    scale = decode_codes(w.scale, "e4m3" if w.kind == "nvfp4" else "e8m0")
    if w.tensor_scale is not None:
        scale = scale * w.tensor_scale  # the fp32 product quantize divided by
    return (elem * scale.repeat_interleave(w.block, dim=1))[:, : w.k]


def _mx_operands(x: Any, w: Any, x_scale: Optional[torch.Tensor]):
    """Normalize mx_linear inputs: (x (M, K), x_scale (M, ceil(K/32)) or None, MXWeight, lead dims)."""
    if hasattr(x, "spec") and hasattr(x, "data"):  # an activation QTensor
        if x.spec.kind != "mx" or x.spec.elem not in ("e4m3", "e5m2"):
            raise _bad(f"mx_linear takes mxfp8 activation QTensors, got spec {x.spec}")
        x, x_scale = x.data, x.scale
    if not isinstance(w, MXWeight):
        w = prepare_mx_weight(w)  # a QTensor: repacked on every call (prepare once for speed)
    lead = tuple(x.shape[:-1])
    x2 = _rows(x, "x")
    m, k = x2.shape
    if k != w.k:
        raise _bad(f"x (..., {k}) does not match the weight (N={w.n}, K={w.k})")
    if x_scale is not None:
        if x2.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise _bad(f"x with x_scale must be MX fp8 data (float8_e4m3fn / e5m2), got {x2.dtype}")
        kb = _cdiv(k, 32)
        if x_scale.numel() != m * kb or x_scale.dtype != torch.float32:
            raise _bad(f"x_scale must be fp32 (..., ceil(K/32)={kb}) (the mxfp8 layout) for x {tuple(x.shape)}, "
                       f"got {tuple(x_scale.shape)} {x_scale.dtype}")
        x_scale = x_scale.reshape(m, kb).contiguous()
    elif x2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise _bad(f"x without x_scale must be bf16 / fp16 / fp32 (w4a16), got {x2.dtype}; "
                   "pass x_scale for MX fp8 activations")
    return x2, x_scale, w, lead


def mx_linear(x: Any, w: Any, x_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
              out_dtype: torch.dtype = torch.bfloat16, split_k: Optional[int] = None,
              fused_reduce: Optional[bool] = None, policy: Optional[DecodePolicy] = None,
              options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """``x @ w.T (+ bias)`` with an MXFP8 / MXFP4 / NVFP4 weight, dequantized inside the Triton kernel.

    Args:
        x: either MX fp8 activations -- an ``mxfp8`` QTensor, or data (M, K) float8 with
            ``x_scale`` (M, ceil(K/32)) fp32 -- or a bf16 / fp16 / fp32 (M, K) tensor (rounded to
            bf16 in the kernel). Leading dims allowed: (..., K).
        w: an :class:`MXWeight` (from :func:`prepare_mx_weight`) or a weight QTensor (repacked
            on every call).
        bias: (N,) or None, added in fp32. out_dtype: bf16 / fp16 / fp32.
        split_k: override the heuristic number of K splits.
        fused_reduce: split-K partials summed by the last split of each tile (`_last_split_reduce`, the bits of the
            reduce kernel, one launch fewer; calls must run in stream order, see `_tile_counters`); default
            the policy's `fused_reduce` on CUDA.
        policy: the decode plan's rules (`engine.kernels.decode_plan.DecodePolicy`; default `DEFAULT_POLICY`): the
            MX split rule and the fused reduce.
        options: the backend's kernel variants (`engine.kernels.options.KernelOptions`: `mx_row_scales`,
            `mx_fp4_ptx`, PDL of the separate reduce).

    Returns:
        (M, N) (or (..., N)) in out_dtype.
    """
    x2, xs, w, lead = _mx_operands(x, w, x_scale)
    bias = _check_out(out_dtype, bias, w.n)
    m, k = x2.shape
    n = w.n
    out = torch.empty((m, n), device=x2.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    bm, bn, _, _ = _tiles(m)
    if m > 64:
        bm, bn = 128, 64  # a (64, 128) bf16 MMA tile keeps the dequantized operands in registers
    n_chunks = w.data.shape[1] * (2 if w.is_fp4 else 1) // MX_CHUNK
    policy = policy or DEFAULT_POLICY
    splits, per = _plan_split(m, n, n_chunks, bm, bn, x2.device, split_k, mx=True, policy=policy)
    part = torch.empty((splits, m, n), device=x2.device, dtype=torch.float32) if splits > 1 else out
    ts = w.tensor_scale
    grid = (_cdiv(n, bn), _cdiv(m, bm), splits)
    fused = (policy.fused_reduce and x2.is_cuda if fused_reduce is None else bool(fused_reduce)) and splits > 1
    _mx_gemm_kernel[grid](
        x2, xs if xs is not None else x2, w.data, w.scale, ts if ts is not None else out, out, part,
        bias if bias is not None else out, _tile_counters(x2.device, grid[0] * grid[1]) if fused else out,
        m, n, k, n_chunks, per,
        x2.stride(0), xs.stride(0) if xs is not None else 0, w.data.stride(0), w.scale.stride(0),
        BM=bm, BN=bn, X_SCALED=xs is not None, W_FP4=w.is_fp4, W_SB=w.block, W_E8M0=w.kind != "nvfp4",
        HAS_TS=ts is not None, USE_PART=splits > 1, HAS_BIAS=bias is not None,
        ROW_SCALES=options.mx_row_scales,
        FP4_PTX=options.mx_fp4_ptx and x2.is_cuda and torch.version.hip is None,
        FUSED_REDUCE=fused,
        RED=sk.reduce_burst(splits, grid[0] * grid[1] * grid[2], sm_count(x2.device)) if fused else 1,
        num_warps=4, num_stages=3)
    if splits > 1 and not fused:
        sk._reduce(part, out, bias, ts, pdl=options.pdl)
    return out.reshape(*lead, n)


def mx_linear_reference(x: Any, w: Any, x_scale: Optional[torch.Tensor] = None,
                        bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                        split_k: Optional[int] = None) -> torch.Tensor:
    """Reference of :func:`mx_linear`: x dequantized (fp8 * 1x32 scale, or x as given, in fp32),
    the weight via :func:`dequantize_mx_weight`, multiplied in float64, + bias."""
    x2, xs, w, lead = _mx_operands(x, w, x_scale)
    m, k = x2.shape
    xf = x2.float()
    if xs is not None:
        xf = xf * _expand_block_scale(xs, m, k, 1, 32)
    return _ref_matmul(xf, dequantize_mx_weight(w), bias, out_dtype).reshape(*lead, w.n)


__all__ = [
    "MXWeight", "dequantize_mx_weight", "mx_linear", "mx_linear_reference", "prepare_mx_weight", "prepare_weight",
]
