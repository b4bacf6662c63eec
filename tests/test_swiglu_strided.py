"""The SwiGLU+quant kernel on strided gate / up views (the halves of the stacked gate/up GEMM output), on the CPU
under the Triton interpreter in a subprocess (tests/interpret_swiglu_strided.py), plus the wrapper's view logic."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpret_util import assert_script_checks

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent / "interpret_swiglu_strided.py"


def test_swiglu_quant_strided_views_under_the_interpreter():
    """Every check prints "ok NAME": a kernel reading the up half at the gate's offset, or at K instead of the row
    stride, gives other bits than the same kernel on contiguous copies."""
    assert_script_checks(SCRIPT)


def test_row_view_keeps_gemm_halves_in_place_and_copies_the_rest():
    from engine.kernels.quant import _row_view

    y = torch.zeros(3, 1, 512)
    gate, up = y.split([256, 256], dim=-1)
    g2, u2 = _row_view(gate), _row_view(up)
    assert g2.shape == (3, 256) and g2.stride() == (512, 1) and g2.data_ptr() == y.data_ptr()
    assert u2.data_ptr() == y.data_ptr() + 256 * y.element_size()
    cols = _row_view(y[:, 0, 0::2])  # strided columns: copied to contiguous rows
    assert cols.is_contiguous() and cols.data_ptr() != y.data_ptr()
    with pytest.raises(ValueError, match="0-d"):
        _row_view(torch.tensor(1.0))


def test_swiglu_quant_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    from engine.kernels import quant

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    y = torch.zeros(2, 512)
    with pytest.raises(ValueError, match="CUDA"):
        quant.swiglu_quant(y[:, :256], y[:, 256:])
