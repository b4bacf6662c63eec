"""Run the interpreter-safe GPU tests on the CPU under the Triton interpreter (a helper script).

    TRITON_INTERPRET=1 python tests/interpret_gpu_tests.py [check ...]

`tests/test_gpu_tests_interpreter.py` runs it in a subprocess (the interpreter is chosen when the kernels are
decorated, so it needs a fresh process). Each check calls one test function of a GPU test module with that
module's DEV = "cpu" (and LIBRARY_BITS = False where it has one): CI has no GPU, so this is where those kernels run
there.

* paged FP8 decode attention (`test_attention_gpu.py`): both V page layouts bit for bit, splits past a short
  sequence's keys, the direct single-split path = the reduce, NaN propagation; the KV write's in-kernel per-head K
  amax against the torch reduction;
* quant kernel knobs (`test_kernel_knobs_gpu.py`): every RMSNorm+quant tiling, act_quant / SwiGLU tilings against
  the default tiling's bits, knob validation; the FP8 GEMM's block_n / split_k / pipeline knobs and the fused
  reduce;
* the error-statistics fold (`test_errorstats_gpu.py`) against its torch reference, and its input validation.

Left out, because the interpreter differs from the GPU there: FP8 bits against the formats library (its FP8
casts differ: LIBRARY_BITS = False compares kernel against kernel instead), NaN bytes read past a sequence's end,
and the paged-decode knob tests, whose 16-bit float tiles the interpreter multiplies as integers. Exit status as
`interpret_util.script_main`.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKS = {
    "v_layouts": ("test_attention_gpu", "test_paged_decode_v_layouts_bit_identical", ()),
    "nan_in_v": ("test_attention_gpu", "test_paged_decode_nan_in_v_propagates", ()),
    "direct_fp8": ("test_attention_gpu", "test_paged_decode_direct_single_split_is_the_reduce_bit_for_bit", (True,)),
    "kv_head_amax": ("test_attention_gpu", "test_kv_write_head_amax_in_kernel_same_bits", ("monkeypatch",)),
    "rmsnorm_tilings": ("test_kernel_knobs_gpu", "test_rmsnorm_quant_every_tiling_is_library_exact", ((5, 1000),)),
    "act_swiglu_tilings": ("test_kernel_knobs_gpu", "test_act_and_swiglu_tilings_same_bits", ()),
    "quant_knob_errors": ("test_kernel_knobs_gpu", "test_quant_knobs_reject_bad_values", ()),
    "gemm_knobs_m1": ("test_kernel_knobs_gpu", "test_fp8_gemm_knobs_and_fused_reduce", (1,)),
    "gemm_knobs_m5": ("test_kernel_knobs_gpu", "test_fp8_gemm_knobs_and_fused_reduce", (5,)),
    "errorstats_fold": ("test_errorstats_gpu", "test_fold_kernel_matches_reference", (1000, "float32", None)),
    "errorstats_fold_bf16": ("test_errorstats_gpu", "test_fold_kernel_matches_reference", (70_001, "bfloat16", None)),
    "errorstats_fold_block16": ("test_errorstats_gpu", "test_fold_kernel_matches_reference", (40_000, "float32", 16)),
    "errorstats_bad_input": ("test_errorstats_gpu", "test_fold_rejects_bad_input", ()),
}


def main(names: list[str]) -> int:
    root = Path(__file__).resolve().parent
    sys.path[:0] = [str(root.parent), str(root)]
    from interpret_util import script_main

    def check(name: str) -> None:
        import importlib

        import pytest
        import torch

        module, fn, args = CHECKS[name]
        t = importlib.import_module(module)
        t.DEV = "cpu"
        if hasattr(t, "LIBRARY_BITS"):
            t.LIBRARY_BITS = False
        args = tuple(getattr(torch, a) if a in ("float32", "bfloat16") else a for a in args)
        if args == ("monkeypatch",):
            with pytest.MonkeyPatch.context() as mp:
                getattr(t, fn)(mp)
        else:
            getattr(t, fn)(*args)

    return script_main(names, list(CHECKS), check)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
