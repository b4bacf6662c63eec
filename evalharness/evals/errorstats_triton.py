"""Triton kernels: fold one tap's (engine, reference) pair into an `ErrorAccumulator`'s state in two launches.

Same state and same statistics as the pure-torch `evalharness.evals.errorstats.fold_reference` (the
reference these kernels are tested against, tests/evalharness/evals/test_errorstats_triton.py):

* ``_partials_kernel``: P <= MAX_PROGRAMS programs of ITERS blocks of BLOCK elements each (ITERS a power
  of two, both functions of n only, so the summation order, hence every bit, is the same on every GPU)
  stride over the n elements; each loads e and r in their own dtype, works in float64 (non-finite
  engine entries zeroed on both sides) and writes its 8 partials in the state's layout. Its
  histogram of |d| is built per program (``tl.histogram``) and added to an int32 scratch histogram
  with integer atomics (exact, order-free).
* ``_finalize_kernel``: one program adds the P partial rows (fixed order) into the state (maxima for
  the last two entries), adds the scratch histogram into the float64 histogram and zeroes the
  scratch for the next call.

Bins: a float32 log2 estimate of the bin (no float64 transcendental in the kernel), corrected by one
exact comparison against the float64 bin edges (`bin_edges`); the reference bins float64 log10 values,
so the two agree except for an |error| within an ulp or so of an edge.

The scratch buffers (MAX_PROGRAMS x 8 float64 partials, an int32 histogram) are one per device and
reused by every call: kernels of one stream run in order, so calls never overlap.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels import kernel_device_ok
from evalharness.evals.errorlayout import BINS, LOG_HI, LOG_LO, STATE_SIZE

MAX_PROGRAMS = 1024
BINS_P2 = 1024  # register histogram width (a power of two >= BINS); bin BINS_P2 - 1 collects masked lanes
FOLD_DEFAULTS = dict(block=512, num_warps=4)
_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _partials_kernel(e_ptr, r_ptr, n, part_ptr, hist_ptr, edges_ptr, ITERS: tl.constexpr,
                     BLOCK: tl.constexpr, NBINS: tl.constexpr, NBINS_P2: tl.constexpr,
                     LOG_LO: tl.constexpr, BIN_SCALE: tl.constexpr, LOG10_2: tl.constexpr, TINY: tl.constexpr):
    """Program pid folds blocks pid, pid + P, ..., pid + (ITERS - 1) P of BLOCK elements; writes its 8 partials
    (the state layout: <e,e>, <e,r>, <r,r>, <d,d>, sum |d|, finite count, max |d|, max |r|)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    zero = tl.zeros([BLOCK], dtype=tl.float64)
    s_ee, s_er, s_rr, s_dd, s_ad, cnt, m_d, m_r = zero, zero, zero, zero, zero, zero, zero, zero
    hist = tl.zeros([NBINS_P2], dtype=tl.int32)
    for i in range(0, ITERS):
        offs = (i * nprog + pid).to(tl.int64) * BLOCK + lanes
        valid = offs < n
        e = tl.load(e_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        r = tl.load(r_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        finite = (e - e) == 0.0  # False for inf and NaN
        e = tl.where(finite, e, 0.0)
        r = tl.where(finite, r, 0.0)
        d = e - r
        ad = tl.abs(d)
        s_ee += e * e
        s_er += e * r
        s_rr += r * r
        s_dd += d * d
        s_ad += ad
        cnt += tl.where(valid & finite, 1.0, 0.0)
        m_d = tl.maximum(m_d, ad)
        m_r = tl.maximum(m_r, tl.abs(r))
        # Bin of |d|: a float32 log estimate (within a small fraction of a bin), then one exact step against
        # the float64 edges: edges[k] <= |d| < edges[k + 1] (edges[0] = 0, edges[NBINS] = inf).
        pos = (tl.log2(tl.maximum(ad.to(tl.float32), TINY)) * LOG10_2 - LOG_LO) * BIN_SCALE
        k = tl.minimum(tl.maximum(pos, 0.0), NBINS - 1.0).to(tl.int32)
        k = tl.where(ad < tl.load(edges_ptr + k), k - 1, tl.where(ad >= tl.load(edges_ptr + k + 1), k + 1, k))
        k = tl.minimum(tl.maximum(k, 0), NBINS - 1)
        b = tl.where(valid & (ad == ad), k, NBINS_P2 - 1)  # NaN (a NaN reference) and tail lanes: not counted
        hist += tl.histogram(b, NBINS_P2)
    row = part_ptr + pid * 8
    tl.store(row + 0, tl.sum(s_ee, axis=0))
    tl.store(row + 1, tl.sum(s_er, axis=0))
    tl.store(row + 2, tl.sum(s_rr, axis=0))
    tl.store(row + 3, tl.sum(s_dd, axis=0))
    tl.store(row + 4, tl.sum(s_ad, axis=0))
    tl.store(row + 5, tl.sum(cnt, axis=0))
    tl.store(row + 6, tl.max(m_d, axis=0))
    tl.store(row + 7, tl.max(m_r, axis=0))
    bins = tl.arange(0, NBINS_P2)
    tl.atomic_add(hist_ptr + bins, hist, mask=bins < NBINS)


@triton.jit
def _finalize_kernel(part_ptr, nparts, hist_tmp_ptr, state_ptr, hist_ptr,
                     MAX_ROWS: tl.constexpr, ROWS: tl.constexpr, NBINS: tl.constexpr, NBINS_P2: tl.constexpr):
    """One program: state[:6] += column sums of the nparts partial rows, state[6:] = max(state, column
    maxima) (rows in chunks of ROWS, a fixed order); hist += scratch histogram; scratch = 0."""
    cols = tl.arange(0, 8)
    sums = tl.zeros([8], dtype=tl.float64)
    maxs = tl.zeros([8], dtype=tl.float64)
    for start in range(0, MAX_ROWS, ROWS):
        rows = start + tl.arange(0, ROWS)
        tile = tl.load(part_ptr + rows[:, None] * 8 + cols[None, :], mask=(rows < nparts)[:, None], other=0.0)
        sums += tl.sum(tile, axis=0)
        maxs = tl.maximum(maxs, tl.max(tile, axis=0))
    old = tl.load(state_ptr + cols)
    tl.store(state_ptr + cols, tl.where(cols < 6, old + sums, tl.maximum(old, maxs)))
    bins = tl.arange(0, NBINS_P2)
    keep = bins < NBINS
    h = tl.load(hist_tmp_ptr + bins, mask=keep, other=0)
    tl.store(hist_ptr + bins, tl.load(hist_ptr + bins, mask=keep, other=0.0) + h.to(tl.float64), mask=keep)
    tl.store(hist_tmp_ptr + bins, tl.zeros([NBINS_P2], dtype=tl.int32), mask=keep)


def bin_edges(device: torch.device | str = "cpu") -> torch.Tensor:
    """(BINS + 1,) float64: bin k holds edges[k] <= |d| < edges[k + 1]; edges[0] = 0, edges[BINS] = inf,
    edges[k] = 10 ** (LOG_LO + k (LOG_HI - LOG_LO) / BINS) between (the reference's log10 bins)."""
    k = torch.arange(1, BINS, dtype=torch.float64)
    inner = torch.pow(10.0, LOG_LO + k * ((LOG_HI - LOG_LO) / BINS))
    return torch.cat((torch.zeros(1, dtype=torch.float64), inner,
                      torch.full((1,), math.inf, dtype=torch.float64))).to(device)


def _scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partials (MAX_PROGRAMS, 8) float64, histogram (BINS_P2,) int32 zeros, bin edges) of `device`, made once."""
    if device not in _SCRATCH:
        _SCRATCH[device] = (torch.empty(MAX_PROGRAMS, STATE_SIZE, dtype=torch.float64, device=device),
                            torch.zeros(BINS_P2, dtype=torch.int32, device=device), bin_edges(device))
    return _SCRATCH[device]


def fold(e: torch.Tensor, r: torch.Tensor, state: torch.Tensor, hist: torch.Tensor, *,
         block: int | None = None, num_warps: int | None = None) -> None:
    """Fold e, r (n,) contiguous float tensors into `state` (8,) and `hist` (BINS,) float64, in place.

    CUDA tensors (CPU under TRITON_INTERPRET=1), all on one device; no host sync. Tiling knobs
    (`block` elements per step, a power of two; `num_warps`): None takes `FOLD_DEFAULTS`; they change
    the summation order, never the counts. Reference: `evalharness.evals.errorstats.fold_reference`."""
    if not kernel_device_ok(e):
        raise ValueError(f"errorstats fold: the Triton kernels need CUDA tensors (got device {e.device})")
    for name, t, shape, dtype in (("e", e, (e.numel(),), None), ("r", r, (e.numel(),), None),
                                  ("state", state, (STATE_SIZE,), torch.float64), ("hist", hist, (BINS,), torch.float64)):
        if tuple(t.shape) != shape or not t.is_contiguous() or t.device != e.device or (dtype and t.dtype != dtype):
            raise ValueError(f"errorstats fold: {name} must be a contiguous {shape} tensor"
                             f"{f' of {dtype}' if dtype else ''} on {e.device}, got {tuple(t.shape)} {t.dtype} "
                             f"on {t.device}")
    block = FOLD_DEFAULTS["block"] if block is None else block
    num_warps = FOLD_DEFAULTS["num_warps"] if num_warps is None else num_warps
    if block < 16 or block & (block - 1):
        raise ValueError(f"errorstats fold: block={block} must be a power of two >= 16")
    n = e.numel()
    if n == 0:
        return
    parts, hist_tmp, edges = _scratch(e.device)
    # ITERS blocks per program, a power of two (few compiled variants), then as few programs as cover n.
    blocks = triton.cdiv(n, block)
    iters = triton.next_power_of_2(triton.cdiv(blocks, MAX_PROGRAMS))
    programs = triton.cdiv(blocks, iters)
    _partials_kernel[(programs,)](
        e, r, n, parts, hist_tmp, edges, ITERS=iters,
        BLOCK=block, NBINS=BINS, NBINS_P2=BINS_P2, LOG_LO=LOG_LO, BIN_SCALE=BINS / (LOG_HI - LOG_LO),
        LOG10_2=math.log10(2.0), TINY=10.0 ** LOG_LO, num_warps=num_warps)
    _finalize_kernel[(1,)](parts, programs, hist_tmp, state, hist, MAX_ROWS=MAX_PROGRAMS, ROWS=64, NBINS=BINS,
                           NBINS_P2=BINS_P2, num_warps=4)
