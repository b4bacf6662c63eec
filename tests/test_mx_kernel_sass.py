"""The MX GEMM's decode loop, compiled for sm_90 on the CPU (Triton's bundled ptxas): a guard on its instruction
count, which its speed follows (session 17: 787-1379 -> 447-500 instructions per 128-column chunk and warp,
2.5-10x faster on the H200, benchmarks/results/h200-2026-11-30-session17/)."""

from __future__ import annotations

import pytest

from benchmarks import sass_loop as S

# measured at session 17 (Triton 3.6): mxfp4 447, nvfp4 500, mxfp8 472 -- about 15% headroom for compiler drift
BOUNDS = {"mxfp4": 520, "nvfp4": 580, "mxfp8": 550}


@pytest.fixture(scope="module", autouse=True)
def _tools():
    if S.triton_tool("ptxas") is None or S.triton_tool("nvdisasm") is None:
        pytest.skip("the Triton wheel ships no ptxas / nvdisasm here")


@pytest.mark.parametrize("kind", sorted(BOUNDS))
def test_mx_decode_loop_stays_lean(kind):
    """The K loop at the decode tile holds <= BOUNDS[kind] instructions, its 8 HGMMAs (4 per 64-column half) among
    them; FP4 weights are decoded by the PRMT table (no fp32 multiply per element: bf16x2 HMUL2 only)."""
    body = S.mx_loop(kind)
    ops = [S.opcode(t) for t in body]
    assert len(body) <= BOUNDS[kind], f"{kind}: {len(body)} instructions in the K loop"
    assert ops.count("HGMMA") == 8
    if kind != "mxfp8":
        assert ops.count("HMUL2") == 32 and ops.count("FMUL") <= 16, (ops.count("HMUL2"), ops.count("FMUL"))


def test_the_guard_sees_the_old_loop():
    """Negative control: the sessions 2-16 path (one gathered scale load per element, `_e2m1_to_f32`) compiled the
    same way is far over the bound, so the bound measures what it claims."""
    body = S.mx_loop("mxfp4", ROW_SCALES=False, FP4_PTX=False, FUSED_REDUCE=False)
    assert len(body) > 2 * BOUNDS["mxfp4"], len(body)
