"""GPU check: the split-K decode kernel's autotuner tunes each split count of a shape separately.

    python benchmarks/check_autotune_keys.py

Calls 4096x14336 at M = 4 with split_k = 2 and 4 (no other knobs) under `DECODE_STAGE_CHOICE = "autotune"` (the
default is the stage rule) and prints the autotuner's cache: one entry per split count, with its
pipeline depth. Exits 1 if they share one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gemm import fp8_block_operands  # noqa: E402
from engine.kernels import gemm as G  # noqa: E402
from engine.kernels import decode_plan as P  # noqa: E402
from engine.kernels import gemm_fp8 as GF  # noqa: E402


def main() -> int:
    xd, xs, wd, ws = fp8_block_operands(4, 4096, 14336)
    P.DECODE_STAGE_CHOICE = "autotune"
    for s in (2, 4):
        G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.bfloat16, split_k=s)
    torch.cuda.synchronize()
    keys = {k: str(c) for k, c in GF._fp8_block_gemm_tuned.cache.items() if tuple(k[:2]) == (4096, 14336)}
    for k, c in keys.items():
        print(f"  key {k[:6]} -> {c}")
    splits = {k[5] for k in keys}
    print(f"split counts tuned separately: {sorted(splits)}")
    return 0 if splits == {2, 4} else 1


if __name__ == "__main__":
    raise SystemExit(main())
