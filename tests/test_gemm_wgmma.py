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


def _compile_sm90(block_n: int, stages: int, gps: int, rotate: bool = False, warp_spec: bool = False):
    """`_fp8_rows_gemm_kernel` compiled for sm_90 (CUDA 12.x PTX) without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = GW._fp8_rows_gemm_kernel
    consts = dict(NS=stages, GPS=gps, KB_PAD=128, HAS_BIAS=True, ROUND_BF16=True, PDL=True, ROTATE=rotate,
                  WS=warp_spec)

    def desc(rows):
        return f"tensordesc<fp8e4nv[{rows}, 128],{gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)}>"

    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in ("x_desc", "w_desc"):
            sig[a] = desc(GW.XROWS if a == "x_desc" else block_n)
        else:
            sig[a] = ("*bf16" if a in ("out_ptr", "bias_ptr") else "*fp32") if a.endswith("_ptr") else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a.endswith("_ptr") or a == "K"}
    src = GluonASTSource(fn=fn, signature=sig, attrs=attrs,
                         constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


@pytest.mark.parametrize("block_n, stages, gps, rotate, warp_spec", [
    (16, 4, 4, False, False), (32, 4, 4, False, False), (64, 3, 4, False, False), (32, 8, 2, False, False),
    (32, 4, 4, True, False), (64, 6, 2, False, True), (32, 4, 4, True, True)])
def test_sm90_code_keeps_wgmma_asynchronous(block_n, stages, gps, rotate, warp_spec):
    """ptxas reports no serialized wgmma (C7514) and no injected wait (C7517); the loop starts all of a stage's
    dots before its first wait (`wgmma.wait_group gps - 1`), and the kernel fits the shared memory the host plans
    for."""
    kernel = _compile_sm90(block_n, stages, gps, rotate, warp_spec)
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "C7514" not in res.stderr and "C7517" not in res.stderr, res.stderr
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k32.f32.e4m3.e4m3" in ptx
    first_wait = ptx.index("wgmma.wait_group")
    assert ptx[:first_wait].count("wgmma.commit_group") == gps
    assert f"wgmma.wait_group.sync.aligned {gps - 1};" in ptx
    assert kernel.metadata.shared <= GW.SMEM_BYTES
    assert kernel.metadata.shared >= GW.smem_bytes(block_n, stages, 128, gps) - 1024
