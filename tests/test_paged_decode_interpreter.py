"""The paged FP8 decode kernel on the CPU: its GPU tests' interpreter-safe checks (tests/interpret_paged_decode.py)
in a subprocess under TRITON_INTERPRET=1 -- the tile ranges (unmasked / masked, window, splits past the keys),
both V page layouts and the direct path, exercised in CI where no GPU is."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpret_util import assert_script_checks

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent / "interpret_paged_decode.py"


def test_paged_decode_kernel_under_the_interpreter():
    """Every check prints "ok NAME"; a kernel that mis-handles a split past a short sequence's keys reads out
    of bounds (a crash) or double-counts tiles (a reference mismatch), and one whose layouts disagree fails
    the bit-for-bit comparison."""
    assert_script_checks(SCRIPT)
