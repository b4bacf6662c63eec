"""The split-K reduce shared by the FP8, MX and wgmma GEMM kernels, and the operand checks of their wrappers.

A GEMM whose output tiles alone would leave SMs idle splits K over programs; each split writes its fp32 partial
sums (S, M, N), and they are summed in split order, never with atomics, so that a given (shape, device) always
gives the same bits: by `_splitk_reduce_kernel` (a second launch), or by the last split of each output tile, found
with an arrival counter (`_last_split_reduce`, the fused reduce; `_tile_counters` holds the counters). Both load
1, 2 or 4 partials per L2 round trip (`reduce_burst`) and add them in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.kernels.quant import _round_bf16
from engine.kernels.pdl import launch_opts, pdl_enter


GROUP = 128  # edge of the 1x128 / 128x128 scale blocks
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    it: the next kernel to use the counter starts after this one has completed (cheaper than an acq_rel exchange:
    docs/design/performance.md#decode-gemms-m--64)."""
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
# Partials the last split of a tile loads per L2 round trip in the fused reduce (`_sum_partials`; the Gluon kernel's
# `_finish` alike), at most: 4, or 1 (one per loop step). Same bits either way: the adds stay in split
# order. The burst's loads and pointers take registers, so `reduce_burst` loads one partial per trip where a grid
# needs more than 2 programs per SM (docs/design/performance.md#decode-gemms-m--64).
REDUCE_BURST = 4


def reduce_burst(splits: int, programs: int, sms: int) -> int:
    """Partials per L2 round trip of the fused reduce (the kernels' RED) for a grid of `programs` over K `splits`:
    1 without a split, at REDUCE_BURST 1, or when the grid needs more than 2 programs per SM (the burst's registers
    can cost one); else 2 for 2 splits, 4 for more."""
    if splits < 2 or REDUCE_BURST < 2 or programs > 2 * sms:
        return 1
    return 2 if splits == 2 or REDUCE_BURST == 2 else 4


# ============================================================================ launch helpers
def _cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    """a rounded up to a multiple of b."""
    return _cdiv(a, b) * b


def _reduce(part: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor],
            ts: Optional[torch.Tensor], round_bf16: bool = False, pdl: bool = True) -> None:
    """Sum the split-K partials part (S, M, N) into out (M, N) (+ tensor scale, + bias; rounded to bf16 values);
    `pdl`: the backend's `KernelOptions.pdl`."""
    s, m, n = part.shape
    block = 1024
    _splitk_reduce_kernel[(_cdiv(m * n, block),)](
        part, out, bias if bias is not None else out, ts if ts is not None else part, m * n, n, s,
        HAS_BIAS=bias is not None, HAS_TS=ts is not None, BLOCK=block, ROUND_BF16=round_bf16, num_warps=4,
        **launch_opts(part, pdl))


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
