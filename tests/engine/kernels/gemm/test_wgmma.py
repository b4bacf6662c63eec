"""The whole-K / split Gluon wgmma decode GEMM (engine/kernels/gemm_wgmma.py): its shape rules, its dispatch from the
GEMM entry points and its sm_90 machine code without a GPU; its numerics on the H200.

* CPU: shape / stage / split rules, the dispatch (kernels stood in by recorders), and the kernel compiled for sm_90
  with the Triton wheel's own ptxas. The machine-code test guards the property the kernel exists for: its
  tensor-core dots stay asynchronous. If any instruction read an accumulator while its wgmma is in flight, ptxas
  would silently serialize every wgmma of the kernel (info C7514) and the loop would wait for each dot in turn.
* GPU (marker `gpu`, skipped without a CUDA device of compute capability 9.0: wgmma / TMA; no interpreter for
  Gluon): against the fp32 reference and bit for bit against the split-K Triton kernel over the same K partition.
  Tolerances and operands: tests/engine/kernels/gemm/common.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tempfile

import pytest
import torch

from engine.kernels import gemm as G
from engine.kernels import decode_plan as P
from engine.kernels import gemm_fp8 as GF
from engine.kernels import gemm_wgmma as GW
from tests.engine.kernels.gemm.common import TOL, Launch, block_operands, rel
from tests.engine.kernels.gemm.common import zero_operands as _operands

SM90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs a CUDA GPU of compute capability 9.0 (wgmma)")


@pytest.mark.parametrize("args, needle", [
    ((0, 256, 512, 32, 8), "M=0"),
    ((65, 256, 512, 32, 8), "M=65"),
    ((4, 256, 520, 32, 8), "K=520"),
    ((4, 256, 8, 32, 8), "K=8"),
    ((4, 0, 512, 32, 8), "N=0"),
    ((4, 256, 16512, 32, 8), "128-groups"),
    ((4, 256, 512, 48, 8), "block_n=48"),
    ((4, 256, 512, 32, 1), "num_stages=1"),
    ((4, 256, 14336, 32, 17), "shared memory"),
    ((4, 256, 512, 32, 3, 2, 1, True), "swap"),
    ((4, 256, 512, 64, 3, 2, 0), "splits=0"),
    ((4, 256, 32768, 64, 3, 2, 1), "per split"),
])
def test_plan_error_names_the_problem(args, needle):
    """Each unsupported shape / config is refused with a message naming the offending value."""
    msg = GW.plan_error(*args)
    assert msg is not None and needle in msg


def test_plan_limits():
    """The largest accepted configs fit the H200's shared memory; one stage more does not."""
    assert GW.plan_error(64, 4096, 16384, 64, 3) is None
    assert GW.plan_error(4, 256, 512, 32, 4, gps=3) is not None
    for bn in GW.BLOCK_NS:
        ns = max(s for s in range(2, 40) if GW.smem_bytes(bn, s, 128) <= GW.SMEM_BYTES)
        assert GW.plan_error(16, 4096, 16384, bn, ns) is None
        assert GW.plan_error(16, 4096, 16384, bn, ns + 1) is not None
        assert GW.default_stages(bn, 2) <= ns
        assert GW.default_stages(bn, 4) <= max(s for s in range(2, 40) if GW.smem_bytes(bn, s, 128, 4) <= GW.SMEM_BYTES)
    assert [GW._groups_pad(kb, 4) for kb in (1, 2, 3, 32, 33, 112, 127, 128)] == [4, 4, 4, 32, 64, 128, 128, 128]
    assert [GW._groups_pad(kb, 2) for kb in (1, 3, 33)] == [2, 4, 64]


@pytest.mark.parametrize("kb", [1, 2, 7, 9, 12, 112, 128, 256])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 8, 300])
@pytest.mark.parametrize("gps", [2, 4])
def test_split_plan_covers_k_in_whole_stages(kb, splits, gps):
    """Every split but the last walks the same whole number of stages, the last at least one group, no split
    more than asked, and the splits cover the groups exactly once."""
    n, per = GW.split_plan(kb, splits, gps)
    assert 1 <= n <= max(1, min(splits, kb)) and per % gps == 0
    assert (n - 1) * per < kb <= n * per
    if splits == 1:
        assert n == 1


def test_split_and_swap_shrink_the_plan():
    """A K split needs a scale table for its own groups only (K = 32768 runs as 2 splits), and with swap the
    activation tile is M rounded up to 8 / 16 / 32 / 64 rows, so more stages fit."""
    assert GW.plan_error(4, 4096, 32768, 64, 3) is not None
    assert GW.plan_error(4, 4096, 32768, 64, 3, 2, 2) is None
    assert [GW.x_rows(m, True) for m in (1, 8, 9, 16, 17, 33, 64)] == [8, 8, 16, 16, 32, 64, 64]
    assert GW.x_rows(4) == GW.XROWS
    fits = lambda m, swap: max(s for s in range(2, 64) if GW.plan_error(m, 4096, 14336, 64, s, 2, 4, swap) is None)
    assert fits(4, True) > fits(4, False) >= fits(64, True)
    assert GW.smem_bytes(64, 4, 28, 2, 16) == 4 * 2 * 80 * 128 + 32 * 16 * 4 + 4 * 16


def test_whole_k_dispatch(monkeypatch):
    """whole_k=True: one whole-K launch with the default tile, stages and groups per stage, or the given ones,
    and no split-K launch; not usable here: the split-K kernel with one split (grid z = 1), no reduce."""
    launched, split = [], Launch()
    monkeypatch.setattr(GW, "usable", lambda *a: True)
    monkeypatch.setattr(GW, "launch", lambda *a, **kw: launched.append(a[-3:]))
    monkeypatch.setattr(GF, "_fp8_block_gemm_kernel", split)
    x, xs, w, ws = _operands()
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, whole_k=True)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, block_n=16, num_stages=5,
                  whole_k=2)
    assert launched == [(GW.BLOCK_N, GW.default_stages(GW.BLOCK_N), GW.GPS), (16, 5, 2)] and split.calls == []
    monkeypatch.setattr(GW, "usable", lambda *a: False)
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, whole_k=True)
    assert len(launched) == 2 and len(split.calls) == 1
    grid, _, meta = split.calls[0]
    assert grid == (256 // 64, 1, 1) and meta["USE_PART"] is False and meta["BN"] == 64


def test_whole_k_from_a_decode_configs_entry(monkeypatch):
    """A decode entry of the policy holding the knob sends calls without explicit knobs to the whole-K kernel with the
    entry's tile, stages and groups per stage (the tuner prints every DECODE_KNOBS key, whole_k included)."""
    launched = []
    monkeypatch.setattr(GW, "usable", lambda *a: True)
    monkeypatch.setattr(GW, "launch", lambda *a, **kw: launched.append(a[-3:]))
    x, xs, w, ws = _operands(m=8)
    key = (P._device_name(x.device.type, x.device.index), w.shape[0], x.shape[1], 16)
    policy = P.DEFAULT_POLICY.with_configs({key: dict(whole_k=4, block_n=32, num_stages=3)})
    GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, policy=policy)
    assert launched == [(32, 3, 4)] and "whole_k" in P.DECODE_KNOBS


def test_usable_refuses_cpu_tensors():
    """No CUDA device, no whole-K kernel (the caller falls back)."""
    x, _, w, _ = _operands()
    assert GW.usable(x, w, 32, 8) is False


def _ptxas() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(path):
        pytest.skip("the Triton wheel ships no ptxas here")
    return path


def _compile_sm90(block_n: int, stages: int, gps: int, split: bool = False, xrows: int = GW.XROWS, red: int = 4):
    """`_fp8_rows_gemm_kernel` compiled for sm_90 (CUDA 12.x PTX) without a GPU; xrows < 64: the swapped kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = GW._fp8_rows_gemm_kernel
    consts = dict(NS=stages, GPS=gps, KB_PAD=128, HAS_BIAS=True, ROUND_BF16=True, PDL=True, SPLIT=split,
                  SWAP=xrows < GW.XROWS, RED=red)

    def desc(rows):
        return f"tensordesc<fp8e4nv[{rows}, 128],{gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)}>"

    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in ("x_desc", "w_desc"):
            sig[a] = desc(xrows if a == "x_desc" else block_n)
        elif a == "cnt_ptr":
            sig[a] = "*i32"
        else:
            sig[a] = ("*bf16" if a in ("out_ptr", "bias_ptr") else "*fp32") if a.endswith("_ptr") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a.endswith("_ptr") or a == "K"}
    src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                         constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


@pytest.mark.parametrize("block_n, stages, gps, split, xrows", [
    (16, 4, 4, False, 64), (32, 4, 4, False, 64), (64, 3, 4, False, 64), (32, 8, 2, False, 64), (64, 6, 2, False, 64),
    (64, 4, 2, True, 64), (64, 4, 2, True, 16), (64, 3, 4, True, 8), (64, 6, 2, True, 32)])
def test_sm90_code_keeps_wgmma_asynchronous(block_n, stages, gps, split, xrows):
    """ptxas reports no serialized wgmma (C7514) and no injected wait (C7517); the loop starts all of a stage's
    dots before its first wait (`wgmma.wait_group gps - 1`), and the kernel fits the shared memory the host plans
    for. Split: the partial store and the counter's acq_rel arrival are there; swapped (xrows < 64): the weight
    tile is the wgmma's A operand (m64, N = the activation rows)."""
    kernel = _compile_sm90(block_n, stages, gps, split, xrows)
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "C7514" not in res.stderr and "C7517" not in res.stderr, res.stderr
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n if xrows == GW.XROWS else xrows}k32.f32.e4m3.e4m3" in ptx
    assert ("atom.global.gpu.acq_rel.add" in ptx) == split, "the fused reduce's arrival: acq_rel at gpu scope"
    first_wait = ptx.index("wgmma.wait_group")
    assert ptx[:first_wait].count("wgmma.commit_group") == gps
    assert f"wgmma.wait_group.sync.aligned {gps - 1};" in ptx
    assert kernel.metadata.shared <= GW.SMEM_BYTES
    assert kernel.metadata.shared >= GW.smem_bytes(block_n, stages, 128, gps, xrows) - 1024


def test_split_reduce_loads_partials_in_bursts():
    """RED = 2 / 4 (`engine.kernels.gemm.reduce_burst`): the last split's reduce loop loads two / four partials'
    values per step, all before the first add (one L2 round trip per RED splits); RED = 1: one partial per step."""
    per_tile = {}
    for red in (1, 2, 4):
        ptx = _compile_sm90(64, 4, 2, split=True, xrows=8, red=red).asm["ptx"]
        loads = [i for i, line in enumerate(ptx.splitlines()) if "ld.global.cg" in line]
        adds = [i for i, line in enumerate(ptx.splitlines()) if "add.f32" in line and i > loads[0]]
        per_tile[red] = len(loads)
        assert loads[-1] < adds[0], f"RED={red}: a partial is loaded after the reduce's first add"
    assert per_tile[4] == 2 * per_tile[2] == 4 * per_tile[1] > 0, per_tile


# ------------------------------------------------------------------ on the H200
def _captured(fn):
    """(a CUDA graph of fn(), what fn returned while captured), fn warmed up on a side stream first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _graph_replays(run, x_static, eager, x_new, fresh):
    """A CUDA graph of run() (reading x_static) replays eager's bits, twice (its output zeroed before each), and after
    x_new is written into x_static, fresh()'s bits; returns the graph's output."""
    graph, out = _captured(run)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int32), eager.view(torch.int32))
    x_static.copy_(x_new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int32), fresh().view(torch.int32))
    return out


@pytest.fixture
def spy(monkeypatch):
    """The GEMM module, with every launch of the whole-K kernel counted in spy.calls."""
    real = GW.launch
    calls = []

    def counted(*args, **kw):
        calls.append(args[-3:-1])  # (block_n, stages)
        return real(*args, **kw)

    monkeypatch.setattr(GW, "launch", counted)
    monkeypatch.setattr(G, "calls", calls, raising=False)
    return G


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("m", [1, 2, 4, 16, 33, 64])
@pytest.mark.parametrize("nk", [(256, 512), (200, 896), (384, 1040)])  # N % block_n != 0; K % 128 != 0, odd groups
def test_whole_k_matches_reference(spy, m, nk, block_n):
    """Every tile size, M up to 64, partial weight tiles, K not a multiple of 128 (an odd group count: the
    padded extra group must add nothing), bias, fp32 and bf16 output: within the FP8 tensor-core tolerance."""
    n, k = nk
    xd, xs, wd, ws = block_operands(m, n, k, seed=m + n)
    bias = torch.randn(n, device="cuda") * 3
    ref = spy.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
    for dt in (torch.float32, torch.bfloat16):
        out = spy.fp8_block_gemm_triton(xd, xs, wd, ws, bias=bias, out_dtype=dt, whole_k=True, block_n=block_n)
        assert out.shape == (m, n) and out.dtype == dt
        err = rel(out, ref)
        assert err <= TOL[dt], f"M={m} N={n} K={k} block_n={block_n} {dt}: rel err {err:.3e}"
    assert len(spy.calls) == 2 and all(c[0] == block_n for c in spy.calls)


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("m", [4, 16])
@pytest.mark.parametrize("whole_k", [True, 4])
def test_whole_k_same_bits_as_split_k_one(spy, m, whole_k):
    """4096 x 14336 (112 groups, the full scale table): within tolerance, and bit-identical to the split-K Triton
    kernel with one split -- two independent implementations of the same per-group math (the weight on the other
    side of the wgmma, scales from a table, other pipelining) agreeing to the last bit, on every call."""
    xd, xs, wd, ws = block_operands(m, 4096, 14336, seed=3)
    out = spy.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, whole_k=whole_k)
    ref = spy.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    assert rel(out, ref) <= TOL[torch.float32]
    one = spy.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, split_k=1, block_n=64)
    assert torch.equal(out.view(torch.int32), one.view(torch.int32))
    again = spy.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, whole_k=whole_k)
    assert torch.equal(out.view(torch.int32), again.view(torch.int32))
    gps = GW.GPS if whole_k is True else whole_k
    assert len(spy.calls) == 2 and spy.calls[0] == (GW.BLOCK_N, GW.default_stages(GW.BLOCK_N, gps))


@pytest.mark.gpu
@SM90
def test_whole_k_special_values(spy):
    """A zero activation row gives exact zeros; a NaN activation poisons only its own output row; +-448
    everywhere (amax at the format max) stays accurate; rows past M are never written."""
    m, n, k = 5, 256, 640
    xd, xs, wd, ws = block_operands(m, n, k, seed=11)
    xd, xs = xd.clone(), xs.clone()
    xd[0] = 0
    xs[0] = 1.0
    xd[3, 300] = float("nan")
    out = torch.full((m + 3, n), 7.0, device="cuda")
    view = out[:m]  # the kernel's own bounds: rows >= M of the buffer must stay untouched
    GW.launch(xd, xs, xs.stride(), wd, ws, ws.stride(), None, view, False, 32, 3, 2)
    assert torch.equal(view[0], torch.zeros_like(view[0]))
    assert torch.isnan(view[3]).all() and torch.isfinite(view[[0, 1, 2, 4]]).all()
    assert torch.equal(out[m:], torch.full_like(out[m:], 7.0)), "rows >= M must stay untouched"
    good = [0, 1, 2, 4]
    ref = spy.fp8_block_linear_reference(xd[good], xs[good], wd, ws, out_dtype=torch.float32)
    assert rel(view[good], ref) <= TOL[torch.float32]
    g = torch.Generator(device="cuda").manual_seed(3)
    sign = lambda r, c: torch.where(torch.rand(r, c, device="cuda", generator=g) < 0.5, -448.0, 448.0)
    x448, w448 = sign(m, k).to(torch.float8_e4m3fn), sign(n, k).to(torch.float8_e4m3fn)
    s_x, s_w = torch.rand(m, 5, device="cuda", generator=g) + 0.5, torch.rand(2, 5, device="cuda", generator=g) + 0.5
    out = spy.fp8_block_gemm_triton(x448, s_x, w448, s_w, out_dtype=torch.float32, whole_k=True)
    assert torch.isfinite(out).all()
    assert rel(out, spy.fp8_block_linear_reference(x448, s_x, w448, s_w, out_dtype=torch.float32)) <= 2e-3


@pytest.mark.gpu
@SM90
def test_whole_k_round_bf16_and_graph(spy):
    """round_bf16 rounds the fp32 result to bf16 values in the kernel; a CUDA graph (PDL launch where enabled)
    replays the eager bits and follows new activation values written into its static input."""
    m, n, k = 8, 512, 2048
    xd, xs, wd, ws = block_operands(m, n, k, seed=21)
    eager = spy._launch_fp8(xd, xs, xs.stride(), wd, ws, ws.stride(), None, torch.float32, None, whole_k=True)
    rounded = spy._launch_fp8(xd, xs, xs.stride(), wd, ws, ws.stride(), None, torch.float32, None, whole_k=True,
                              round_bf16=True)
    assert torch.equal(rounded, eager.to(torch.bfloat16).float())
    x_static = xd.clone()
    x2, _, _, _ = block_operands(m, n, k, seed=22)
    out = _graph_replays(lambda: spy.fp8_block_gemm_triton(x_static, xs, wd, ws, out_dtype=torch.float32,
                                                           whole_k=True), x_static, eager, x2,
                         lambda: spy.fp8_block_gemm_triton(x2, xs, wd, ws, out_dtype=torch.float32, whole_k=True))
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@SM90
def test_whole_k_falls_back_when_rows_are_not_tma_aligned(spy):
    """Activation rows whose stride is not a multiple of 16 bytes cannot be read by TMA: the call runs the
    split-K kernel with one split instead (no whole-K launch), still within tolerance."""
    m, n, k = 4, 256, 512
    xd, xs, wd, ws = block_operands(m, n, k, seed=5)
    wide = torch.zeros(m, k + 8, device="cuda", dtype=torch.float8_e4m3fn)
    wide[:, :k] = xd
    x_view = wide[:, :k]
    out = spy._launch_fp8(x_view, xs, xs.stride(), wd, ws, ws.stride(), None, torch.float32, None, whole_k=True)
    assert spy.calls == []
    ref = spy.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    assert rel(out, ref) <= TOL[torch.float32]


def _wg(xd, xs, wd, ws, bias=None, dtype=torch.float32, round_bf16=False, block_n=64, stages=3, gps=2, splits=1,
        swap=False, out=None):
    """`gemm_wgmma.launch` into a fresh (M, N) buffer (or out)."""
    out = torch.empty((xd.shape[0], wd.shape[0]), device="cuda", dtype=dtype) if out is None else out
    GW.launch(xd, xs, xs.stride(), wd, ws, ws.stride(), bias, out, round_bf16, block_n, stages, gps, splits=splits,
              swap=swap)
    return out


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("m", [1, 4, 13, 16, 24, 33])
@pytest.mark.parametrize("nk, splits, gps", [((200, 1424), 2, 2), ((384, 4096), 4, 2), ((384, 3072), 3, 4),
                                             ((4096, 14336), 4, 2), ((4096, 14336), 2, 4), ((256, 896), 8, 2),
                                             ((384, 2560), 5, 2), ((256, 2304), 9, 2)])
def test_split_and_swap_same_bits_as_split_k(spy, m, nk, splits, gps, swap):
    """K split across programs (`launch(splits=S)`: partials summed in split order by the last split of each tile),
    with the activation on either side of the wgmma: bit-identical to the split-K Triton kernel with the same K
    partition and its fused reduce -- tails in N and K (an odd group count, a last split shorter than the others),
    bias added and bf16 rounding in the reducing split -- and the same bits again on the next call (the arrival
    counters were left zeroed). (256, 896): 7 groups asked for 8 splits, planned as 4 splits of 2; 5 and 9 splits:
    the reduce's last four-partial burst (`engine.kernels.gemm.REDUCE_BURST`) ends short."""
    n, k = nk
    kb = -(-k // 128)
    s_eff, per = GW.split_plan(kb, splits, gps)
    assert s_eff <= splits and per % gps == 0 and (s_eff - 1) * per < kb <= s_eff * per
    assert -(-kb // s_eff) == per, "the case must have a split-K partition to compare with"
    xd, xs, wd, ws = block_operands(m, n, k, seed=m + n + splits)
    bias = torch.randn(n, device="cuda") * 3
    for round_bf16 in (False, True):
        out = _wg(xd, xs, wd, ws, bias, round_bf16=round_bf16, splits=splits, gps=gps, swap=swap)
        again = _wg(xd, xs, wd, ws, bias, round_bf16=round_bf16, splits=splits, gps=gps, swap=swap)
        assert torch.equal(out.view(torch.int32), again.view(torch.int32))
        ref = spy.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
        assert rel(out, ref) <= TOL[torch.bfloat16 if round_bf16 else torch.float32]
        tri = spy._launch_fp8(xd, xs, xs.stride(), wd, ws, ws.stride(), bias, torch.float32, s_eff, block_n=64,
                              fused_reduce=True, sliced=False, round_bf16=round_bf16)
        assert torch.equal(out.view(torch.int32), tri.view(torch.int32)), (m, n, k, s_eff, swap, round_bf16)


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("swap", [False, True])
def test_split_special_values_and_bounds(spy, swap):
    """Split K: a zero activation row gives exact zeros, a NaN in one split's activation poisons only its own
    output row, rows >= M of the output buffer are never written, and the bf16 output matches the fp32 one rounded."""
    m, n, k = 5, 256, 1024
    xd, xs, wd, ws = block_operands(m, n, k, seed=17)
    xd, xs = xd.clone(), xs.clone()
    xd[0] = 0
    xs[0] = 1.0
    xd[3, 700] = float("nan")  # group 5: the third of 4 splits of 2 groups
    buf = torch.full((m + 3, n), 7.0, device="cuda")
    view = _wg(xd, xs, wd, ws, splits=4, swap=swap, out=buf[:m])
    assert torch.equal(view[0], torch.zeros_like(view[0]))
    assert torch.isnan(view[3]).all() and torch.isfinite(view[[0, 1, 2, 4]]).all()
    assert torch.equal(buf[m:], torch.full_like(buf[m:], 7.0)), "rows >= M must stay untouched"
    bf = _wg(xd, xs, wd, ws, dtype=torch.bfloat16, splits=4, swap=swap)
    good = [0, 1, 2, 4]
    assert torch.equal(bf[good], view[good].to(torch.bfloat16))


@pytest.mark.gpu
@SM90
def test_split_in_a_cuda_graph(spy):
    """A CUDA graph of split calls (the fused reduce's counters captured) replays the eager bits, twice, and follows
    new activations written into its static input."""
    m, n, k = 4, 1024, 4096
    xd, xs, wd, ws = block_operands(m, n, k, seed=31)
    eager = _wg(xd, xs, wd, ws, splits=4, swap=True)
    x_static = xd.clone()
    out = torch.empty_like(eager)
    x2, _, _, _ = block_operands(m, n, k, seed=32)
    _graph_replays(lambda: _wg(x_static, xs, wd, ws, splits=4, swap=True, out=out), x_static, eager, x2,
                   lambda: _wg(x2, xs, wd, ws, splits=4, swap=True))


@pytest.mark.gpu
@SM90
def test_wgmma_entries_dispatch_with_the_split_k_bits(spy, monkeypatch):
    """The H200 entry for 4096x14336 at BM 16 runs the wgmma kernel (4 splits, the rule's stages) at M = 4 and 16 and
    gives the bits the split-K entry before it gave (4 splits of 64-row tiles, fused reduce); wgmma=False alone keeps
    the entry's split count on the split-K kernel, with the same bits again."""
    monkeypatch.setattr(P, "_device_name", lambda *a: "NVIDIA H200")
    for m in (4, 16):
        xd, xs, wd, ws = block_operands(m, 4096, 14336, seed=40 + m)
        out = spy.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
        assert spy.calls[-1] == (64, GW.swap_stages(m, 112, 4))
        old = spy.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, split_k=4, block_n=64,
                                        num_warps=4, num_stages=5, fused_reduce=True, sliced=False)
        assert torch.equal(out.view(torch.int32), old.view(torch.int32))
        n_calls = len(spy.calls)
        off = spy.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, wgmma=False)
        assert len(spy.calls) == n_calls and torch.equal(off.view(torch.int32), old.view(torch.int32))


def _wgmma_entries():
    """The H200's decode entries that select the wgmma kernel (read without touching a device)."""
    return sorted(key for key, knobs in P.DEFAULT_POLICY.decode_configs.items()
                  if key[0] == "NVIDIA H200" and knobs.get("wgmma"))


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("key", _wgmma_entries())
def test_every_wgmma_entry_runs_the_kernel_with_split_k_bits(spy, monkeypatch, key):
    """Each H200 wgmma entry (BM 16 and BM 32), at the top and the bottom M of its tile, launches the Gluon kernel
    with the entry's stages (or `swap_stages`), and gives the bits of the split-K kernel over the same K partition."""
    monkeypatch.setattr(P, "_device_name", lambda *a: "NVIDIA H200")
    _, n, k, bm = key
    knobs = P.DEFAULT_POLICY.decode_configs[key]
    gps = knobs["wgmma"] if knobs["wgmma"] in (2, 4) else GW.GPS
    kb = -(-k // 128)
    s_eff, per = GW.split_plan(kb, knobs["split_k"], gps)
    assert -(-kb // s_eff) == per, "the entry's partition must be one split-K can run"
    for m in (bm, bm // 2 + 1):
        xd, xs, wd, ws = block_operands(m, n, k, seed=m + n + k)
        spy.calls.clear()
        out = spy.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
        assert spy.calls == [(64, knobs.get("num_stages") or GW.swap_stages(m, kb, knobs["split_k"], gps))], key
        tri = spy._launch_fp8(xd, xs, xs.stride(), wd, ws, ws.stride(), None, torch.float32, s_eff, block_n=64,
                              fused_reduce=True, sliced=False, wgmma=False)
        assert torch.equal(out.view(torch.int32), tri.view(torch.int32)), (key, m)


@pytest.mark.gpu
@SM90
@pytest.mark.parametrize("nk", [(1536, 8960), (3584, 4096), (5120, 3072), (8192, 2048), (4096, 7168), (2048, 11008)])
def test_the_wgmma_rule_runs_shapes_without_an_entry(spy, monkeypatch, nk):
    """A decode call (M 2-32) on a shape without a decode entry launches the Gluon kernel with `wgmma_plan`'s
    stages: within TOL of the fp32 reference (bf16 with a bias too), the same bits twice, and the split-K kernel's bits
    where that kernel can run the plan's K partition. A policy with wgmma_rule off: no launch (the split-K
    heuristic)."""
    from engine.kernels import sm_count

    n, k = nk
    kb = -(-k // 128)
    sms = sm_count(torch.device("cuda"))
    for m in (2, 5, 12, 24, 32):
        assert (P._device_name("cuda", torch.cuda.current_device()), n, k, P._tiles(m)[0]) not in \
            P.DEFAULT_POLICY.decode_configs
        splits, gps, stages = P.wgmma_plan(m, n, k, sms)
        xd, xs, wd, ws = block_operands(m, n, k, seed=m + n + k)
        spy.calls.clear()
        out = spy.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
        assert spy.calls == [(64, stages or GW.swap_stages(m, kb, splits, gps))], (nk, m)
        ref = spy.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
        assert rel(out, ref) <= TOL[torch.float32], (nk, m)
        assert torch.equal(out.view(torch.int32), spy.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
                           .view(torch.int32))
        bias = torch.randn(n, device="cuda")
        bf = spy.fp8_block_linear(xd, xs, wd, ws, bias, out_dtype=torch.bfloat16)
        assert rel(bf.float(), ref + bias) <= TOL[torch.bfloat16], (nk, m)
        if -(-kb // splits) == GW.split_plan(kb, splits, gps)[1]:
            tri = spy._launch_fp8(xd, xs, xs.stride(), wd, ws, ws.stride(), None, torch.float32, splits, block_n=64,
                                  fused_reduce=True, sliced=False, wgmma=False)
            assert torch.equal(out.view(torch.int32), tri.view(torch.int32)), (nk, m)
    spy.calls.clear()
    off = spy.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32,
                               policy=dataclasses.replace(P.DEFAULT_POLICY, wgmma_rule=False))
    assert spy.calls == [] and rel(off, ref) <= TOL[torch.float32]
