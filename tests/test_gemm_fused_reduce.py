"""The fused split-K reduce's host side (CPU): its counter buffer and when a call takes it.

The kernel side is tested on the GPU in test_kernel_knobs_gpu.py: the same bits as the reduce kernel (NaN / Inf
partials included), counters left at zero, a CUDA graph surviving an outgrown counter buffer.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.kernels import gemm as G


@pytest.fixture
def fresh(monkeypatch):
    """Empty counter registries for the test."""
    monkeypatch.setattr(G, "_COUNTERS", {})
    monkeypatch.setattr(G, "_RETIRED", [])
    return G


def test_counters_grow_by_doubling_and_retire_without_freeing(fresh):
    """Large enough: the same zeroed buffer. Too small: a new zeroed one, at least twice as large; the old one
    stays allocated (a CUDA graph captured with it still uses its address)."""
    dev = torch.device("cpu")
    a = fresh._tile_counters(dev, 10)
    assert a.dtype == torch.int32 and a.numel() == 4096 and int(a.abs().sum()) == 0
    assert fresh._tile_counters(dev, 4096) is a
    old = weakref.ref(a)
    del a
    b = fresh._tile_counters(dev, 4097)
    gc.collect()
    assert b.numel() == 8192 and old() is not None and old() is not b
    assert fresh._tile_counters(dev, 5 << 13).numel() == 5 << 13
    assert len(fresh._RETIRED) == 2


class _Launch:
    """Stands in for a Triton kernel: records the grid, arguments and meta of each launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((grid, args, meta))


def _operands(m=3, n=256, k=1024):
    x = torch.zeros(m, k).to(torch.float8_e4m3fn)
    w = torch.zeros(n, k).to(torch.float8_e4m3fn)
    return x, torch.ones(m, k // 128), w, torch.ones(n // 128, k // 128)


@pytest.mark.parametrize("fused", [True, False])
def test_split_k_dispatch(fresh, monkeypatch, fused):
    """4 K splits: fused, one launch with FUSED_REDUCE that gets the shared counters and no reduce kernel; not
    fused, the reduce kernel sums the launch's partials (the same bits, one launch more)."""
    kern, reduced = _Launch(), []
    monkeypatch.setattr(fresh, "_fp8_block_gemm_kernel", kern)
    monkeypatch.setattr(fresh, "_reduce", lambda part, out, *a, **kw: reduced.append(part))
    x, xs, w, ws = _operands()
    fresh.fp8_block_gemm_triton(x, xs, w, ws, out_dtype=torch.float32, split_k=4, block_n=64, num_warps=4,
                                num_stages=3, fused_reduce=fused)
    (grid, args, meta), = kern.calls
    assert grid == (4, 1, 4) and tuple(args[5].shape) == (4, 3, 256)
    assert meta["FUSED_REDUCE"] is fused and meta["USE_PART"] is True
    if fused:
        assert not reduced and args[7] is fresh._COUNTERS[x.device]
    else:
        assert reduced and reduced[0] is args[5] and x.device not in fresh._COUNTERS


def test_unsplit_call_uses_no_counters(fresh, monkeypatch):
    """One K split: no partials, no counters, no reduce, whatever fused_reduce says."""
    kern = _Launch()
    monkeypatch.setattr(fresh, "_fp8_block_gemm_kernel", kern)
    x, xs, w, ws = _operands()
    fresh.fp8_block_gemm_triton(x, xs, w, ws, out_dtype=torch.float32, split_k=1, block_n=64, num_warps=4,
                                num_stages=3, fused_reduce=True)
    (_, _, meta), = kern.calls
    assert meta["FUSED_REDUCE"] is False and meta["USE_PART"] is False and not fresh._COUNTERS
