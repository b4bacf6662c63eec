"""The Triton decode GEMM kernels on the CPU: tests/interpret_gemm.py's checks in a subprocess under TRITON_INTERPRET=1
(split-K tiles and reduces, the committed DECODE_CONFIGS knob sets, the bf16 epilogue, the M = 1 GEMV), so that CI,
which has no GPU, runs the kernels' index arithmetic against a float64 reference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent / "interpret_gemm.py"


def test_decode_gemm_kernels_under_the_interpreter():
    """Every check prints "ok NAME": a split that drops or repeats a K group, a wrong block's scale, a fused reduce
    that sums in another order than the reduce kernel, or a bf16 epilogue that does not round to nearest even
    fails its check."""
    spec = importlib.util.spec_from_file_location("interpret_gemm", SCRIPT)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)  # the names of the checks the script runs
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in helper.CHECKS:
        assert f"ok {name} " in proc.stdout, proc.stdout
