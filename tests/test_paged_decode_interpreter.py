"""The paged FP8 decode kernel on the CPU: its GPU tests' interpreter-safe checks (tests/interpret_paged_decode.py)
in a subprocess under TRITON_INTERPRET=1 -- the tile ranges (unmasked / masked, window, splits past the keys),
both V page layouts and the direct path, exercised in CI where no GPU is."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent / "interpret_paged_decode.py"


def test_paged_decode_kernel_under_the_interpreter():
    """Every check prints "ok NAME"; a kernel that mis-handles a split past a short sequence's keys reads out
    of bounds (a crash) or double-counts tiles (a reference mismatch), and one whose layouts disagree fails
    the bit-for-bit comparison."""
    spec = importlib.util.spec_from_file_location("interpret_paged_decode", SCRIPT)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)  # the names of the checks the script runs
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in helper.CHECKS:
        assert f"ok {name} " in proc.stdout, proc.stdout
