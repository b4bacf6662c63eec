"""What the interpreter helper scripts (tests/interpret_*.py) share: the check loop (`run_checks`: every named check,
"ok NAME (T s)" or the traceback and "FAILED NAME", exit status 0 / 1) and `allow_tensor_loop_bounds`."""

from __future__ import annotations

import time
import traceback
from typing import Callable, Iterable


def run_checks(names: Iterable[str], check: Callable[[str], None]) -> int:
    failed = 0
    for name in names:
        t0 = time.time()
        try:
            check(name)
        except Exception:  # noqa: BLE001 -- report every check, then fail
            traceback.print_exc()
            print(f"FAILED {name}", flush=True)
            failed += 1
            continue
        print(f"ok {name} ({time.time() - t0:.1f} s)", flush=True)
    return 1 if failed else 0


def allow_tensor_loop_bounds() -> bool:
    """Make the interpreter's tensor.__index__ accept one-element arrays (False if its hook is missing). Numpy >= 2
    refuses int() of a one-element 1-d array, which is how the interpreter turns a loop bound computed in the kernel
    (`range(g0, g1)` with tensor bounds) into a Python int."""
    import numpy as np
    import triton.runtime.interpreter as interp

    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None:
        return False

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    return True
