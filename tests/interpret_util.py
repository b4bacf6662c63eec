"""The check loop shared by the interpreter helper scripts (tests/interpret_*.py): run every named check, print
"ok NAME (T s)" or the traceback and "FAILED NAME", and return the exit status (0: all passed, 1: any failed)."""

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
