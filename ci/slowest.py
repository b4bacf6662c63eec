"""Print the N slowest tests (default 15) of one or more JUnit XML files, across all of CI's pytest steps, then the
totals of all steps as one closing line ("ci: P passed, F failed, S skipped").

    python3 ci/slowest.py [-n N] FILE.xml...
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_cases(files: list[Path]) -> list[tuple[float, str, str]]:
    """(seconds, test id, outcome: passed / failed / skipped) of every test case in the JUnit files (missing files
    are skipped); a failure or an error counts as failed."""
    cases = []
    for f in files:
        if not f.is_file():
            continue
        for case in ET.parse(f).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')} ({f.stem})"
            failed = case.find("failure") is not None or case.find("error") is not None
            outcome = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
            cases.append((float(case.get("time", 0.0)), name, outcome))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    cases = read_cases(args.files)
    rows = sorted(cases, reverse=True)[:args.n]
    print(f"{len(rows)} slowest tests (setup + call + teardown):")
    for seconds, name, _ in rows:
        print(f"{seconds:8.2f}s  {name}")
    count = {o: sum(c[2] == o for c in cases) for o in ("passed", "failed", "skipped")}
    print(f"ci: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
