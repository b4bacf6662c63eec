"""The split-K reduce of engine/kernels/splitk.py: the fused reduce (the last split of each tile sums the partials,
`_last_split_reduce`) gives the bits of the reduce kernel (`_splitk_reduce_kernel`).

* Host side (CPU, no kernel launched): the counter buffer, when a call takes which reduce, the burst rule.
* Kernels: `gpu` + `interpreter` tests also run on CPU tensors under TRITON_INTERPRET=1 (fewer split counts there,
  `by_device`: still full and short bursts of 4 and 2 partials); CUDA graphs need the GPU.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.kernels import gemm as G
from engine.kernels import decode_plan as P
from engine.kernels import gemm_fp8 as GF
from engine.kernels import gemm_mx as GM
from engine.kernels import splitk as SK
from tests.engine.kernels.gemm.common import TOL, Launch, block_operands, randn, rel, same_bits
from tests.engine.kernels.gemm.common import zero_operands as _operands
from tests.support.interpret import INTERPRET, by_device

GEMM_TOL = TOL[torch.float32]


@pytest.fixture
def fresh(monkeypatch):
    """Empty counter registries for the test."""
    monkeypatch.setattr(SK, "_COUNTERS", {})
    monkeypatch.setattr(SK, "_RETIRED", [])


def test_counters_grow_by_doubling_and_retire_without_freeing(fresh):
    """Large enough: the same zeroed buffer. Too small: a new zeroed one, at least twice as large; the old one
    stays allocated (a CUDA graph captured with it still uses its address)."""
    dev = torch.device("cpu")
    a = SK._tile_counters(dev, 10)
    assert a.dtype == torch.int32 and a.numel() == 4096 and int(a.abs().sum()) == 0
    assert SK._tile_counters(dev, 4096) is a
    old = weakref.ref(a)
    del a
    b = SK._tile_counters(dev, 4097)
    gc.collect()
    assert b.numel() == 8192 and old() is not None and old() is not b
    assert SK._tile_counters(dev, 5 << 13).numel() == 5 << 13
    assert len(SK._RETIRED) == 2


@pytest.mark.parametrize("fused", [True, False])
def test_split_k_dispatch(fresh, monkeypatch, fused):
    """4 K splits: fused, one launch with FUSED_REDUCE that gets the shared counters and no reduce kernel; not
    fused, the reduce kernel sums the launch's partials (the same bits, one launch more)."""
    kern, reduced = Launch(), []
    monkeypatch.setattr(GF, "_fp8_block_gemm_kernel", kern)
    monkeypatch.setattr(SK, "_reduce", lambda part, out, *a, **kw: reduced.append(part))
    x, xs, w, ws = _operands()
    G.fp8_block_gemm_triton(x, xs, w, ws, out_dtype=torch.float32, split_k=4, block_n=64, num_warps=4,
                                num_stages=3, fused_reduce=fused)
    (grid, args, meta), = kern.calls
    assert grid == (4, 1, 4) and tuple(args[5].shape) == (4, 3, 256)
    assert meta["FUSED_REDUCE"] is fused and meta["USE_PART"] is True
    # 16 programs on the CPU's 4 "SMs": more than 2 per SM, one partial per round trip; unfused: no reduce in-kernel
    assert meta["RED"] == 1
    if fused:
        assert not reduced and args[7] is SK._COUNTERS[x.device]
    else:
        assert reduced and reduced[0] is args[5] and x.device not in SK._COUNTERS


@pytest.mark.parametrize("sms, red", [(8, 4), (7, 1), (1000, 4)])
def test_split_k_dispatch_passes_the_burst_rule(fresh, monkeypatch, sms, red):
    """The fused reduce's RED is `reduce_burst` of the launch's splits and program count: 16 programs over 8 SMs
    fit 2 per SM (4 partials per trip), over 7 they do not (1)."""
    kern = Launch()
    monkeypatch.setattr(GF, "_fp8_block_gemm_kernel", kern)
    monkeypatch.setattr(P, "sm_count", lambda device: sms)
    monkeypatch.setattr(GF, "sm_count", lambda device: sms)
    x, xs, w, ws = _operands()
    G.fp8_block_gemm_triton(x, xs, w, ws, out_dtype=torch.float32, split_k=4, block_n=64, num_warps=4,
                            num_stages=3, fused_reduce=True)
    (grid, _, meta), = kern.calls
    assert grid == (4, 1, 4) and meta["RED"] == red


@pytest.mark.parametrize("splits, programs, sms, burst, red", [
    (1, 10, 132, 4, 1), (2, 128, 132, 4, 2), (3, 192, 132, 4, 4), (4, 264, 132, 4, 4), (4, 265, 132, 4, 1),
    (16, 256, 132, 4, 4), (4, 256, 132, 2, 2), (4, 256, 132, 1, 1), (2, 256, 132, 1, 1)])
def test_reduce_burst_rule(monkeypatch, splits, programs, sms, burst, red):
    """Partials per round trip: none to sum without a split; 2 for 2 splits; REDUCE_BURST for more; 1 once the grid
    needs more than 2 programs per SM (the burst's registers could cost one) or when REDUCE_BURST is 1."""
    monkeypatch.setattr(SK, "REDUCE_BURST", burst)
    assert SK.reduce_burst(splits, programs, sms) == red


def test_unsplit_call_uses_no_counters(fresh, monkeypatch):
    """One K split: no partials, no counters, no reduce, whatever fused_reduce says."""
    kern = Launch()
    monkeypatch.setattr(GF, "_fp8_block_gemm_kernel", kern)
    x, xs, w, ws = _operands()
    G.fp8_block_gemm_triton(x, xs, w, ws, out_dtype=torch.float32, split_k=1, block_n=64, num_warps=4,
                                num_stages=3, fused_reduce=True)
    (_, _, meta), = kern.calls
    assert meta["FUSED_REDUCE"] is False and meta["USE_PART"] is False and not SK._COUNTERS


# ------------------------------------------------------------------ the kernels
@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("m", by_device([1, 5], [5]))
def test_fp8_gemm_knobs_and_fused_reduce(m):
    """block_n / split_k / warps / stages within tolerance; fused split-K reduce == two-kernel path, bit for bit."""
    n, k = by_device(320, 136), 1152  # K/128 = 9 groups: uneven splits; N not a multiple of 128
    xd, xs, wd, ws = block_operands(m, n, k, seed=10 + m)
    bias = randn(n, seed=12)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
    for bn in (32, 128):
        for split in (1, 4):
            plain = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32, split_k=split,
                                            block_n=bn, num_warps=4, num_stages=3)
            assert rel(plain, ref) < GEMM_TOL, (bn, split)
            fused = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32, split_k=split,
                                            block_n=bn, num_warps=4, num_stages=3, fused_reduce=True)
            assert torch.equal(fused, plain), (bn, split)
    assert int(SK._COUNTERS[xd.device].abs().sum()) == 0  # the last split of each tile reset its counter
    with pytest.raises(ValueError, match="block_n"):
        G.fp8_block_gemm_triton(xd, xs, wd, ws, block_n=48)


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("k, splits", by_device([(2048, (2, 3, 4, 6, 8, 16)), (1152, (5, 9))],
                                             [(1024, (2, 4, 8)), (1152, (3, 5))]))
def test_fused_reduce_bursts_same_bits(monkeypatch, k, splits):
    """The fused reduce loading four, two or one partials per round trip (the kernels' RED, forced through
    `reduce_burst`; on this little CPU grid the rule gives 1) gives the two-kernel path's bits at every split count,
    full bursts (4, 8, 16 splits) and a short last one (2, 3, 5, 6, 9), on the FP8 split-K kernel, and on the MX
    kernel (MXFP8 x MXFP8 and bf16 x NVFP4) at 4, 5 and 9 splits."""
    from engine.formats import quantize

    m, n = 5, 128
    xd, xs, wd, ws = block_operands(m, n, k, seed=k)
    x = randn(m, k, seed=3).to(torch.bfloat16)
    w32 = randn(n, k, seed=4)
    mx_cases = [(quantize(x.float(), "mxfp8"), GM.prepare_mx_weight(quantize(w32, "mxfp8"))),
                (x, GM.prepare_mx_weight(quantize(w32, "nvfp4")))]
    for split in splits:
        assert P._plan_split(m, n, k // 128, 16, 64, xd.device, split)[0] == split
        kw = dict(split_k=split, block_n=64, num_warps=4, num_stages=3, sliced=False)
        plain = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, fused_reduce=False, **kw)
        # the interpreter: 5 splits (short last bursts of 4 and of 2) of the NVFP4 case, whose reduce applies the tensor
        # scale (the MXFP8 one sums as the FP8 kernel's does)
        mx = (mx_cases if split in (4, 5, 9) else []) if not INTERPRET else (mx_cases[1:] if split == 5 else [])
        mx_plain = [GM.mx_linear(a, b, out_dtype=torch.float32, split_k=split, fused_reduce=False) for a, b in mx]
        for burst in (4, 2, 1):
            monkeypatch.setattr(SK, "reduce_burst", lambda splits, programs, sms, r=burst: r)
            fused = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, fused_reduce=True, **kw)
            assert same_bits(fused, plain), (split, burst)
            for (a, b), ref in zip(mx, mx_plain):
                got = GM.mx_linear(a, b, out_dtype=torch.float32, split_k=split, fused_reduce=True)
                assert same_bits(got, ref), (split, burst)


@pytest.mark.gpu
def test_fused_reduce_counters_outgrown_under_a_graph(monkeypatch):
    """A CUDA graph captured with the fused split-K reduce keeps working after a call with more tiles has grown the
    counter buffer: the old buffer is retired, not freed, and every call leaves its counters at zero."""
    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setitem(SK._COUNTERS, dev, torch.zeros(8, dtype=torch.int32, device=dev))
    monkeypatch.setattr(SK, "_RETIRED", [])
    small = weakref.ref(SK._COUNTERS[dev])  # only the module may keep the captured buffer alive
    xd, xs, wd, ws = block_operands(4, 512, 2048, seed=40)  # 8 tiles of 64 rows
    kw = dict(out_dtype=torch.float32, split_k=4, block_n=64, num_warps=4, num_stages=3, fused_reduce=True,
              sliced=False)  # M = 4 with 4 splits would otherwise run the sliced kernel, which has no counters
    want = G.fp8_block_gemm_triton(xd, xs, wd, ws, **kw)
    assert SK._COUNTERS[dev] is small()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = G.fp8_block_gemm_triton(xd, xs, wd, ws, **kw)
    big = block_operands(4, 2048, 2048, seed=41)  # 32 tiles: a new counter buffer
    G.fp8_block_gemm_triton(*big, **kw)
    assert SK._COUNTERS[dev] is not small() and SK._COUNTERS[dev].numel() >= 4096
    assert small() is not None  # retired, not freed: the graph's counters are still this tensor's memory
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    assert int(small().abs().sum()) == 0 and int(SK._COUNTERS[dev].abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 16])
def test_split_k_reduce_with_nan_and_inf_partials(m):
    """NaN / Inf in one split's partial sums (a NaN activation, an Inf activation scale) reach the output through the
    fused reduce exactly as through the reduce kernel; the fused reduce leaves its counters at zero."""
    n, k = 256, 1024
    xd, xs, wd, ws = block_operands(m, n, k, seed=30 + m)
    xd = xd.clone()
    xd[0, 5] = float("nan")  # e4m3fn has a NaN and no Inf: the Inf comes from a scale
    xs = xs.clone()
    xs[m - 1, 6] = float("inf")
    for split in (2, 8):
        kw = dict(out_dtype=torch.float32, split_k=split, block_n=64, num_warps=4, num_stages=3)
        plain = G.fp8_block_gemm_triton(xd, xs, wd, ws, fused_reduce=False, **kw)
        got = G.fp8_block_gemm_triton(xd, xs, wd, ws, fused_reduce=True, **kw)
        assert bool(plain[0].isnan().all()) and not bool(plain[m - 1].isfinite().all())
        torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)
    assert int(SK._COUNTERS[xd.device].abs().sum()) == 0
