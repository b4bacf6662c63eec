"""The FP8 block / per-tensor Triton GEMM kernels and their launch (`_launch_fp8`).

`_fp8_block_gemm_kernel`: split-K "swap-AB" FP8 MMA (``out^T = W @ x^T`` so that the big N dimension fills the MMA
rows; each 128-wide K group is one FP8 tensor-core dot promoted to fp32 and scaled by ``w_scale * x_scale``), with
the fused or separate reduce of `engine.kernels.splitk`; `_fp8_sliced_gemm_kernel`: 2-8 K slices side by side in one
program's MMA tile, summed in registers in slice order (the bits of the split-K kernel with the same K partition);
`_fp8_gemv_kernel`: M = 1 on the CUDA cores. `_launch_fp8` takes the knobs of a call, a measured entry or the rules of
`engine.kernels.decode_plan`, and runs the kernel they name (or the Gluon kernels of `engine.kernels.gemm_wgmma`).
The public wrappers and the references are in `engine.kernels.gemm`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels import gemm_wgmma as gw
from engine.kernels import sm_count
from engine.kernels.quant import _round_bf16
from engine.kernels.options import DEFAULT_OPTIONS, KernelOptions
from engine.kernels.pdl import launch_opts, pdl_enter
from engine.kernels import decode_plan as plan
from engine.kernels import splitk as sk
from engine.kernels.decode_plan import (DEFAULT_POLICY, SLICES, DecodePolicy, _decode_knobs, _decode_stages, _opt_outs,
                                        _plan_split, _sliced_instead, _tiles)
from engine.kernels.splitk import GROUP, _bad, _cdiv, _epilogue, _last_split_reduce, _tile_counters


FP8 = torch.float8_e4m3fn


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
                           PDL: tl.constexpr = False, RED: tl.constexpr = 4):
    """Grid (N tiles, M tiles, K splits). acc (BN, BM) += dot(W (BN, 128), X^T (128, BM)) * ws * xs
    per 128-wide K group: FP8 tensor-core dot, promoted to fp32 once per group. BN divides 128, so
    one weight-scale row serves the whole tile. Per-tensor scales use stride 0.

    The loop is `_scaled_steps`.
    FUSED_REDUCE (split-K): the last split to finish a tile sums all partials itself (`_last_split_reduce`, per-tile
    arrival counters cnt_ptr): the same bits as `_splitk_reduce_kernel`, without its launch."""
    pdl_enter(PDL)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(2)
    offs_n, offs_m, n_ok, m_ok, w_rows, x_rows, ws_row, xs_rows, g0, g1 = _split_k_tile(
        x_ptr, xs_ptr, w_ptr, ws_ptr, pid_n, pid_m, pid_s, M, N, K, groups_per_split, stride_xm, stride_wn,
        stride_xsm, stride_wsn, BM, BN)
    acc = _scaled_steps(tl.zeros((BN, BM), dtype=tl.float32), w_rows, x_rows, ws_row, xs_rows, g0, g1, K, n_ok,
                        m_ok, stride_wsg, stride_xsg)
    _epilogue(acc, offs_n, offs_m, pid_s, M, N, out_ptr, part_ptr, bias_ptr, out_ptr,
              USE_PART, HAS_BIAS and not FUSED_REDUCE, False, ROUND_BF16)
    if USE_PART and FUSED_REDUCE:
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
    handshake after the last step (its cost: docs/design/performance.md#decode-gemms-m--64)."""
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
    for i in range(0, groups_per_slice):  # scales one step ahead, as `_scaled_steps` (two is slower)
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
                     ROUND_BF16: tl.constexpr, PDL: tl.constexpr = False):
    """M = 1 on CUDA cores, grid (cdiv(N, BN),): a program streams BN whole weight rows, GK 128-groups per step
    (16-byte cp.async loads, L2 only, pipelined STAGES deep through shared memory; no MMA, no split-K and so
    no reduce). Per
    group: the 128 exact E4M3 x E4M3 products summed in fp32, times w_scale * x_scale, accumulated in fp32
    -- the block-scaled math of `_fp8_block_gemm_kernel` in another summation order. BN divides 128 (one
    weight-scale row per program); per-tensor scales use stride 0."""
    pid = tl.program_id(0)
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


def _launch_gemv(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                 ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor,
                 round_bf16: bool, block_n: int = 8, groups: int = 8, num_stages: int = 3, num_warps: int = 4,
                 pdl: bool = True) -> None:
    """The M = 1 CUDA-core kernel (`_fp8_gemv_kernel`) on x (1, K), w (N, K) into out (1, N). Defaults for shapes
    without a GEMV entry: 8 rows x 8 groups per step (docs/design/performance.md#decode-gemms-m--64). `pdl`:
    `KernelOptions.pdl` (every launcher here)."""
    n, k = w.shape
    gk = min(groups, triton.next_power_of_2(_cdiv(k, GROUP)))
    _fp8_gemv_kernel[(_cdiv(n, block_n),)](
        x, xs, w, ws, out, bias if bias is not None else out, n, k, w.stride(0), xs_strides[1], *ws_strides,
        BN=block_n, GK=gk, STAGES=num_stages, HAS_BIAS=bias is not None, ROUND_BF16=round_bf16,
        num_warps=num_warps, **launch_opts(x, pdl))


def _launch_sliced(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                   ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor,
                   round_bf16: bool, slices: int, block_n: Optional[int] = None, num_warps: Optional[int] = None,
                   num_stages: Optional[int] = None, per: Optional[int] = None,
                   policy: DecodePolicy = DEFAULT_POLICY, pdl: bool = True) -> None:
    """`_fp8_sliced_gemm_kernel` on x (M, K), w (N, K) into out (M, N): `slices` K slices of `per` 128-groups (default
    ceil(K/128 / slices), as `_plan_split`) and block_n weight rows each (default 64 / slices: 64-row MMA tiles) per
    program, activation tiles of BM = the next power of two >= M (at least 16 / slices columns per slice, so that the
    MMA's N side is >= 16). On the H200 the same bits as the split-K kernel with 64-row tiles, 4 warps and the same
    K partition, and its reduce (tests/engine/kernels/gemm/test_fp8_block.py)."""
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
    stages = num_stages or (_decode_stages(grid[0] * grid[1], sm_count(x.device), policy.decode_stages)
                            if x.is_cuda else 3)
    _fp8_sliced_gemm_kernel[grid](x, xs, w, ws, out, bias if bias is not None else out, m, n, k, per,
                                  x.stride(0), w.stride(0), *xs_strides, *ws_strides, BM=bm, R=rows, S=slices,
                                  HAS_BIAS=bias is not None, ROUND_BF16=round_bf16, num_warps=num_warps or 4,
                                  num_stages=stages, **launch_opts(x, pdl))


def _launch_wgmma(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                  ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor,
                  round_bf16: bool, gps: int, splits: int, num_stages: Optional[int], pdl: bool = True) -> bool:
    """The Gluon wgmma kernel with the activation on the wgmma's N side (`gemm_wgmma.launch(swap=True)`, 64 weight
    rows per program), `splits` K splits and num_stages pipeline stages (default `gemm_wgmma.swap_stages`), when it
    can run here; False (nothing launched) when it cannot."""
    stages = num_stages or gw.swap_stages(x.shape[0], _cdiv(x.shape[1], GROUP), splits, gps)
    if not gw.usable(x, w, 64, stages, gps, splits, True):
        return False
    gw.launch(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, 64, stages, gps, splits=splits, swap=True,
              pdl=pdl)
    return True


def _launch_fp8(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor,
                ws: torch.Tensor, ws_strides: tuple[int, int], bias: Optional[torch.Tensor],
                out_dtype: torch.dtype, split_k: Optional[int], block_n: Optional[int] = None,
                num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                fused_reduce: Optional[bool] = None, round_bf16: bool = False,
                whole_k: Optional[int] = None, sliced: Optional[int] = None, wgmma: Optional[int] = None,
                policy: Optional[DecodePolicy] = None, options: KernelOptions = DEFAULT_OPTIONS) -> torch.Tensor:
    """Run the Triton FP8 GEMM on x (M, K), w (N, K) with the given scale strides; out (M, N).

    Knobs left None come from the policy's decode entry (all of them, when one matches) or its rules: `_tiles` (BN,
    warps, stages; on big decode weights `_decode_stages`), `_split_k`, the fused reduce on CUDA. `options`: the
    backend's kernel variants (PDL)."""
    policy = policy or DEFAULT_POLICY
    pdl = options.pdl
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        return out if bias is None else out.add_(bias.to(out_dtype))
    knobs = dict(split_k=split_k, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                 fused_reduce=fused_reduce, whole_k=whole_k, sliced=sliced, wgmma=wgmma)
    if m == 1 and x.is_cuda and policy.gemv_m1 and all(v is None for v in knobs.values()):
        _launch_gemv(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16,
                     **plan._gemv_knobs(n, k, x.device, policy), pdl=pdl)
        return out
    cfg = _decode_knobs(m, n, k, x.device, knobs, policy)
    opt_outs = _opt_outs(cfg)
    auto = {}
    if cfg == opt_outs:  # neither knobs nor an entry: the heuristic's kernel
        auto = plan._heuristic_whole_k(m, n, x.device, policy)
        if not auto and opt_outs.get("wgmma") is not False:
            auto = plan._heuristic_wgmma(m, n, k, x.device, policy)
    cfg = dict(cfg, **auto)
    if cfg.get("whole_k"):
        wbn = cfg.get("block_n") or gw.BLOCK_N
        gps = cfg.get("whole_k") if cfg.get("whole_k") in (2, 4) else gw.GPS
        wstages = cfg.get("num_stages") or gw.default_stages(wbn, gps)
        if gw.usable(x, w, wbn, wstages, gps):
            gw.launch(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, wbn, wstages, gps, pdl=pdl)
            return out
        # not here (device / layout / shape): the heuristic's split-K call, or for an explicit whole_k the same
        # math in the split-K kernel (one split: the same bits on the H200)
        cfg = opt_outs if auto else dict(cfg, split_k=1)
    if cfg.get("sliced") and not isinstance(cfg["sliced"], bool):
        _launch_sliced(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, cfg["sliced"],
                       cfg.get("block_n"), cfg.get("num_warps"), cfg.get("num_stages"), policy=policy, pdl=pdl)
        return out
    bm, bn, warps, stages = _tiles(m)
    bn = cfg.get("block_n") or bn
    if bn not in (16, 32, 64, 128):
        raise _bad(f"block_n={bn}: use 16, 32, 64 or 128 (it must divide the 128-wide weight-scale blocks)")
    splits, per = _plan_split(m, n, _cdiv(k, GROUP), bm, bn, x.device, cfg.get("split_k"), policy=policy)
    if cfg.get("wgmma"):  # the rule's or the given split count; where it cannot run, the split-K kernel below
        if bn != 64:
            raise _bad(f"wgmma with block_n={bn}: the wgmma kernel's weight tile is 64 rows (its wgmma M)")
        gps = cfg["wgmma"] if cfg["wgmma"] in (2, 4) else gw.GPS  # (True == 1: the default)
        if _launch_wgmma(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, gps, splits,
                         cfg.get("num_stages"), pdl):
            return out
        if auto:  # the rule's kernel cannot run here: the split rule's own call
            cfg = opt_outs
            splits, per = _plan_split(m, n, _cdiv(k, GROUP), bm, bn, x.device, None, policy=policy)
    if _sliced_instead(x, m, splits, bn, cfg.get("num_warps") or warps, cfg, policy):
        _launch_sliced(x, xs, xs_strides, w, ws, ws_strides, bias, out, round_bf16, splits, None, 4,
                       cfg.get("num_stages"), per, policy=policy, pdl=pdl)
        return out
    fr = cfg.get("fused_reduce")
    fused = (policy.fused_reduce and x.is_cuda if fr is None else bool(fr)) and splits > 1
    part = torch.empty((splits, m, n), device=x.device, dtype=torch.float32) if splits > 1 else out
    grid = (_cdiv(n, bn), _cdiv(m, bm), splits)
    cnt = _tile_counters(x.device, grid[0] * grid[1]) if fused else out
    args = (x, xs, w, ws, out, part, bias if bias is not None else out, cnt, m, n, k, per, splits,
            x.stride(0), w.stride(0), *xs_strides, *ws_strides)
    meta = dict(BM=bm, BN=bn, USE_PART=splits > 1, HAS_BIAS=bias is not None and (splits == 1 or fused),
                FUSED_REDUCE=fused, ROUND_BF16=round_bf16,
                RED=sk.reduce_burst(splits, grid[0] * grid[1] * grid[2], sm_count(x.device)) if fused else 1)
    explicit = cfg.get("num_warps") is not None or cfg.get("num_stages") is not None
    if x.is_cuda and m <= 64 and n * k >= policy.tune_min_weight and not explicit:  # big decode weight
        stages = _decode_stages(grid[0] * grid[1] * grid[2], sm_count(x.device), policy.decode_stages)
    _fp8_block_gemm_kernel[grid](*args, **meta, num_warps=cfg.get("num_warps") or warps,
                                 num_stages=cfg.get("num_stages") or stages, **launch_opts(x, pdl))
    if splits > 1 and not fused:
        sk._reduce(part, out, bias, None, round_bf16, pdl)
    return out
