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
* :func:`mx_linear`: MXFP8 x MXFP8, and 16-bit activations x MXFP8 / MXFP4 / NVFP4 weights: a
  dequant-in-kernel Triton GEMM (sm_90 cuBLAS has no MX / NVFP4 GEMM). Weights are repacked once
  by :func:`prepare_mx_weight` (two E2M1 codes per byte, 1-byte scale codes); activations are
  used as stored. Elements are decoded and multiplied by their block scale into bf16 (exact for
  E2M1 x E8M0, E4M3 x E8M0 and E2M1 x E4M3 products, except blocks so tiny (< ~2**-118) that the
  product underflows bf16), then multiplied on bf16 tensor cores with fp32 accumulation; 16-bit /
  fp32 activations are rounded to bf16 in the kernel (w4a16); the NVFP4 tensor scale is applied
  to the fp32 accumulator.
* :func:`legacy_scaled_mm_blockwise`: the OLD ``torch._scaled_mm`` call with unpadded scales,
  kept only so a test can reproduce its silent wrong results (see its docstring).

Split-K partial sums go to an fp32 buffer that a second kernel reduces in a fixed order (or, with
``fused_reduce``, the last split of each tile -- found with an arrival counter -- sums them in the
same order; with ``cluster``, the splits of a tile form one thread-block cluster and sum them in the same order
through distributed shared memory; no atomic accumulation either way), so a given (shape, device) always
produces the same bits; at M <= 16 / splits with 2 or 4 splits, on CUDA, the splits instead sit side by side in one
program's MMA tile and are summed in registers in the same order (`_fp8_sliced_gemm_kernel`: the same bits, without
the partials' round trip). The number of splits is a function of the shape and the SM count only, or of a
``DECODE_CONFIGS`` entry (measured configs stored as data, per device and shape; the tuning knobs
are keyword arguments of :func:`fp8_block_gemm_triton`). Decode calls on weights of >= 2**24
elements without an entry take their pipeline depth from the programs per SM (`_decode_stages`; measured as a
decode step runs them); `DECODE_STAGE_CHOICE = "autotune"` instead times 3 depths on the first call per shape
(~0.1 s: warm up before capturing a CUDA graph). No wrapper synchronizes the host.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels import cluster as cl
from engine.kernels import gemm_wgmma as gw
from engine.kernels import sm_count
from engine.kernels.cluster import arrive as cluster_arrive, load_local, store_remote, wait as cluster_wait
from engine.kernels.quant import _round_bf16
from engine.kernels.pdl import l2_prefetch, launch_opts, pdl_enter

GROUP = 128  # edge of the 1x128 / 128x128 scale blocks
MX_CHUNK = 128  # K columns per MX kernel step; prepared MX weights are padded to a multiple of it
FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_SCALED_MM = getattr(F, "scaled_mm", None)  # torch >= 2.10: explicit ScalingType API
_SCALING = getattr(F, "ScalingType", None)


# ============================================================================ kernels
@triton.jit
def _ts_bias(acc, ts_ptr, bias, HAS_TS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc * tensor scale (ts_ptr) + bias in fp32, one fma when both are present: the same rounding in every kernel
    that applies them (a separate multiply and add is contracted to an fma, or not, at the compiler's choice: the
    fused reduce and the reduce kernel differed in the last bit on the H200 that way)."""
    if HAS_TS and HAS_BIAS:
        acc = tl.fma(acc, tl.load(ts_ptr), bias)
    elif HAS_TS:
        acc = acc * tl.load(ts_ptr)
    elif HAS_BIAS:
        acc = acc + bias
    return acc


@triton.jit
def _epilogue(acc, offs_n, offs_m, pid_s, M, N, out_ptr, part_ptr, bias_ptr, ts_ptr,
              USE_PART: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TS: tl.constexpr, ROUND_BF16: tl.constexpr = False):
    """Store acc (BN, BM) = a tile of out^T: raw fp32 partial sums to part[pid_s] (split-K), or
    acc * tensor_scale + bias in fp32, cast to out's dtype, into out (M, N)."""
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    idx = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    if USE_PART:
        tl.store(part_ptr + pid_s.to(tl.int64) * M * N + idx, acc, mask=mask)
    else:
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        acc = _ts_bias(acc, ts_ptr, bias, HAS_TS, HAS_BIAS)
        if ROUND_BF16:  # a bf16 output held in an fp32 buffer (the engine's fp32 carrier): no cast kernel after
            acc = _round_bf16(acc)
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_partials(part_ptr, idx, mask, mn, n_splits, BN: tl.constexpr, BM: tl.constexpr, RED: tl.constexpr):
    """0 + part[0][idx] + part[1][idx] + ... + part[n_splits - 1][idx] in fp32, in split order (the bits of
    `_splitk_reduce_kernel`). RED = 2 / 4: the loads of that many partials are issued together, then added in order
    (one L2 round trip per RED splits, not per split: `reduce_burst`); RED = 1: one partial per loop step."""
    tot = tl.zeros((BN, BM), dtype=tl.float32)
    if RED == 1:
        for s in range(n_splits):  # split order, as _splitk_reduce_kernel
            tot += tl.load(part_ptr + s * mn + idx, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        tl.static_assert(RED == 2 or RED == 4, "RED: 1, 2 or 4 partials per round trip")
        for s0 in range(0, n_splits, RED):
            base = part_ptr + s0 * mn + idx
            p0 = tl.load(base, mask=mask, other=0.0, cache_modifier=".cg")
            p1 = tl.load(base + mn, mask=mask & (s0 + 1 < n_splits), other=0.0, cache_modifier=".cg")
            if RED == 4:
                p2 = tl.load(base + 2 * mn, mask=mask & (s0 + 2 < n_splits), other=0.0, cache_modifier=".cg")
                p3 = tl.load(base + 3 * mn, mask=mask & (s0 + 3 < n_splits), other=0.0, cache_modifier=".cg")
            tot += p0
            if s0 + 1 < n_splits:
                tot += p1
            if RED == 4:
                if s0 + 2 < n_splits:
                    tot += p2
                if s0 + 3 < n_splits:
                    tot += p3
    return tot


@triton.jit
def _last_split_reduce(offs_n, offs_m, pid_n, pid_m, M, N, n_splits, part_ptr, out_ptr, bias_ptr, ts_ptr, cnt_ptr,
                       BN: tl.constexpr, BM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_TS: tl.constexpr,
                       ROUND_BF16: tl.constexpr, RED: tl.constexpr = 4):
    """The fused split-K reduce, called by every split after storing its partial tile: the last split to arrive at
    the tile's counter (cnt_ptr, per tile, reset to 0 by that split) sums all partials in split order from zero, times
    the tensor scale, plus bias -- the fp32 operations of `_splitk_reduce_kernel`, so its bits, without its launch.
    Each split's partial store is released by its arrival (acq_rel); the reset is a plain store, with no fence before
    it: the next kernel to use the counter starts after this one has completed (H200, 2026-11-29: 0.5 us less per
    call than an acq_rel exchange)."""
    tile = pid_m * tl.num_programs(0) + pid_n
    tl.debug_barrier()  # every thread's partial store happens before the release below
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == n_splits - 1:
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        idx = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tot = _sum_partials(part_ptr, idx, mask, M.to(tl.int64) * N, n_splits, BN, BM, RED)
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        tot = _ts_bias(tot, ts_ptr, bias, HAS_TS, HAS_BIAS)
        if ROUND_BF16:
            tot = _round_bf16(tot)
        tl.store(out_ptr + idx, tot.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(cnt_ptr + tile, 0)  # ready for the next call (kernels on a stream complete in order)


@triton.jit
def _cluster_reduce(acc, started, pid_n, pid_s, offs_m, M, N, out_ptr, bias_ptr, BN: tl.constexpr, BM: tl.constexpr,
                    S: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Split-K reduce inside a cluster of the S splits of one tile (engine.kernels.cluster): rows
    [r * BN/S, (r+1) * BN/S) of the tile belong to rank r. Each split stores those rows of its partial acc
    (BN, BM) into rank r's shared memory (slot = its split index), the cluster barrier publishes them, and
    each rank sums its rows' S slots in split order from zero -- the same fp32 additions as
    `_splitk_reduce_kernel` and the fused reduce, so the same bits -- and writes them to out (M, N)."""
    ROWS: tl.constexpr = BN // S
    SLOT: tl.constexpr = ROWS * BM * 4
    REGION: tl.constexpr = S * SLOT
    n_l = tl.arange(0, BN)
    m_l = tl.arange(0, BM)
    off = pid_s * SLOT + ((n_l % ROWS)[:, None] * BM + m_l[None, :]) * 4
    dst = (n_l // ROWS)[:, None] + m_l[None, :] * 0
    ready = cluster_wait(started)  # every CTA of the cluster runs: its shared memory exists
    store_remote(acc, off + ready * 0, dst, REGION)
    cluster_wait(cluster_arrive(ready, True))  # every split's rows are in place
    r_l = tl.arange(0, ROWS)
    r_off = (r_l[:, None] * BM + m_l[None, :]) * 4
    tot = tl.zeros((ROWS, BM), dtype=tl.float32)
    for s in tl.static_range(S):  # split order, as _splitk_reduce_kernel
        tot += load_local(r_off + s * SLOT, REGION)
    offs_n = pid_n * BN + pid_s * ROWS + r_l
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    if HAS_BIAS:
        tot += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    if ROUND_BF16:
        tot = _round_bf16(tot)
    tl.store(out_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None], tot.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_tile(x_ptr, xs_ptr, w_ptr, ws_ptr, pid_n, pid_m, pid_s, M, N, K, groups_per_split, stride_xm, stride_wn,
                  stride_xsm, stride_wsn, BM: tl.constexpr, BN: tl.constexpr):
    """The tile of split-K program (pid_n, pid_m, pid_s): (offs_n, offs_m, n_ok, m_ok, weight rows, activation rows,
    the tile's weight-scale row, its activation-scale rows, first and end 128-group [g0, g1) of its K split)."""
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    ws_row = ws_ptr + ((pid_n * BN) // 128) * stride_wsn
    xs_rows = xs_ptr + offs_m * stride_xsm
    g0 = pid_s * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, tl.cdiv(K, 128))
    return offs_n, offs_m, offs_n < N, offs_m < M, w_rows, x_rows, ws_row, xs_rows, g0, g1


@triton.jit
def _scaled_steps(acc, w_rows, x_rows, ws_row, xs_rows, g_lo, g_hi, K, n_ok, m_ok, stride_wsg, stride_xsg):
    """The split-K loop over the 128-groups [g_lo, g_hi), added to acc (BN, BM): per group the FP8 tensor-core dot
    of the weight rows and activation rows, times that group's scales, promoted to fp32. The scales of group g+1
    are loaded during step g (the pipeliner streams W / X through shared memory but leaves these small loads
    synchronous: their latency would stall every step)."""
    offs_k = tl.arange(0, 128)
    ws_next = tl.load(ws_row + g_lo * stride_wsg, mask=g_lo < g_hi, other=0.0)
    xs_next = tl.load(xs_rows + g_lo * stride_xsg, mask=m_ok & (g_lo < g_hi), other=0.0)
    for g in range(g_lo, g_hi):
        ws = ws_next
        xs = xs_next
        ws_next = tl.load(ws_row + (g + 1) * stride_wsg, mask=g + 1 < g_hi, other=0.0)
        xs_next = tl.load(xs_rows + (g + 1) * stride_xsg, mask=m_ok & (g + 1 < g_hi), other=0.0)
        k = g * 128 + offs_k
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(w, tl.trans(x)) * (xs[None, :] * ws)
    return acc


# M, N and the scale strides are not value-specialized: fewer compiled variants; K and the row
# strides are (16-byte divisibility enables vector loads).
@triton.jit(do_not_specialize=["M", "N", "groups_per_split", "n_splits", "stride_xsm", "stride_xsg", "stride_wsn",
                               "stride_wsg"])
def _fp8_block_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, bias_ptr, cnt_ptr,
                           M, N, K, groups_per_split, n_splits,
                           stride_xm, stride_wn, stride_xsm, stride_xsg, stride_wsn, stride_wsg,
                           BM: tl.constexpr, BN: tl.constexpr, USE_PART: tl.constexpr,
                           HAS_BIAS: tl.constexpr, FUSED_REDUCE: tl.constexpr, ROUND_BF16: tl.constexpr = False,
                           PDL: tl.constexpr = False, CLUSTER: tl.constexpr = 1, RED: tl.constexpr = 4):
    """Grid (N tiles, M tiles, K splits). acc (BN, BM) += dot(W (BN, 128), X^T (128, BM)) * ws * xs
    per 128-wide K group: FP8 tensor-core dot, promoted to fp32 once per group. BN divides 128, so
    one weight-scale row serves the whole tile. Per-tensor scales use stride 0.

    The loop is `_scaled_steps` (also the fixed-reducer probe's, benchmarks/probe_kernels.py).
    FUSED_REDUCE (split-K): the last split to finish a tile sums all partials itself (`_last_split_reduce`, per-tile
    arrival counters cnt_ptr): the same bits as `_splitk_reduce_kernel`, without its launch."""
    pdl_enter(PDL)
    pid_m = tl.program_id(1)
    if CLUSTER > 1:  # grid (N tiles * CLUSTER, M tiles) in clusters of CLUSTER: the splits of one tile
        pid_n = tl.program_id(0) // CLUSTER
        pid_s = tl.program_id(0) % CLUSTER
        started = cluster_arrive(pid_s, False)  # matched by the wait before the first remote store
    else:
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(2)
    offs_n, offs_m, n_ok, m_ok, w_rows, x_rows, ws_row, xs_rows, g0, g1 = _split_k_tile(
        x_ptr, xs_ptr, w_ptr, ws_ptr, pid_n, pid_m, pid_s, M, N, K, groups_per_split, stride_xm, stride_wn,
        stride_xsm, stride_wsn, BM, BN)
    acc = _scaled_steps(tl.zeros((BN, BM), dtype=tl.float32), w_rows, x_rows, ws_row, xs_rows, g0, g1, K, n_ok,
                        m_ok, stride_wsg, stride_xsg)
    if CLUSTER > 1:
        _cluster_reduce(acc, started, pid_n, pid_s, offs_m, M, N, out_ptr, bias_ptr, BN, BM, CLUSTER, HAS_BIAS,
                        ROUND_BF16)
    else:
        _epilogue(acc, offs_n, offs_m, pid_s, M, N, out_ptr, part_ptr, bias_ptr, out_ptr,
                  USE_PART, HAS_BIAS and not FUSED_REDUCE, False, ROUND_BF16)
    if USE_PART and FUSED_REDUCE and CLUSTER == 1:
        _last_split_reduce(offs_n, offs_m, pid_n, pid_m, M, N, n_splits, part_ptr, out_ptr, bias_ptr, out_ptr, cnt_ptr,
                           BN, BM, HAS_BIAS, False, ROUND_BF16, RED)


@triton.jit(do_not_specialize=["M", "N", "groups_per_slice", "stride_xsm", "stride_xsg", "stride_wsn", "stride_wsg"])
def _fp8_sliced_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, bias_ptr, M, N, K, groups_per_slice,
                            stride_xm, stride_wn, stride_xsm, stride_xsg, stride_wsn, stride_wsg,
                            BM: tl.constexpr, R: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ROUND_BF16: tl.constexpr = False, PDL: tl.constexpr = False):
    """Split-K inside one program: grid (N / R, M tiles). The program owns R weight rows over the whole K, cut into
    S slices of `groups_per_slice` 128-groups -- the split-K kernel's splits -- that sit side by side in one MMA:
    tile row s * R + n holds weight row n of slice s, tile column s' * BM + m activation row m of slice s'. Each
    step's dot (S*R, 128) x (128, S*BM) so computes every slice's product at once (the off-diagonal blocks s != s'
    are discarded), each diagonal block scaled by its own group's scales as `_scaled_steps` does. At the end the S
    partials are summed in slice order from zero in registers: the fp32 operations of the split-K kernel with
    S splits and its fused reduce, so its bits, without the partials' round trip through memory and the arrival
    handshake after the last step (H200, 2026-11-29: ~1.3 us per call at 4096x14336)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rr = tl.arange(0, S * R)
    cc = tl.arange(0, S * BM)
    s_r = rr // R  # slice of each tile row / column
    s_c = cc // BM
    offs_n = pid_n * R + rr % R
    offs_m = pid_m * BM + cc % BM
    n_ok = offs_n < N
    m_ok = offs_m < M
    n_groups = tl.cdiv(K, 128)
    g_r = s_r * groups_per_slice  # first 128-group of the row's / column's slice
    g_c = s_c * groups_per_slice
    end_r = tl.minimum(g_r + groups_per_slice, n_groups)
    end_c = tl.minimum(g_c + groups_per_slice, n_groups)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (g_r * 128)[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (g_c * 128)[:, None]
    ws_rows = ws_ptr + ((pid_n * R) // 128) * stride_wsn + g_r * stride_wsg  # R divides 128: one scale row
    xs_rows = xs_ptr + offs_m * stride_xsm + g_c * stride_xsg
    offs_k = tl.arange(0, 128)
    ws_next = tl.load(ws_rows, mask=g_r < end_r, other=0.0)
    xs_next = tl.load(xs_rows, mask=m_ok & (g_c < end_c), other=0.0)
    acc = tl.zeros((S * R, S * BM), dtype=tl.float32)
    for i in range(0, groups_per_slice):  # scales a step ahead, as `_scaled_steps` (two ahead: 20.4 -> 25-31 us)
        ws = ws_next
        xs = xs_next
        ws_next = tl.load(ws_rows + (i + 1) * stride_wsg, mask=g_r + i + 1 < end_r, other=0.0)
        xs_next = tl.load(xs_rows + (i + 1) * stride_xsg, mask=m_ok & (g_c + i + 1 < end_c), other=0.0)
        k = i * 128 + offs_k
        w_ok = (n_ok & (g_r + i < end_r))[:, None] & ((g_r * 128)[:, None] + k[None, :] < K)
        x_ok = (m_ok & (g_c + i < end_c))[:, None] & ((g_c * 128)[:, None] + k[None, :] < K)
        w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0)
        x = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
        acc += tl.dot(w, tl.trans(x)) * (xs[None, :] * ws[:, None])
    diag = tl.reshape(s_r, (S, R, 1, 1)) == tl.reshape(s_c, (1, 1, S, BM))
    part = tl.sum(tl.where(diag, tl.reshape(acc, (S, R, S, BM)), 0.0), axis=2)  # (S, R, BM): slice s's partial
    tot = tl.zeros((R, BM), dtype=tl.float32)
    s_l = tl.reshape(tl.arange(0, S), (S, 1, 1))
    for s in tl.static_range(S):  # slice order from zero, as `_last_split_reduce`
        tot += tl.sum(tl.where(s_l == s, part, 0.0), axis=0)
    _epilogue(tot, pid_n * R + tl.arange(0, R), pid_m * BM + tl.arange(0, BM), 0, M, N, out_ptr, out_ptr, bias_ptr,
              out_ptr, False, HAS_BIAS, False, ROUND_BF16)


@triton.jit
def _gemv_rows(w_ptr, ws_ptr, pid, N, K, stride_wn, stride_wsn, BN: tl.constexpr, GK: tl.constexpr):
    """The weight rows of GEMV program pid: (row indices, rows < N, the GK * 128 K offsets of one step, the K
    group count, the rows' weight-scale row, the rows' pointers)."""
    rows = pid * BN + tl.arange(0, BN)
    r_ok = rows < N
    offs = tl.arange(0, GK * 128)
    kb = tl.cdiv(K, 128)
    ws_row = ws_ptr + ((pid * BN) // 128) * stride_wsn
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    return rows, r_ok, offs, kb, ws_row, w_rows


@triton.jit(do_not_specialize=["N", "stride_xsg", "stride_wsn", "stride_wsg"])
def _fp8_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, bias_ptr, N, K, stride_wn, stride_xsg, stride_wsn,
                     stride_wsg, BN: tl.constexpr, GK: tl.constexpr, STAGES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ROUND_BF16: tl.constexpr, PDL: tl.constexpr = False, PF_BYTES: tl.constexpr = 0):
    """M = 1 on CUDA cores, grid (cdiv(N, BN),): a program streams BN whole weight rows, GK 128-groups per step
    (16-byte cp.async loads, L2 only, pipelined STAGES deep through shared memory; no MMA, no split-K and so
    no reduce). Per
    group: the 128 exact E4M3 x E4M3 products summed in fp32, times w_scale * x_scale, accumulated in fp32
    -- the block-scaled math of `_fp8_block_gemm_kernel` in another summation order. BN divides 128 (one
    weight-scale row per program); per-tensor scales use stride 0.

    PF_BYTES > 0 (with PDL): before waiting for the previous kernel, prefetch the first PF_BYTES of each of
    the program's weight rows into L2 (weights are constant within a step; engine.kernels.pdl)."""
    pid = tl.program_id(0)
    if PF_BYTES > 0:
        for r in tl.static_range(BN):
            if pid * BN + r < N:
                l2_prefetch(w_ptr + (pid * BN + r).to(tl.int64) * stride_wn, PF_BYTES)
    pdl_enter(PDL)
    rows, r_ok, offs, kb, ws_row, w_rows = _gemv_rows(w_ptr, ws_ptr, pid, N, K, stride_wn, stride_wsn, BN, GK)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for g0 in tl.range(0, kb, GK, num_stages=STAGES):
        k = g0 * 128 + offs
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        part = tl.sum(tl.reshape(w * x[None, :], (BN, GK, 128)), axis=2)  # (BN, GK) per-group dots
        gi = g0 + tl.arange(0, GK)
        g_ok = gi < kb
        sc = tl.load(ws_row + gi * stride_wsg, mask=g_ok, other=0.0) * tl.load(xs_ptr + gi * stride_xsg, mask=g_ok,
                                                                             other=0.0)
        acc += tl.sum(part * sc[None, :], axis=1)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = _round_bf16(acc)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=r_ok)


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
def _spread_scales(t, SB: tl.constexpr, KIND: tl.constexpr, SCALE_BITS: tl.constexpr, DT: tl.constexpr):
    """A (R, NB) tile of `_scale_tile` as (R, NB * SB) values in DT, each scale repeated over its SB columns. KIND 0:
    fp32 values; 1: E8M0 codes; 2: E4M3 scales, decoded by `_e4m3_to_f32` when SCALE_BITS, else by the FP8 cast.
    Exact in bf16: powers of two and E4M3 values are bf16 numbers."""
    if KIND == 0:
        v = t
    elif KIND == 1:
        v = _e8m0_to_f32(t.to(tl.int32))
    elif SCALE_BITS:
        v = _e4m3_to_f32(t.to(tl.uint8, bitcast=True).to(tl.int32))
    else:
        v = t.to(tl.float32)
    v = v.to(DT)
    return tl.reshape(tl.broadcast_to(v[:, :, None], (v.shape[0], v.shape[1], SB)), (v.shape[0], v.shape[1] * SB))


@triton.jit
def _mx_weight_deq(wv, ws_rows, kk, n_ok, W_SB: tl.constexpr, W_E8M0: tl.constexpr, SCALE_BITS: tl.constexpr):
    """Weight elements wv (BN, 64) fp32 times their block scales (gathered per column), as bf16. E4M3 scales (NVFP4)
    convert by `_e4m3_to_f32` when SCALE_BITS, else by the FP8 cast."""
    s = tl.load(ws_rows + (kk // W_SB)[None, :], mask=n_ok[:, None], other=0.0)
    if W_E8M0:
        sf = _e8m0_to_f32(s.to(tl.int32))
    elif SCALE_BITS:
        sf = _e4m3_to_f32(s.to(tl.uint8, bitcast=True).to(tl.int32))
    else:
        sf = s.to(tl.float32)
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
             X_SCALED: tl.constexpr, SCALE_BITS: tl.constexpr):
    """acc += (w_vals * weight scales) @ (x * x scales)^T over the 64 columns k0 + h (k0 a multiple of 64; w_sc, x_sc
    their `_scale_tile`s). Both products are exact in bf16 (E2M1 / E4M3 / E5M2 times a power of two or an E4M3 scale;
    MX fp8 times a power of two), so w_vals in bf16 (multiplied in bf16) or fp32 (in fp32, then rounded) give the same
    operand bits."""
    w = (w_vals * _spread_scales(w_sc, W_SB, W_KIND, SCALE_BITS, w_vals.dtype)).to(tl.bfloat16)
    kk = k0 + h
    ok = m_ok[:, None] & (kk < K)[None, :]
    xv = tl.load(x_rows + kk[None, :], mask=ok, other=0.0).to(tl.float32)
    if X_SCALED:
        xv = xv * _spread_scales(x_sc, 32, 0, SCALE_BITS, tl.float32)
    return tl.dot(w, tl.trans(xv.to(tl.bfloat16)), acc)


@triton.jit(do_not_specialize=["M", "N", "n_chunks", "chunks_per_split", "stride_xsm", "stride_wsn"])
def _mx_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, ts_ptr, out_ptr, part_ptr, bias_ptr, cnt_ptr,
                    M, N, K, n_chunks, chunks_per_split, stride_xm, stride_xsm, stride_wn, stride_wsn,
                    BM: tl.constexpr, BN: tl.constexpr, X_SCALED: tl.constexpr, W_FP4: tl.constexpr,
                    W_SB: tl.constexpr, W_E8M0: tl.constexpr, HAS_TS: tl.constexpr,
                    USE_PART: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_BITS: tl.constexpr = True,
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
            acc = _mx_half(acc, wl, ws_lo, xs_lo, x_rows, c * 128, h, m_ok, K, W_SB, W_KIND, X_SCALED, SCALE_BITS)
            acc = _mx_half(acc, wh, ws_hi, xs_hi, x_rows, c * 128 + 64, h, m_ok, K, W_SB, W_KIND, X_SCALED,
                           SCALE_BITS)
            ws_lo, ws_hi, xs_lo, xs_hi = ws_lo_n, ws_hi_n, xs_lo_n, xs_hi_n
        else:
            if W_FP4:
                b = tl.load(w_rows + (c * 64 + h)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
                w_lo = _e2m1_to_f32(b & 15)
                w_hi = _e2m1_to_f32(b >> 4)
            else:
                w_lo = tl.load(w_rows + k_lo[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
                w_hi = tl.load(w_rows + k_hi[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            w_lo = _mx_weight_deq(w_lo, ws_rows, k_lo, n_ok, W_SB, W_E8M0, SCALE_BITS)
            acc = tl.dot(w_lo, tl.trans(_mx_act(x_rows, xs_rows, k_lo, m_ok, K, X_SCALED)), acc)
            w_hi = _mx_weight_deq(w_hi, ws_rows, k_hi, n_ok, W_SB, W_E8M0, SCALE_BITS)
            acc = tl.dot(w_hi, tl.trans(_mx_act(x_rows, xs_rows, k_hi, m_ok, K, X_SCALED)), acc)
    _epilogue(acc, offs_n, offs_m, pid_s, M, N, out_ptr, part_ptr, bias_ptr, ts_ptr,
              USE_PART, HAS_BIAS, HAS_TS)
    if USE_PART and FUSED_REDUCE:
        _last_split_reduce(offs_n, offs_m, pid_n, pid_m, M, N, tl.num_programs(2), part_ptr, out_ptr, bias_ptr, ts_ptr,
                           cnt_ptr, BN, BM, HAS_BIAS, HAS_TS, False, RED)


@triton.jit
def _splitk_reduce_kernel(part_ptr, out_ptr, bias_ptr, ts_ptr, MN, N, S,
                          HAS_BIAS: tl.constexpr, HAS_TS: tl.constexpr, BLOCK: tl.constexpr,
                          ROUND_BF16: tl.constexpr = False, PDL: tl.constexpr = False):
    """out = (sum over s = 0..S-1, in that order, of part[s]) * tensor_scale + bias (`_ts_bias`), cast to out's
    dtype."""
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(S):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    acc = _ts_bias(acc, ts_ptr, bias, HAS_TS, HAS_BIAS)
    if ROUND_BF16:
        acc = _round_bf16(acc)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _bench_quick(fn, quantiles):
    """Short autotuning benchmark (the default spends ~125 ms per config)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


# Decode (M <= 64) calls without knobs or a DECODE_CONFIGS entry on weights of >= TUNE_MIN_WEIGHT elements: the
# pipeline depth (it does not change the summation order) comes from DECODE_STAGE_CHOICE; smaller weights use the
# fixed _tiles config.
TUNE_MIN_WEIGHT = 1 << 24
# "rule": `_decode_stages`, by programs per SM; "autotune": `_fp8_block_gemm_tuned`, timed by do_bench on repeated
# calls, which picks by how a call runs with its weight's last copy in L2, not as a decode step runs it. Timed as a
# decode step runs them (H200, 2026-11-30, CUDA graph over weight copies, M = 4 / 16 / 24, scored by
# `benchmarks/stage_rule_eval.py`) against the best of 3 / 4 / 6 stages per point: on the 16 fitted shapes
# (N 2048-28672 x K 2048-14336) the rule is 1.004x the best (worst 1.05x), the autotuner 1.052x (worst 1.35x); on
# 12 held-out shapes (Qwen2-7B, 5120-wide, Llama-3-70B, lm_heads) the rule 1.023x (worst 1.21x), the autotuner 1.036x.
DECODE_STAGE_CHOICE = "rule"
# (programs per SM up to, stages): deep pipelines while at most one program per SM streams, shallower as more
# programs share an SM's shared memory and issue slots.
DECODE_STAGES = ((1.0, 6), (2.0, 4), (float("inf"), 3))


def _decode_stages(programs: int, sms: int, limits=None) -> int:
    """Pipeline depth of a decode call of the split-K kernel launching `programs` programs on `sms` SMs, by `limits`
    ((programs per SM up to, stages), ...; default DECODE_STAGES)."""
    load = programs / max(1, sms)
    return next(stages for limit, stages in (limits or DECODE_STAGES) if load <= limit)


# Split-K partials summed by the last split of each tile (same bits as the reduce kernel, one launch
# fewer per GEMM: a decode step has ~6 per layer) unless a call or a DECODE_CONFIGS entry says otherwise.
FUSED_REDUCE_DEFAULT = True
# Partials the last split of a tile loads per L2 round trip in the fused reduce (`_sum_partials`; the Gluon kernel's
# `_finish` alike), at most: 4, or 1 (one per loop step). Same bits either way: the adds stay in split
# order. H200, 2026-11-30, four per trip everywhere against one:
# one call 4096x14336 M = 4 21.55 -> 20.6 us, M = 32 25.0 -> 24.1; in a CUDA graph 7168x16384 M = 32 44.0 -> 38.5,
# 4096x4096 M = 16 7.97 -> 7.57. The burst's loads and pointers take registers (the BM 32 / BN 64 / 8-warp split-K
# kernel 80 -> 105 per thread, 3 -> 2 programs per SM): 6144x4096 M = 32, 384 programs, went 11.0 -> 14.2 us. Hence
# `reduce_burst`: one partial per trip where a grid needs more than 2 programs per SM.
REDUCE_BURST = 4


def reduce_burst(splits: int, programs: int, sms: int) -> int:
    """Partials per L2 round trip of the fused reduce (the kernels' RED) for a grid of `programs` over K `splits`:
    1 without a split, at REDUCE_BURST 1, or when the grid needs more than 2 programs per SM (the burst's registers
    can cost one); else 2 for 2 splits, 4 for more."""
    if splits < 2 or REDUCE_BURST < 2 or programs > 2 * sms:
        return 1
    return 2 if splits == 2 or REDUCE_BURST == 2 else 4


# M = 1 without explicit knobs runs `_fp8_gemv_kernel` (CUDA cores, whole rows per program, no split-K): on the
# H200 it beat the split-K MMA kernel on every Llama-3-8B decode shape (2026-11-29: 4096x4096 11.2 vs 13.8 us,
# 4096x14336 24.2 vs 26.7 us). Its bits differ from the
# M >= 2 kernel's (summation order), as cuBLAS's above `small_m` do.
GEMV_M1 = True
# Bytes of each weight row the GEMV prefetches into L2 at its start, before its PDL wait (engine.kernels.pdl).
# Off: on the H200 (2026-11-29), back to back in a CUDA graph with PDL, 1 KB vs none: 4096x14336 2.48 vs 3.57 TB/s,
# 28672x4096 3.85 vs 3.94, 7168x16384 3.88 vs 3.47; Llama-3-8B decode, pipelined, batch 1 2.91 vs 2.89 ms, batch 8
# 3.51 vs 3.45 ms. Prefetches of 4 KB and more were slower still.
GEMV_PREFETCH_BYTES = 0
# DECODE_STAGE_CHOICE = "autotune". Keyed by the split count too: a call with only split_k given must not inherit the
# stages tuned for another split count of the same shape.
_fp8_block_gemm_tuned = triton.autotune(
    configs=[triton.Config({}, num_warps=4, num_stages=s) for s in (3, 4, 6)],
    key=["N", "K", "BM", "BN", "USE_PART", "n_splits"], do_bench=_bench_quick)(_fp8_block_gemm_kernel)

# Measured decode configs, as data: (device name, N, K, BM) -> knobs of `fp8_block_gemm_triton`
# (split_k, block_n, num_warps, num_stages, fused_reduce). `fp8_block_linear` uses an entry when one
# matches, else the heuristic (`_tiles`, `_split_k`, `_decode_stages`).
# `benchmarks/tune_kernels.py` prints entries to paste here. The split count changes the fp32
# summation order, so an entry fixes the bits of that (shape, device) like the heuristic does.
DECODE_CONFIGS: dict[tuple[str, int, int, int], dict[str, Any]] = {
    # BM 16 (M 2-16) on the big decode shapes: the Gluon wgmma kernel (activation rows on the wgmma's N side; `wgmma`
    # knob), its split count measured per shape and its pipeline by `gemm_wgmma.swap_stages` unless pinned. H200,
    # 2026-11-30, us per call in a CUDA graph over weight copies, M = 4 / 8 / 16, this entry vs the split-K kernel:
    #   4096x14336 (4 splits: the split-K kernel's K partition, the same bits): 16.9 / 17.3 / 17.9 vs 17.5 / 18.6 / 19.1;
    #   6144x4096 (2 splits):  8.4 / 8.6 / 9.5 vs 8.9 / 9.6 / 9.9;
    #   7168x16384 (1 split, 4 stages, the fastest at every M): 30.0 / 30.2 / 30.8 vs 30.5 / 31.7 / 32.2;
    #   28672x4096 (1 split): 28.3 / 28.6 / 29.3 vs 29.7 / 29.9 / 30.0.
    # 4096x4096 stays on split-K: the wgmma kernel was 1-7% slower at M = 2 / 4.
    ("NVIDIA H200", 4096, 14336, 16): dict(wgmma=True, split_k=4, block_n=64),
    ("NVIDIA H200", 6144, 4096, 16): dict(wgmma=True, split_k=2, block_n=64),
    # Llama-3-8B decode at batch 8 / 64, swept as a decode step runs them (H200, 2026-11-30, CUDA graph of 64 calls
    # over weight copies; us per call, entry vs heuristic). 4096x4096 at BM 16 wants 4 splits, not the heuristic's 8
    # (7.7 vs 11.0 us):
    ("NVIDIA H200", 4096, 4096, 16): dict(split_k=4, block_n=64, num_warps=4, num_stages=4, fused_reduce=True),
    # At BM 64 split-K partials cost up to a quarter of the weight's bytes (splits x 64 rows x N x 4 B, written and
    # read back) and the whole-K kernel's 64 activation rows are all real: it wins where N is small. 28672x4096
    # takes 128-row tiles and no split. Batch-64 runtime step 6.00 -> 4.71 ms with these six entries.
    ("NVIDIA H200", 6144, 4096, 64): dict(whole_k=4, block_n=64),  # 11.4 vs 21.0
    ("NVIDIA H200", 4096, 4096, 64): dict(whole_k=4, block_n=64),  # 9.7 vs 18.6
    ("NVIDIA H200", 28672, 4096, 64): dict(split_k=1, block_n=128, num_warps=4, num_stages=3,
                                           fused_reduce=True),  # 39.4 vs 48.2
    ("NVIDIA H200", 4096, 14336, 64): dict(whole_k=2, block_n=32),  # 25.3 vs 34.5
    # 7168x16384 at BM 16: the wgmma kernel, one split, 4 stages (30.0-30.8 us in the graph, against 31.7 / 32.6 us
    # for the best split-K config and 2.59 / 2.62 TB/s for the split rule's 2 splits).
    ("NVIDIA H200", 7168, 16384, 16): dict(wgmma=True, split_k=1, block_n=64, num_stages=4),
    # 28672x4096 (gate+up) at BM 16: the wgmma kernel, one split (28.3-29.3 us in the graph). Left to the autotuner
    # (timed on repeated calls, L2 warm) the split-K kernel's stages flip between runs, and one pick that was faster
    # per call (3.54 -> 3.72 TB/s) was slower in a CUDA graph over weight copies (3.87 -> 3.21 TB/s at M = 4).
    ("NVIDIA H200", 28672, 4096, 16): dict(wgmma=True, split_k=1, block_n=64),
    # BM 32 (M 17-32) on the big decode shapes: the Gluon wgmma kernel too (its activation rows: 32), split count and
    # stages from a sweep at M = 24 / 32 (H200, 2026-11-30, us per call in a CUDA graph over weight copies, each timed
    # twice), against the best split-K configs:
    #   28672x4096 (1 split, 4 stages: swap_stages' default): 32.0 / 32.2 vs 33.0 / 33.6;
    #   4096x14336 (2 splits, 6 stages): 20.0 / 20.0 vs 21.8 / 21.8;
    #   7168x16384 (1 split, 4 stages): 32.9 / 33.1 vs 37.7 / 38.3;
    #   6144x4096 (1 split, 4 groups x 3 stages): 8.7 / 8.8 vs 11.0;
    #   4096x4096 (1 split, 4 groups x 3 stages): 8.1 / 8.2 vs 8.9 / 9.0.
    # With one program per SM (at most 132), the deeper pipelines past swap_stages' 112 KB are pinned.
    ("NVIDIA H200", 28672, 4096, 32): dict(wgmma=True, split_k=1, block_n=64),
    ("NVIDIA H200", 4096, 14336, 32): dict(wgmma=True, split_k=2, block_n=64, num_stages=6),
    ("NVIDIA H200", 7168, 16384, 32): dict(wgmma=True, split_k=1, block_n=64, num_stages=4),
    ("NVIDIA H200", 6144, 4096, 32): dict(wgmma=4, split_k=1, block_n=64, num_stages=3),
    ("NVIDIA H200", 4096, 4096, 32): dict(wgmma=4, split_k=1, block_n=64, num_stages=3),
    # (benchmarks/e2e_before.py keeps the earlier split-K BM-32 entries as a preset, for A/B runs.)
    # Llama-3-8B's lm_head at batch 2-16: the stage rule's 3 stages (15 programs per SM) run 132.1 / 140.2 us per call
    # at M = 4 / 16 in a CUDA graph, 4 stages 124.8 / 130.8, the best of 3 / 4 / 6 at both (H200, 2026-11-30). One
    # split as the heuristic: same bits.
    ("NVIDIA H200", 128256, 4096, 16): dict(split_k=1, block_n=64, num_warps=4, num_stages=4, fused_reduce=True),
}
DECODE_KNOBS = ("split_k", "block_n", "num_warps", "num_stages", "fused_reduce", "cluster", "whole_k", "sliced",
               "wgmma")
# The heuristic for shapes without an entry (H200, 2026-11-30: 21 shapes N 2048-28672 x K 2048-14336 at M = 12 / 24 /
# 48, each call timed as a decode step runs it, in a CUDA graph over weight copies). K splits until the programs
# about fill the SMs (SPLIT_FILL per SM; 2 per SM costs more in partials and reduces than the extra programs gain):
# geometric mean 1.05x the best split count at BM 16 and 32, against 1.12x / 1.20x for 2 per SM. At BM 64 (M 33-64)
# the whole-K kernel instead (64-row tiles from N = 4096, 32 below; 4 groups per stage): 1.04x the best of every
# variant tried, against 1.44x for the split rule (up to 2x slower). Off the sm_90 whole-K kernel (other GPUs, rows
# TMA cannot read) BM 64 takes the split rule.
SPLIT_FILL = 0.9
WHOLE_K_AT_BM64 = True
# The decode rule on sm_90 for shapes without an entry, M 2-32 (BM 16 / 32): the swapped Gluon wgmma kernel (the
# H200's Llama-3-8B entries above), its split count, groups per stage and stages from `wgmma_plan`. Measured on four
# H200 sweeps (2026-11-30: 57 shapes N 1280-151936 x K 2048-28672 at M = 4 / 16 / 32, split counts 1-8 with 2 / 4
# groups per stage, us per call in a CUDA graph over weight copies; `benchmarks/split_rule_eval.py --wgmma` scores
# it): per sweep 1.013-1.026x the best variant and 0.85-0.88x the split-K heuristic's time (geometric means); the
# sweep held out from the rule's first form scored it 1.041x / 0.873x.
# - Weights of at least WGMMA_RULE_WIDE x SMs 64-row tiles take one split (the fewest the scale table allows): 6144- to
#   151936-row weights ran up to 34% faster than with the split-K heuristic.
# - Narrower ones, at most WGMMA_RULE_MAX_SPLITS splits: with 8 activation rows (M <= 8) K splits until the programs
#   fill WGMMA_RULE_FILL8 per SM, each split keeping >= WGMMA_RULE_MIN_GROUPS8 128-groups (2048x2048, 3072x2048: one
#   split 16-32% faster than four); with 16 / 32 rows the split count whose programs fill the SMs' last wave best
#   (fewest on a tie: 64 tiles take 2 splits, not 4; 80 tiles 3), each keeping >= WGMMA_RULE_MIN_GROUPS (4096x4096:
#   one split 3-9% faster than two).
# - Stages: where every program has an SM to itself, the deepest pipeline (<= WGMMA_RULE_MAX_STAGES) with 2 groups per
#   stage at 8 rows, 4 at 16 / 32; else `gemm_wgmma.swap_stages` with 2.
# Known misses, slower than the split-K heuristic: 19456x2560 by 3-11% (304 tiles: 1.15 waves of two programs per SM),
# 4096x4096 at M = 4 by 11% (the H200 has an entry), 1280x8192 at M = 16 / 32 by 3-4%. WGMMA_RULE = False: the split-K
# heuristic (`_split_k`).
WGMMA_RULE = True
WGMMA_RULE_WIDE = 0.7
WGMMA_RULE_FILL8 = 2.0
WGMMA_RULE_MAX_SPLITS = 4
WGMMA_RULE_MIN_GROUPS = 20
WGMMA_RULE_MIN_GROUPS8 = 10
WGMMA_RULE_MAX_STAGES = 8
# The MX kernel's split rule by tile height BM: (programs per SM to fill, at least this many splits), measured as a
# decode step runs it (H200, 2026-11-30, CUDA graph over weight copies, `probe_kernels.py --only mx_split`: 6 shapes
# x M = 1 / 4 / 16 / 32 x 1-16 splits; `split_rule_eval.py --mx`), pick / best split, geometric mean per pair:
# this rule 1.003x (bf16 x MXFP4), 1.000x (bf16 x NVFP4), 1.000x (MXFP8 x MXFP8), worst point 1.013x.
# - BM 16: 2 per SM, but 2 splits where that gives one (28672x4096, 448 tiles: one split 7-13% slower than two);
#   without the floor 1.017 / 1.016 / 1.008x, worst 1.13x; 4 per SM 1.004 / 1.011 / 1.038x, worst 1.18x (6144x4096
#   wants 4 splits, not 8);
# - BM 32: 1.5 per SM, 1.000x for all three (2 per SM 1.08-1.13x, 4: 1.15-1.18x): with twice the activation rows a
#   program does more work per weight byte, and fewer, longer splits win.
# - BM 64 (M 33-64) takes BM 32's rule: 1.021 / 1.020 / 1.016x at M = 48 / 64, worst 1.14x (6144x4096); 4 per SM
#   1.21-1.22x.
# - Held-out shapes (Qwen2.5-14B's and Qwen2-7B's MLPs at M = 4 / 16 / 32): 1.075 / 1.080 / 1.034x, worst 1.21x
#   (5120x13824 at BM 16 wants 8 splits, gets 4); 4 per SM 1.015 / 1.014 / 1.027x there. The BM-16 fill is fitted to
#   the Llama-3-8B shapes; 4-6 per SM at BM 16 would score 1.017-1.020x overall against this rule's 1.021x and cost
#   the Llama-3-8B shapes 1.7%.
MX_SPLIT_RULE = {16: (2.0, 2), 32: (1.5, 1)}


def mx_split_k(tiles: int, steps: int, sms: int, bm: int) -> int:
    """K splits of the MX kernel for `tiles` output tiles of height bm and `steps` 128-column chunks on `sms` SMs:
    `_split_k` at the fill of `MX_SPLIT_RULE` (heights it lacks take the largest listed one's), raised to the rule's
    floor where each split keeps >= 4 chunks."""
    fill, floor = MX_SPLIT_RULE.get(bm, MX_SPLIT_RULE[max(MX_SPLIT_RULE)])
    s = _split_k(tiles, steps, sms, fill)
    return max(s, floor) if steps // floor >= 4 else s
# NVFP4's E4M3 block scales decoded by bit arithmetic (`_e4m3_to_f32`) instead of the FP8 cast (same values).
MX_SCALE_BITS = True
# Each row's block scales loaded as one tile per 64 columns, a chunk ahead, and E2M1 decoded by shifts and one multiply
# (`_chunk_scales`, `_spread_scales`, `_e2m1_nibble_to_f32`) instead of one gathered scale load per element and
# `_e2m1_to_f32` (same bits).
MX_ROW_SCALES = True
# With MX_ROW_SCALES on NVIDIA CUDA: packed E2M1 decoded to bf16 by PRMT table lookups in inline PTX
# (`_e2m1_bytes_to_bf16`) and multiplied by the block scales in bf16 (same bits; never under the CPU interpreter).
MX_FP4_PTX = True
# MX split-K partials summed by the last split of each tile (`_last_split_reduce`) on CUDA, as FUSED_REDUCE_DEFAULT for
# the FP8 kernel (same bits as the reduce kernel).
MX_FUSED_REDUCE = True
# Measured M = 1 GEMV configs, as data: (device name, N, K) -> knobs of `_launch_gemv` (block_n, groups, num_stages,
# num_warps); other shapes use its defaults. Same output bits as the defaults in every sweep. H200 (2026-11-29), one
# call after a clean L2 flush: 4096x14336 19.3 us vs 19.7-19.9 with the defaults in two sweeps; 28672x4096 33.2 vs
# 34.6 in one sweep, even in bench_gemm.
GEMV_CONFIGS: dict[tuple[str, int, int], dict[str, Any]] = {
    ("NVIDIA H200", 4096, 14336): dict(block_n=4, groups=8, num_stages=3, num_warps=2),
    ("NVIDIA H200", 28672, 4096): dict(block_n=4, groups=8, num_stages=3, num_warps=2),
}


# ============================================================================ launch helpers
def _cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    """a rounded up to a multiple of b."""
    return _cdiv(a, b) * b


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) by M: decode tiles (BM the next power of two >= M, >= 16:
    the MMA's N side) up to M = 64, large square tiles above."""
    if m <= 64:
        return max(16, triton.next_power_of_2(m)), 64, 4, 4
    return 128, 128, 8, 3


def _split_k(tiles: int, steps: int, sms: int, fill: float = 2.0) -> int:
    """K splits: the smallest power of two that gives >= fill programs per SM, keeping >= 4 K steps
    per split and at most 16 splits (a deterministic function of the shape and the SM count)."""
    s = 1
    while tiles * s < fill * sms and steps // (2 * s) >= 4 and s < 16:
        s *= 2
    return s


def _plan_split(m: int, n: int, steps: int, bm: int, bn: int, device: torch.device,
                split_k: Optional[int], mx: bool = False) -> tuple[int, int]:
    """(splits, K steps per split), with no empty split; the heuristic for split_k None (decode M only): the FP8
    kernel's (`_split_k` at `SPLIT_FILL`), or with `mx` the MX kernel's (`mx_split_k`)."""
    if split_k is None:
        tiles, sms = _cdiv(n, bn) * _cdiv(m, bm), sm_count(device)
        if m > 64:
            split_k = 1
        else:
            split_k = mx_split_k(tiles, steps, sms, bm) if mx else _split_k(tiles, steps, sms, SPLIT_FILL)
    per = _cdiv(steps, max(1, min(split_k, steps)))
    return _cdiv(steps, per), per


def _reduce(part: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor],
            ts: Optional[torch.Tensor], round_bf16: bool = False) -> None:
    """Sum the split-K partials part (S, M, N) into out (M, N) (+ tensor scale, + bias; rounded to bf16 values)."""
    s, m, n = part.shape
    block = 1024
    _splitk_reduce_kernel[(_cdiv(m * n, block),)](
        part, out, bias if bias is not None else out, ts if ts is not None else part, m * n, n, s,
        HAS_BIAS=bias is not None, HAS_TS=ts is not None, BLOCK=block, ROUND_BF16=round_bf16, num_warps=4,
        **launch_opts(part))


def _bad(msg: str) -> ValueError:
    """A ValueError for bad GEMM operands."""
    return ValueError(f"engine.kernels.gemm: {msg}")


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """(..., K) -> (M, K) with unit stride along K."""
    if x.dim() < 1:
        raise _bad(f"{name} must have at least 1 dim (..., K), got a 0-d tensor")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] <= 1 else x2.contiguous()


def _check_out(out_dtype: torch.dtype, bias: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    """Validate out_dtype and bias (N,); return the contiguous bias."""
    if out_dtype not in OUT_DTYPES:
        raise _bad(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if bias is None:
        return None
    if bias.shape != (n,):
        raise _bad(f"bias must have shape ({n},) (one per output column), got {tuple(bias.shape)}")
    return bias.contiguous()


def _check_fp8(t: torch.Tensor, name: str, spec: str) -> None:
    """FP8 E4M3 data check."""
    if t.dtype != FP8:
        raise _bad(f"{name} must be torch.float8_e4m3fn data (quantize with '{spec}'), got {t.dtype}")


@functools.lru_cache(maxsize=None)
def _device_name(device_type: str, index: Optional[int]) -> str:
    """The CUDA device name keying `DECODE_CONFIGS` ("" on CPU)."""
    return torch.cuda.get_device_name(index if index is not None else 0) if device_type == "cuda" else ""


_COUNTERS: dict[torch.device, torch.Tensor] = {}
# Outgrown counter buffers stay allocated: a CUDA graph captured with one keeps using its address.
_RETIRED: list[torch.Tensor] = []


def _tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of >= n per-tile arrival counters for FUSED_REDUCE (kernels leave it zeroed).

    Shared by every fused call on the device: fused split-K calls must run in stream order (one stream,
    or CUDA graphs replayed on one stream); allocate it (one plain call) before capturing a graph. When a
    call needs more counters, a buffer twice as large (at least) replaces it, and the old one is retired,
    not freed: a graph captured with it still owns valid, zeroed counters."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 4096, 2 * buf.numel() if buf is not None else 0), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _opt_outs(knobs: dict[str, Any]) -> dict[str, Any]:
    """The knobs that only keep a call off a kernel (sliced=False, wgmma=False): they leave entries and heuristics
    in force."""
    return {key: v for key, v in knobs.items() if key in ("sliced", "wgmma") and v is False}


def _decode_knobs(m: int, n: int, k: int, device: torch.device, knobs: dict[str, Any]) -> dict[str, Any]:
    """Explicit knobs, else a `DECODE_CONFIGS` entry for (device, N, K, BM) (M <= 64 only; with sliced=False and / or
    wgmma=False when those are the only knobs given), else {}."""
    given = {key: v for key, v in knobs.items() if v is not None}
    if m > 64 or given != _opt_outs(given):
        return given
    entry = DECODE_CONFIGS.get((_device_name(device.type, device.index), n, k, _tiles(m)[0]), {})
    return dict(entry, **given)  # sliced / wgmma=False alone keep the entry: its split-K call, not those kernels


def _positive_int(v: Any) -> bool:
    """An int > 0 (a JSON true is not one)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# The values each DECODE_KNOBS key takes in an entry file: (check, what to write in the error).
_KNOB_VALUES: dict[str, tuple[Any, str]] = {
    "split_k": (_positive_int, "a positive integer"),
    "block_n": (lambda v: v in (16, 32, 64, 128) and not isinstance(v, bool), "16, 32, 64 or 128"),
    "num_warps": (lambda v: v in (1, 2, 4, 8, 16) and not isinstance(v, bool), "1, 2, 4, 8 or 16"),
    "num_stages": (_positive_int, "a positive integer"),
    "fused_reduce": (lambda v: isinstance(v, bool), "true or false"),
    "cluster": (lambda v: isinstance(v, bool), "true or false"),
    "whole_k": (lambda v: v is True or (v in (2, 4) and not isinstance(v, bool)), "true, 2 or 4"),
    "sliced": (lambda v: v is False or (v in (2, 4, 8) and not isinstance(v, bool)), "false, 2, 4 or 8"),
    "wgmma": (lambda v: isinstance(v, bool) or v in (2, 4), "true, false, 2 or 4"),
}


def load_decode_configs(path: str, apply: bool = True) -> dict[tuple[str, int, int, int], dict[str, Any]]:
    """`DECODE_CONFIGS` entries from a JSON file -- a list of {"device", "n", "k", "bm", "knobs"} objects, as
    `benchmarks/probe_kernels.py --only decode_graph` writes them -- validated, and added to (or replacing entries
    of) `DECODE_CONFIGS` when apply. For trying measured configs in a whole decode step before pasting them into
    the table; returns the entries read."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    except OSError as exc:
        raise _bad(f"decode configs {path}: cannot read it ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise _bad(f"decode configs {path}: not JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(rows, list):
        raise _bad(f"decode configs {path}: expected a JSON list of entries, got {type(rows).__name__}")
    out: dict[tuple[str, int, int, int], dict[str, Any]] = {}
    for i, row in enumerate(rows):
        where = f"decode configs {path}, entry {i}"
        if not isinstance(row, dict) or set(row) != {"device", "n", "k", "bm", "knobs"}:
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise _bad(f"{where}: expected the keys device, n, k, bm, knobs; got {got}")
        if not isinstance(row["device"], str) or not all(_positive_int(row[a]) for a in "nk"):
            raise _bad(f"{where}: device must be a GPU name string, n and k positive integers")
        if row["bm"] not in (16, 32, 64):
            raise _bad(f"{where}: bm={row['bm']!r}; decode tiles have BM 16, 32 or 64 (see _tiles)")
        knobs = row["knobs"]
        bad = sorted(set(knobs) - set(DECODE_KNOBS)) if isinstance(knobs, dict) else ["<not an object>"]
        if bad or not knobs:
            raise _bad(f"{where}: unknown knob(s) {bad or '(none given)'}; use {', '.join(DECODE_KNOBS)}")
        for name, value in knobs.items():
            ok, allowed = _KNOB_VALUES[name]
            if not ok(value):
                raise _bad(f"{where}: {name}={value!r}; use {allowed}")
        out[(row["device"], row["n"], row["k"], row["bm"])] = dict(knobs)
    if apply:
        DECODE_CONFIGS.update(out)
    return out


def _heuristic_whole_k(m: int, n: int, device: torch.device) -> dict[str, Any]:
    """The whole-K knobs the heuristic picks for a call without knobs or entry: 33-64 rows (tile BM 64) on CUDA
    while `WHOLE_K_AT_BM64`, 64-row weight tiles from N = 4096 and 32 below, 4 groups per stage (see SPLIT_FILL);
    else {}. Where the kernel cannot run, the caller takes the split rule instead."""
    if WHOLE_K_AT_BM64 and device.type == "cuda" and m <= 64 and _tiles(m)[0] == 64:
        return dict(whole_k=4, block_n=64 if n >= 4096 else 32)
    return {}


def wgmma_plan(m: int, n: int, k: int, sms: int) -> Optional[tuple[int, int, Optional[int]]]:
    """(K splits, groups per stage, stages or None for `gemm_wgmma.swap_stages`' default) of the swapped wgmma kernel
    for an M x N x K decode call on `sms` SMs, by the rule at WGMMA_RULE; None where it has no plan (M outside 2-32, or
    no configuration fits). Memoized per activation-row class (8 / 16 / 32 rows) and rule constants: a call costs a
    dict lookup, not the ~25 us of planning."""
    rows = gw.x_rows(m, True)
    if m < 2 or rows > 32:
        return None
    return _wgmma_plan(rows, n, k, sms, (WGMMA_RULE_WIDE, WGMMA_RULE_FILL8, WGMMA_RULE_MAX_SPLITS,
                                         WGMMA_RULE_MIN_GROUPS, WGMMA_RULE_MIN_GROUPS8, WGMMA_RULE_MAX_STAGES))


@functools.lru_cache(maxsize=4096)
def _wgmma_plan(rows: int, n: int, k: int, sms: int, rule: tuple) -> Optional[tuple[int, int, Optional[int]]]:
    """`wgmma_plan` for `rows` activation rows (the kernel's tile for every M it rounds up to rows) under the rule
    constants `rule`."""
    wide, fill8, max_splits, min_groups, min_groups8, max_stages = rule
    tiles, kb = _cdiv(n, 64), _cdiv(k, GROUP)

    def exact(s: int, gps: int = 2) -> bool:  # s splits as asked, each within the scale table, none trivially short
        got, per = gw.split_plan(kb, s, gps)
        return got == s and per <= gw.MAX_GROUPS and (s == 1 or per >= 4)

    fewest = next((s for s in range(1, kb + 1) if exact(s)), None)
    if fewest is None:
        return None
    splits = fewest
    if tiles < wide * sms:
        tried = [s for s in range(fewest, max(fewest, max_splits) + 1) if exact(s)]
        if rows == 8:
            splits = max((s for s in tried if tiles * s <= fill8 * sms and (s == fewest or kb / s >= min_groups8)),
                         default=fewest)
        else:
            tried = [s for s in tried if s == fewest or kb / s >= min_groups]
            splits = min(tried, key=lambda s: (-round(wave_fill(tiles * s, sms), 9), s))
    gps, stages = 2, None
    if tiles * splits <= sms:  # one program per SM: the deepest pipeline that fits
        for g in ((2,) if rows == 8 else (4, 2)):
            s_eff, per = gw.split_plan(kb, splits, g)
            deep = [st for st in range(2, max_stages + 1) if st <= _cdiv(per, g)
                    and gw.plan_error(rows, n, k, 64, st, g, s_eff, True) is None]
            if deep:
                gps, stages, splits = g, max(deep), s_eff
                break
    if gw.plan_error(rows, n, k, 64, stages or gw.swap_stages(rows, kb, splits, gps), gps, splits, True) is not None:
        return None
    return splits, gps, stages


def wave_fill(programs: int, sms: int) -> float:
    """How full the SMs' waves of `programs` one-per-SM programs are: programs / (SMs x waves)."""
    return programs / (sms * _cdiv(programs, sms))


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    """Compute capability 9.0 exactly (the wgmma kernels' target)."""
    return torch.cuda.get_device_capability(index) == (9, 0)


def _heuristic_wgmma(m: int, n: int, k: int, device: torch.device) -> dict[str, Any]:
    """The wgmma knobs the rule picks for a call without knobs or entry (`wgmma_plan`, while WGMMA_RULE, on an sm_90
    CUDA device); else {}. Where the kernel cannot run the call, the caller takes the split rule instead."""
    if not (WGMMA_RULE and device.type == "cuda" and
            _sm90(device.index if device.index is not None else torch.cuda.current_device())):
        return {}
    plan = wgmma_plan(m, n, k, sm_count(device))
    if plan is None:
        return {}
    splits, gps, stages = plan
    return dict(wgmma=gps, split_k=splits, block_n=64, **({} if stages is None else {"num_stages": stages}))


def _launch_gemv(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                 ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor,
                 round_bf16: bool, block_n: int = 8, groups: int = 8, num_stages: int = 3, num_warps: int = 4,
                 prefetch: Optional[int] = None) -> None:
    """The M = 1 CUDA-core kernel (`_fp8_gemv_kernel`) on x (1, K), w (N, K) into out (1, N). Defaults from the
    H200 sweep (2026-11-29): 8 rows x 8 groups per step.
    `prefetch`: L2-prefetched bytes per weight row (None: `GEMV_PREFETCH_BYTES`; 0 or unaligned rows: none)."""
    n, k = w.shape
    gk = min(groups, triton.next_power_of_2(_cdiv(k, GROUP)))
    pf = min(GEMV_PREFETCH_BYTES if prefetch is None else prefetch, k) // 16 * 16
    if not (w.is_cuda and w.data_ptr() % 16 == 0 and w.stride(0) % 16 == 0):
        pf = 0
    _fp8_gemv_kernel[(_cdiv(n, block_n),)](
        x, xs, w, ws, out, bias if bias is not None else out, n, k, w.stride(0), xs_strides[1], *ws_strides,
        BN=block_n, GK=gk, STAGES=num_stages, HAS_BIAS=bias is not None, ROUND_BF16=round_bf16,
        PF_BYTES=pf, num_warps=num_warps, **launch_opts(x))


def _cluster_ok(x: torch.Tensor, splits: int, bn: int) -> bool:
    """Whether the cluster reduce can run: CUDA sm_90+, 2 / 4 / 8 splits (portable cluster sizes) that divide the
    tile's rows. Otherwise the fused reduce runs instead (the same additions in the same order: same bits)."""
    return (x.is_cuda and splits in (2, 4, 8) and bn % splits == 0
            and cl.supported(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def _launch_cluster(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                    ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor,
                    bm: int, bn: int, splits: int, per: int, round_bf16: bool, num_warps: int, num_stages: int) -> None:
    """The split-K kernel with its `splits` K splits of each tile in one thread-block cluster, reduced through
    distributed shared memory (`_cluster_reduce`): no partial-sum buffer, no counters.

    Opt-in only (no default, no DECODE_CONFIGS entry). H200, 4096x14336, 4 splits x 64 rows, one call after a
    clean L2 flush: M = 4 21.1 us vs the fused reduce's 21.0, M = 16 21.7 vs 21.5; back to back in a CUDA graph
    with PDL 26.1 vs 18.8 us (without PDL 18.9 vs 19.0). Clusters of 4 leave 8 of the 132 SMs unused (124 SMs,
    2-3 programs each) and the partial exchange through the cluster barrier costs what the global handshake
    does (2026-11-29)."""
    m, k = x.shape
    n = w.shape[0]
    opts = launch_opts(x)
    args = dict(x_ptr=x, xs_ptr=xs, w_ptr=w, ws_ptr=ws, out_ptr=out, part_ptr=out,
                bias_ptr=bias if bias is not None else out, cnt_ptr=out, M=m, N=n, K=k, groups_per_split=per,
                n_splits=splits, stride_xm=x.stride(0), stride_wn=w.stride(0), stride_xsm=xs_strides[0],
                stride_xsg=xs_strides[1], stride_wsn=ws_strides[0], stride_wsg=ws_strides[1], BM=bm, BN=bn,
                USE_PART=True, HAS_BIAS=bias is not None, FUSED_REDUCE=False, ROUND_BF16=round_bf16,
                PDL=opts["PDL"], CLUSTER=splits, RED=1)
    cl.launch(_fp8_block_gemm_kernel, (_cdiv(n, bn), _cdiv(m, bm)), splits, bn * bm * 4, args,
              num_warps=num_warps, num_stages=num_stages, **{k_: v for k_, v in opts.items() if k_ != "PDL"})


SLICES = (2, 4, 8)  # K slices the sliced kernel can hold side by side
# Split-K decode calls with 2 or 4 splits and M <= 16 / splits run as the sliced kernel, same bits (`_sliced_instead`).
# H200, 4096x14336 / 7168x16384 / 4096x4096 / 6144x4096 at M = 2 and 4, each with its DECODE_CONFIGS entry's 4 splits
# and stages (2026-11-30), us per call in a CUDA graph over
# weight copies, sliced vs split-K with its fused reduce: 17.4-17.7 vs 18.3-18.6, 30.8-31.0 vs 31.6-32.0, 6.7-6.8 vs
# 7.3-7.7, 8.8-8.9 vs 9.4-9.7; one call after a clean L2 flush 20.4-20.5 vs 20.6-21.3 on 4096x14336. At M = 8 (4
# slices of 8 columns: twice the split-K kernel's MMA columns) it loses on 4096x14336 (19.2 vs 18.8) and 6144x4096, and
# at M = 16 by 15-30%. 8 splits (M <= 2) are left out: their graph times swung between 16.6 and 25 us.
SLICED_AUTO = True
SLICED_AUTO_SPLITS = (2, 4)


def _sliced_instead(x: torch.Tensor, m: int, splits: int, bn: int, warps: int, cfg: dict[str, Any]) -> bool:
    """Whether a split-K decode call runs as the sliced kernel instead (`SLICED_AUTO`): on CUDA, 2 or 4 splits of
    64-row tiles with 4 warps (the split-K MMA whose bits the sliced kernel reproduces), no cluster asked for, and
    M <= 16 / splits, so that the slices' activation columns (splits x next_pow2(M)) fit the split-K kernel's 16;
    never with sliced=False."""
    return (SLICED_AUTO and x.is_cuda and splits in SLICED_AUTO_SPLITS and bn == 64 and warps == 4
            and cfg.get("sliced") is not False and not cfg.get("cluster") and triton.next_power_of_2(m) * splits <= 16)


def _launch_sliced(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                   ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor,
                   round_bf16: bool, slices: int, block_n: Optional[int] = None, num_warps: Optional[int] = None,
                   num_stages: Optional[int] = None, per: Optional[int] = None) -> None:
    """`_fp8_sliced_gemm_kernel` on x (M, K), w (N, K) into out (M, N): `slices` K slices of `per` 128-groups (default
    ceil(K/128 / slices), as `_plan_split`) and block_n weight rows each (default 64 / slices: 64-row MMA tiles) per
    program, activation tiles of BM = the next power of two >= M (at least 16 / slices columns per slice, so that the
    MMA's N side is >= 16). On the H200 the same bits as the split-K kernel with 64-row tiles, 4 warps and the same
    K partition, and its reduce (`probe_kernels.py --only gemm_sliced`, tests/engine/kernels/gemm/test_fp8_block.py)."""
    m, k = x.shape
    n = w.shape[0]
    if slices not in SLICES:
        raise _bad(f"sliced={slices}: use one of {SLICES} K slices per program")
    rows = block_n or 64 // slices
    if rows not in (8, 16, 32, 64) or slices * rows > 256:
        raise _bad(f"sliced={slices} with block_n={rows}: block_n must be 8, 16, 32 or 64 weight rows per slice, "
                   f"and slices x block_n at most 256 tile rows")
    bm = max(triton.next_power_of_2(m) if m <= 64 else 64, 16 // slices)
    if slices * bm > 128:
        raise _bad(f"sliced={slices} at M={m}: the slices' activation tiles would be {slices} x {bm} = {slices * bm} "
                   f"MMA columns; use at most 128 (M <= {128 // slices}), or split_k")
    per = per or _cdiv(_cdiv(k, GROUP), slices)
    grid = (_cdiv(n, rows), _cdiv(m, bm))
    stages = num_stages or (_decode_stages(grid[0] * grid[1], sm_count(x.device)) if x.is_cuda else 3)
    _fp8_sliced_gemm_kernel[grid](x, xs, w, ws, out, bias if bias is not None else out, m, n, k, per,
                                  x.stride(0), w.stride(0), *xs_strides, *ws_strides, BM=bm, R=rows, S=slices,
                                  HAS_BIAS=bias is not None, ROUND_BF16=round_bf16, num_warps=num_warps or 4,
                                  num_stages=stages, **launch_opts(x))


def _launch_wgmma(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                  ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor,
                  round_bf16: bool, gps: int, splits: int, num_stages: Optional[int]) -> bool:
    """The Gluon wgmma kernel with the activation on the wgmma's N side (`gemm_wgmma.launch(swap=True)`, 64 weight
    rows per program), `splits` K splits and num_stages pipeline stages (default `gemm_wgmma.swap_stages`), when it
    can run here; False (nothing launched) when it cannot."""
    stages = num_stages or gw.swap_stages(x.shape[0], _cdiv(x.shape[1], GROUP), splits, gps)
    if not gw.usable(x, w, 64, stages, gps, splits, True):
        return False
    gw.launch(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, 64, stages, gps, splits=splits, swap=True)
    return True


def _launch_fp8(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, split_k: Optional[int], block_n: Optional[int] = None,
                num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                fused_reduce: Optional[bool] = None, round_bf16: bool = False,
                cluster: Optional[bool] = None, whole_k: Optional[int] = None,
                sliced: Optional[int] = None, wgmma: Optional[int] = None) -> torch.Tensor:
    """Run the Triton FP8 GEMM on x (M, K), w (N, K) with the given scale strides; out (M, N).

    Knobs left None come from `DECODE_CONFIGS` (all of them, when an entry matches) or the defaults:
    `_tiles` (BN, warps, stages; on big decode weights `_decode_stages`), `_split_k`, the fused reduce on
    CUDA (`FUSED_REDUCE_DEFAULT`)."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        return out if bias is None else out.add_(bias.to(out_dtype))
    knobs = dict(split_k=split_k, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                 fused_reduce=fused_reduce, cluster=cluster, whole_k=whole_k, sliced=sliced, wgmma=wgmma)
    if m == 1 and x.is_cuda and GEMV_M1 and all(v is None for v in knobs.values()):
        _launch_gemv(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16,
                     **GEMV_CONFIGS.get((_device_name(x.device.type, x.device.index), n, k), {}))
        return out
    cfg = _decode_knobs(m, n, k, x.device, knobs)
    opt_outs = _opt_outs(cfg)
    auto = {}
    if cfg == opt_outs:  # neither knobs nor an entry: the heuristic's kernel
        auto = _heuristic_whole_k(m, n, x.device)
        if not auto and opt_outs.get("wgmma") is not False:
            auto = _heuristic_wgmma(m, n, k, x.device)
    cfg = dict(cfg, **auto)
    if cfg.get("whole_k"):
        wbn = cfg.get("block_n") or gw.BLOCK_N
        gps = cfg.get("whole_k") if cfg.get("whole_k") in (2, 4) else gw.GPS
        wstages = cfg.get("num_stages") or gw.default_stages(wbn, gps)
        if gw.usable(x, w, wbn, wstages, gps):
            gw.launch(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, wbn, wstages, gps)
            return out
        # not here (device / layout / shape): the heuristic's split-K call, or for an explicit whole_k the same
        # math in the split-K kernel (one split: the same bits on the H200)
        cfg = opt_outs if auto else dict(cfg, split_k=1)
    if cfg.get("sliced") and not isinstance(cfg["sliced"], bool):
        _launch_sliced(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, cfg["sliced"],
                       cfg.get("block_n"), cfg.get("num_warps"), cfg.get("num_stages"))
        return out
    bm, bn, warps, stages = _tiles(m)
    bn = cfg.get("block_n") or bn
    if bn not in (16, 32, 64, 128):
        raise _bad(f"block_n={bn}: use 16, 32, 64 or 128 (it must divide the 128-wide weight-scale blocks)")
    splits, per = _plan_split(m, n, _cdiv(k, GROUP), bm, bn, x.device, cfg.get("split_k"))
    if cfg.get("wgmma"):  # the rule's or the given split count; where it cannot run, the split-K kernel below
        if bn != 64:
            raise _bad(f"wgmma with block_n={bn}: the wgmma kernel's weight tile is 64 rows (its wgmma M)")
        gps = cfg["wgmma"] if cfg["wgmma"] in (2, 4) else gw.GPS  # (True == 1: the default)
        if _launch_wgmma(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, gps, splits,
                         cfg.get("num_stages")):
            return out
        if auto:  # the rule's kernel cannot run here: the split rule's own call
            cfg = opt_outs
            splits, per = _plan_split(m, n, _cdiv(k, GROUP), bm, bn, x.device, None)
    if _sliced_instead(x, m, splits, bn, cfg.get("num_warps") or warps, cfg):
        _launch_sliced(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, splits, None, 4,
                       cfg.get("num_stages"), per)
        return out
    fr = cfg.get("fused_reduce")
    fused = (FUSED_REDUCE_DEFAULT and x.is_cuda if fr is None else bool(fr)) and splits > 1
    if cfg.get("cluster") and _cluster_ok(x, splits, bn):
        _launch_cluster(x, xs, xs_strides, w, ws, ws_strides, bias, out, bm, bn, splits, per, round_bf16,
                        cfg.get("num_warps") or warps, cfg.get("num_stages") or stages)
        return out
    part = torch.empty((splits, m, n), device=x.device, dtype=torch.float32) if splits > 1 else out
    grid = (_cdiv(n, bn), _cdiv(m, bm), splits)
    cnt = _tile_counters(x.device, grid[0] * grid[1]) if fused else out
    args = (x, xs, w, ws, out, part, bias if bias is not None else out, cnt, m, n, k, per, splits,
            x.stride(0), w.stride(0), *xs_strides, *ws_strides)
    meta = dict(BM=bm, BN=bn, USE_PART=splits > 1, HAS_BIAS=bias is not None and (splits == 1 or fused),
                FUSED_REDUCE=fused, ROUND_BF16=round_bf16,
                RED=reduce_burst(splits, grid[0] * grid[1] * grid[2], sm_count(x.device)) if fused else 1)
    explicit = cfg.get("num_warps") is not None or cfg.get("num_stages") is not None
    big_decode = x.is_cuda and m <= 64 and n * k >= TUNE_MIN_WEIGHT and not explicit
    if big_decode and DECODE_STAGE_CHOICE == "autotune":
        _fp8_block_gemm_tuned[grid](*args, **meta, **launch_opts(x))
    else:
        if big_decode:
            stages = _decode_stages(grid[0] * grid[1] * grid[2], sm_count(x.device))
        _fp8_block_gemm_kernel[grid](*args, **meta, num_warps=cfg.get("num_warps") or warps,
                                     num_stages=cfg.get("num_stages") or stages, **launch_opts(x))
    if splits > 1 and not fused:
        _reduce(part, out, bias, None, round_bf16)
    return out


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
                          cluster: Optional[bool] = None, whole_k: Optional[int] = None,
                          sliced: Optional[int] = None, wgmma: Optional[int] = None) -> torch.Tensor:
    """The Triton FP8 block-scaled GEMM for any M (decode tiles + split-K up to M = 64, 128x128 tiles above).

    x_data (..., K) fp8 + x_scale (..., ceil(K/128)); w_data (N, K) fp8 + w_scale (ceil(N/128),
    ceil(K/128)); bias (N,) or None -> (..., N) in out_dtype.

    Tuning knobs (None: a `DECODE_CONFIGS` entry for this device / shape when all are None, else the
    defaults): ``split_k`` K splits (changes the fp32 summation order); ``block_n`` weight rows per
    program (16 / 32 / 64 / 128); ``num_warps``, ``num_stages`` (pipeline depth); ``fused_reduce``:
    the last split of each tile sums the partials (same bits as the separate reduce kernel, one launch
    fewer; fused calls must run in stream order, see `_tile_counters`); ``cluster``: the splits of each
    tile run as one thread-block cluster and sum their partials through distributed shared memory
    (`_cluster_reduce`: same bits again; CUDA sm_90+ with 2 / 4 / 8 splits dividing ``block_n``, else
    the fused reduce runs); ``whole_k`` (True, or 2 / 4 groups per pipeline stage): no split-K at all, each
    program streams ``block_n`` (16 / 32 / 64, default 64) whole weight rows through the Gluon wgmma kernel of
    `engine.kernels.gemm_wgmma` -- the same bits as ``split_k=1, block_n=64`` on the H200 (CUDA compute
    capability 9.0, M <= 64, K a multiple of 16 up to 16384; elsewhere the split-K kernel with one split runs
    instead). Without knobs or an entry, calls with 33-64 rows take it on the H200 (`WHOLE_K_AT_BM64`); at
    M <= 32 it is slower than split-K there, and opt-in; ``sliced`` (2 / 4 / 8): split-K inside one program, the
    K slices side by side in one MMA tile and summed in registers (`_fp8_sliced_gemm_kernel`: the bits of
    ``split_k=sliced, block_n=64`` on the H200 without the partials' trip through memory; ``block_n`` is then the
    weight rows per slice, default 64 / sliced). On CUDA, split-K calls with 2 or 4 splits of 64-row tiles and
    M <= 16 / splits take it by themselves (`SLICED_AUTO`); ``sliced=False`` keeps them on the split-K kernel;
    ``wgmma`` (True, or 2 / 4 groups per pipeline stage): the Gluon wgmma kernel of `engine.kernels.gemm_wgmma` with
    the activation rows on the wgmma's N side, 64-row weight tiles, ``split_k`` K splits (default: the split rule's)
    of whole pipeline stages and the same fused reduce -- the bits of ``split_k=S, block_n=64`` with the same K
    partition on the H200 (sm_90, M <= 64; elsewhere the split-K kernel runs); ``num_stages`` then counts its
    pipeline stages (default: `gemm_wgmma.swap_stages`). The H200's `DECODE_CONFIGS` entries for the big Llama-3-8B
    decode shapes at BM 16 select it; ``wgmma=False`` keeps a call off it (and on the entry's split-K config).
    """
    x, xs, w, ws, lead = _block_operands(x_data, x_scale, w_data, w_scale)
    bias = _check_out(out_dtype, bias, w.shape[0])
    out = _launch_fp8(x, xs, (xs.stride(0), xs.stride(1)), w, ws, (ws.stride(0), ws.stride(1)),
                      bias, out_dtype, split_k, block_n, num_warps, num_stages, fused_reduce, cluster=cluster,
                      whole_k=whole_k, sliced=sliced, wgmma=wgmma)
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
    -- without that padding the old API reads the wrong scales (see legacy_scaled_mm_blockwise).
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
                     small_m: int = 64, out_round: Optional[str] = None) -> torch.Tensor:
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
                      bias, out_dtype, None, round_bf16=out_round is not None)
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


def legacy_scaled_mm_blockwise(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                               w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """!!! KNOWN-WRONG: DO NOT USE FOR COMPUTATION. Exists only to reproduce a silent-error trap. !!!

    The old ``torch._scaled_mm`` call with the *unpadded* 1x128 x 128x128 scales (x_scale (M, Kb)
    with strides (1, M); w_scale.t() (Kb, Nb) with strides (1, Kb)). On torch 2.11 + H200 it
    returns relative errors of 0.38-0.53, with no exception, whenever K/128 is not a multiple of 4
    (K = 640, 896, 1152, 1408): cuBLAS reads the weight-scale grid with a leading dimension padded
    to a multiple of 4, i.e. the wrong scales. :func:`scaled_mm_blockwise` pads correctly. A
    numerics harness must catch exactly this class of bug; tests/engine/kernels/gemm/test_fp8_block.py keeps it caught.
    Needs M % 4 == 0 and K, N multiples of 16 (it does no padding).
    """
    x, xs, w, ws, _ = _block_operands(x_data, x_scale, w_data, w_scale)
    sa = xs.t().contiguous().t()
    sb = ws.contiguous().t()
    return torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


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
                      small_m: int = 64) -> torch.Tensor:
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
    out = _launch_fp8(x, xs, (0, 0), w, ws, (0, 0), bias, out_dtype, None)
    return out.reshape(*lead, w.shape[0])


def fp8_tensor_linear_reference(x_data: torch.Tensor, x_scale: torch.Tensor, w_data: torch.Tensor,
                                w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                                out_dtype: torch.dtype = torch.bfloat16, small_m: int = 64) -> torch.Tensor:
    """Reference of :func:`fp8_tensor_linear`: dequantize both (fp32), multiply, add bias."""
    x, xs, w, ws, lead = _tensor_operands(x_data, x_scale, w_data, w_scale)
    return _ref_matmul(x.float() * xs, w.float() * ws, bias, out_dtype).reshape(*lead, w.shape[0])


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
              fused_reduce: Optional[bool] = None) -> torch.Tensor:
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
            `MX_FUSED_REDUCE` on CUDA.

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
    splits, per = _plan_split(m, n, n_chunks, bm, bn, x2.device, split_k, mx=True)
    part = torch.empty((splits, m, n), device=x2.device, dtype=torch.float32) if splits > 1 else out
    ts = w.tensor_scale
    grid = (_cdiv(n, bn), _cdiv(m, bm), splits)
    fused = (MX_FUSED_REDUCE and x2.is_cuda if fused_reduce is None else bool(fused_reduce)) and splits > 1
    _mx_gemm_kernel[grid](
        x2, xs if xs is not None else x2, w.data, w.scale, ts if ts is not None else out, out, part,
        bias if bias is not None else out, _tile_counters(x2.device, grid[0] * grid[1]) if fused else out,
        m, n, k, n_chunks, per,
        x2.stride(0), xs.stride(0) if xs is not None else 0, w.data.stride(0), w.scale.stride(0),
        BM=bm, BN=bn, X_SCALED=xs is not None, W_FP4=w.is_fp4, W_SB=w.block, W_E8M0=w.kind != "nvfp4",
        HAS_TS=ts is not None, USE_PART=splits > 1, HAS_BIAS=bias is not None, SCALE_BITS=MX_SCALE_BITS,
        ROW_SCALES=MX_ROW_SCALES, FP4_PTX=MX_FP4_PTX and x2.is_cuda and torch.version.hip is None,
        FUSED_REDUCE=fused, RED=reduce_burst(splits, grid[0] * grid[1] * grid[2], sm_count(x2.device)) if fused else 1,
        num_warps=4, num_stages=3)
    if splits > 1 and not fused:
        _reduce(part, out, bias, ts)
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
    "MXWeight", "dequantize_mx_weight", "fp8_block_gemm_triton", "fp8_block_linear", "fp8_block_linear_reference",
    "fp8_tensor_linear", "fp8_tensor_linear_reference", "has_scaled_mm", "legacy_scaled_mm_blockwise",
    "mx_linear", "mx_linear_reference", "prepare_mx_weight", "prepare_weight", "scaled_mm_blockwise",
    "scaled_mm_tensorwise",
]
