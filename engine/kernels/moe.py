"""Routed-expert MoE on the GPU: tokens sorted by expert, grouped FP8 GEMMs, fp32 combine; no host sync.

The semantics are those of `engine.numerics.Numerics.moe` (the emulation):

1. the (tokens, k) expert choices are sorted by expert, stably (`sort_by_expert`
   == `engine.routing.dispatch_plan`, but with device-side segment offsets);
2. the FP8 token rows (data + scales, quantized once before dispatch) are
   gathered into that order *once* (`permute_rows`): the seed article's fix
   for the Gather cost of an unsorted dispatch;
3. per expert segment ``g = x @ Wg.T``, ``u = x @ Wu.T`` (GEMM output rounded to
   `out_dtype`, the recipe's ``linear.output``: bf16 for FP8 recipes);
4. ``silu(g) * u`` in fp32, quantized row-locally for all experts in one launch;
5. ``y = act @ Wd.T`` (rounded to `out_dtype`), ``y * routing weight`` in fp32,
   summed back per token in fp32 in the emulation's order (`combine`).

Two GEMM modes, both grouped (one launch per projection for all experts, the
segment offsets read on the device):

* ``mode="block"`` (recipe-faithful, ``fp8-block``): activations E4M3 1x128,
  expert weights E4M3 128x128 with fp32 block scales, exactly the recipe's
  formats. A Triton grouped GEMM applies both scales inside the K loop (one
  128-wide K block per step, fp32 accumulation across blocks). cuBLAS has no
  blockwise grouped GEMM on sm_90, hence Triton.
* ``mode="rowwise"`` (a *different format* from the recipe, for speed):
  ``torch._scaled_grouped_mm`` with one fp32 scale per token row and per weight
  output channel. The 1x128 input is dequantized and requantized per token,
  the SwiGLU output is quantized per token, and the 128x128-block weights are
  converted once (`rowwise_expert_weights`): dequantize each expert to fp32
  (``data * block scale``) and requantize each output channel (a row of the
  (N, K) weight) to E4M3 with ``scale = amax(row) / 448``. That is two extra
  roundings per weight and per activation, so its result matches the
  emulation of a *rowwise* recipe (``grouped_fp8_moe_reference(mode="rowwise")``),
  not ``fp8-block``.

Expert weights travel stacked (`ExpertWeights`): data (E, N, K)
``float8_e4m3fn`` and fp32 scales (E, ceil(N/128), ceil(K/128)) (block) or
(E, N) (per channel). Pure-torch references sit beside the wrappers
(`*_reference`); `unsorted_fp8_moe` is the naive per-expert dispatch kept for
the benchmark's side-by-side.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

GROUP = 128  # activation group / weight block edge
FP8 = torch.float8_e4m3fn

ActQuant = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class ExpertWeights(NamedTuple):
    """One projection of all experts, stacked: data (E, N, K) float8_e4m3fn, scale fp32.

    scale: (E, ceil(N/128), ceil(K/128)) 128x128 block scales, or (E, N) per output channel.
    """

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def blockwise(self) -> bool:
        """True for 128x128 block scales, False for per-channel scales."""
        return self.scale.dim() == 3


class SortPlan(NamedTuple):
    """Token copies sorted by expert, all on the device (no host sync to build it).

    order: (tokens*k,) int64 positions into the flattened (tokens, k) choices, sorted by expert (stable);
    token: (tokens*k,) int64 token index of each sorted copy (``order // k``);
    offsets: (experts+1,) int32, expert e owns sorted copies ``offsets[e]:offsets[e+1]``;
    inverse: (tokens*k,) int64 sorted position of each flattened choice (``inverse[order] = arange``);
    token_rows: (tokens, k) int64 sorted positions of each token's copies, ascending
        (the order the emulation's index_add sums them in).
    """

    order: torch.Tensor
    token: torch.Tensor
    offsets: torch.Tensor
    inverse: torch.Tensor
    token_rows: torch.Tensor


# --------------------------------------------------------------------------- kernels
@triton.jit
def _grouped_gemm_block_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, offs_ptr, tile_expert_ptr, tile_start_ptr,
                               N, K, n_experts, max_tiles_m, a_kb, b_nb, b_kb,
                               BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """C[rows of expert e] = sum over 128-wide K blocks of (A_blk @ B_e_blk^T) * sa[row, kb] * sb[e, n//128, kb].

    A (M, K) fp8 sorted by expert, sa (M, ceil(K/128)); B (E, N, K) fp8, sb (E, ceil(N/128), ceil(K/128));
    C (M, N). 1-D grid over (m tiles upper bound) x (n tiles), m-tile -> expert through tile_expert.
    """
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BN)
    # grouped ordering: GROUP_M consecutive m-tiles sweep the n-tiles together so B stays in L2
    width = GROUP_M * n_tiles_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(max_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= n_experts:  # a tile beyond the real ones (the grid is an upper bound known on the host)
        return
    row_end = tl.load(offs_ptr + e + 1)
    rows = tl.load(offs_ptr + e) + (pid_m - tl.load(tile_start_ptr + e)) * BM + tl.arange(0, BM)
    rmask = rows < row_end
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < N
    ks = tl.arange(0, 128)
    rows64 = rows.to(tl.int64)
    e64 = e.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * K + ks[None, :]  # (BM, 128)
    b_ptrs = b_ptr + e64 * N * K + cols.to(tl.int64)[None, :] * K + ks[:, None]  # (128, BN), K-contiguous
    sa_ptrs = sa_ptr + rows64 * a_kb
    sb_ptrs = sb_ptr + e64 * b_nb * b_kb + (cols // 128) * b_kb
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, a_kb):  # a_kb = ceil(K/128) K blocks
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
        else:
            kmask = ks + kb * 128 < K
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        sa = tl.load(sa_ptrs + kb, mask=rmask, other=0.0)
        sb = tl.load(sb_ptrs + kb, mask=cmask, other=0.0)
        # promote each block's tensor-core partial sum to fp32 with its scales (two-level accumulation)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += 128
        b_ptrs += 128
    tl.store(c_ptr + rows64[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _row_values(x_ptr, xs_ptr, u_ptr, rows, cols, M, K, stride_x, stride_u, n_groups, MODE: tl.constexpr):
    """fp32 tile (BM, BK) of the values to quantize: MODE 0 = FP8 data * 1x128 scale, MODE 1 = silu(g) * u."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:
        s = tl.load(xs_ptr + r64[:, None] * n_groups + cols[None, :] // 128, mask=mask, other=1.0)
        h = x * s
    else:
        u = tl.load(u_ptr + r64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = tl.div_rn(x, 1.0 + tl.exp(-x)) * u
    return h


@triton.jit
def _rowwise_quant_kernel(x_ptr, xs_ptr, u_ptr, out_ptr, scale_ptr, hp_ptr, M, K, stride_x, stride_u, n_groups,
                          MODE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, STORE_HP: tl.constexpr):
    """Per-row E4M3 quantization (library ``e4m3:token`` bits): pass 1 row amax, pass 2 RNE(h / scale)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    amax = tl.zeros((BM,), tl.float32)
    n_nan = tl.zeros((BM,), tl.int32)
    nan = tl.zeros((BM,), tl.float32)  # becomes NaN exactly for rows holding a NaN
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        h = _row_values(x_ptr, xs_ptr, u_ptr, rows, cols, M, K, stride_x, stride_u, n_groups, MODE)
        amax = tl.maximum(amax, tl.max(tl.abs(h), axis=1))
        n_nan += tl.sum((h != h).to(tl.int32), axis=1)
        nan += tl.sum(tl.where(h != h, h, 0.0), axis=1)
    scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    scale = tl.where(amax == 0.0, 1.0, scale)
    scale = tl.where(n_nan > 0, nan, scale)  # a NaN row poisons its scale, as the library does
    r64 = rows.to(tl.int64)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        h = _row_values(x_ptr, xs_ptr, u_ptr, rows, cols, M, K, stride_x, stride_u, n_groups, MODE)
        if STORE_HP:
            tl.store(hp_ptr + r64[:, None] * K + cols[None, :], h, mask=mask)
        y = tl.div_rn(h, scale[:, None])
        tl.store(out_ptr + r64[:, None] * K + cols[None, :], y.to(tl.float8e4nv, fp_downcast_rounding="rtne"),
                 mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < M)


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, order_ptr, w_ptr, out_ptr, n, d,
                    TOPK: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """out[t] = sum over the token's copies j (ascending sorted position) of fp32(y[j]) * w_flat[order[j]]."""
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = toks < n
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = tmask[:, None] & (cols[None, :] < d)
    t64 = toks.to(tl.int64)
    acc = tl.zeros((BT, BD), tl.float32)
    for s in tl.static_range(TOPK):
        j = tl.load(rows_ptr + t64 * TOPK + s, mask=tmask, other=0)
        w = tl.load(w_ptr + tl.load(order_ptr + j, mask=tmask, other=0), mask=tmask, other=0.0)
        y = tl.load(y_ptr + j[:, None] * d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += y * w[:, None]
    tl.store(out_ptr + t64[:, None] * d + cols[None, :], acc, mask=mask)


# --------------------------------------------------------------------------- weights
def stack_expert_weights(ws: Sequence) -> ExpertWeights:
    """Stack E experts' quantized weights once at weight prep -> `ExpertWeights` (E, N, K) + scales.

    `ws`: a list of `engine.formats.QTensor` (``e4m3:128x128``, or ``e4m3:channel``) or
    ``(data (N, K) float8_e4m3fn, scale)`` pairs with scale (ceil(N/128), ceil(K/128)) or (N,) / (N, 1).
    """
    if len(ws) == 0:
        raise ValueError("stack_expert_weights: got an empty list of expert weights")
    datas, scales = [], []
    for i, w in enumerate(ws):
        data, scale = (w.data, w.scale) if hasattr(w, "spec") else w
        if data.dtype != FP8 or data.dim() != 2:
            raise ValueError(f"expert {i}: weight data must be a 2-D float8_e4m3fn (N, K) tensor, "
                             f"got {tuple(data.shape)} {data.dtype}; quantize it with 'e4m3:128x128' first")
        n, k = data.shape
        grid = (math.ceil(n / GROUP), math.ceil(k / GROUP))
        if tuple(scale.shape) == grid:
            scales.append(scale.float())
        elif scale.numel() == n and scale.shape[0] == n:
            scales.append(scale.float().reshape(n))
        else:
            raise ValueError(f"expert {i}: weight scale shape {tuple(scale.shape)} is neither the 128x128 block "
                             f"grid {grid} nor per-channel ({n},) for data {tuple(data.shape)}")
        datas.append(data)
    if len({tuple(d.shape) for d in datas}) != 1 or len({tuple(s.shape) for s in scales}) != 1:
        raise ValueError(f"stack_expert_weights: experts differ in shape: {sorted({tuple(d.shape) for d in datas})}")
    return ExpertWeights(torch.stack(datas).contiguous(), torch.stack(scales).contiguous())


def _dequant_weights(w: ExpertWeights) -> torch.Tensor:
    """fp32 values (E, N, K) of stacked expert weights (block or per-channel scales)."""
    e, n, k = w.data.shape
    if not w.blockwise:
        return w.data.float() * w.scale[:, :, None]
    s = w.scale.repeat_interleave(GROUP, 1).repeat_interleave(GROUP, 2)[:, :n, :k]  # (E, N, K)
    return w.data.float() * s


def rowwise_expert_weights(w: ExpertWeights) -> ExpertWeights:
    """128x128 block-scaled expert weights -> per-output-channel E4M3 (for ``mode="rowwise"``); run once at prep.

    Each expert is dequantized to fp32 (``data * block scale``) and every output
    channel (a row of the (N, K) weight) is requantized with the library's
    ``e4m3:channel`` quantizer: ``scale = amax(row) / 448``. A different format
    from the recipe's 128x128 tiles (one more rounding of every weight).
    """
    if not w.blockwise:
        return w
    from engine.formats import quantize

    e, n, k = w.data.shape
    q = quantize(_dequant_weights(w).reshape(e * n, k), "e4m3:channel")  # row-local: all experts at once
    return ExpertWeights(q.data.reshape(e, n, k).contiguous(), q.scale.reshape(e, n).float().contiguous())


# --------------------------------------------------------------------------- dispatch
def sort_by_expert(ids: torch.Tensor, num_experts: int) -> SortPlan:
    """Stable sort of the (tokens, k) expert choices by expert, entirely on the device (no host sync).

    Same order as `engine.routing.dispatch_plan`; the segment boundaries stay on the
    device as int32 `offsets` (found by a binary search in the sorted ids), so a
    grouped GEMM can read them without a ``bincount().tolist()``. `ids` must hold
    values in [0, num_experts) (not checked here: checking would need a sync).
    """
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"sort_by_expert: ids must be (tokens, k) int64/int32, got {tuple(ids.shape)} {ids.dtype}")
    n, k = ids.shape
    flat = ids.reshape(-1)  # (tokens*k,)
    sorted_ids, order = torch.sort(flat, stable=True)  # (tokens*k,) each
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)  # (experts+1,): first copy of each expert
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))
    token_rows = inverse.view(n, k).sort(dim=1).values  # (tokens, k), ascending sorted positions
    return SortPlan(order=order, token=order // k, offsets=offsets, inverse=inverse, token_rows=token_rows)


def permute_rows(data: torch.Tensor, scale: torch.Tensor, plan: SortPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather FP8 token rows (tokens, d) and their scales (tokens, G) into sorted order (tokens*k, ...), once."""
    rows = data.view(torch.uint8).index_select(0, plan.token).view(data.dtype)  # (tokens*k, d), FP8 bits as bytes
    return rows, scale.index_select(0, plan.token)


def combine(y: torch.Tensor, plan: SortPlan, weights: torch.Tensor) -> torch.Tensor:
    """Scale sorted expert outputs y (tokens*k, d) by the routing weights (tokens, k) and sum per token -> fp32.

    Each token's copies are summed in ascending sorted position starting from 0,
    the order of the emulation's ``index_add_`` on CPU (deterministic, no atomics).
    """
    n, k = plan.token_rows.shape
    d = y.shape[1]
    out = torch.empty(n, d, device=y.device, dtype=torch.float32)
    if n == 0 or d == 0:
        return out.zero_()
    w = weights.float().contiguous().reshape(-1)  # (tokens*k,)
    bt, bd = 16, 128
    _combine_kernel[(triton.cdiv(n, bt), triton.cdiv(d, bd))](y, plan.token_rows, plan.order, w, out, n, d,
                                                             TOPK=k, BT=bt, BD=bd, num_warps=4)
    return out


def combine_reference(y: torch.Tensor, plan: SortPlan, weights: torch.Tensor) -> torch.Tensor:
    """`combine` in torch: the emulation's ``index_add_`` of ``fp32(y) * w[order]`` (tokens, d) fp32."""
    n = plan.token_rows.shape[0]
    yw = y.float() * weights.float().reshape(-1)[plan.order, None]  # (tokens*k, d)
    return torch.zeros(n, y.shape[1], device=y.device).index_add_(0, plan.token, yw)


# --------------------------------------------------------------------------- grouped GEMMs
def _default_config(rows: int, experts: int, n: int) -> dict:
    """Tile config of the block grouped GEMM from the mean rows per expert (small segments -> BM 64)."""
    if rows <= 96 * experts:
        return dict(BM=64, BN=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=4)


def tile_map(offsets: torch.Tensor, rows: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Device map from m-tile to expert for a grouped launch: (tile_expert, tile_start, max_tiles).

    Expert e owns ``ceil(count_e / bm)`` tiles starting at ``tile_start[e]``; tiles past the
    last real one map to expert E. `max_tiles` is a host-side upper bound (from shapes only).
    """
    e = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]  # (experts,)
    tiles = (counts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0, dtype=torch.int32)
    max_tiles = max(1, min(rows, (rows + e * (bm - 1)) // bm))
    t = torch.arange(max_tiles, device=offsets.device, dtype=torch.int32)
    tile_expert = torch.searchsorted(tile_end, t, right=True, out_int32=True)  # (max_tiles,)
    return tile_expert, (tile_end - tiles).contiguous(), max_tiles


def grouped_gemm_block(a: torch.Tensor, a_scale: torch.Tensor, w: ExpertWeights, offsets: torch.Tensor, *,
                       out_dtype: torch.dtype = torch.bfloat16, config: Optional[dict] = None,
                       tiles: Optional[tuple] = None) -> torch.Tensor:
    """Grouped blockwise FP8 GEMM: rows offsets[e]:offsets[e+1] of a (M, K) times expert e's (N, K)^T -> (M, N).

    a: float8_e4m3fn (M, K) sorted by expert, a_scale fp32 (M, ceil(K/128)) 1x128 scales;
    w: block-scaled `ExpertWeights` (E, N, K); offsets: (E+1,) int32 on the device.
    Rows outside [offsets[0], offsets[E]) are left unwritten. Reference: `grouped_gemm_reference`.
    """
    m, k = a.shape
    e, n, kw = w.data.shape
    if kw != k or not w.blockwise or a.dtype != FP8 or a_scale.shape != (m, math.ceil(k / GROUP)):
        raise ValueError(f"grouped_gemm_block: a {tuple(a.shape)} {a.dtype} / a_scale {tuple(a_scale.shape)} do not "
                         f"fit weights {tuple(w.data.shape)} with scales {tuple(w.scale.shape)} "
                         f"(need FP8 a (M, K), a_scale (M, ceil(K/128)), 128x128 block weight scales)")
    cfg = dict(_default_config(m, e, n) if config is None else config)
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    tile_expert, tile_start, max_tiles = tiles if tiles is not None else tile_map(offsets, m, bm)
    grid = (max_tiles * triton.cdiv(n, bn),)
    _grouped_gemm_block_kernel[grid](a, a_scale.contiguous(), w.data, w.scale, out, offsets, tile_expert, tile_start,
                                     n, k, e, max_tiles, a_scale.shape[1], w.scale.shape[1], w.scale.shape[2],
                                     BM=bm, BN=bn, GROUP_M=cfg.pop("GROUP_M", 8), EVEN_K=(k % GROUP == 0), **cfg)
    return out


@functools.lru_cache(maxsize=None)
def _rowwise_grouped_mm() -> Callable:
    """The row-wise FP8 grouped GEMM of this torch, feature-detected (2.11 and 2.13 both have one of these).

    Prefers ``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=..., out_dtype=...)``
    (its schema is checked for an ``offs`` argument), else ``F.scaled_grouped_mm`` with
    ``ScalingType.RowWise``. Both take `offs` = the (E,) int32 *end* offsets of the groups.
    """
    op = getattr(torch.ops.aten, "_scaled_grouped_mm", None)
    if op is not None and "offs" in [arg.name for arg in op.default._schema.arguments]:
        return lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    scaling = getattr(F, "ScalingType", None)
    if hasattr(F, "scaled_grouped_mm") and scaling is not None:
        return lambda a, b, sa, sb, offs: F.scaled_grouped_mm(a, b, sa, scaling.RowWise, sb, scaling.RowWise,
                                                              offs=offs, output_dtype=torch.bfloat16)
    raise RuntimeError(f"torch {torch.__version__} has neither torch._scaled_grouped_mm nor "
                       "F.scaled_grouped_mm: use mode='block' (Triton) for the MoE experts")


def grouped_gemm_rowwise(a: torch.Tensor, a_scale: torch.Tensor, w: ExpertWeights,
                         offsets: torch.Tensor) -> torch.Tensor:
    """Row-wise FP8 grouped GEMM (cuBLAS/CUTLASS): a (M, K) fp8 + a_scale (M,) x per-channel w (E, N, K) -> (M, N) bf16.

    Needs K and N multiples of 16 (16-byte row alignment of the FP8 operands and bf16 output).
    """
    m, k = a.shape
    e, n, kw = w.data.shape
    if w.blockwise:
        raise ValueError("grouped_gemm_rowwise: weights carry 128x128 block scales; convert them once with "
                         "rowwise_expert_weights() at weight prep")
    if kw != k or k % 16 or n % 16:
        raise ValueError(f"grouped_gemm_rowwise: a {tuple(a.shape)} vs weights {tuple(w.data.shape)}: K and N must "
                         f"match and be multiples of 16 for torch._scaled_grouped_mm; use mode='block' otherwise")
    if m == 0:
        return torch.empty(0, n, device=a.device, dtype=torch.bfloat16)
    return _rowwise_grouped_mm()(a, w.data.transpose(1, 2), a_scale.reshape(m).contiguous(), w.scale,
                                 offsets[1:].contiguous())


def grouped_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, w: ExpertWeights, offsets: torch.Tensor,
                           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp32 GEMM of the dequantized operands per expert segment, rounded to out_dtype -> (M, N) (host sync)."""
    x = _dequant_rows(a, a_scale)
    wd = _dequant_weights(w)
    out = torch.zeros(a.shape[0], w.data.shape[1], device=a.device, dtype=out_dtype)
    bounds = offsets.tolist()
    for e in range(w.data.shape[0]):
        s0, s1 = bounds[e], bounds[e + 1]
        if s1 > s0:
            out[s0:s1] = F.linear(x[s0:s1], wd[e]).to(out_dtype)
    return out


# --------------------------------------------------------------------------- activations
def _dequant_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of FP8 rows (M, K) with 1x128 scales (M, ceil(K/128)) or per-row scales (M,) / (M, 1)."""
    k = data.shape[-1]
    if scale.numel() == data.shape[0]:
        return data.float() * scale.reshape(-1, 1)
    return data.float() * scale.repeat_interleave(GROUP, -1)[..., :k]


def _rowwise_quant_launch(x, xs, u, rows, k, stride_x, stride_u, mode, return_hp):
    """Allocate outputs and launch `_rowwise_quant_kernel`."""
    out = torch.empty(rows, k, device=x.device, dtype=FP8)
    scale = torch.empty(rows, device=x.device, dtype=torch.float32)
    hp = torch.empty(rows, k, device=x.device, dtype=torch.float32) if return_hp else out
    if rows:
        bm = 4
        _rowwise_quant_kernel[(triton.cdiv(rows, bm),)](x, xs, u, out, scale, hp, rows, k, stride_x, stride_u,
                                                        xs.shape[-1] if mode == 0 else 1, MODE=mode, BM=bm, BK=512,
                                                        STORE_HP=return_hp, num_warps=4)
    return (out, scale, hp) if return_hp else (out, scale)


def rowwise_requant(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 1x128 rows (M, K) + scales (M, ceil(K/128)) -> per-token E4M3 (M, K) + scales (M,).

    Bit-exact with the library's ``e4m3:token`` quantization of the dequantized rows.
    """
    m, k = data.shape
    if data.dtype != FP8 or scale.shape != (m, math.ceil(k / GROUP)) or not data.is_contiguous():
        raise ValueError(f"rowwise_requant: want contiguous FP8 data (M, K) and 1x128 scales (M, ceil(K/128)), "
                         f"got {tuple(data.shape)} {data.dtype} and {tuple(scale.shape)}")
    return _rowwise_quant_launch(data, scale.contiguous(), data, m, k, k, 0, 0, False)


def swiglu_rowwise_quant(gate: torch.Tensor, up: torch.Tensor, return_hp: bool = False):
    """silu(gate) * up in fp32 -> per-token E4M3 (M, I) + scales (M,) [+ fp32 activation]; rows may be strided."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"swiglu_rowwise_quant: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be equal "
                         "2-D shapes with unit column stride")
    m, k = gate.shape
    return _rowwise_quant_launch(gate, gate, up, m, k, gate.stride(0), up.stride(0), 1, return_hp)


def swiglu_rowwise_quant_reference(gate: torch.Tensor, up: torch.Tensor):
    """Torch SwiGLU then the library's ``e4m3:token`` quantizer: (data, scales (M,), fp32 activation)."""
    from engine.formats import quantize

    h = F.silu(gate.float()) * up.float()
    q = quantize(h, "e4m3:token")
    return q.data, q.scale.reshape(-1), h


# --------------------------------------------------------------------------- MoE
def _check_moe_inputs(xq_data, xq_scale, w_gate, w_up, w_down, weights, ids) -> tuple[int, int, int, int, int]:
    """Validate shapes (host metadata only, no sync) -> (tokens, d, experts, inter, k)."""
    if xq_data.dim() != 2 or xq_data.dtype != FP8:
        raise ValueError(f"MoE input xq_data must be (tokens, d) float8_e4m3fn, got {tuple(xq_data.shape)} "
                         f"{xq_data.dtype}")
    n, d = xq_data.shape
    if tuple(xq_scale.shape) != (n, math.ceil(d / GROUP)):
        raise ValueError(f"MoE input xq_scale must be the 1x128 scales (tokens, ceil(d/128)) = "
                         f"{(n, math.ceil(d / GROUP))}, got {tuple(xq_scale.shape)}")
    e, inter, _ = w_gate.data.shape
    for name, w, shape in (("w_gate", w_gate, (e, inter, d)), ("w_up", w_up, (e, inter, d)),
                           ("w_down", w_down, (e, d, inter))):
        if tuple(w.data.shape) != shape or w.data.dtype != FP8:
            raise ValueError(f"MoE {name} must be stacked FP8 (E, N, K) = {shape} (see stack_expert_weights), "
                             f"got {tuple(w.data.shape)} {w.data.dtype}")
    if ids.dim() != 2 or ids.shape[0] != n or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"MoE routing: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
                         f"(tokens={n}, k)")
    return n, d, e, inter, ids.shape[1]


def _expert_mlp(xs, ss, w_gate, w_up, w_down, offsets, *, mode, act_quant, out_dtype, config):
    """SwiGLU MLP of sorted rows xs (M, d) FP8 + scales through grouped GEMMs -> (M, d) in out_dtype."""
    if mode == "block":
        cfg = dict(_default_config(xs.shape[0], w_gate.data.shape[0], w_gate.data.shape[1]) if config is None
                   else config)
        tiles = tile_map(offsets, xs.shape[0], cfg["BM"])  # shared by the three GEMMs
        g = grouped_gemm_block(xs, ss, w_gate, offsets, out_dtype=out_dtype, config=cfg, tiles=tiles)
        u = grouped_gemm_block(xs, ss, w_up, offsets, out_dtype=out_dtype, config=cfg, tiles=tiles)
        if act_quant is None:
            from engine.kernels.quant import swiglu_quant

            act_quant = swiglu_quant
        aq, as_ = act_quant(g, u)  # one launch for all experts: 1x128 groups are row-local
        return grouped_gemm_block(aq, as_, w_down, offsets, out_dtype=out_dtype, config=cfg, tiles=tiles)
    g = grouped_gemm_rowwise(xs, ss, w_gate, offsets)
    u = grouped_gemm_rowwise(xs, ss, w_up, offsets)
    aq, as_ = (act_quant or swiglu_rowwise_quant)(g, u)
    return grouped_gemm_rowwise(aq, as_, w_down, offsets)


def _mode_weights(mode: str, out_dtype: torch.dtype, ws: Sequence[ExpertWeights]) -> list[ExpertWeights]:
    """Check the mode / weight-scale combination; rowwise converts block weights (slow: do it at prep)."""
    if mode == "block":
        if not all(w.blockwise for w in ws):
            raise ValueError("mode='block' needs 128x128 block-scaled weights (E, N/128, K/128); got per-channel "
                             "scales: use mode='rowwise' or stack the block-quantized weights")
        return list(ws)
    if mode == "rowwise":
        if out_dtype != torch.bfloat16:
            raise ValueError(f"mode='rowwise': torch._scaled_grouped_mm writes bf16 only, out_dtype={out_dtype}")
        return [rowwise_expert_weights(w) for w in ws]
    raise ValueError(f"MoE mode must be 'block' or 'rowwise', got {mode!r}")


def grouped_fp8_moe(xq_data: torch.Tensor, xq_scale: torch.Tensor, w_gate: ExpertWeights, w_up: ExpertWeights,
                    w_down: ExpertWeights, weights: torch.Tensor, ids: torch.Tensor, *, mode: str = "block",
                    act_quant: Optional[ActQuant] = None, out_dtype: torch.dtype = torch.bfloat16,
                    config: Optional[dict] = None) -> torch.Tensor:
    """Routed-expert SwiGLU MLP, sorted dispatch + grouped FP8 GEMMs -> (tokens, d) fp32. No host sync.

    xq_data (tokens, d) float8_e4m3fn + xq_scale (tokens, ceil(d/128)): the input quantized once
    (``moe.input``, E4M3 1x128); w_gate / w_up (E, inter, d), w_down (E, d, inter): `ExpertWeights`;
    weights (tokens, k) fp32 routing weights, ids (tokens, k) expert ids in [0, E).
    mode: ``"block"`` (Triton, recipe-faithful) or ``"rowwise"`` (``_scaled_grouped_mm``; see the module
    docstring for the format change). act_quant(gate, up) -> (FP8 data, scales): the SwiGLU + quant of the
    intermediate (default: `engine.kernels.quant.swiglu_quant` 1x128 for block, `swiglu_rowwise_quant`
    for rowwise). out_dtype: rounding of every GEMM output (the recipe's ``linear.output``).
    config: block-GEMM tiles dict(BM, BN, GROUP_M, num_warps, num_stages).
    Reference: `grouped_fp8_moe_reference`.
    """
    n, d, e, _, k = _check_moe_inputs(xq_data, xq_scale, w_gate, w_up, w_down, weights, ids)
    w_gate, w_up, w_down = _mode_weights(mode, out_dtype, (w_gate, w_up, w_down))
    if n == 0:
        return torch.zeros(0, d, device=xq_data.device)
    plan = sort_by_expert(ids, e)
    if mode == "rowwise":  # per-token requant before the gather: n rows instead of n*k, same bits
        xq_data, xq_scale = rowwise_requant(xq_data.contiguous(), xq_scale)
    xs, ss = permute_rows(xq_data, xq_scale, plan)  # (tokens*k, d): the one gather
    y = _expert_mlp(xs, ss, w_gate, w_up, w_down, plan.offsets, mode=mode, act_quant=act_quant,
                    out_dtype=out_dtype, config=config)  # (tokens*k, d)
    return combine(y, plan, weights)


def unsorted_fp8_moe(xq_data: torch.Tensor, xq_scale: torch.Tensor, w_gate: ExpertWeights, w_up: ExpertWeights,
                     w_down: ExpertWeights, weights: torch.Tensor, ids: torch.Tensor, *, mode: str = "block",
                     act_quant: Optional[ActQuant] = None, out_dtype: torch.dtype = torch.bfloat16,
                     config: Optional[dict] = None) -> torch.Tensor:
    """The naive dispatch, for comparison only: a Python loop over experts, a boolean mask + gather per expert.

    Same arguments, kernels and result as `grouped_fp8_moe` (each expert runs the same GEMM kernels
    as a one-group launch); only the dispatch differs: one host sync per expert (the mask's
    ``nonzero``), E gathers, E x 3 GEMM launches, and an fp32 ``index_add_`` combine.
    """
    n, d, e, _, k = _check_moe_inputs(xq_data, xq_scale, w_gate, w_up, w_down, weights, ids)
    w_gate, w_up, w_down = _mode_weights(mode, out_dtype, (w_gate, w_up, w_down))
    out = torch.zeros(n, d, device=xq_data.device)
    if mode == "rowwise":
        xq_data, xq_scale = rowwise_requant(xq_data.contiguous(), xq_scale)
    raw = xq_data.view(torch.uint8)
    for ex in range(e):
        tok, slot = torch.nonzero(ids == ex, as_tuple=True)  # host sync: the shape depends on the data
        m = tok.numel()
        if m == 0:
            continue
        xs, ss = raw.index_select(0, tok).view(FP8), xq_scale.index_select(0, tok)
        offs = torch.tensor([0, m], device=xs.device, dtype=torch.int32)
        one = [ExpertWeights(w.data[ex:ex + 1], w.scale[ex:ex + 1]) for w in (w_gate, w_up, w_down)]
        y = _expert_mlp(xs, ss, *one, offs, mode=mode, act_quant=act_quant, out_dtype=out_dtype, config=config)
        out.index_add_(0, tok, y.float() * weights[tok, slot].float()[:, None])
    return out


def grouped_fp8_moe_reference(xq_data: torch.Tensor, xq_scale: torch.Tensor, w_gate: ExpertWeights,
                              w_up: ExpertWeights, w_down: ExpertWeights, weights: torch.Tensor, ids: torch.Tensor,
                              *, mode: str = "block", out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Pure torch, everything dequantized to fp32, in `Numerics.moe`'s order -> (tokens, d) fp32.

    dispatch_plan (host sync) -> gather -> per expert segment fp32 ``F.linear`` rounded to out_dtype
    -> ``silu(g) * u`` -> one library quantization of all segments (``e4m3:1x128``; ``e4m3:token``
    for rowwise) -> down GEMM rounded -> ``* w[order]`` -> ``index_add_`` in fp32. For
    ``mode="rowwise"`` the input is requantized per token and the weights per channel with the
    library first (the same bits as the GPU path's conversions).
    """
    from engine.formats import quantize
    from engine.routing import dispatch_plan

    n, d, e, inter, k = _check_moe_inputs(xq_data, xq_scale, w_gate, w_up, w_down, weights, ids)
    ws = _mode_weights(mode, out_dtype, (w_gate, w_up, w_down))
    wg, wu, wd = (_dequant_weights(w) for w in ws)  # (E, N, K) fp32 each
    x = _dequant_rows(xq_data, xq_scale)  # (tokens, d)
    act_spec = "e4m3:1x128"
    if mode == "rowwise":
        x = quantize(x, "e4m3:token").dequantize()
        act_spec = "e4m3:token"
    out = torch.zeros(n, d, device=xq_data.device)
    if n == 0:
        return out

    def rnd(t: torch.Tensor) -> torch.Tensor:
        """The ``linear.output`` rounding of a GEMM result."""
        return t.to(out_dtype).float()

    plan = dispatch_plan(ids, e)
    xs = x.index_select(0, plan.token)  # (tokens*k, d), expert-contiguous
    segments, start = [], 0
    for ex, count in enumerate(plan.counts):
        if count:
            segments.append((ex, start, count))
            start += count
    acts = [F.silu(rnd(F.linear(xs[s0:s0 + c], wg[ex]))) * rnd(F.linear(xs[s0:s0 + c], wu[ex]))
            for ex, s0, c in segments]  # (count, inter) each
    a_all = quantize(torch.cat(acts), act_spec).dequantize()  # row-local: one quantization of all segments
    y = torch.cat([rnd(F.linear(a_all[s0:s0 + c], wd[ex])) for ex, s0, c in segments])  # (tokens*k, d)
    y = y * weights.float().reshape(-1)[plan.order, None]
    return out.index_add_(0, plan.token, y)
