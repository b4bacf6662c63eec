"""`bench_e2e.py` with the decode GEMM heuristic of sessions 3-13 (K splits until 2 programs per SM, no whole-K
kernel at BM 64): the before side of session 14's A/B on shapes without a DECODE_CONFIGS entry.

    python benchmarks/e2e_old_split_rule.py [bench_e2e.py arguments]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels import gemm  # noqa: E402

gemm.SPLIT_FILL = 2.0
gemm.WHOLE_K_AT_BM64 = False
print("decode GEMM heuristic: SPLIT_FILL 2.0, WHOLE_K_AT_BM64 off (sessions 3-13)", flush=True)
runpy.run_path(str(Path(__file__).resolve().parent / "bench_e2e.py"), run_name="__main__")
