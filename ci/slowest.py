"""Print the N slowest tests (default 15) of one or more JUnit XML files, across all of CI's pytest steps, then the
totals of all steps as one closing line ("ci: P passed, F failed, S skipped").

    python3 ci/slowest.py [-n N] FILE.xml...
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def slowest(files: list[Path], n: int) -> list[tuple[float, str]]:
    """(seconds, test id) of the n slowest test cases in the JUnit files (missing files are skipped)."""
    cases = []
    for f in files:
        if not f.is_file():
            continue
        for case in ET.parse(f).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            cases.append((float(case.get("time", 0.0)), f"{name} ({f.stem})"))
    return sorted(cases, reverse=True)[:n]


def totals(files: list[Path]) -> dict[str, int]:
    """Passed / failed (failures + errors) / skipped test cases over the JUnit files."""
    out = {"passed": 0, "failed": 0, "skipped": 0}
    for f in files:
        if not f.is_file():
            continue
        for case in ET.parse(f).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                out["failed"] += 1
            elif case.find("skipped") is not None:
                out["skipped"] += 1
            else:
                out["passed"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    rows = slowest(args.files, args.n)
    print(f"{len(rows)} slowest tests (setup + call + teardown):")
    for seconds, name in rows:
        print(f"{seconds:8.2f}s  {name}")
    t = totals(args.files)
    print(f"ci: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
