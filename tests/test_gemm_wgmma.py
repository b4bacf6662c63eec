"""The whole-K Gluon wgmma decode GEMM without a GPU: its shape rules, its dispatch from the GEMM entry points,
and its sm_90 machine code (compiled here, on the CPU, with the Triton wheel's own ptxas).

The machine-code test guards the property the kernel exists for: its tensor-core dots stay asynchronous. If
any instruction read an accumulator while its wgmma is in flight, ptxas would silently serialize every wgmma of
the kernel (info C7514) and the loop would wait for each dot in turn. The kernel's numerics are tested on the
H200 (test_gemm_wgmma_gpu.py).
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

from engine.kernels import gemm as G
from engine.kernels import gemm_wgmma as GW
from tests.test_gemm_fused_reduce import _Launch, _operands


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
    launched, split = [], _Launch()
    monkeypatch.setattr(GW, "usable", lambda *a: True)
    monkeypatch.setattr(GW, "launch", lambda *a: launched.append(a[-3:]))
    monkeypatch.setattr(G, "_fp8_block_gemm_kernel", split)
    monkeypatch.setattr(G, "_fp8_block_gemm_tuned", split)
    x, xs, w, ws = _operands()
    G._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, whole_k=True)
    G._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, block_n=16, num_stages=5,
                  whole_k=2)
    assert launched == [(GW.BLOCK_N, GW.default_stages(GW.BLOCK_N), GW.GPS), (16, 5, 2)] and split.calls == []
    monkeypatch.setattr(GW, "usable", lambda *a: False)
    G._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None, whole_k=True)
    assert len(launched) == 2 and len(split.calls) == 1
    grid, _, meta = split.calls[0]
    assert grid == (256 // 64, 1, 1) and meta["USE_PART"] is False and meta["BN"] == 64


def test_whole_k_from_a_decode_configs_entry(monkeypatch):
    """A DECODE_CONFIGS entry holding the knob sends calls without explicit knobs to the whole-K kernel with the
    entry's tile, stages and groups per stage (the tuner prints every DECODE_KNOBS key, whole_k included)."""
    launched = []
    monkeypatch.setattr(GW, "usable", lambda *a: True)
    monkeypatch.setattr(GW, "launch", lambda *a: launched.append(a[-3:]))
    x, xs, w, ws = _operands(m=8)
    key = (G._device_name(x.device.type, x.device.index), w.shape[0], x.shape[1], 16)
    monkeypatch.setitem(G.DECODE_CONFIGS, key, dict(whole_k=4, block_n=32, num_stages=3))
    G._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), None, torch.float32, None)
    assert launched == [(32, 3, 4)] and "whole_k" in G.DECODE_KNOBS


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


def _compile_sm90(block_n: int, stages: int, gps: int, rotate: bool = False, warp_spec: bool = False,
                  split: bool = False, xrows: int = GW.XROWS, red: int = 4):
    """`_fp8_rows_gemm_kernel` compiled for sm_90 (CUDA 12.x PTX) without a GPU; xrows < 64: the swapped kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = GW._fp8_rows_gemm_kernel
    consts = dict(NS=stages, GPS=gps, KB_PAD=128, HAS_BIAS=True, ROUND_BF16=True, PDL=True, ROTATE=rotate,
                  WS=warp_spec, SPLIT=split, SWAP=xrows < GW.XROWS, TIMES=False, RED=red)

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
        elif a == "t_ptr":
            sig[a] = "*i64"
        else:
            sig[a] = ("*bf16" if a in ("out_ptr", "bias_ptr") else "*fp32") if a.endswith("_ptr") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a.endswith("_ptr") or a == "K"}
    src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                         constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


@pytest.mark.parametrize("block_n, stages, gps, rotate, warp_spec, split, xrows", [
    (16, 4, 4, False, False, False, 64), (32, 4, 4, False, False, False, 64), (64, 3, 4, False, False, False, 64),
    (32, 8, 2, False, False, False, 64), (32, 4, 4, True, False, False, 64), (64, 6, 2, False, True, False, 64),
    (32, 4, 4, True, True, False, 64), (64, 4, 2, False, False, True, 64), (64, 4, 2, False, False, True, 16),
    (64, 3, 4, False, False, True, 8), (64, 6, 2, True, True, True, 32)])
def test_sm90_code_keeps_wgmma_asynchronous(block_n, stages, gps, rotate, warp_spec, split, xrows):
    """ptxas reports no serialized wgmma (C7514) and no injected wait (C7517); the loop starts all of a stage's
    dots before its first wait (`wgmma.wait_group gps - 1`), and the kernel fits the shared memory the host plans
    for. Split: the partial store and the counter's acq_rel arrival are there; swapped (xrows < 64): the weight
    tile is the wgmma's A operand (m64, N = the activation rows)."""
    kernel = _compile_sm90(block_n, stages, gps, rotate, warp_spec, split, xrows)
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
