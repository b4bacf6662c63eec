"""Triton kernels of the paged KV cache: paged decode attention (split-K) and the fused cache write.

`paged_decode_attention` reads the pages and scales of `PagedKVCache`
(`engine.kernels.paged_cache`; V pages token- or dimension-major, its
`v_layout`, through strides) directly through the block table: each
(sequence, kv_head) context is split over `num_splits` programs
(flash-decoding: partial max, sum and unnormalised accumulator per split) and
a small second kernel merges the splits. Numerics as in
`engine.kernels.attention` (FP32 QK^T and softmax, P and dequantized V in
bf16 for PV, FP32 accumulation, optional E4M3 1x128 output), with two
FP8-cache refinements on by default (knobs `qk_fp16`, `fold_v_scale`): QK^T
on fp16 operands (q rows scaled by a power of two; same products, cheaper
E4M3 widening) and, with one V scale per token, the V scale applied to P
(bf16(P * v_scale) @ V, V widened exactly) instead of to V.
`paged_decode_attention_reference` runs the FP32 `Numerics.attention` on
`gather`ed, dequantized K/V.

`kv_write` is the cache's fused quantize + scatter (the `"triton"` write path),
bit-exact with the `engine.formats.quantize` path.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels.attention import (LOG2E, _check_dtype, _compute_types, _e4m3_scale, _emulated_attention,
                                      _finish, _keep_rounded, _launch, _load_v, _out_buffers, _pow2, _qk, _scale_view,
                                      _softmax_step, _store_e4m3, _store_e4m3_groups, _store_output, _strides,
                                      dequantize)
from engine.kernels import sm_count
from engine.kernels.paged_cache import PagedKVCache, _to_device
from engine.kernels.options import DEFAULT_OPTIONS, KernelOptions
from engine.kernels.pdl import launch_opts, pdl_enter

__all__ = ["PagedKVCache", "decode_splits", "decode_tiles", "kv_write", "paged_decode_attention",
           "paged_decode_attention_reference"]


# ------------------------------------------------------------- decode kernels
@triton.jit
def _decode_tile(acc, l_i, m_i, n0, end, q, q_down, row_scale, q_pos, seq, kvh, window, kc_ptr, vc_ptr, kcs_ptr,
                 vcs_ptr, bt_ptr, s_bt, sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t, sv_d, sks_blk, sks_h, sks_t,
                 svs_blk, svs_h, svs_t, svs_g, MASKED: tl.constexpr, PAGE: tl.constexpr, DQ: tl.constexpr,
                 DV: tl.constexpr, DQ_P: tl.constexpr, DV_P: tl.constexpr, BN: tl.constexpr,
                 HAS_SCALES: tl.constexpr, V_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 COMPUTE: tl.constexpr, PV_DTYPE: tl.constexpr, FP32_QK: tl.constexpr, PAGE_TILE: tl.constexpr,
                 QK_F16: tl.constexpr, V_ON_P: tl.constexpr, PV_F16: tl.constexpr):
    """One BN-key tile [n0, n0 + BN) of `_paged_decode_kernel` (n0 BN-aligned): scores, online softmax and
    PV into (acc, l_i, m_i). MASKED=False: every key of the tile is below `end` and visible to every row
    (no token masks: unmasked vector loads; the same values, so the same bits, as the masked step)."""
    dq = tl.arange(0, DQ_P)
    dv = tl.arange(0, DV_P)
    t = n0 + tl.arange(0, BN)
    if MASKED:
        tmask = t < end
    else:
        tmask = tl.full((BN,), 1, tl.int1)  # all true (a splat: uniform along the tokens); no token masks
    if PAGE_TILE:
        page = tl.load(bt_ptr + seq * s_bt + n0 // PAGE).to(tl.int64)  # scalar
        slot = tl.multiple_of(n0 % PAGE, BN) + tl.arange(0, BN)  # tiles start BN-aligned (lo and chunk are)
    else:
        page = tl.load(bt_ptr + seq * s_bt + t // PAGE, mask=tmask, other=0).to(tl.int64)  # (BN,)
        slot = t % PAGE
    k_rows = page * sk_blk + kvh * sk_h + slot * sk_t  # (BN,) element offsets of each token's row
    v_rows = page * sv_blk + kvh * sv_h + slot * sv_t
    vs_rows = page * svs_blk + kvh * svs_h + slot * svs_t
    dmask = dq[None, :] < DQ
    vmask = dv[None, :] < DV
    if MASKED:  # dimension-major V: the token mask splits these V loads into byte loads (the few edge tiles)
        dmask = tmask[:, None] & dmask
        vmask = tmask[:, None] & vmask
    k = tl.load(kc_ptr + k_rows[:, None] + dq[None, :], mask=dmask, other=0.0)
    if QK_F16:
        s = _qk(q, k.to(tl.float16), False) * q_down[:, None]  # (BM, BN)
    else:
        s = _qk(q, k.to(COMPUTE), FP32_QK)
    if HAS_SCALES:
        if MASKED:
            ks = tl.load(kcs_ptr + page * sks_blk + kvh * sks_h + slot * sks_t, mask=tmask, other=1.0)
        else:
            ks = tl.load(kcs_ptr + page * sks_blk + kvh * sks_h + slot * sks_t)
        s = s * ks[None, :]
    s = s * row_scale[:, None]
    if MASKED:
        vis = (t[None, :] <= q_pos[:, None]) & tmask[None, :]
        if HAS_WINDOW:
            vis = vis & (t[None, :] > q_pos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
    else:  # always true here; the select keeps the compiler from fusing the scaling into exp2's subtraction
        s = _keep_rounded(s, t[None, :] <= q_pos[:, None])
    p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, True)
    if V_ON_P:
        v = tl.load(vc_ptr + v_rows[:, None] + dv[None, :] * sv_d, mask=vmask, other=0.0)
        if MASKED:
            vsc = tl.load(vcs_ptr + vs_rows, mask=tmask, other=1.0)  # (BN,)
        else:
            vsc = tl.load(vcs_ptr + vs_rows)
        if PV_F16:
            wp = (p * vsc[None, :]).to(tl.bfloat16).to(tl.float32)  # the bf16 weights of the bf16 path
            e = ((tl.max(wp, axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 max)
            sh = tl.minimum(tl.maximum(14 - e, -126), 126)
            wp = (wp * ((sh + 127) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
            pv = tl.dot(wp, v.to(tl.float16)) * ((127 - sh) << 23).to(tl.float32, bitcast=True)[:, None]
        else:
            pv = tl.dot((p * vsc[None, :]).to(PV_DTYPE), v.to(PV_DTYPE))
    else:
        v = _load_v(vc_ptr + v_rows[:, None] + dv[None, :] * sv_d, vcs_ptr + vs_rows, svs_g, tmask,
                    HAS_SCALES, V_GROUPS, DV, DV_P, PV_DTYPE)
        pv = tl.dot(p.to(PV_DTYPE), v)
    return acc * alpha[:, None] + pv, l_i, m_i


@triton.jit
def _paged_decode_kernel(q_ptr, qs_ptr, kc_ptr, vc_ptr, kcs_ptr, vcs_ptr, bt_ptr, seq_ptr, slen_ptr, qpos_ptr,
                         pm_ptr, pl_ptr, pacc_ptr, out_ptr, hp_ptr, osc_ptr,
                         sqb, sqh, sqt, sqd, sqsb, sqsh, sqst, s_bt, s_qp,
                         sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t, sv_d, sks_blk, sks_h, sks_t,
                         svs_blk, svs_h, svs_t, svs_g,
                         HKV, GROUP, TQ, NSPLIT, qk_scale, window,
                         PAGE: tl.constexpr, DQ: tl.constexpr, DV: tl.constexpr, DQ_P: tl.constexpr,
                         DV_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_QS: tl.constexpr,
                         HAS_SCALES: tl.constexpr, V_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         COMPUTE: tl.constexpr, PV_DTYPE: tl.constexpr, FP32_QK: tl.constexpr,
                         PAGE_TILE: tl.constexpr, QK_F16: tl.constexpr, V_ON_P: tl.constexpr,
                         PV_F16: tl.constexpr = False, DIRECT: tl.constexpr = False,
                         OUT_MODE: tl.constexpr = 0, STORE_HP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (batch*kv_heads, row blocks, splits). Rows r = g*TQ + i pack the GROUP query heads sharing one KV
    head (times tq queries) into one tile; the split takes an equal share (whole BN tiles, BN-aligned) of the
    keys [lo, hi) its rows can see and writes partial (max, sum, unnormalised acc) for the reduce kernel.
    Tiles that every row sees whole run `_decode_tile` without token masks (16-byte vector loads of K and
    of dimension-major V; the masked loads of a token-contiguous V tile compile to byte loads); the few
    tiles at the window's start and at the split's / causal end run masked. V is addressed through
    (sv_t, sv_d), so both page layouts of `PagedKVCache` (`v_layout`) use this kernel.

    PAGE_TILE (BN <= PAGE): an aligned tile lies in one page: one block-table read per tile, contiguous slots.
    QK_F16 (FP8 K, bf16 / FP8 q): each q row is scaled by a power of two into fp16 range and K is widened to
    fp16 (one cvt per two elements instead of three for bf16); exact for every q element within 2**-28 of
    its row's max, and the power of two is taken back out of the fp32 scores.
    V_ON_P (FP8 V with one scale per token): the token's V scale multiplies P (BM x BN) instead of V
    (BN x DV): V is widened exactly to bf16 and P * v_scale is rounded to bf16 once (one rounding less
    than bf16(P) x bf16(V * v_scale)).
    PV_F16 (with V_ON_P): the bf16 values bf16(P * v_scale) of each row are scaled by a power of two into
    fp16 range (row max -> [2**14, 2**15)) and V is widened to fp16 (one cvt per two elements, as K):
    the same products as the bf16 PV for every weight within 2**-32 of its row's max in the tile, the
    power of two taken back out of the fp32 result.
    DIRECT (NSPLIT == 1): the program writes the final output itself (acc / l, stored as
    `_decode_reduce_kernel` would: the same bits, one launch fewer) instead of partials."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    b = pid // HKV
    kvh = pid % HKV
    split = tl.program_id(2)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < GROUP * TQ
    g = rows // TQ
    i = rows % TQ
    head = kvh * GROUP + g
    seq = tl.load(seq_ptr + b).to(tl.int64)
    seq_len = tl.load(slen_ptr + b)
    q_pos = tl.load(qpos_ptr + b.to(tl.int64) * s_qp + i, mask=rmask, other=0)
    dq = tl.arange(0, DQ_P)
    dv = tl.arange(0, DV_P)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + head.to(tl.int64)[:, None] * sqh + i.to(tl.int64)[:, None] * sqt
                + dq[None, :] * sqd, mask=rmask[:, None] & (dq[None, :] < DQ), other=0.0)
    if QK_F16:
        qf = q.to(tl.float32)
        e = ((tl.max(tl.abs(qf), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 amax)
        sh = tl.minimum(tl.maximum(14 - e, -126), 126)  # row amax -> [2**14, 2**15)
        q = (qf * ((sh + 127) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        q_down = ((127 - sh) << 23).to(tl.float32, bitcast=True)  # (BM,) 2**-sh
    else:
        q = q.to(COMPUTE)
        q_down = tl.full((BM,), 1.0, tl.float32)  # unused
    row_scale = tl.full((BM,), qk_scale, tl.float32)
    if HAS_QS:
        row_scale = row_scale * tl.load(qs_ptr + b.to(tl.int64) * sqsb + head.to(tl.int64) * sqsh + i * sqst,
                                        mask=rmask, other=1.0)
    hi = tl.minimum(seq_len, tl.max(tl.where(rmask, q_pos, -1)) + 1)
    if HAS_WINDOW:
        lo = tl.maximum(tl.min(tl.where(rmask, q_pos, 2147483647)) - window + 1, 0)
        lo = lo - lo % BN  # aligned tiles; the keys below the window are masked by `vis`
    else:
        lo = 0
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NSPLIT), BN) * BN
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)
    acc = tl.zeros((BM, DV_P), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    # tiles every row sees whole (causal and window): no token masks, so K and V (dim-major V pages: tokens
    # contiguous) load as 16-byte vectors; masked tiles before (window) and after (the split's or the causal end)
    full_end = start + tl.maximum(tl.minimum(end, tl.min(tl.where(rmask, q_pos, 2147483647)) + 1) - start, 0) // BN * BN
    a = start
    if HAS_WINDOW:
        # the first tile every row's window covers; clamped into [start, max(start, end)] (a split past the
        # keys has end < start: every loop is empty)
        a = tl.maximum(tl.minimum(tl.cdiv(tl.maximum(tl.max(tl.where(rmask, q_pos, -1)) - window + 1, 0), BN) * BN,
                                  end), start)
        full_end = tl.maximum(full_end, a)
    for phase in tl.static_range(3):  # [start, a) masked (window only), [a, full_end) unmasked, [full_end, end)
        if phase != 0 or HAS_WINDOW:
            if phase == 0:
                lo_p, hi_p = start, a
            elif phase == 1:
                lo_p, hi_p = a, full_end
            else:
                lo_p, hi_p = full_end, end
            for n0 in range(lo_p, hi_p, BN):
                acc, l_i, m_i = _decode_tile(
                    acc, l_i, m_i, n0, end, q, q_down, row_scale, q_pos, seq, kvh, window, kc_ptr, vc_ptr, kcs_ptr,
                    vcs_ptr, bt_ptr, s_bt, sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t, sv_d, sks_blk, sks_h, sks_t,
                    svs_blk, svs_h, svs_t, svs_g, phase != 1, PAGE, DQ, DV, DQ_P, DV_P, BN, HAS_SCALES, V_GROUPS,
                    HAS_WINDOW, COMPUTE, PV_DTYPE, FP32_QK, PAGE_TILE, QK_F16, V_ON_P, PV_F16)
    if DIRECT:  # one split: the reduce's sum_s w_s acc_s / sum_s w_s l_s with the single weight w = 1, exactly
        orow = (b * TQ + i) * (HKV * GROUP) + head  # (BM,) rows of the output viewed as (B*TQ*H, DV)
        _store_output(acc / l_i[:, None], orow, rmask, 0, out_ptr, hp_ptr, osc_ptr, DV, DV, DV_P, OUT_MODE,
                      STORE_HP)
    else:
        prow = ((b * (HKV * GROUP) + head) * TQ + i).to(tl.int64) * NSPLIT + split  # (BM,) into (B, H, TQ, S)
        tl.store(pm_ptr + prow, m_i, mask=rmask)
        tl.store(pl_ptr + prow, l_i, mask=rmask)
        tl.store(pacc_ptr + prow[:, None] * DV + dv[None, :], acc, mask=rmask[:, None] & (dv[None, :] < DV))


@triton.jit
def _decode_reduce_kernel(pm_ptr, pl_ptr, pacc_ptr, out_ptr, hp_ptr, osc_ptr, H, TQ, NSPLIT,
                          S_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr, OUT_MODE: tl.constexpr,
                          STORE_HP: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (batch*heads*tq,): merge the splits of one query row: out = sum_s w_s acc_s / sum_s w_s l_s with
    w_s = exp2(m_s - max_s m_s); no visible key anywhere gives NaN (0 / 0)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)  # = (b*H + h)*TQ + i
    i = pid % TQ
    bh = pid // TQ
    b = bh // H
    h = bh % H
    sp = tl.arange(0, S_P)
    smask = sp < NSPLIT
    base = pid.to(tl.int64) * NSPLIT
    m = tl.load(pm_ptr + base + sp, mask=smask, other=float("-inf"))
    lsum = tl.load(pl_ptr + base + sp, mask=smask, other=0.0)
    dv = tl.arange(0, DV_P)
    acc = tl.load(pacc_ptr + (base + sp)[:, None] * DV + dv[None, :], mask=smask[:, None] & (dv[None, :] < DV),
                  other=0.0)
    mx = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(mx == float("-inf"), 0.0, mx))
    o = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)  # (DV_P,)
    row = tl.full((1,), 0, tl.int32) + b * TQ + i
    _store_output(o[None, :], row, row >= 0, h * DV, out_ptr, hp_ptr, osc_ptr, H * DV, DV, DV_P,
                  OUT_MODE, STORE_HP)




@triton.jit
def _head_amax(k_ptr, h, B, T, skb, skh, skt, skd, DK: tl.constexpr, DK_P: tl.constexpr, RB: tl.constexpr):
    """max |k| over every (row, token) of KV head h of a (B, heads, T, DK) chunk, NaN when any element is NaN (the
    library's NaN-propagating amax), RB (row, token) pairs per step: one step when RB >= B * T, so that its loads
    go out with the program's own (one memory round trip, not one per step)."""
    dk = tl.arange(0, DK_P)
    amax = tl.full((), 0.0, tl.float32)
    nan = tl.full((), 0, tl.int32)
    for r0 in range(0, B * T, RB):
        r = r0 + tl.arange(0, RB)
        ok = (r < B * T)[:, None] & (dk < DK)[None, :]
        x = tl.load(k_ptr + (r // T).to(tl.int64)[:, None] * skb + h * skh + (r % T)[:, None] * skt + dk[None, :] * skd,
                    mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x)))
        nan += tl.sum((x != x).to(tl.int32))
    return tl.where(nan > 0, float("nan"), amax)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kamax_ptr, bt_ptr, seq_ptr, start_ptr, kc_ptr, vc_ptr, kcs_ptr, vcs_ptr,
                     T, s_bt, MAX_BLOCKS, TRASH, skb, skh, skt, skd, svb, svh, svt, svd,
                     sk_blk, sk_h, sk_t, sv_blk, sv_h, sv_t, sv_d, sks_blk, sks_h, sks_t, svs_blk, svs_h, svs_t, svs_g,
                     PAGE: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_P: tl.constexpr, DV_P: tl.constexpr,
                     GW: tl.constexpr, NG: tl.constexpr, VG: tl.constexpr, BT: tl.constexpr, FP8: tl.constexpr,
                     K_PER_HEAD: tl.constexpr, V_TOKEN: tl.constexpr, slen_ptr, UPDATE_LEN: tl.constexpr = False,
                     PDL: tl.constexpr = False, AMAX_ROWS: tl.constexpr = 0):
    """Grid (batch, token blocks, kv_heads): quantize BT tokens of one (row, kv_head) and scatter them to
    their pages. K: the head's scale from kamax (e4m3:head) or one scale per token (e4m3:token); V: one
    scale per 128-group (GW-wide groups, NG per padded row, VG real ones), or with V_TOKEN one scale per
    token written to all VG group slots. Non-FP8 caches store the cast values. UPDATE_LEN: program (b, 0, 0)
    raises seq_lens[seq] to start + T (an atomic max: rows naming one sequence twice agree). AMAX_ROWS > 0 (with
    K_PER_HEAD): each program computes its head's amax over the whole chunk itself (`_head_amax`, AMAX_ROWS
    (row, token) pairs per step; for small chunks: decode steps) instead of reading kamax."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(2)
    tok = tl.program_id(1) * BT + tl.arange(0, BT)
    tmask = tok < T
    seq = tl.load(seq_ptr + b)
    start = tl.load(start_ptr + b)
    if UPDATE_LEN:
        if (h == 0) & (tl.program_id(1) == 0):
            tl.atomic_max(slen_ptr + seq, (start + T).to(tl.int32))
    pos = start + tok  # int64
    blk = pos // PAGE
    page = tl.load(bt_ptr + seq * s_bt + tl.minimum(blk, MAX_BLOCKS - 1), mask=tmask, other=TRASH)
    page = tl.where(blk < MAX_BLOCKS, page, TRASH).to(tl.int64)  # beyond the table: the trash page
    slot = pos % PAGE
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    kmask = tmask[:, None] & (dk[None, :] < DK)
    vmask = tmask[:, None] & (dv[None, :] < DV)
    x = tl.load(k_ptr + b.to(tl.int64) * skb + h * skh + tok[:, None] * skt + dk[None, :] * skd, mask=kmask,
                other=0.0).to(tl.float32)
    y = tl.load(v_ptr + b.to(tl.int64) * svb + h * svh + tok[:, None] * svt + dv[None, :] * svd, mask=vmask,
                other=0.0).to(tl.float32)
    koff = page[:, None] * sk_blk + h * sk_h + slot[:, None] * sk_t + dk[None, :]
    voff = page[:, None] * sv_blk + h * sv_h + slot[:, None] * sv_t + dv[None, :] * sv_d
    if FP8:
        if K_PER_HEAD:
            if AMAX_ROWS > 0:
                amax = tl.full((BT,), 0.0, tl.float32) + _head_amax(k_ptr, h, tl.num_programs(0), T, skb, skh, skt,
                                                                     skd, DK, DK_P, AMAX_ROWS)
            else:
                amax = tl.full((BT,), 0.0, tl.float32) + tl.load(kamax_ptr + h)
            ks = tl.div_rn(amax, tl.full((BT,), 448.0, tl.float32))  # a NaN amax gives a NaN scale
            ks = tl.where(amax == 0.0, 1.0, ks)
        else:
            ks = _e4m3_scale(x)
        _store_e4m3(x, ks[:, None], kmask, koff, kc_ptr)
        tl.store(kcs_ptr + page * sks_blk + h * sks_h + slot * sks_t, ks, mask=tmask)
        gi = tl.arange(0, NG)
        soff = (page * svs_blk + h * svs_h + slot * svs_t)[:, None] + gi[None, :] * svs_g  # (BT, NG)
        if V_TOKEN:
            vsc = _e4m3_scale(y)  # (BT,): the whole head_dim (padding is 0)
            _store_e4m3(y, vsc[:, None], vmask, voff, vc_ptr)
            tl.store(vcs_ptr + soff, tl.broadcast_to(vsc[:, None], (BT, NG)), mask=tmask[:, None] & (gi[None, :] < VG))
        else:
            _store_e4m3_groups(tl.reshape(y, (BT * NG, GW)), tl.reshape(vmask, (BT * NG, GW)),
                               tl.reshape(voff, (BT * NG, GW)), tl.reshape(soff, (BT * NG,)), vc_ptr, vcs_ptr)
    else:
        tl.store(kc_ptr + koff, x, mask=kmask)  # cast to the cache dtype (RNE) by the store
        tl.store(vc_ptr + voff, y, mask=vmask)


# ----------------------------------------------------------------- wrappers
# e4m3:head K: chunks of up to this many (row, token) pairs -- decode steps up to batch 64 -- get their per-head
# amax inside the write kernel (each program reads its head's whole chunk, at most 64 x head_dim values, in one
# step) instead of two torch launches (abs, amax) before it: 32 layers x two small launches per decode step. Larger
# chunks (prefill) keep the torch reduction: the in-kernel reads grow with the chunk squared. Same bits either way.
HEAD_AMAX_MAX_TOKENS = 64


def kv_write(cache: PagedKVCache, layer: int, sid: torch.Tensor, st: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, update_lens: bool = False, options: KernelOptions = DEFAULT_OPTIONS) -> None:
    """Quantize k (batch, kv_heads, t, d) / v (batch, kv_heads, t, dv) and scatter them into the pages of
    sequences sid (batch,) at positions st[b] + j (device int tensors). The per-head K amax over the call
    (e4m3:head, NaN-propagating like the library's): for up to `HEAD_AMAX_MAX_TOKENS` (row, token) pairs every
    program of the one launch computes its head's amax itself, else one torch reduction runs first.
    `update_lens`: also raise cache.seq_lens[sid] to st + t in the same launch. Reference: the cache's "library"
    write path (`PagedKVCache.write` without a kernel)."""
    b, h, t, _ = k.shape
    per_head = cache.fp8 and cache.k_spec == "e4m3:head"
    in_kernel = per_head and b * t <= HEAD_AMAX_MAX_TOKENS
    kamax = k.abs().float().amax(dim=(0, 2, 3)).contiguous() if per_head and not in_kernel else cache.seq_lens
    kc, vc = cache.k_data(layer), cache.v_data(layer)
    kcs = cache.k_scale(layer) if cache.fp8 else kc
    vcs = cache.v_scale(layer) if cache.fp8 else vc
    dk_p, dv_p = triton.next_power_of_2(cache.head_dim), triton.next_power_of_2(cache.head_dim_v)
    gw = min(dv_p, 128)
    bt = 1 if t == 1 else 32  # decode steps write one token per row; two variants keep compiles few
    _kv_write_kernel[(b, triton.cdiv(t, bt), h)](
        k, v, kamax, cache.block_tables, sid, st, kc, vc, kcs, vcs,
        t, cache.block_tables.stride(0), cache.max_blocks_per_seq, cache.trash,
        *k.stride(), *v.stride(), *kc.stride()[:3], *vc.stride()[:4],
        *(kcs.stride()[:3] if cache.fp8 else (0, 0, 0)), *(vcs.stride()[:4] if cache.fp8 else (0, 0, 0, 0)),
        PAGE=cache.block_size, DK=cache.head_dim, DV=cache.head_dim_v, DK_P=dk_p, DV_P=dv_p, GW=gw,
        NG=dv_p // gw, VG=cache.v_groups, BT=bt, FP8=cache.fp8, K_PER_HEAD=per_head,
        V_TOKEN=cache.v_spec == "e4m3:token", slen_ptr=cache.seq_lens, UPDATE_LEN=update_lens,
        AMAX_ROWS=max(16, triton.next_power_of_2(b * t)) if in_kernel else 0, num_warps=4,
        **launch_opts(k, options.pdl))


def _decode_rows(q: torch.Tensor, cache: PagedKVCache, seq_lens, seq_ids, q_pos):
    """(seq_ids int32 (b,), seq_lens int32 (b,), q_pos int32 (b, tq)) on the device, defaults filled in:
    rows 0..b-1 of the cache, the cache's lengths, the last tq positions of each sequence."""
    b, _, tq, _ = q.shape
    dev = q.device
    ids = torch.arange(b) if seq_ids is None else torch.as_tensor(seq_ids)
    ids = _to_device(ids.reshape(-1), dev).to(torch.int32)
    if seq_lens is None:
        lens = cache.seq_lens.to(dev)[ids.long()]
    else:
        lens = _to_device(torch.as_tensor(seq_lens).reshape(-1), dev).to(torch.int32)
    if ids.numel() != b or lens.numel() != b:
        raise ValueError(f"seq_ids / seq_lens need one entry per batch row ({b}), got {ids.numel()} / {lens.numel()}")
    if q_pos is None:
        qp = lens[:, None] - tq + torch.arange(tq, device=dev, dtype=torch.int32)  # (b, tq)
    else:
        qp = _to_device(torch.as_tensor(q_pos), dev).to(torch.int32)
        if qp.shape not in ((tq,), (b, tq)):
            raise ValueError(f"q_pos must be ({tq},) or ({b}, {tq}), got {tuple(qp.shape)}")
        qp = qp.expand(b, tq)
    return ids.contiguous(), lens.contiguous(), qp


# Tiles per split at or below which FP8 pages take the short-context tiles (`decode_tiles`).
SHORT_TILES = 4
# ... as long as their grid holds at most this many of those 4-warp programs per SM; a larger grid keeps 2 warps
# (with the short walk's 3 stages). Evidence: docs/design/performance.md#fp8-paged-decode-attention.
SHORT_MAX_PROGRAMS_PER_SM = 2


def decode_tiles(cache: PagedKVCache, tiles_per_split: Optional[int] = None) -> tuple[int, int]:
    """Default (num_warps, num_stages) of the paged decode kernel for this cache, given how many block_n tiles a
    split walks (None: many). FP8 pages (dimension-major V): 2 warps, 5 stages for long walks; a split of at most
    SHORT_TILES tiles is latency-bound and gets 4 warps, 3 stages. Other caches keep 4 warps, 5 stages. Evidence:
    docs/design/performance.md#fp8-paged-decode-attention."""
    if not cache.fp8:
        return (4, 5)
    return (4, 3) if tiles_per_split is not None and tiles_per_split <= SHORT_TILES else (2, 5)


def decode_plan(cache: PagedKVCache, sms: int, batch: int, context: int, block_n: int, row_blocks: int = 1,
                cap: int = 128, num_splits: Optional[int] = None,
                num_warps: Optional[int] = None) -> tuple[int, int, int]:
    """(num_warps, num_stages, num_splits) of a paged decode call on `batch` sequences of at most `context`
    tokens: the given splits / warps, else `decode_splits` and `decode_tiles` -- the splits for the long-walk
    warps first; where they leave each split at most SHORT_TILES tiles, the short-context tiles, and the splits
    again for their warps, unless that grid has more than SHORT_MAX_PROGRAMS_PER_SM programs per SM (then the
    long-walk warps and splits with the short walk's stages). A function of these arguments only, so a CUDA
    graph's replays keep one grid."""
    tiles = triton.cdiv(max(1, context), block_n)
    warps = num_warps or decode_tiles(cache)[0]
    splits = num_splits or decode_splits(sms, batch, cache.kv_heads, context, block_n, row_blocks, cap, warps)
    short_w, stages = decode_tiles(cache, triton.cdiv(tiles, splits))
    if num_warps is None and short_w != warps:
        short_splits = num_splits or decode_splits(sms, batch, cache.kv_heads, context, block_n, row_blocks, cap,
                                                   short_w)
        if batch * cache.kv_heads * row_blocks * short_splits <= SHORT_MAX_PROGRAMS_PER_SM * sms:
            warps, splits = short_w, short_splits
    return warps, stages, splits


def decode_splits(sms: int, batch: int, kv_heads: int, context: int, block_n: int, row_blocks: int = 1,
                  cap: int = 128, num_warps: int = 4) -> int:
    """Default split count of the paged decode kernel: about 8 warps' worth of programs per SM (2 programs of
    4 warps, 4 of 2) over batch x kv_heads x row_blocks, rounded down (a ceiling spills a few programs into
    another wave), at most one split per block_n tile of `context`, at most `cap`. A short context gets several
    one-tile splits instead of one serial program per KV head. Evidence:
    docs/design/performance.md#fp8-paged-decode-attention."""
    per_sm = max(1, 8 // max(1, num_warps))
    return max(1, min((per_sm * sms) // max(1, batch * kv_heads * row_blocks), triton.cdiv(context, block_n), cap))


def paged_decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, seq_lens=None, *, seq_ids=None,
                           q_pos=None, scale: Optional[float] = None, sliding_window: Optional[int] = None,
                           q_scale=None, block_n: int = 64, num_splits: Optional[int] = None,
                           out_dtype: torch.dtype = torch.float32, out_quant: Optional[str] = None,
                           return_hp: bool = False, num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                           qk_fp16: Optional[bool] = None, fold_v_scale: Optional[bool] = None,
                           maxnreg: Optional[int] = None, out_round: Optional[str] = None,
                           pv_fp16: Optional[bool] = None, direct: Optional[bool] = None,
                           options: KernelOptions = DEFAULT_OPTIONS):
    """Decode attention over the paged cache (split-K). Reference: `paged_decode_attention_reference`.

    q: (batch, heads, tq, head_dim) fp32 / bf16 / fp16 / float8_e4m3fn (with q_scale: per tensor,
    (batch, heads) or (batch, heads, tq)); row b attends to sequence seq_ids[b] (default b) of `cache`,
    whose first seq_lens[b] tokens (default: cache.seq_lens) are the keys at positions 0..len-1; the
    queries sit at q_pos (tq,) or (batch, tq) (default: the last tq positions, len-tq..len-1), causal
    by position, optional sliding window. block_n: keys per tile (any page size); num_splits: programs
    per (sequence, kv_head) (default `decode_splits`: about 8 warps' worth of programs per SM, rounded
    down; fix it for CUDA graphs). Tuning knobs (see `_paged_decode_kernel`; benchmarks/tune_kernels.py
    sweeps them): block_n, num_splits, num_warps and
    num_stages (default `decode_tiles`: 2 warps / 5 stages for FP8 pages, 4 / 5 otherwise); maxnreg
    (registers per thread);
    qk_fp16 (default: on for an FP8 cache with bf16 / FP8 q), fold_v_scale (default: on for an FP8
    cache with one V scale per token, head_dim_v <= 128) and pv_fp16 (default: on with fold_v_scale;
    docs/design/performance.md#fp8-paged-decode-attention), all ignored where
    they do not apply; direct (default: on when num_splits == 1): the split writes the output itself, no
    reduce launch (same bits).

    Returns (batch, tq, heads*head_dim_v) like `flash_attention` (fp32 / bf16, or with
    out_quant="e4m3:1x128" (data, scales[, fp32 output]); out_round="bf16" with out_quant rounds the
    output to bf16 before quantizing it, and the fp32 output returned holds those bf16 values).
    """
    _check_dtype(q, "q")
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, heads, tq, head_dim), got shape {tuple(q.shape)}")
    if out_round is not None and (out_round != "bf16" or out_quant is None):
        raise ValueError(f"out_round {out_round!r}: use None, or 'bf16' together with out_quant (a plain bf16 "
                         "output is out_dtype=torch.bfloat16)")
    b, h, tq, dq = q.shape
    hkv, dv = cache.kv_heads, cache.head_dim_v
    if dq != cache.head_dim or h % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache (kv_heads {hkv} must divide heads, "
                         f"head_dim must be {cache.head_dim})")
    if block_n not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_n {block_n}: use 16, 32, 64, 128 or 256")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    dev = q.device
    ids, lens, qp = _decode_rows(q, cache, seq_lens, seq_ids, q_pos)
    qs = _scale_view(q_scale, (b, h, tq), "q_scale", dev)
    group = h // hkv
    bm = min(64, _pow2(group * tq))
    n_mb = triton.cdiv(group * tq, bm)
    dw, ds, num_splits = decode_plan(cache, sm_count(dev), b, cache.context_bound(seq_ids, b), block_n, n_mb,
                                     num_splits=num_splits, num_warps=num_warps)
    num_warps, num_stages = num_warps or dw, num_stages or ds
    direct = num_splits == 1 if direct is None else bool(direct)
    if direct and num_splits != 1:
        raise ValueError(f"direct=True writes the output from the split itself: it needs num_splits=1, "
                         f"got {num_splits}")
    out, hp, osc, mode, store_hp, second = _out_buffers(b, tq, h, dv, dev, out_dtype, out_quant, return_hp, out_round)
    if direct:
        pm = pl = pacc = out  # unused
    else:
        pm = torch.empty((b, h, tq, num_splits), device=dev, dtype=torch.float32)
        pl = torch.empty_like(pm)
        pacc = torch.empty((b, h, tq, num_splits, dv), device=dev, dtype=torch.float32)
    kc, vc = cache.k_data(layer), cache.v_data(layer)
    kcs, vcs = cache.k_scale(layer), cache.v_scale(layer)
    compute, fp32_qk, pv = _compute_types(q.dtype, kc.dtype, vc.dtype)
    qk_scale = (1.0 / math.sqrt(dq) if scale is None else float(scale)) * LOG2E
    f16_ok = cache.fp8 and q.dtype in (torch.bfloat16, torch.float8_e4m3fn)
    fold_ok = cache.fp8 and cache.v_groups == 1
    fold = fold_ok and (fold_v_scale is None or bool(fold_v_scale))
    args = (q, qs if qs is not None else pm, kc, vc, kcs if kcs is not None else pm, vcs if vcs is not None else pm,
            cache.block_tables, ids, lens, qp, pm, pl, pacc, out, hp, osc,
            *q.stride(), *_strides(qs, 3), cache.block_tables.stride(0), qp.stride(0),
            *kc.stride()[:3], *vc.stride()[:4], *_strides(kcs, 3), *_strides(vcs, 4),
            hkv, group, tq, num_splits, qk_scale, sliding_window or 0)
    kwargs = dict(PAGE=cache.block_size, DQ=dq, DV=dv, DQ_P=_pow2(dq), DV_P=_pow2(dv), BM=bm, BN=block_n,
                  HAS_QS=qs is not None, HAS_SCALES=cache.fp8, V_GROUPS=cache.v_groups,
                  HAS_WINDOW=sliding_window is not None, COMPUTE=compute, PV_DTYPE=pv, FP32_QK=fp32_qk,
                  PAGE_TILE=block_n <= cache.block_size, QK_F16=f16_ok and (qk_fp16 is None or bool(qk_fp16)),
                  V_ON_P=fold, PV_F16=fold and (pv_fp16 is None or bool(pv_fp16)),
                  DIRECT=direct, OUT_MODE=mode, STORE_HP=store_hp,
                  num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}),
                  **launch_opts(q, options.pdl))
    _launch(_paged_decode_kernel, (b * hkv, n_mb, num_splits), args, kwargs,
            f"paged_decode_attention(block_n={block_n})")
    if not direct:
        _launch(_decode_reduce_kernel, (b * h * tq,),
                (pm, pl, pacc, out, hp, osc, h, tq, num_splits),
                dict(S_P=triton.next_power_of_2(num_splits), DV=dv, DV_P=_pow2(dv), OUT_MODE=mode,
                     STORE_HP=store_hp, num_warps=4, **launch_opts(q, options.pdl)), "paged decode reduce")
    return _finish(out, hp, osc, out_quant, return_hp, second)


def paged_decode_attention_reference(q: torch.Tensor, cache: PagedKVCache, layer: int, seq_lens=None, *,
                                     seq_ids=None, q_pos=None, scale: Optional[float] = None,
                                     sliding_window: Optional[int] = None, q_scale=None) -> torch.Tensor:
    """FP32 `Numerics.attention` per sequence on the gathered, dequantized K/V: (batch, tq, heads*dv) fp32."""
    b, h, tq, _ = q.shape
    ids, lens, qp = _decode_rows(q, cache, seq_lens, seq_ids, q_pos)
    qd = dequantize(q, q_scale)
    outs = []
    for i, (sid, n) in enumerate(zip(ids.tolist(), lens.tolist())):
        k, v = cache.gather(layer, sid, n)  # (1, kv_heads, n, d)
        k_pos = torch.arange(n, device=q.device)
        outs.append(_emulated_attention(qd[i:i + 1], k.to(q.device), v.to(q.device), qp[i], k_pos,
                                        sliding_window, scale))
    return torch.cat(outs)  # (batch, tq, heads*dv)
