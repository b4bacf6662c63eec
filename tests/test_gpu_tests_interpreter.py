"""The interpreter-safe GPU tests on the CPU (tests/interpret_gpu_tests.py in a subprocess under TRITON_INTERPRET=1:
paged decode attention, quant kernel and GEMM knobs, the error-statistics fold), and test_rope_kernel.py's own
interpreter tests, so that CI, which has no GPU, runs those Triton kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interpret_util import assert_script_checks

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def test_gpu_tests_under_the_interpreter():
    """Every check prints "ok NAME"; e.g. a paged-decode kernel that mis-handles a split past a short sequence's keys
    reads out of bounds (a crash) or double-counts tiles (a reference mismatch), and one whose layouts disagree
    fails the bit-for-bit comparison."""
    assert_script_checks(HERE / "interpret_gpu_tests.py")


def test_rope_kernel_interpreter_tests():
    """test_rope_kernel.py's tests marked for the interpreter run (they skip unless TRITON_INTERPRET=1) and pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           str(HERE / "test_rope_kernel.py")], capture_output=True, text=True, env=env, timeout=600,
                          cwd=HERE.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed = [line for line in proc.stdout.splitlines() if " passed" in line]
    assert passed and int(passed[-1].split(" passed")[0].split()[-1]) >= 20, proc.stdout[-2000:]
