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
    return x, torch.ones(m, -(-k // 128)), w, torch.ones(-(-n // 128), -(-k // 128))


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
    # 16 programs on the CPU's 4 "SMs": more than 2 per SM, one partial per round trip; unfused: no reduce in-kernel
    assert meta["RED"] == 1
    if fused:
        assert not reduced and args[7] is fresh._COUNTERS[x.device]
    else:
        assert reduced and reduced[0] is args[5] and x.device not in fresh._COUNTERS


@pytest.mark.parametrize("sms, red", [(8, 4), (7, 1), (1000, 4)])
def test_split_k_dispatch_passes_the_burst_rule(fresh, monkeypatch, sms, red):
    """The fused reduce's RED is `reduce_burst` of the launch's splits and program count: 16 programs over 8 SMs
    fit 2 per SM (4 partials per trip), over 7 they do not (1)."""
    kern = _Launch()
    monkeypatch.setattr(fresh, "_fp8_block_gemm_kernel", kern)
    monkeypatch.setattr(fresh, "sm_count", lambda device: sms)
    x, xs, w, ws = _operands()
    fresh.fp8_block_gemm_triton(x, xs, w, ws, out_dtype=torch.float32, split_k=4, block_n=64, num_warps=4,
                                num_stages=3, fused_reduce=True)
    (grid, _, meta), = kern.calls
    assert grid == (4, 1, 4) and meta["RED"] == red


@pytest.mark.parametrize("splits, programs, sms, burst, red", [
    (1, 10, 132, 4, 1), (2, 128, 132, 4, 2), (3, 192, 132, 4, 4), (4, 264, 132, 4, 4), (4, 265, 132, 4, 1),
    (16, 256, 132, 4, 4), (4, 256, 132, 2, 2), (4, 256, 132, 1, 1), (2, 256, 132, 1, 1)])
def test_reduce_burst_rule(monkeypatch, splits, programs, sms, burst, red):
    """Partials per round trip: none to sum without a split; 2 for 2 splits; REDUCE_BURST for more; 1 once the grid
    needs more than 2 programs per SM (the burst's registers could cost one) or when REDUCE_BURST is 1."""
    monkeypatch.setattr(G, "REDUCE_BURST", burst)
    assert G.reduce_burst(splits, programs, sms) == red


def test_unsplit_call_uses_no_counters(fresh, monkeypatch):
    """One K split: no partials, no counters, no reduce, whatever fused_reduce says."""
    kern = _Launch()
    monkeypatch.setattr(fresh, "_fp8_block_gemm_kernel", kern)
    x, xs, w, ws = _operands()
    fresh.fp8_block_gemm_triton(x, xs, w, ws, out_dtype=torch.float32, split_k=1, block_n=64, num_warps=4,
                                num_stages=3, fused_reduce=True)
    (_, _, meta), = kern.calls
    assert meta["FUSED_REDUCE"] is False and meta["USE_PART"] is False and not fresh._COUNTERS


# ------------------------------------------------------------------------------------------ cluster reduce
def test_cluster_knob_falls_back_to_the_counters_off_cuda(fresh, monkeypatch):
    """cluster=True where clusters cannot run (here: the CPU) is the fused reduce: same bits, the normal launch."""
    kern = _Launch()
    monkeypatch.setattr(fresh, "_fp8_block_gemm_kernel", kern)
    monkeypatch.setattr(fresh.cl, "launch", lambda *a, **kw: pytest.fail("no cluster launch off CUDA"))
    x, xs, w, ws = _operands()
    fresh.fp8_block_gemm_triton(x, xs, w, ws, out_dtype=torch.float32, split_k=4, block_n=64, num_warps=4,
                                num_stages=3, fused_reduce=True, cluster=True)
    (grid, _, meta), = kern.calls
    assert grid == (4, 1, 4) and meta["FUSED_REDUCE"] is True and "CLUSTER" not in meta


class _FakeCuda:
    """What `_cluster_ok` reads of an operand on a CUDA device."""
    is_cuda = True
    device = torch.device("cuda", 0)


@pytest.mark.parametrize("splits,bn,ok", [(2, 64, True), (4, 64, True), (8, 16, True), (8, 128, True),
                                          (1, 64, False), (3, 64, False), (16, 64, False), (16, 128, False)])
def test_cluster_rules(monkeypatch, splits, bn, ok):
    """Portable cluster sizes 2 / 4 / 8 only (a single split needs no reduce; 16 is non-portable)."""
    monkeypatch.setattr(G.cl, "supported", lambda index: True)
    assert G._cluster_ok(_FakeCuda(), splits, bn) is ok
    monkeypatch.setattr(G.cl, "supported", lambda index: False)  # before sm_90
    assert G._cluster_ok(_FakeCuda(), splits, bn) is False


def test_cluster_dispatch_passes_every_kernel_argument(fresh, monkeypatch):
    """The cluster launch names every argument of the real kernel (the launcher passes them by position), asks for
    clusters of `splits` CTAs over (N tiles, M tiles) with BN x BM fp32 of reduce region each, and allocates neither
    partials nor counters."""
    calls = []
    monkeypatch.setattr(fresh, "_cluster_ok", lambda x, splits, bn: True)
    monkeypatch.setattr(fresh.cl, "launch", lambda *a, **kw: calls.append((a, kw)))
    x, xs, w, ws = _operands(m=20, n=320, k=1920)
    out = fresh.fp8_block_gemm_triton(x, xs, w, ws, bias=torch.ones(320), out_dtype=torch.bfloat16, split_k=8,
                                      block_n=32, num_warps=4, num_stages=5, cluster=True)
    ((kernel, grid, size, region, args), opts), = calls
    assert kernel is G._fp8_block_gemm_kernel and set(args) == set(kernel.arg_names)
    assert grid == (10, 1) and size == 8 and region == 32 * 32 * 4 and opts == dict(num_warps=4, num_stages=5)
    assert args["CLUSTER"] == 8 and args["groups_per_split"] == 2 and args["n_splits"] == 8
    assert args["out_ptr"] is args["part_ptr"] and args["HAS_BIAS"] is True and args["FUSED_REDUCE"] is False
    assert out.shape == (20, 320) and not fresh._COUNTERS


class _Compiled:
    """Stands in for a Triton CompiledKernel."""

    def __init__(self, shared):
        self.metadata = type("Meta", (), {"shared": shared, "num_warps": 4})()
        self.function, self.name = 1234, "_fp8_block_gemm_kernel"
        self.packed_metadata = (4, 1, shared)

    def _init_handles(self):
        pass


def test_prepare_rewrites_the_launch_metadata_once(monkeypatch):
    """Clusters of `size` CTAs with the kernel's shared memory (rounded to 16 B) plus the region; checked against the
    device's occupancy once per compiled kernel; a cluster that does not fit is a clear error."""
    from engine.kernels import cluster as cl

    asked = []
    monkeypatch.setattr(cl, "_occupancy", lambda fn, shared, size: asked.append((fn, shared, size)) or 7)
    c = _Compiled(51208)
    cl._prepare(c, 4, 4096)
    assert c.packed_metadata == (4, 4, 51216 + 4096) and asked == [(1234, 55312, 4)] and c._engine_max_clusters == 7
    cl._prepare(c, 4, 4096)
    assert len(asked) == 1
    cl._prepare(c, 8, 4096)  # another cluster size: asked again
    assert c.packed_metadata == (4, 8, 55312) and len(asked) == 2
    monkeypatch.setattr(cl, "_occupancy", lambda fn, shared, size: 0)
    with pytest.raises(RuntimeError, match="cluster of 8 CTAs of _fp8_block_gemm_kernel with 232448 B"):
        cl._prepare(_Compiled(228352), 8, 4096)
