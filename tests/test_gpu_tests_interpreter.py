"""The GPU tests marked `interpreter`, run on the CPU under the Triton interpreter (a pytest subprocess with
TRITON_INTERPRET=1: the interpreter is chosen when the kernels are decorated), and test_rope_kernel.py's own
interpreter tests, so that CI, which has no GPU, runs the Triton kernels.

tests/conftest.py patches the interpreter there (tests/interpret_util.py: `faithful_floats` makes its bf16 / FP8
casts and dots the GPU's, checked against torch by test_triton_float_semantics.py), so these runs compare FP8 and
bf16 kernel bits with the formats library, as on the GPU: the quant kernels (RMSNorm / residual / SwiGLU + quant,
every tiling, adversarial inputs), the FP8 block and MX GEMMs, flash and paged-decode attention and the FP8 KV
write, the MoE sort / grouped GEMM / row-wise quant, and the error-statistics fold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
GPU_MODULES = ("test_triton_float_semantics.py", "test_kernels_gpu.py", "test_kernel_knobs_gpu.py", "test_gemm_gpu.py",
               "test_attention_gpu.py", "test_moe_gpu.py", "test_errorstats_gpu.py")
MIN_PASSED = 467  # the marked tests at the time of writing (session 18): fewer passing means some stopped running


def _interpreted_pytest(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=HERE.parent)


def _count(summary: str, word: str) -> int:
    m = re.search(rf"(\d+) {word}", summary)
    return int(m.group(1)) if m else 0


def test_gpu_tests_marked_interpreter_pass_on_the_cpu():
    """Every test marked `interpreter` in the GPU modules passes under the interpreter, none of them skips (a skip
    would mean the interpreter could not be patched), and the others are deselected, not run."""
    # ~18 minutes on a 2-core CI machine (session 18): the timeout leaves twice that
    proc = _interpreted_pytest("-m", "interpreter", "-rs", *(str(HERE / m) for m in GPU_MODULES), timeout=3600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    assert _count(summary, "passed") >= MIN_PASSED, summary
    assert _count(summary, "skipped") == 0 and _count(summary, "failed") == 0, out[-4000:]


def test_rope_kernel_interpreter_tests():
    """test_rope_kernel.py's tests marked for the interpreter run (they skip unless TRITON_INTERPRET=1) and pass."""
    proc = _interpreted_pytest(str(HERE / "test_rope_kernel.py"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _count(proc.stdout.strip().splitlines()[-1], "passed") >= 20, proc.stdout[-2000:]
