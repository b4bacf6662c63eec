"""`bench_e2e.py` with the SwiGLU+quant inputs copied to contiguous tensors first (two copy kernels per layer,
`gate.contiguous()` / `up.contiguous()` of the stacked gate/up GEMM's output halves) instead of read in place: the
"before" side of that A/B. Same process, same code otherwise.

    python benchmarks/e2e_swiglu_copies.py [bench_e2e.py arguments]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels import quant  # noqa: E402

_strided = quant.swiglu_quant


def _copied(gate, up, *args, **kwargs):
    return _strided(gate.contiguous(), up.contiguous(), *args, **kwargs)


quant.swiglu_quant = _copied
print("SwiGLU+quant inputs copied to contiguous tensors before the kernel (e2e_swiglu_copies.py)", flush=True)
runpy.run_path(str(Path(__file__).resolve().parent / "bench_e2e.py"), run_name="__main__")
