"""Decode FP8 block GEMMs written in Gluon (Triton's explicit-layout dialect) for sm_90: a TMA ring, a scale table
in shared memory, asynchronous wgmma.

``out (M, N) = x (M, K) @ w (N, K)^T`` for block-scaled operands (x 1x128, w 128x128, as
:func:`engine.kernels.gemm.fp8_block_linear`) and M <= 64. Program (p, s) owns ``BN`` weight rows over the 128-groups of
K split s (all of K with one split). Two orientations:

* activation rows on the wgmma's M side (64 rows; TMA zero-fills rows >= M) and the weight tile on its N side, so BN
  can be 16, 32 or 64 -- ``fp8_block_gemm_triton(..., whole_k=True)`` (or 2 / 4: 128-groups per pipeline stage), one
  split, no reduce: the default at BM 64 (M 33-64), where all 64 activation rows are real;
* ``swap``: 64 weight rows on the M side and the activation rows on the N side (M rounded up to 8 / 16 / 32 / 64),
  with ``splits`` K splits whose partials the last split of each tile sums (the split-K kernel's fused reduce) --
  ``fp8_block_gemm_triton(..., wgmma=True, split_k=S)``: the H200's BM-16 / BM-32 entries for the Llama-3-8B decode
  shapes, and on sm_90 every decode call (M 2-32) without an entry, planned by
  ``engine.kernels.decode_plan.wgmma_plan``.

The loop:

* GPS weight and activation tiles per stage arrive by TMA into a ring of NS shared-memory stages with one mbarrier
  each; the weight of the first NS stages is requested before the PDL wait (weights are never written by a decode
  step: engine.kernels.pdl's contract), the activation after it;
* all GPS dots of a stage are started asynchronously (each into the registers of the accumulator retired in the
  previous stage) and retired in group order with `warpgroup_mma_wait(GPS - 1 - j)`;
* the per-group scales ``x_scale[m, g] * w_scale[n // 128, g]`` of the program's split are computed once into a
  shared-memory table (at most MAX_GROUPS groups per split) and read per group, never loaded from global memory
  inside the loop.

Numerics: each group's FP8 dot (K = 128, fp32 result) times its scale is added to the fp32 accumulator in group order,
and split partials are summed in split order from zero: on the H200 the output is bit-identical to the split-K Triton
kernel with 64-row tiles and the same K partition, in both orientations (tests/engine/kernels/gemm/test_wgmma.py;
its H200 run: benchmarks/results/h200-2026-11-30/gpu_tests_gemm_wgmma.log).

Which calls take it is `engine.kernels.decode_plan`'s decision (the device's decode entries; `wgmma_plan` at M 2-32,
whole K at M 33-64 on sm_90); the measurements behind that rule are in docs/design/performance.md (Decode GEMMs),
from benchmarks/results/h200-2026-11-30/probe_wgmma_sweep.txt.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

XROWS = 64  # the wgmma M: activation rows per tile (M <= XROWS; TMA zero-fills the rest)
MAX_GROUPS = 128  # 128-groups of K whose scales fit the shared-memory table (K <= 16384)
BLOCK_NS = (16, 32, 64)  # weight rows per program (the wgmma N)


@gluon.jit
def _pdl_enter():
    """griddepcontrol.wait, then launch_dependents (engine.kernels.pdl's `pdl_enter`, in Gluon)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _request(x_desc, w_desc, x_smem, w_smem, bars, i, nch, c0, NS: gl.constexpr, GPS: gl.constexpr,
             WEIGHT: gl.constexpr, ACT: gl.constexpr):
    """TMA the chunk of loop iteration i -- chunk c = c0 + i % nch, 128-groups c * GPS ... c * GPS + GPS - 1
    (c0: the program's K split) -- of the weight and / or activation into stage i % NS (nothing when i >= nch;
    groups past K are zero-filled by TMA). The stage's barrier expects all of the chunk's bytes (set with the weight,
    or with the activation when WEIGHT is off)."""
    st = i % NS
    ok = i < nch
    c = c0 + i % nch
    if WEIGHT:
        mbarrier.expect(bars.index(st), GPS * (w_desc.block_type.nbytes + x_desc.block_type.nbytes), pred=ok)
        for j in gl.static_range(GPS):
            tma.async_copy_global_to_shared(w_desc, [gl.program_id(0) * w_desc.block_type.shape[0],
                                                     (c * GPS + j) * 128], bars.index(st), w_smem.index(st * GPS + j),
                                            pred=ok)
    if ACT:
        for j in gl.static_range(GPS):
            tma.async_copy_global_to_shared(x_desc, [0, (c * GPS + j) * 128], bars.index(st),
                                            x_smem.index(st * GPS + j), pred=ok)


@gluon.jit
def _settled(t):
    """t unchanged, through a side-effecting no-op: the code computing t (reading a retired accumulator) stays
    before the next wgmma, which reuses that accumulator's registers. Without it the compiler sinks those reads
    past the wgmma, must copy the in-flight accumulator, and ptxas then serializes every wgmma (C7514)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [t], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _dot(x_smem, w_smem, i, over, SWAP: gl.constexpr):
    """Start the FP8 dot of buffer i asynchronously into the registers of `over` (retired, not added to): X W^T
    (activation rows on the wgmma's M side), or with SWAP W X^T (weight rows on M, activation rows on N)."""
    if SWAP:
        t = warpgroup_mma(w_smem.index(i), x_smem.index(i).permute((1, 0)), over, use_acc=False, is_async=True)
    else:
        t = warpgroup_mma(x_smem.index(i), w_smem.index(i).permute((1, 0)), over, use_acc=False, is_async=True)
    return t


@gluon.jit
def _add(acc, d, s_smem, g, srow: gl.constexpr, SWAP: gl.constexpr):
    """acc + group g's dot d times its scale row, one scale per activation row (kept before the next wgmma on d's
    registers: `_settled`). srow: the layout of the activation-row axis of acc (SWAP: its columns)."""
    if SWAP:
        r = _settled(acc + d * s_smem.index(g).load(srow)[None, :])
    else:
        r = _settled(acc + d * s_smem.index(g).load(srow)[:, None])
    return r


@gluon.jit
def _chunk(acc, d0, d1, d2, d3, x_smem, w_smem, s_smem, b, g, srow: gl.constexpr, GPS: gl.constexpr,
           SWAP: gl.constexpr):
    """One stage: its GPS dots (buffers b ... b + GPS - 1, groups g ... g + GPS - 1) all started, each over the
    registers of the accumulator d0..d3 retired in the previous stage, then retired in group order with
    wait(GPS - 1 - j) and added to acc times their scales. None stays in flight (ptxas would otherwise serialize
    every wgmma of the kernel: C7514)."""
    t0 = _dot(x_smem, w_smem, b, d0, SWAP)
    t1 = _dot(x_smem, w_smem, b + 1, d1, SWAP)
    if GPS == 4:
        t2 = _dot(x_smem, w_smem, b + 2, d2, SWAP)
        t3 = _dot(x_smem, w_smem, b + 3, d3, SWAP)
    if GPS == 2:
        d0 = warpgroup_mma_wait(1, deps=(t0, ))
        acc = _add(acc, d0, s_smem, g, srow, SWAP)
        d1 = warpgroup_mma_wait(0, deps=(t1, ))
        acc = _add(acc, d1, s_smem, g + 1, srow, SWAP)
    else:
        d0 = warpgroup_mma_wait(3, deps=(t0, ))
        acc = _add(acc, d0, s_smem, g, srow, SWAP)
        d1 = warpgroup_mma_wait(2, deps=(t1, ))
        acc = _add(acc, d1, s_smem, g + 1, srow, SWAP)
        d2 = warpgroup_mma_wait(1, deps=(t2, ))
        acc = _add(acc, d2, s_smem, g + 2, srow, SWAP)
        d3 = warpgroup_mma_wait(0, deps=(t3, ))
        acc = _add(acc, d3, s_smem, g + 3, srow, SWAP)
    return acc, d0, d1, d2, d3


@gluon.jit
def _finish(acc, idx, mask, on, M, N, pid, pid_s, out_ptr, bias_ptr, part_ptr, cnt_ptr, HAS_BIAS: gl.constexpr,
            ROUND_BF16: gl.constexpr, SPLIT: gl.constexpr, RED: gl.constexpr):
    """Store the program's tile acc at out[idx] (+ bias, rounded to bf16 values when asked); with SPLIT, store it as
    split pid_s's partial part[pid_s][idx] instead, and the last split of the tile to arrive at its counter
    cnt_ptr[pid] sums all partials in split order from zero, adds the bias, rounds and stores: the fp32 operations of
    `engine.kernels.splitk._last_split_reduce`, so the bits of the split-K kernel's fused reduce (RED = 1 / 2 / 4
    partials loaded per L2 round trip: `engine.kernels.splitk.reduce_burst`)."""
    if SPLIT:
        mn = M.to(gl.int64) * N
        gl.store(part_ptr + pid_s * mn + idx, acc, mask=mask)
        gl.thread_barrier()  # every thread's partial store happens before the release below
        arrived = gl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        ns = gl.num_programs(1)
        if arrived == ns - 1:
            acc = gl.zeros_like(acc)
            if RED == 1:
                for s in range(ns):  # split order, as the split-K reduce
                    acc += gl.load(part_ptr + s * mn + idx, mask=mask, other=0.0, cache_modifier=".cg")
            else:  # RED partials' loads in flight per L2 round trip, added in split order
                for s0 in range(0, ns, RED):
                    base = part_ptr + s0 * mn + idx
                    p0 = gl.load(base, mask=mask, other=0.0, cache_modifier=".cg")
                    p1 = gl.load(base + mn, mask=mask & (s0 + 1 < ns), other=0.0, cache_modifier=".cg")
                    if RED == 4:
                        p2 = gl.load(base + 2 * mn, mask=mask & (s0 + 2 < ns), other=0.0, cache_modifier=".cg")
                        p3 = gl.load(base + 3 * mn, mask=mask & (s0 + 3 < ns), other=0.0, cache_modifier=".cg")
                    acc += p0
                    if s0 + 1 < ns:
                        acc += p1
                    if RED == 4:
                        if s0 + 2 < ns:
                            acc += p2
                        if s0 + 3 < ns:
                            acc += p3
            _store_out(acc, idx, mask, on, N, out_ptr, bias_ptr, HAS_BIAS, ROUND_BF16)
            gl.store(cnt_ptr + pid, 0)  # ready for the next call (kernels on a stream complete in order)
    else:
        _store_out(acc, idx, mask, on, N, out_ptr, bias_ptr, HAS_BIAS, ROUND_BF16)


@gluon.jit
def _store_out(acc, idx, mask, on, N, out_ptr, bias_ptr, HAS_BIAS: gl.constexpr, ROUND_BF16: gl.constexpr):
    """out[idx] = acc (+ bias[on]), rounded to bf16 values when asked, cast to out's dtype."""
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)
    if ROUND_BF16:  # engine.kernels.quant._round_bf16: nearest bf16, ties to even, NaN kept
        bits = acc.to(gl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        acc = gl.where(acc != acc, acc, r.to(gl.float32, bitcast=True))
    gl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


# M, N, K and the scale strides are not value-specialized: one compiled variant per tile / pipeline / epilogue.
@gluon.jit(do_not_specialize=["M", "N", "K", "groups_per_split", "stride_xsm", "stride_xsg", "stride_wsn",
                              "stride_wsg"])
def _fp8_rows_gemm_kernel(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, bias_ptr, part_ptr, cnt_ptr, M, N, K,
                          groups_per_split, stride_xsm, stride_xsg, stride_wsn, stride_wsg,
                          NS: gl.constexpr, GPS: gl.constexpr, KB_PAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                          ROUND_BF16: gl.constexpr, PDL: gl.constexpr, SPLIT: gl.constexpr = False,
                          SWAP: gl.constexpr = False, RED: gl.constexpr = 4):
    """Grid (cdiv(N, BN), K splits), 4 warps (one warpgroup). See the module docstring.
    Program (pid, pid_s) walks the 128-groups [pid_s * groups_per_split, + groups_per_split) of K (a multiple of
    GPS; all of K with one split)."""
    XR: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    if SWAP:  # weight rows on the wgmma's M side, activation rows on its N side
        gl.static_assert(BN == 64, "SWAP: 64 weight rows (the wgmma M of one warpgroup)")
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, XR, 32])
        srow: gl.constexpr = gl.SliceLayout(0, mma)
        acc_shape: gl.constexpr = (BN, XR)
    else:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN, 32])
        srow: gl.constexpr = gl.SliceLayout(1, mma)
        acc_shape: gl.constexpr = (XR, BN)
    gl.static_assert(GPS == 2 or GPS == 4, "GPS: 2 or 4 groups per stage")
    pid = gl.program_id(0)
    pid_s = gl.program_id(1)
    n0 = pid * BN
    g0 = pid_s * groups_per_split
    ng = gl.minimum(groups_per_split, gl.cdiv(K, 128) - g0)  # this split's groups
    nch = gl.cdiv(ng, GPS)
    c0 = g0 // GPS

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [NS * GPS, XR, 128], x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [NS * GPS, BN, 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(NS):  # weights only before the PDL wait
        _request(x_desc, w_desc, x_smem, w_smem, bars, i, nch, c0, NS, GPS, True, False)
    if PDL:
        _pdl_enter()
    for i in gl.static_range(NS):
        _request(x_desc, w_desc, x_smem, w_smem, bars, i, nch, c0, NS, GPS, False, True)

    # The scale table s[j, m] = x_scale[m, g0 + j] * w_scale[n0 // 128, g0 + j] (0 past the split), in shared memory.
    sl: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, gl.num_warps()], [0, 1])
    gi = gl.arange(0, KB_PAD, layout=gl.SliceLayout(1, sl))
    mi = gl.arange(0, XR, layout=gl.SliceLayout(0, sl))
    g_ok = gi < ng
    xs = gl.load(xs_ptr + mi[None, :] * stride_xsm + (g0 + gi)[:, None] * stride_xsg,
                 mask=g_ok[:, None] & (mi < M)[None, :], other=0.0)
    ws = gl.load(ws_ptr + (n0 // 128) * stride_wsn + (g0 + gi) * stride_wsg, mask=g_ok, other=0.0)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    s_smem = gl.allocate_shared_memory(gl.float32, [KB_PAD, XR], flat, xs * ws[:, None])._reinterpret(
        gl.float32, [KB_PAD, XR], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # row j: s_smem.index(j)

    acc = gl.zeros(acc_shape, gl.float32, mma)
    d0 = gl.zeros(acc_shape, gl.float32, mma)
    d1 = gl.zeros(acc_shape, gl.float32, mma)
    d2 = gl.zeros(acc_shape, gl.float32, mma)
    d3 = gl.zeros(acc_shape, gl.float32, mma)
    gl.thread_barrier()  # the scale table is written

    for i in range(0, nch):  # one warpgroup computes each stage, then refills it
        st = i % NS
        mbarrier.wait(bars.index(st), (i // NS) & 1)
        acc, d0, d1, d2, d3 = _chunk(acc, d0, d1, d2, d3, x_smem, w_smem, s_smem, st * GPS, (i % nch) * GPS, srow,
                                     GPS, SWAP)
        gl.thread_barrier()  # every warp is past this stage's wgmmas before its stage is refilled
        _request(x_desc, w_desc, x_smem, w_smem, bars, i + NS, nch, c0, NS, GPS, True, True)
    for i in gl.static_range(NS):
        mbarrier.invalidate(bars.index(i))

    if SWAP:  # acc (BN, XR): rows are weight rows n, columns activation rows m
        om = gl.arange(0, XR, layout=srow)[None, :]
        on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))[:, None]
    else:  # acc (XR, BN)
        om = gl.arange(0, XR, layout=srow)[:, None]
        on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))[None, :]
    _finish(acc, om.to(gl.int64) * N + on, (om < M) & (on < N), on, M, N, pid, pid_s, out_ptr, bias_ptr, part_ptr,
            cnt_ptr, HAS_BIAS, ROUND_BF16, SPLIT, RED)


# ============================================================================ host side
SMEM_BYTES = 232448  # H100 / H200 shared memory per block (opt-in maximum)
GPS = 2  # 128-groups per pipeline stage (one barrier, one refill per stage), unless the call says 4
BLOCK_N = 64  # weight rows per program, unless the call says
# Pipeline stages by weight rows per program (GPS = 2), unless the call says; the fastest per row count
# (docs/design/performance.md#decode-gemms-m--64).
DEFAULT_STAGES = {16: 8, 32: 8, 64: 6}
# The same with 4 groups per stage.
DEFAULT_STAGES_GPS4 = {16: 4, 32: 4, 64: 3}


def default_stages(block_n: int, gps: int = GPS) -> int:
    """Pipeline stages when the call does not say (they fit the shared memory up to K = 16384)."""
    return (DEFAULT_STAGES if gps == 2 else DEFAULT_STAGES_GPS4).get(block_n, 3)


# Pipeline stages of the swapped kernel (activation rows on the wgmma's N side) when the call does not say: as many as
# keep a program's shared memory (tile ring and scale table) within SWAP_SMEM_BYTES, so that two programs fit on one
# SM (228 KB, 1 KB reserved per program: the next program, or under PDL the next kernel's, starts while one streams),
# and no more than the split has stages of groups (docs/design/performance.md#decode-gemms-m--64;
# benchmarks/results/h200-2026-11-30/probe_wgmma_sweep.txt).
SWAP_SMEM_BYTES = 112 * 1024


def swap_stages(m: int, kb: int, splits: int, gps: int = GPS) -> int:
    """Default pipeline stages of the swapped kernel for M rows and kb 128-groups in `splits` K splits."""
    per = split_plan(kb, splits, gps)[1]
    xr = x_rows(m, True)
    fit = max((s for s in range(2, 64) if smem_bytes(64, s, per, gps, xr) <= SWAP_SMEM_BYTES), default=2)
    return max(2, min(fit, -(-per // gps)))


def _groups_pad(kb: int, gps: int = GPS) -> int:
    """Rows of the scale table: the group count rounded up to whole stages, then to a power of two."""
    n = -(-kb // gps) * gps
    return 1 << (n - 1).bit_length()


def x_rows(m: int, swap: bool = False) -> int:
    """Activation rows of one tile: the wgmma M (64), or with swap the wgmma N: M rounded up to a power of two, at
    least 8."""
    return max(8, 1 << (m - 1).bit_length()) if swap else XROWS


def split_plan(kb: int, splits: int, gps: int = GPS) -> tuple[int, int]:
    """(splits, 128-groups per split) for `splits` K splits asked of kb groups: the groups per split rounded up to
    whole stages (so a split's chunks never reach into the next split's), then the split count that covers kb."""
    per = -(-kb // max(1, min(splits, kb)))
    per = -(-per // gps) * gps
    return -(-kb // per), per


def smem_bytes(block_n: int, stages: int, kb: int, gps: int = GPS, xrows: int = XROWS) -> int:
    """Shared memory of one program walking kb 128-groups: the tile ring, the scale table, the barriers."""
    return stages * gps * (xrows + block_n) * 128 + _groups_pad(kb, gps) * xrows * 4 + stages * 16


def plan_error(m: int, n: int, k: int, block_n: int, stages: int, gps: int = GPS, splits: int = 1,
               swap: bool = False) -> Optional[str]:
    """Why the kernel cannot run this shape / config (None: it can). Device and layout checks are `usable`'s."""
    if not 1 <= m <= XROWS:
        return f"M={m}: 1 <= M <= {XROWS} (the activation rows of one wgmma tile)"
    if n < 1:
        return f"N={n}: at least one weight row"
    if k < 16 or k % 16:
        return f"K={k}: a positive multiple of 16 (TMA rows are 16-byte aligned)"
    if block_n not in BLOCK_NS:
        return f"block_n={block_n}: one of {BLOCK_NS}"
    if swap and block_n != 64:
        return f"block_n={block_n}: swap puts the weight rows on the wgmma M side, which is 64"
    if gps not in (2, 4):
        return f"gps={gps}: 2 or 4 groups per stage"
    if splits < 1:
        return f"splits={splits}: at least 1"
    per = split_plan(-(-k // 128), splits, gps)[1]
    if per > MAX_GROUPS:
        return f"K={k}: at most {MAX_GROUPS} 128-groups per split (the shared-memory scale table)"
    xr = x_rows(m, swap)
    if stages < 2 or smem_bytes(block_n, stages, per, gps, xr) > SMEM_BYTES:
        return (f"num_stages={stages}: 2 <= stages and {smem_bytes(block_n, max(stages, 2), per, gps, xr)} "
                f"bytes of shared memory > {SMEM_BYTES}")
    return None


def _aligned(t: torch.Tensor) -> bool:
    """TMA-able 2-D FP8 rows: contiguous rows, 16-byte aligned base and row stride."""
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def usable(x: torch.Tensor, w: torch.Tensor, block_n: int, stages: int, gps: int = GPS, splits: int = 1,
           swap: bool = False) -> bool:
    """Whether `launch` runs x (M, K) @ w (N, K)^T here: CUDA compute capability 9.0 exactly (wgmma), E4M3
    operands with TMA-able rows, and `plan_error` None."""
    if not (x.is_cuda and w.is_cuda and x.dtype == w.dtype == torch.float8_e4m3fn):
        return False
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        return False
    return _aligned(x) and _aligned(w) and plan_error(x.shape[0], w.shape[0], x.shape[1], block_n, stages,
                                                       gps, splits, swap) is None


def _layout(rows: int):
    """The 128-byte-swizzled shared layout of a (rows, 128) FP8 tile (TMA destination, wgmma operand)."""
    return gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)


def launch(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor, ws: torch.Tensor,
           ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor, round_bf16: bool,
           block_n: int, stages: int, gps: int = GPS, splits: int = 1, swap: bool = False, pdl: bool = True) -> None:
    """out (M, N) = x @ w^T (+ bias; rounded to bf16 values when round_bf16) with `_fp8_rows_gemm_kernel`; the
    caller has checked `usable`. Scales as `engine.kernels.gemm_fp8._launch_fp8` (strides of x_scale (M, Kb) and
    w_scale (Nb, Kb)). splits > 1: K split as `split_plan` says, the splits' partials summed in split order by the
    last split of each tile (the split-K kernel's fused reduce: calls must run in stream order). pdl: the backend's
    `KernelOptions.pdl`."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from engine.kernels import sm_count
    from engine.kernels.splitk import _tile_counters, reduce_burst
    from engine.kernels.pdl import launch_opts

    m, k = x.shape
    n = w.shape[0]
    xr = x_rows(m, swap)
    n_splits, per = split_plan(-(-k // 128), splits, gps)
    grid = (-(-n // block_n), n_splits)
    part = torch.empty((n_splits, m, n), device=x.device, dtype=torch.float32) if n_splits > 1 else out
    cnt = _tile_counters(x.device, grid[0]) if n_splits > 1 else out
    x_desc = TensorDescriptor.from_tensor(x, [xr, 128], _layout(xr))
    w_desc = TensorDescriptor.from_tensor(w, [block_n, 128], _layout(block_n))
    _fp8_rows_gemm_kernel[grid](
        x_desc, w_desc, xs, ws, out, bias if bias is not None else out, part, cnt,
        m, n, k, per, *xs_strides, *ws_strides, NS=stages, GPS=gps, KB_PAD=_groups_pad(per, gps),
        SPLIT=n_splits > 1, SWAP=swap,
        RED=reduce_burst(n_splits, grid[0] * n_splits, sm_count(x.device)),
        HAS_BIAS=bias is not None, ROUND_BF16=round_bf16, num_warps=4, **launch_opts(x, pdl))
