"""Run the paged FP8 decode kernel's GPU tests on the CPU under the Triton interpreter (a helper script).

    TRITON_INTERPRET=1 python tests/interpret_paged_decode.py [check ...]

`tests/test_paged_decode_interpreter.py` runs it in a subprocess (the interpreter is chosen when the kernels
are decorated, so it needs a fresh process). The checks are tests of `tests/test_attention_gpu.py` whose
assertions hold in the interpreter: decode vs the FP32 reference, both V page layouts bit for bit, splits
past a short sequence's keys, the direct single-split path, NaN propagation; the KV write's in-kernel per-head
K amax against the torch reduction (kernel vs kernel). (Not those comparing FP8 bits
with the formats library, nor NaN bytes read past a sequence's end: the interpreter's FP8 casts differ
from the GPU's.)

Numpy >= 2 refuses int() of a one-element 1-d array, which is how the interpreter turns a loop bound
computed in the kernel (`range(start, end, BN)` with tensor bounds) into a Python int; the script makes
that conversion take the single element. Exit status 0: every check passed ("ok NAME" lines); 3: the
interpreter lacks the hook this relies on (the caller skips); anything else: a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHECKS = {
    "v_layouts": ("test_paged_decode_v_layouts_bit_identical", ()),
    "nan_in_v": ("test_paged_decode_nan_in_v_propagates", ()),
    "direct_fp8": ("test_paged_decode_direct_single_split_is_the_reduce_bit_for_bit", (True,)),
    "kv_head_amax": ("test_kv_write_head_amax_in_kernel_same_bits", ("monkeypatch",)),
}


def main(names: list[str]) -> int:
    root = Path(__file__).resolve().parent
    sys.path[:0] = [str(root.parent), str(root)]
    from interpret_util import script_main

    def check(name: str) -> None:
        import pytest
        import test_attention_gpu as t

        t.DEV = "cpu"
        fn, args = CHECKS[name]
        if args == ("monkeypatch",):
            with pytest.MonkeyPatch.context() as mp:
                getattr(t, fn)(mp)
        else:
            getattr(t, fn)(*args)

    return script_main(names, list(CHECKS), check)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
