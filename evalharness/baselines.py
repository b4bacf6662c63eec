"""Baselines: result files promoted to `baselines/<suite>/<run_key>.json` (GPU runs:
`baselines/<suite>/<hardware_class>/<run_key>.json`), with provenance.

`update` prints the diff it is about to write (metric by metric) before writing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from evalharness.errors import ResultError
from evalharness.gate import baseline_path, hardware_class
from evalharness.provenance import now_iso
from evalharness.results import iter_results, load_result, write_json_atomic


def _diff(old: dict[str, Any] | None, new: dict[str, Any], limit: int = 12) -> list[str]:
    """Human-readable metric changes between an old baseline and a new result."""
    if old is None:
        return [f"  new baseline ({len(new['metrics'])} metrics)"]
    lines = []
    om, nm = old["metrics"], new["metrics"]
    changed = []
    for k in sorted(set(om) | set(nm)):
        a, b = om.get(k), nm.get(k)
        if a == b:
            continue
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            rel = (b - a) / abs(a) if a else float("inf")
            changed.append((abs(rel), f"  {k}: {a:.6g} -> {b:.6g} ({rel:+.2%})"))
        else:
            changed.append((float("inf"), f"  {k}: {a} -> {b}"))
    changed.sort(key=lambda x: -x[0])
    lines += [c for _, c in changed[:limit]]
    if len(changed) > limit:
        lines.append(f"  ... and {len(changed) - limit} more changed metric(s)")
    if not changed:
        lines.append("  unchanged")
    return lines


def nonfinite_metrics(doc: dict[str, Any]) -> list[str]:
    """The metrics a result stores as null: NaN/Inf values."""
    return sorted(k for k, v in (doc.get("metrics") or {}).items() if v is None)


def update_baselines(results_dir: str | Path, baselines_dir: str | Path, dry_run: bool = False,
                     log: Callable[[str], None] = print, force: bool = False) -> list[Path]:
    """Promote every successful result in `results_dir` to a baseline; prints the diff first.

    A result with non-finite (NaN/Inf) metrics is refused unless `force`: a ResultError lists them, and nothing is
    written (every later run would be compared with nothing on those metrics)."""
    results_dir = Path(results_dir)
    manifest = results_dir / "suite.json"
    suite_name = json.loads(manifest.read_text()).get("name") if manifest.exists() else None
    results = list(iter_results(results_dir))
    bad = [(doc["run_key"], nonfinite_metrics(doc)) for _, doc in results if doc["status"] == "ok"]
    bad = [(key, names) for key, names in bad if names]
    if bad and not force:
        listing = "; ".join(f"{key}: {len(names)} metric(s), e.g. {', '.join(names[:3])}" for key, names in bad)
        raise ResultError(f"{results_dir}: refusing to promote result(s) with non-finite (NaN/Inf) metrics "
                          f"({listing}); a baseline must hold numbers: fix the run (its outputs were NaN/Inf), or "
                          "pass --force to promote them anyway; nothing was written")
    for key, names in bad:
        log(f"warning: {key} has {len(names)} non-finite metric(s) ({', '.join(names[:3])}); promoted (--force)")
    written = []
    for path, doc in results:
        if doc["status"] != "ok":
            log(f"skip {doc['run_key']}: status {doc['status']} (a failed run cannot be a baseline)")
            continue
        sname = suite_name or (doc.get("suite") or {}).get("name", "default")
        target = baseline_path(baselines_dir, sname, doc["run_key"], hardware_class(doc))
        old = load_result(target) if target.exists() else None
        log(f"{'would write' if dry_run else 'write'} {target}:")
        for line in _diff(old, doc):
            log(line)
        if dry_run:
            continue
        base = dict(doc)
        base["kind"] = "baseline"
        base["baseline"] = {"promoted_at": now_iso(), "from": str(path)}
        write_json_atomic(target, base)
        written.append(target)
    return written
