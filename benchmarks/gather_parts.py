"""Gather the runs that parts of a suite (benchmarks/split_suite.py) finished into the suite's results folder.

A part's result is new when the results folder has no result of that run key, or one of another status or
fingerprint (the folder may hold the stubs that earlier device calls returned: status and fingerprint without metrics
and samples). New results are copied there and their file names printed, one a line. `--stubs DIR` then writes every
result of the folder as such a stub into DIR: what `evalharness run --resume` reads, a few KiB a run.
`benchmarks/run_device.sh nightly` uses both between device calls.

  python benchmarks/gather_parts.py RESULTS PART_DIR... [--stubs DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def _identity(path: Path) -> tuple | None:
    """(status, fingerprint sha256) of a result file; None for a file that is not a readable result."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    fingerprint = doc.get("fingerprint")
    return doc.get("status"), fingerprint.get("sha256") if isinstance(fingerprint, dict) else None


def gather(results: Path, parts: list[Path]) -> list[str]:
    """Copy the parts' results that `results` does not hold yet (see the module docstring); their file names."""
    results.mkdir(parents=True, exist_ok=True)
    new = []
    for part in parts:
        for path in sorted(part.glob("*__*.json")) if part.is_dir() else []:
            mine = _identity(path)
            if mine is None or mine == _identity(results / path.name):
                continue
            shutil.copyfile(path, results / (path.name + ".tmp"))
            (results / (path.name + ".tmp")).replace(results / path.name)
            new.append(path.name)
    return new


def write_stubs(results: Path, dst: Path) -> int:
    """Every result of `results` without its metrics and samples, into `dst`; how many."""
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    for path in sorted(results.glob("*__*.json")):
        doc = json.loads(path.read_text())
        doc["metrics"] = {}
        doc.pop("samples", None)
        (dst / path.name).write_text(json.dumps(doc))
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("parts", type=Path, nargs="*", help="the parts' results folders (missing ones are skipped)")
    ap.add_argument("--stubs", type=Path, default=None, metavar="DIR", help="then write the stubs of every result")
    args = ap.parse_args(argv)
    for name in gather(args.results, args.parts):
        print(name)
    if args.stubs is not None:
        write_stubs(args.results, args.stubs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
