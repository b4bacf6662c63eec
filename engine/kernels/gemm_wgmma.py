"""Decode FP8 block GEMM with no split-K, written in Gluon (Triton's explicit-layout dialect) for sm_90.

``out (M, N) = x (M, K) @ w (N, K)^T`` for block-scaled operands (x 1x128, w 128x128, as
:func:`engine.kernels.gemm.fp8_block_linear`) and M <= 64. Each program owns ``BN`` whole weight rows
over the whole of K, so no program depends on another and there is no split-K reduce. Reached through
``fp8_block_gemm_triton(..., whole_k=True)`` (or ``whole_k=2 / 4``: 128-groups per pipeline stage).

Why it exists: the split-K Triton kernel (`engine.kernels.gemm._fp8_block_gemm_kernel`) spends ~1.8 us of its
~21 us on 4096x14336 at M = 4 / 16 in the reduce between programs (README, sessions 11-12), and one Triton
program cannot stream a whole weight row block fast enough, because each K step waits for its own tensor-core
dot (`wgmma.wait_group 0`) before scaling it. Gluon lets the loop be written out:

* GPS weight tiles (BN, 128) and activation tiles (64, 128) per stage arrive by TMA into a ring of NS
  shared-memory stages with one mbarrier each; the weight of the first NS stages is requested before the PDL
  wait (weights are never written by a decode step: engine.kernels.pdl's contract), the activation after it;
* the activation is on the wgmma's M side (64 rows; TMA zero-fills rows >= M, whose outputs are never stored)
  and the weight tile on its N side, so BN can be 16, 32 or 64;
* all GPS dots of a stage are started asynchronously (each into the registers of the accumulator retired in
  the previous stage) and retired in group order with `warpgroup_mma_wait(GPS - 1 - j)`;
* the per-group scales ``x_scale[m, g] * w_scale[n // 128, g]`` are computed once into a shared-memory table
  (at most MAX_GROUPS groups) and read per group, never loaded from global memory inside the loop.

Numerics: each group's FP8 dot (K = 128, fp32 result) times its scale is added to the fp32 accumulator in group
order: on the H200 the output is bit-identical to the split-K kernel with one split and 64-row tiles
(``split_k=1, block_n=64``), an independent implementation of the same math (tests/test_gemm_wgmma_gpu.py).
``launch(rotate=True)`` starts each program's K walk at its own chunk instead (a different fixed order);
``launch(warp_spec=True)`` moves the TMA refills to a producer warp (`gl.warp_specialize`; same bits).

Where it runs: the decode GEMMs with 33-64 rows (tile BM 64) by default on the H200 (`gemm.WHOLE_K_AT_BM64`),
where its 64 activation rows are all real and split-K's partials cost up to a quarter of the weight's bytes:
1.04x the best of every variant tried over 21 shapes in CUDA graphs, against 1.44x for the split rule; Llama-3-8B
batch-64 decode step 6.00 -> 4.71 ms (benchmarks/results/h200-2026-11-30-session14/). At M <= 32 it is opt-in.

Measured at M = 4 / 16 (H200, benchmarks/results/h200-2026-11-30-session13/): correct, but slower than the
split-K default. 4096x14336, one call after a clean L2 flush: 32.8-39.4 us
at M = 4 and 32.0-35.6 at M = 16 (best configs, 64 rows x 2-4 groups per stage) against 20.6-21.5 us for the
split-K kernel; 28672x4096 47-51 us against 32. Under ncu, one program of one warpgroup per SM issues an
instruction every 4.7 cycles with no other warp to switch to (1.03 active warps per scheduler). A 64-row program
streams ~27 GB/s but N / 64 = 64 programs fill only 64 SMs; a 32-row program (128 SMs) streams ~11 GB/s, where
3 TB/s needs ~23 GB/s on every SM. Neither 2 or 4 groups per stage, nor the rotated walk (-1 to -5 us), nor the
producer warp (within +-0.6 us), nor issuing the groups' K=32 wgmma slices round-robin (same bits, same time;
measured, then removed) changes that: the time follows the number of 128-groups a program walks (~0.3 us each),
neither the issue of its loads nor its tensor-core chains. Remaining suspects, untested: the TMA engine's per-SM
throughput on 128-byte-wide boxes (the split-K kernel streams through cp.async instead), and the 64 padded
activation rows each group writes to and reads from shared memory.
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
def _request(x_desc, w_desc, x_smem, w_smem, bars, i, start, nch, NS: gl.constexpr, GPS: gl.constexpr,
             WEIGHT: gl.constexpr, ACT: gl.constexpr):
    """TMA the chunk of loop iteration i -- chunk c = (i + start) % nch, 128-groups c * GPS ... c * GPS + GPS - 1 --
    of the weight and / or activation into stage i % NS (nothing when i >= nch; groups past K are zero-filled by
    TMA). The stage's barrier expects all of the chunk's bytes (set with the weight, or with the activation when
    WEIGHT is off)."""
    st = i % NS
    ok = i < nch
    c = (i + start) % nch
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
def _dot(x_smem, w_smem, i, over):
    """Start the FP8 dot of buffer i asynchronously into the registers of `over` (retired, not added to)."""
    return warpgroup_mma(x_smem.index(i), w_smem.index(i).permute((1, 0)), over, use_acc=False, is_async=True)


@gluon.jit
def _add(acc, d, s_smem, g, srow: gl.constexpr):
    """acc + group g's dot d times its scale row (kept before the next wgmma on d's registers: `_settled`)."""
    return _settled(acc + d * s_smem.index(g).load(srow)[:, None])


@gluon.jit
def _chunk(acc, d0, d1, d2, d3, x_smem, w_smem, s_smem, b, g, srow: gl.constexpr, GPS: gl.constexpr):
    """One stage: its GPS dots (buffers b ... b + GPS - 1, groups g ... g + GPS - 1) all started, each over the
    registers of the accumulator d0..d3 retired in the previous stage, then retired in group order with
    wait(GPS - 1 - j) and added to acc times their scales. None stays in flight (ptxas would otherwise serialize
    every wgmma of the kernel: C7514)."""
    t0 = _dot(x_smem, w_smem, b, d0)
    t1 = _dot(x_smem, w_smem, b + 1, d1)
    if GPS == 4:
        t2 = _dot(x_smem, w_smem, b + 2, d2)
        t3 = _dot(x_smem, w_smem, b + 3, d3)
    if GPS == 2:
        d0 = warpgroup_mma_wait(1, deps=(t0, ))
        acc = _add(acc, d0, s_smem, g, srow)
        d1 = warpgroup_mma_wait(0, deps=(t1, ))
        acc = _add(acc, d1, s_smem, g + 1, srow)
    else:
        d0 = warpgroup_mma_wait(3, deps=(t0, ))
        acc = _add(acc, d0, s_smem, g, srow)
        d1 = warpgroup_mma_wait(2, deps=(t1, ))
        acc = _add(acc, d1, s_smem, g + 1, srow)
        d2 = warpgroup_mma_wait(1, deps=(t2, ))
        acc = _add(acc, d2, s_smem, g + 2, srow)
        d3 = warpgroup_mma_wait(0, deps=(t3, ))
        acc = _add(acc, d3, s_smem, g + 3, srow)
    return acc, d0, d1, d2, d3


@gluon.jit
def _consume(acc, d0, d1, d2, d3, x_smem, w_smem, s_smem, ready, empty, nch, start, srow: gl.constexpr,
             NS: gl.constexpr, GPS: gl.constexpr):
    """Warp-specialized consumer (the default partition, one warpgroup): each stage's dots as it arrives, then the
    stage handed back to the producer through its `empty` barrier."""
    for i in range(0, nch):
        st = i % NS
        mbarrier.wait(ready.index(st), (i // NS) & 1)
        acc, d0, d1, d2, d3 = _chunk(acc, d0, d1, d2, d3, x_smem, w_smem, s_smem, st * GPS,
                                     ((i + start) % nch) * GPS, srow, GPS)
        gl.thread_barrier()  # every consumer warp is past this stage's wgmmas
        mbarrier.arrive(empty.index(st))
    return (acc, )


@gluon.jit
def _produce(x_desc, w_desc, x_smem, w_smem, ready, empty, nch, start, NS: gl.constexpr, GPS: gl.constexpr):
    """Warp-specialized producer (one warp): stages NS, NS + 1, ... by TMA, each once the consumer has released
    the stage's previous chunk (the first NS were requested before the partitions forked)."""
    for i in range(NS, nch):
        st = i % NS
        mbarrier.wait(empty.index(st), ((i // NS) - 1) & 1)
        _request(x_desc, w_desc, x_smem, w_smem, ready, i, start, nch, NS, GPS, True, True)


# M, N, K and the scale strides are not value-specialized: one compiled variant per tile / pipeline / epilogue.
@gluon.jit(do_not_specialize=["M", "N", "K", "stride_xsm", "stride_xsg", "stride_wsn", "stride_wsg"])
def _fp8_rows_gemm_kernel(x_desc, w_desc, xs_ptr, ws_ptr, out_ptr, bias_ptr, M, N, K,
                          stride_xsm, stride_xsg, stride_wsn, stride_wsg,
                          NS: gl.constexpr, GPS: gl.constexpr, KB_PAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                          ROUND_BF16: gl.constexpr, PDL: gl.constexpr, ROTATE: gl.constexpr = False,
                          WS: gl.constexpr = False):
    """Grid (cdiv(N, BN),), 4 warps (one warpgroup; WS: plus one producer warp). See the module docstring."""
    XR: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(GPS == 2 or GPS == 4, "GPS: 2 or 4 groups per stage")
    pid = gl.program_id(0)
    n0 = pid * BN
    kb = gl.cdiv(K, 128)
    nch = gl.cdiv(kb, GPS)

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [NS * GPS, XR, 128], x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [NS * GPS, BN, 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bars.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # ROTATE: program p walks the chunks from p % nch on (wrapping), so that the programs do not all read the same
    # activation tile at once (a different, still fixed, summation order per program).
    start = pid % nch if ROTATE else 0
    for i in gl.static_range(NS):  # weights only before the PDL wait
        _request(x_desc, w_desc, x_smem, w_smem, bars, i, start, nch, NS, GPS, True, False)
    if PDL:
        _pdl_enter()
    for i in gl.static_range(NS):
        _request(x_desc, w_desc, x_smem, w_smem, bars, i, start, nch, NS, GPS, False, True)

    # The scale table s[g, m] = x_scale[m, g] * w_scale[n0 // 128, g] (0 outside), in shared memory.
    sl: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, gl.num_warps()], [0, 1])
    gi = gl.arange(0, KB_PAD, layout=gl.SliceLayout(1, sl))
    mi = gl.arange(0, XR, layout=gl.SliceLayout(0, sl))
    g_ok = gi < kb
    xs = gl.load(xs_ptr + mi[None, :] * stride_xsm + gi[:, None] * stride_xsg,
                 mask=g_ok[:, None] & (mi < M)[None, :], other=0.0)
    ws = gl.load(ws_ptr + (n0 // 128) * stride_wsn + gi * stride_wsg, mask=g_ok, other=0.0)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    s_smem = gl.allocate_shared_memory(gl.float32, [KB_PAD, XR], flat, xs * ws[:, None])._reinterpret(
        gl.float32, [KB_PAD, XR], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # row g: s_smem.index(g)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    srow: gl.constexpr = gl.SliceLayout(1, mma)
    acc = gl.zeros((XR, BN), gl.float32, mma)
    d0 = gl.zeros((XR, BN), gl.float32, mma)
    d1 = gl.zeros((XR, BN), gl.float32, mma)
    d2 = gl.zeros((XR, BN), gl.float32, mma)
    d3 = gl.zeros((XR, BN), gl.float32, mma)
    gl.thread_barrier()  # the scale table is written

    if WS:  # a producer warp refills the ring while the warpgroup computes
        acc, = gl.warp_specialize([
            (_consume, (acc, d0, d1, d2, d3, x_smem, w_smem, s_smem, bars, empty, nch, start, srow, NS, GPS)),
            (_produce, (x_desc, w_desc, x_smem, w_smem, bars, empty, nch, start, NS, GPS)),
        ], [1], [40])
    else:  # one warpgroup computes each stage, then refills it
        for i in range(0, nch):
            st = i % NS
            mbarrier.wait(bars.index(st), (i // NS) & 1)
            acc, d0, d1, d2, d3 = _chunk(acc, d0, d1, d2, d3, x_smem, w_smem, s_smem, st * GPS,
                                         ((i + start) % nch) * GPS, srow, GPS)
            gl.thread_barrier()  # every warp is past this stage's wgmmas before its stage is refilled
            _request(x_desc, w_desc, x_smem, w_smem, bars, i + NS, start, nch, NS, GPS, True, True)
    for i in gl.static_range(NS):
        mbarrier.invalidate(bars.index(i))
        mbarrier.invalidate(empty.index(i))

    rows = gl.arange(0, XR, layout=srow)
    cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    if HAS_BIAS:
        acc = acc + gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
    if ROUND_BF16:  # engine.kernels.quant._round_bf16: nearest bf16, ties to even, NaN kept
        bits = acc.to(gl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        acc = gl.where(acc != acc, acc, r.to(gl.float32, bitcast=True))
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


# ============================================================================ host side
SMEM_BYTES = 232448  # H100 / H200 shared memory per block (opt-in maximum)
GPS = 2  # 128-groups per pipeline stage (one barrier, one refill per stage), unless the call says 4
BLOCK_N = 64  # weight rows per program, unless the call says
# Pipeline stages by weight rows per program (GPS = 2), unless the call says. H200, 4096x14336 at M = 4 / 16, one
# call: 64 rows x 2 groups x 6 stages was the fastest config, 39.4 / 34.3 us; 32 rows x 2 x 8: 43.0 / 37.5
# (benchmarks/results/h200-2026-11-30-session13/probe_gemm_wholek_rotate.txt).
DEFAULT_STAGES = {16: 8, 32: 8, 64: 6}
# With 4 groups per stage: 64 x 4 x 3 (38.2 / 35.6 us) and 32 x 4 x 4 (44.1 / 38.0 us), same file.
DEFAULT_STAGES_GPS4 = {16: 4, 32: 4, 64: 3}


def default_stages(block_n: int, gps: int = GPS) -> int:
    """Pipeline stages when the call does not say (they fit the shared memory up to K = 16384)."""
    return (DEFAULT_STAGES if gps == 2 else DEFAULT_STAGES_GPS4).get(block_n, 3)


def _groups_pad(kb: int, gps: int = GPS) -> int:
    """Rows of the scale table: the group count rounded up to whole stages, then to a power of two."""
    n = -(-kb // gps) * gps
    return 1 << (n - 1).bit_length()


def smem_bytes(block_n: int, stages: int, kb: int, gps: int = GPS) -> int:
    """Shared memory of one program: the tile ring, the scale table, the barriers."""
    return stages * gps * (XROWS + block_n) * 128 + _groups_pad(kb, gps) * XROWS * 4 + stages * 16


def plan_error(m: int, n: int, k: int, block_n: int, stages: int, gps: int = GPS) -> Optional[str]:
    """Why the kernel cannot run this shape / config (None: it can). Device and layout checks are `usable`'s."""
    if not 1 <= m <= XROWS:
        return f"M={m}: 1 <= M <= {XROWS} (the activation rows of one wgmma tile)"
    if n < 1:
        return f"N={n}: at least one weight row"
    if k < 16 or k % 16:
        return f"K={k}: a positive multiple of 16 (TMA rows are 16-byte aligned)"
    if block_n not in BLOCK_NS:
        return f"block_n={block_n}: one of {BLOCK_NS}"
    if gps not in (2, 4):
        return f"gps={gps}: 2 or 4 groups per stage"
    if -(-k // 128) > MAX_GROUPS:
        return f"K={k}: at most {MAX_GROUPS} 128-groups (the shared-memory scale table)"
    if stages < 2 or smem_bytes(block_n, stages, -(-k // 128), gps) > SMEM_BYTES:
        return (f"num_stages={stages}: 2 <= stages and {smem_bytes(block_n, max(stages, 2), -(-k // 128), gps)} "
                f"bytes of shared memory > {SMEM_BYTES}")
    return None


def _aligned(t: torch.Tensor) -> bool:
    """TMA-able 2-D FP8 rows: contiguous rows, 16-byte aligned base and row stride."""
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def usable(x: torch.Tensor, w: torch.Tensor, block_n: int, stages: int, gps: int = GPS) -> bool:
    """Whether `launch` runs x (M, K) @ w (N, K)^T here: CUDA compute capability 9.0 exactly (wgmma), E4M3
    operands with TMA-able rows, and `plan_error` None."""
    if not (x.is_cuda and w.is_cuda and x.dtype == w.dtype == torch.float8_e4m3fn):
        return False
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(dev) != (9, 0):
        return False
    return _aligned(x) and _aligned(w) and plan_error(x.shape[0], w.shape[0], x.shape[1], block_n, stages,
                                                       gps) is None


def _layout(rows: int):
    """The 128-byte-swizzled shared layout of a (rows, 128) FP8 tile (TMA destination, wgmma operand)."""
    return gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)


def launch(x: torch.Tensor, xs: torch.Tensor, xs_strides: tuple[int, int], w: torch.Tensor, ws: torch.Tensor,
           ws_strides: tuple[int, int], bias: Optional[torch.Tensor], out: torch.Tensor, round_bf16: bool,
           block_n: int, stages: int, gps: int = GPS, rotate: bool = False, warp_spec: bool = False) -> None:
    """out (M, N) = x @ w^T (+ bias; rounded to bf16 values when round_bf16) with `_fp8_rows_gemm_kernel`; the
    caller has checked `usable`. Scales as `engine.kernels.gemm._launch_fp8` (strides of x_scale (M, Kb) and
    w_scale (Nb, Kb))."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from engine.kernels.pdl import launch_opts

    m, k = x.shape
    n = w.shape[0]
    x_desc = TensorDescriptor.from_tensor(x, [XROWS, 128], _layout(XROWS))
    w_desc = TensorDescriptor.from_tensor(w, [block_n, 128], _layout(block_n))
    _fp8_rows_gemm_kernel[(-(-n // block_n),)](
        x_desc, w_desc, xs, ws, out, bias if bias is not None else out, m, n, k, *xs_strides, *ws_strides,
        NS=stages, GPS=gps, KB_PAD=_groups_pad(-(-k // 128), gps), ROTATE=rotate, WS=warp_spec,
        HAS_BIAS=bias is not None, ROUND_BF16=round_bf16, num_warps=4, **launch_opts(x))
