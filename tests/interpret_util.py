"""What the interpreter helper scripts (tests/interpret_*.py) and the tests running them share.

A script runs its checks on CPU tensors under TRITON_INTERPRET=1 (`script_main`: every named check prints
"ok NAME (T s)", or its traceback and "FAILED NAME"; exit status 0 all passed, 1 a failure, 2 not under the
interpreter, 3 the interpreter lacks the hook `allow_tensor_loop_bounds` needs). Its test runs it in a subprocess
(`assert_script_checks`), because the interpreter is chosen when the kernels are decorated: a fresh process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable, Sequence


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


def script_main(names: Sequence[str], checks: Sequence[str], check: Callable[[str], None],
                loop_bounds: bool = True) -> int:
    """A helper script's main: the named checks (all when none are named) under the interpreter; exit status above."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if loop_bounds and not allow_tensor_loop_bounds():
        print("SKIP: triton.runtime.interpreter has no _patch_lang_tensor")
        return 3
    return run_checks(list(names) or list(checks), check)


def assert_script_checks(script: Path, timeout: int = 900) -> None:
    """Run a helper script in a subprocess under TRITON_INTERPRET=1: skipped when it exits 3, else it must exit 0
    and print "ok NAME " for every name in its CHECKS."""
    import pytest

    spec = importlib.util.spec_from_file_location(script.stem, script)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)  # the names of the checks the script runs
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in helper.CHECKS:
        assert f"ok {name} " in proc.stdout, proc.stdout
