"""`evalharness trend DIR... --out OUT`: the time series of every gated metric across dated results dirs.

Each DIR is one results dir (typically one nightly: ``nightly/2026-11-28``).
Its date is the first ``YYYY-MM-DD`` (optionally followed by ``THH:MM`` /
``_HHMM``) in the folder name, else the earliest ``provenance.created_at`` of
its results. Dirs are ordered by date.

Gated metrics: those matched by the gate rules of the newest dir's suite.json
(else `evalharness.gate.DEFAULT_RULES`) that are not ``severity: warn``; a
glob rule contributes only when it matches at most `MAX_GLOB_MATCHES` metrics
of a run (per-tap globs such as ``layer_error.*.rel_l2`` belong in the
error-vs-depth plot, not in a trend). ``--metric GLOB`` picks metrics
explicitly instead.

Writes OUT/trend.md (one table per metric: run key x date, plus the change of
the last value vs the previous one), OUT/trend.json and one PNG per metric
(OUT/trend_<metric>.png, one line per run key).
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from pathlib import Path
from typing import Any

from evalharness.errors import ResultError

MAX_GLOB_MATCHES = 8
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})(?:[T_ ]?(\d{2})[:\-]?(\d{2}))?")
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def _finite(x: Any) -> bool:
    """A finite real number."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def dir_date(path: Path, docs: list[dict[str, Any]]) -> str:
    """The date label of a results dir (module docstring)."""
    m = _DATE.search(path.name)
    if m:
        return m.group(1) + (f"T{m.group(2)}:{m.group(3)}" if m.group(2) else "")
    stamps = sorted(str((d.get("provenance") or {}).get("created_at", "")) for d in docs)
    stamps = [s for s in stamps if s]
    if not stamps:
        raise ResultError(f"{path}: cannot date this results dir (no YYYY-MM-DD in its name, no created_at)")
    return stamps[0][:16]


def gated_metrics(manifest: dict[str, Any], docs: list[dict[str, Any]], explicit: list[str] | None = None) -> list[str]:
    """The metrics to trend (module docstring), sorted."""
    names = sorted({k for d in docs for k in (d.get("metrics") or {})})
    if explicit:
        return [n for n in names if any(fnmatch.fnmatchcase(n, g) for g in explicit)]
    from evalharness.gate import DEFAULT_RULES

    rules = (manifest.get("gate") or {}).get("rules") or DEFAULT_RULES
    chosen: set[str] = set()
    for rule in rules:
        if not isinstance(rule, dict) or rule.get("severity", "fail") == "warn" or "metric" not in rule:
            continue
        matched = [n for n in names if fnmatch.fnmatchcase(n, rule["metric"])]
        glob = any(c in rule["metric"] for c in "*?[")
        if glob and len(matched) > MAX_GLOB_MATCHES:
            continue  # a per-tap glob: the error-vs-depth plot shows those
        chosen.update(matched)
    return sorted(chosen)


def collect(dirs: list[str | Path], metrics: list[str] | None = None) -> dict[str, Any]:
    """Load the dirs and build {dates, dirs, metrics: {metric: {run_key: [value per date | None]}}}."""
    from evalharness.results import load_dir

    loaded = []
    for d in dirs:
        p = Path(d)
        manifest, docs = load_dir(p)
        loaded.append((dir_date(p, docs), p, manifest, docs))
    if not loaded:
        raise ResultError("trend: no results dirs given")
    loaded.sort(key=lambda t: (t[0], str(t[1])))
    dates = [t[0] for t in loaded]
    newest = loaded[-1]
    chosen = gated_metrics(newest[2], [doc for t in loaded for doc in t[3]], metrics)
    series: dict[str, dict[str, list[float | None]]] = {}
    for metric in chosen:
        rows: dict[str, list[float | None]] = {}
        for i, (_, _, _, docs) in enumerate(loaded):
            for doc in docs:
                v = (doc.get("metrics") or {}).get(metric)
                if doc.get("status") == "ok" and _finite(v):
                    rows.setdefault(doc["run_key"], [None] * len(loaded))[i] = float(v)
        if rows:
            series[metric] = dict(sorted(rows.items()))
    return {"dates": dates, "dirs": [str(t[1]) for t in loaded], "metrics": series}


def _last_change(values: list[float | None]) -> tuple[float | None, float | None]:
    """(last value, relative change of the last value vs the previous available one)."""
    seen = [v for v in values if v is not None]
    if len(seen) < 2 or values[-1] is None:
        return (values[-1] if values else None), None
    prev = seen[-2]
    return values[-1], ((values[-1] - prev) / abs(prev) if prev else None)


def plot_metric(metric: str, dates: list[str], rows: dict[str, list[float | None]], path: Path) -> Path:
    """One line per run key over the dates."""
    from evalharness.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = list(range(len(dates)))
    for key, vals in rows.items():
        pts = [(x, v) for x, v in zip(xs, vals) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax.set_xticks(xs)
    ax.set_xticklabels(dates, rotation=30, ha="right")
    ax.set_ylabel(metric)
    ax.set_title(f"trend: {metric}")
    ax.grid(True, alpha=0.3)
    if len(rows) <= 16:
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _fmt(x: float | None) -> str:
    """Compact number ('-' when missing)."""
    return "-" if x is None else f"{x:.5g}"


def build_trend(dirs: list[str | Path], out_dir: str | Path, metrics: list[str] | None = None) -> dict[str, Any]:
    """Write trend.md, trend.json and the PNGs; returns the data plus a few summary lines for the report."""
    data = collect(dirs, metrics)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dates = data["dates"]
    md = ["# Trend of the gated metrics", "", f"{len(dates)} results dir(s): " +
          ", ".join(f"{d} (`{p}`)" for d, p in zip(dates, data["dirs"])), ""]
    changes = []
    for metric, rows in data["metrics"].items():
        png = plot_metric(metric, dates, rows, out / f"trend_{_SAFE.sub('-', metric)}.png")
        md += [f"## {metric}", "", "| run | " + " | ".join(dates) + " | last vs previous |",
               "|---|" + "---|" * (len(dates) + 1)]
        for key, vals in rows.items():
            last, rel = _last_change(vals)
            md.append(f"| {key} | " + " | ".join(_fmt(v) for v in vals) + f" | {'-' if rel is None else f'{rel:+.2%}'} |")
            if rel is not None:
                changes.append((abs(rel), metric, key, rel, last))
        md += ["", f"![{metric}]({png.name})", ""]
    changes.sort(reverse=True)
    summary = ["| metric | run | last | change vs previous |", "|---|---|---|---|"]
    summary += [f"| {m} | {k} | {_fmt(last)} | {rel:+.2%} |" for _, m, k, rel, last in changes[:10]]
    if not changes:
        summary = ["(fewer than two dated values per metric: no change to show yet)"]
    md += ["## Largest changes (last vs previous)", ""] + summary
    (out / "trend.md").write_text("\n".join(md) + "\n")
    (out / "trend.json").write_text(json.dumps(data, indent=1))
    return {**data, "n_dirs": len(dates), "summary_lines": ["Largest changes of the last nightly vs the previous:",
                                                              ""] + summary}
