"""The Triton decode GEMM kernels on the CPU: tests/interpret_gemm.py's checks in a subprocess under TRITON_INTERPRET=1
(split-K tiles and reduces, the committed DECODE_CONFIGS knob sets, the bf16 epilogue, the M = 1 GEMV), so that CI,
which has no GPU, runs the kernels' index arithmetic against a float64 reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpret_util import assert_script_checks

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent / "interpret_gemm.py"


def test_decode_gemm_kernels_under_the_interpreter():
    """Every check prints "ok NAME": a split that drops or repeats a K group, a wrong block's scale, a fused reduce
    that sums in another order than the reduce kernel, or a bf16 epilogue that does not round to nearest even
    fails its check."""
    assert_script_checks(SCRIPT)
