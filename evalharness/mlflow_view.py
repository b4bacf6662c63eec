"""What one result file looks like in mlflow: params, tags, headline and flat metrics, step series, plots, links.

Pure functions of a result dict (no mlflow import); :mod:`evalharness.tracking` logs what they return.

* **Headline metrics** (:func:`headline_metrics`): copies of the numbers a reader compares first, named
  ``0_headline/<result key>``. mlflow's compare-runs page sorts metric rows by name in code-unit order (digits
  before letters), so they are its first rows (it shows about six rows of 45 px before its 300 px table scrolls);
  they are logged first, so the parallel-coordinates plot colours by ``0_headline/ppl_kld.kld_mean``: the gate's
  count of failed checks for the run (``0_headline/gate.fail``, when a gate summary is logged), KLD mean and p99,
  PPL ratio, top-1 agreement (their intervals are the flat ``ppl_kld.*_lo`` / ``_hi`` metrics), and for each
  configured task or group its accuracy delta with interval and McNemar p-value.
* **Step series** (:func:`split_metrics`): per-layer statistics ``<eval>.layers.{i}.<tap>.<stat>`` become one
  metric ``<eval>.<tap>.<stat>`` with step = layer index; position buckets ``<eval>.pos{lo}_{hi}.<stat>`` become
  ``<eval>.pos_bucket.<stat>`` with step = the bucket's first position; ``<eval>.<name>bucket{i}`` becomes
  ``<eval>.<name>bucket`` with step = the bucket's first position (from ``samples.<eval>.<name>_edges``, else i);
  per-position arrays in ``samples`` (``*_by_position``) become series with step = position. The flat keys they
  replace are not logged as metrics (the result JSON artifact and ``per_layer/<eval>.csv`` keep them).
* **Plots** (:func:`write_plots`): PNGs logged at the artifact root, with the same names in every run, so the
  compare page's "Artifacts" section lists them and shows a chosen one side by side for every run.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import urllib.parse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

HEADLINE = "0_headline/"     # sorts before every lower- and upper-case name in mlflow's compare table
# Headline ppl_kld statistics, in logging order (the first is the parallel-coordinates plot's default colour).
HEADLINE_PPL = ("ppl_kld.kld_mean", "ppl_kld.ppl_ratio", "ppl_kld.top1_agree", "ppl_kld.kld_p99")
HEADLINE_TASK_STATS = ("delta", "delta_lo", "delta_hi", "mcnemar_p")
EXPERIMENT_KIND_TAG = ("mlflow.experimentKind", "custom_model_development")  # what the UI's kind switch writes
PER_LAYER = re.compile(r"^(?P<eval>[^.]+)\.layers\.(?P<layer>\d+)\.(?P<tap>.+)\.(?P<stat>[^.]+)$")
POS_BUCKET = re.compile(r"^(?P<eval>[^.]+)\.pos(?P<lo>\d+)_(?P<hi>\d+)\.(?P<stat>.+)$")
INDEXED_BUCKET = re.compile(r"^(?P<eval>[^.]+)\.(?P<name>[a-z0-9_]*bucket)(?P<i>\d+)$")
BY_POSITION_METRIC = re.compile(r"^(?P<name>.+_by_position)\.(?P<pos>\d+)$")
TASK_DELTA = re.compile(r"^tasks\.(?P<task>.+)\.delta$")
PLOT_STATS = ("rel_l2", "sqnr_db")
MAX_PARAM_LEN = 500          # mlflow allows 6000; long values (overrides, scales) are summarised
MAX_TAG_LEN = 5000           # mlflow allows 8000


def _short(value: Any, limit: int) -> str:
    """A value as an mlflow param/tag string, cut to `limit` characters."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _finite(x: Any) -> float | None:
    """`x` as a finite float, or None (null, NaN/Inf, non-numbers)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def model_name(doc: dict[str, Any]) -> str:
    """The result's model name (spec.model.name, else the run key's first part)."""
    return ((doc.get("spec") or {}).get("model") or {}).get("name") or doc["run_key"].split("__")[0]


# ---------------------------------------------------------------- params and tags

def flat_params(doc: dict[str, Any]) -> dict[str, str]:
    """The flat params of a result: `0_headline/recipe`, model, recipe name + every site, serving, backend, seed,
    suite, evals. `0_headline/recipe` sorts first: the compare page's scatter plot takes it as its x axis."""
    spec = doc.get("spec") or {}
    recipe = spec.get("recipe") or {}
    out: dict[str, Any] = {f"{HEADLINE}recipe": recipe.get("name"), "suite": (doc.get("suite") or {}).get("name"),
                           "backend": spec.get("backend"), "seed": spec.get("seed")}
    for k, v in (spec.get("model") or {}).items():
        out[f"model.{k}"] = v
    for k, v in recipe.items():
        if k == "description":
            continue
        if k == "scales" and isinstance(v, dict):
            v = "static scales for " + ",".join(sorted(v))
        out[f"recipe.{k}"] = v
    for k, v in (spec.get("serving") or {}).items():
        out[f"serving.{k}"] = v
    for ev, cfg in (spec.get("evals") or {}).items():
        for k, v in (cfg or {}).items():
            out[f"evals.{ev}.{k}"] = v
    return {k: _short(v, MAX_PARAM_LEN) for k, v in out.items() if v is not None}


def result_tags(doc: dict[str, Any], sha: str) -> dict[str, str]:
    """Tags of a result's run: suite name/sha, git sha, hardware class, cpu/gpu, run_key, model, status,
    nonfinite."""
    prov = doc.get("provenance") or {}
    hw = prov.get("hardware") or {}
    suite = doc.get("suite") or {}
    tags = {
        "run_key": doc["run_key"], "model": model_name(doc), "status": doc.get("status"), "result_sha": sha,
        "suite": suite.get("name"), "suite_sha": suite.get("sha256"), "git_sha": prov.get("git_sha"),
        "mlflow.source.git.commit": (prov.get("git_sha") or "").removesuffix("-dirty") or None,
        "hardware_class": hw.get("hardware_class"), "cpu": hw.get("cpu"), "gpu": hw.get("gpu"),
        "device": hw.get("device"), "created_at": prov.get("created_at"), "kind": "result",
    }
    nonfinite = sorted(k for k, v in (doc.get("metrics") or {}).items() if v is None or (
        isinstance(v, float) and not math.isfinite(v)))
    if nonfinite:
        tags["nonfinite_metrics"] = ",".join(nonfinite)
    err = doc.get("error")
    if err:
        tags["error"] = f"{err.get('type')}: {err.get('message')}"
    return {k: _short(v, MAX_TAG_LEN) for k, v in tags.items() if v not in (None, "")}


# ---------------------------------------------------------------- metrics

def headline_tasks(doc: dict[str, Any]) -> list[str]:
    """The task names whose delta is a headline: the configured names (spec.evals.tasks.tasks) that have one,
    else every task with a delta (a group's subtasks are not headlines when the group is configured)."""
    metrics = doc.get("metrics") or {}
    have = [m["task"] for m in map(TASK_DELTA.match, metrics) if m]
    names = (((doc.get("spec") or {}).get("evals") or {}).get("tasks") or {}).get("tasks")
    names = [names] if isinstance(names, str) else list(names or [])
    return [n for n in names if n in have] or sorted(have)


def headline_metrics(doc: dict[str, Any]) -> dict[str, float]:
    """`0_headline/<key>`: KLD mean, PPL ratio, top-1 agreement, KLD p99, each headline task's delta, interval and
    McNemar p (finite values only), in logging order."""
    metrics = doc.get("metrics") or {}
    keys = list(HEADLINE_PPL)
    keys += [f"tasks.{t}.{s}" for t in headline_tasks(doc) for s in HEADLINE_TASK_STATS]
    return {HEADLINE + k: v for k, v in ((k, _finite(metrics.get(k))) for k in keys) if v is not None}


def per_layer_rows(metrics: dict[str, Any]) -> list[tuple[str, int, str, str, float]]:
    """(eval, layer, tap, stat, value) for every `<eval>.layers.{i}.<tap>.<stat>` metric with a finite value."""
    rows = []
    for name, value in metrics.items():
        m = PER_LAYER.match(name)
        v = _finite(value)
        if m and v is not None:
            rows.append((m["eval"], int(m["layer"]), m["tap"], m["stat"], v))
    rows.sort(key=lambda r: (r[0], r[1], r[2], r[3]))
    return rows


def position_series(doc: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Series by position (`<eval>.<name>_by_position`): from samples arrays or `..._by_position.<pos>` metrics."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for ev, arrays in (doc.get("samples") or {}).items():
        if not isinstance(arrays, dict):
            continue
        for name, arr in arrays.items():
            if "by_position" not in name or name.endswith("_positions"):
                continue
            if isinstance(arr, dict):  # {position: value}
                pairs = [(int(p), _finite(v)) for p, v in arr.items() if str(p).lstrip("-").isdigit()]
            elif isinstance(arr, list):
                pos = arrays.get(f"{name}_positions") or arrays.get("positions")
                if not (isinstance(pos, list) and len(pos) == len(arr) and all(isinstance(p, int) for p in pos)):
                    pos = list(range(len(arr)))
                pairs = [(int(p), _finite(v)) for p, v in zip(pos, arr)]
            else:
                continue
            out[f"{ev}.{name}"] += [(p, v) for p, v in pairs if v is not None]
    for name, value in (doc.get("metrics") or {}).items():
        m = BY_POSITION_METRIC.match(name)
        if m and _finite(value) is not None and f"{m['name']}" not in out:
            out[m["name"] + "#metric"].append((int(m["pos"]), float(value)))
    return {k.removesuffix("#metric"): sorted(v) for k, v in out.items() if v}


def _bucket_start(doc: dict[str, Any], ev: str, name: str, i: int) -> int:
    """First position of bucket `i` from `samples.<eval>.<name>_edges` (e.g. kld_bucket_edges), else `i`."""
    edges = ((doc.get("samples") or {}).get(ev) or {}).get(f"{name}_edges")
    if isinstance(edges, list) and i < len(edges) and isinstance(edges[i], int):
        return edges[i]
    return i


def split_metrics(doc: dict[str, Any]) -> tuple[dict[str, float], dict[str, list[tuple[int, float]]]]:
    """(flat metrics, step series) of a result: the finite metrics plus `timing.*`, minus the per-layer,
    position-bucket and by-position keys, which become series (step = layer / first position of the bucket)."""
    flat: dict[str, float] = {}
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    samples_series = position_series({"samples": doc.get("samples")})
    for key, value in (doc.get("metrics") or {}).items():
        v = _finite(value)
        if v is None:
            continue
        if m := PER_LAYER.match(key):
            series[f"{m['eval']}.{m['tap']}.{m['stat']}"].append((int(m["layer"]), v))
        elif m := POS_BUCKET.match(key):
            series[f"{m['eval']}.pos_bucket.{m['stat']}"].append((int(m["lo"]), v))
        elif m := INDEXED_BUCKET.match(key):
            series[f"{m['eval']}.{m['name']}"].append((_bucket_start(doc, m["eval"], m["name"], int(m["i"])), v))
        elif m := BY_POSITION_METRIC.match(key):
            if m["name"] not in samples_series:
                series[m["name"]].append((int(m["pos"]), v))
        else:
            flat[key] = v
    for k, v in (doc.get("timing") or {}).items():
        if _finite(v) is not None:
            flat[f"timing.{k}"] = float(v)
    for name, pairs in samples_series.items():
        series.setdefault(name, pairs)
    return flat, {k: sorted(v) for k, v in series.items()}


def flat_metrics(doc: dict[str, Any]) -> dict[str, float]:
    """The metrics logged as single values (see :func:`split_metrics`)."""
    return split_metrics(doc)[0]


def step_series(doc: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """The metrics logged as step series (see :func:`split_metrics`)."""
    return split_metrics(doc)[1]


def per_layer_csv(rows: Iterable[tuple[str, int, str, str, float]]) -> str:
    """CSV text with header layer,tap,stat,value (rows of one eval)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["layer", "tap", "stat", "value"])
    for _, layer, tap, stat, value in rows:
        w.writerow([layer, tap, stat, repr(value)])
    return buf.getvalue()


# ---------------------------------------------------------------- gate

def gate_counts(files: list[Path]) -> tuple[dict[str, dict[str, int]], set[str]]:
    """({run_key: {"PASS": n, "WARN": n, "FAIL": n}}, run keys with a baseline problem) from the gate's markdown
    summary (its "Runs" table and "Baseline problems" list), else from its JUnit XML."""
    counts: dict[str, dict[str, int]] = {}
    problems: set[str] = set()
    md = next((f for f in files if f.suffix == ".md"), None)
    if md is not None:
        section = ""
        for line in md.read_text(errors="replace").splitlines():
            if line.startswith("## "):
                section = line[3:].strip()
            elif section == "Runs" and line.startswith("| ") and not line.startswith(("| run |", "|---")):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) == 4 and all(c.isdigit() for c in cells[1:]):
                    counts[cells[0]] = dict(zip(("PASS", "WARN", "FAIL"), map(int, cells[1:])))
            elif section == "Baseline problems" and line.startswith("- "):
                problems.add(line[2:].split(":", 1)[0].strip())
        return counts, problems
    xml = next((f for f in files if f.suffix == ".xml"), None)
    if xml is not None:
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            cases = list(suite.iter("testcase"))
            if suite.get("name") == "baselines":
                problems |= {c.get("name") for c in cases}
                continue
            fail = sum(c.find("failure") is not None for c in cases)
            warn = sum((c.findtext("system-out") or "").startswith("WARN") for c in cases)
            counts[suite.get("name")] = {"PASS": len(cases) - fail - warn, "WARN": warn, "FAIL": fail}
    return counts, problems


def run_verdict(counts: dict[str, int]) -> str:
    """FAIL if any verdict failed, else WARN if any warned, else PASS."""
    return "FAIL" if counts.get("FAIL") else "WARN" if counts.get("WARN") else "PASS"


# ---------------------------------------------------------------- plots and links

def write_plots(doc: dict[str, Any], folder: Path) -> list[Path]:
    """PNG plots: error vs depth per tap kind (one figure per stat) and position series; Agg canvas, no pyplot."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    rows = [r for r in per_layer_rows(doc.get("metrics") or {}) if r[0] == "layer_error"]
    for stat in PLOT_STATS:
        by_tap: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for _, layer, tap, st, v in rows:
            if st == stat:
                by_tap[tap].append((layer, v))
        if not by_tap:
            continue
        fig = Figure(figsize=(8, 5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        colors = matplotlib.colormaps["tab20"].colors
        for j, (tap, pts) in enumerate(sorted(by_tap.items())):
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=tap, color=colors[(2 * j) % 20 + (j // 10) % 2])
        if stat == "rel_l2" and all(v > 0 for pts in by_tap.values() for _, v in pts):
            ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel(stat)
        ax.set_title(f"{doc['run_key']}: {stat} vs depth")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = folder / f"error_vs_depth_{stat}.png"
        fig.savefig(path)
        written.append(path)
    for name, pts in position_series(doc).items():
        fig = Figure(figsize=(8, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        xs, ys = zip(*pts)
        ax.plot(xs, ys)
        ax.set_xlabel("position")
        ax.set_ylabel(name)
        ax.set_title(f"{doc['run_key']}: {name}")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = folder / f"{name.replace('.', '_')}.png"
        fig.savefig(path)
        written.append(path)
    return written


def compare_url(base_url: str, run_ids: list[str], experiment_ids: list[str]) -> str:
    """The mlflow 3.x UI compare-runs page: `<base>/#/compare-runs?runs=[...]&experiments=[...]`."""
    q = (f"runs={urllib.parse.quote(json.dumps(run_ids, separators=(',', ':')))}"
         f"&experiments={urllib.parse.quote(json.dumps(experiment_ids, separators=(',', ':')))}")
    return f"{base_url.rstrip('/')}/#/compare-runs?{q}"


def experiment_url(base_url: str, experiment_id: str) -> str:
    """The experiment's runs table in mlflow 3's "Model training" view (`workflowType=machine_learning`; without
    it, mlflow 3.17 opens an experiment on its GenAI overview unless the browser remembers the other view)."""
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
