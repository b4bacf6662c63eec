"""Where a suite run's time went: the `timing` of every result file in a results folder, as text tables.

    python benchmarks/timing_table.py RESULTS_DIR

One row per run (model x recipe x serving x backend): status, total seconds and each eval's seconds; then
one row per eval part that timed itself (``tasks.<task>.ref_s`` / ``eng_s``, ``longctx.<part>_s``) with a
column per run, so the reference's one-off cost and each backend's cost per task sit side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(folder: Path) -> list[dict]:
    """The result documents of `folder` (kind 'result'), in file-name order."""
    docs = []
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"skipped {path.name}: {exc}", file=sys.stderr)
            continue
        if isinstance(doc, dict) and doc.get("kind") == "result":
            docs.append(doc)
    return docs


def tables(docs: list[dict]) -> str:
    """Two fixed-width tables: per run (whole evals) and per eval part."""
    if not docs:
        return "no result files\n"
    evals = sorted({k for d in docs for k in (d.get("timing") or {}) if k.endswith("_s") and "." not in k}
                   - {"total_s"})
    parts = sorted({k for d in docs for k in (d.get("timing") or {}) if "." in k})
    width = max(len(d["run_key"]) for d in docs)
    out = [f"{'run':{width}s}  status  {'total_s':>8s}" + "".join(f"  {e:>14s}" for e in evals)]
    for d in docs:
        t = d.get("timing") or {}
        out.append(f"{d['run_key']:{width}s}  {d.get('status', '?'):6s}  {t.get('total_s', float('nan')):8.1f}"
                   + "".join(f"  {t[e]:14.1f}" if e in t else f"  {'-':>14s}" for e in evals))
    if parts:
        names = [d["run_key"] for d in docs]
        pw = max(max(len(p) for p in parts), len("part (seconds) / run"))
        out += ["", "runs:", *(f"  {i + 1}: {n}" for i, n in enumerate(names)),
                f"{'part (seconds) / run':{pw}s}" + "".join(f"  {i + 1:>8d}" for i in range(len(docs)))]
        for p in parts:
            row = [(d.get("timing") or {}).get(p) for d in docs]
            out.append(f"{p:{pw}s}" + "".join(f"  {v:8.1f}" if v is not None else f"  {'-':>8s}" for v in row))
    return "\n".join(out) + "\n"


def main() -> None:
    """Print the tables of the folder given on the command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", type=Path, help="a folder of result JSON files")
    folder = ap.parse_args().results_dir
    if not folder.is_dir():
        ap.error(f"{folder} is not a folder of result JSON files")
    sys.stdout.write(tables(load(folder)))


if __name__ == "__main__":
    main()
