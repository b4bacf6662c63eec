"""mlflow tracking: a view of the result files, never their keeper.

Each result JSON becomes one mlflow run, nested under a parent run that
stands for the suite invocation (the results directory), so mlflow's
compare view puts the recipes of one suite side by side:

* **params** (flat): `model.*`, `recipe.name` and every recipe site
  (`recipe.linear.weight`, `recipe.kv.k`, ...), `serving.*`, `backend`,
  `seed`, `suite`, `evals.*`;
* **tags**: `suite`, `suite_sha`, `git_sha`, `hardware_class`, `cpu`, `gpu`,
  `run_key`, `status`, `result_sha` (sha256 of the file), `nonfinite_metrics`
  (metrics stored as null, which mlflow cannot hold);
* **metrics**: the result's `metrics` dict as is, plus step series:
  per-layer stats `layer_error.<tap>.<stat>` with step = layer index (from
  `layer_error.layers.{i}.<tap>.<stat>`) and position series
  (`ppl_kld.kld_by_position`, step = position) when the result has them;
* **artifacts**: `result/<run_key>.json`, `per_layer/<eval>.csv`
  (layer, tap, stat, value), `plots/*.png` (error vs depth per tap kind, KLD by
  position) and `gate/*` when the results dir holds a gate summary.

Idempotent: a child run is identified by its `run_key` and `result_sha` tags.
Logging the same file again finds it and leaves it alone (`force=True`
replaces it); a child whose logging was interrupted (tag `logged=partial`) is
replaced. A parent run is found again by a `parent_key` tag (host + results
dir), so `evalharness log DIR` after `evalharness run --out DIR` adds nothing,
`run --resume` adds the missing runs to the same parent, and a fresh re-run
into the same dir (new file contents) starts a new parent: history is kept.

Default store: `sqlite:///<results>/mlflow.db` with artifacts in
`<results>/mlartifacts`; `$MLFLOW_TRACKING_URI` or `--tracking-uri` (e.g. a
server `http://host:5000`) override it. Failures raise `TrackingError`; the
runner turns them into warnings (`make_result_logger`).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import re
import socket
import sys
import tempfile
import time
import urllib.parse
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

from evalharness.results import iter_results

PER_LAYER = re.compile(r"^(?P<eval>[^.]+)\.layers\.(?P<layer>\d+)\.(?P<tap>.+)\.(?P<stat>[^.]+)$")
BY_POSITION_METRIC = re.compile(r"^(?P<name>.+_by_position)\.(?P<pos>\d+)$")
GATE_FILES = ("summary.md", "gate_summary.md", "gate.md", "junit.xml", "gate_junit.xml")
PLOT_STATS = ("rel_l2", "sqnr_db")
MAX_PARAM_LEN = 500          # mlflow allows 6000; long values (overrides, scales) are summarised
MAX_TAG_LEN = 5000           # mlflow allows 8000
BATCH_METRICS = 1000         # mlflow's MAX_METRICS_PER_BATCH
BATCH_PARAMS_TAGS = 100      # mlflow's MAX_PARAMS_TAGS_PER_BATCH
HTTP_DEFAULTS = {            # bounded retries so that a down server costs seconds, not minutes
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


class TrackingError(Exception):
    """mlflow is missing, unreachable or refused a request (a warning for `run`, exit 1 for `log`)."""


@dataclasses.dataclass
class Logged:
    """What happened to one result file: `action` is logged | unchanged | replaced."""

    run_key: str
    action: str
    run_id: str
    parent_id: str | None


# ---------------------------------------------------------------- pure helpers (no mlflow needed)

def default_tracking_uri(results_dir: str | Path) -> str:
    """The sqlite store beside the results: `sqlite:///<abs results dir>/mlflow.db`."""
    return f"sqlite:///{Path(results_dir).resolve()}/mlflow.db"


def resolve_tracking_uri(cli_uri: str | None, results_dir: str | Path) -> str:
    """`--tracking-uri`, else `$MLFLOW_TRACKING_URI`, else the sqlite file beside the results."""
    return cli_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(results_dir)


def default_experiment(suite_name: str | None) -> str:
    """The experiment a suite's runs go to unless `--experiment` says otherwise."""
    return f"evalharness-{suite_name or 'default'}"


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (the `result_sha` tag: same file, same run)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _short(value: Any, limit: int) -> str:
    """A value as an mlflow param/tag string, cut to `limit` characters."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def flat_params(doc: dict[str, Any]) -> dict[str, str]:
    """The flat params of a result: model, recipe name + every site, serving, backend, seed, suite, evals."""
    spec = doc.get("spec") or {}
    out: dict[str, Any] = {"suite": (doc.get("suite") or {}).get("name"), "backend": spec.get("backend"),
                           "seed": spec.get("seed")}
    for k, v in (spec.get("model") or {}).items():
        out[f"model.{k}"] = v
    recipe = spec.get("recipe") or {}
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
    """Tags of a result's run: suite name/sha, git sha, hardware class, cpu/gpu, run_key, status, nonfinite."""
    prov = doc.get("provenance") or {}
    hw = prov.get("hardware") or {}
    suite = doc.get("suite") or {}
    tags = {
        "run_key": doc["run_key"], "status": doc.get("status"), "result_sha": sha,
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


def _finite(x: Any) -> float | None:
    """`x` as a finite float, or None (null, NaN/Inf, non-numbers)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def flat_metrics(doc: dict[str, Any]) -> dict[str, float]:
    """The result's metrics dict (finite numbers only) plus `timing.*`."""
    out = {k: v for k, v in ((k, _finite(v)) for k, v in (doc.get("metrics") or {}).items()) if v is not None}
    for k, v in (doc.get("timing") or {}).items():
        if _finite(v) is not None:
            out[f"timing.{k}"] = float(v)
    return out


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


def step_series(doc: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Every step series of a result: per-layer stats (step = layer) and position series (step = position)."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for ev, layer, tap, stat, v in per_layer_rows(doc.get("metrics") or {}):
        series[f"{ev}.{tap}.{stat}"].append((layer, v))
    for name, pairs in position_series(doc).items():
        series.setdefault(name, pairs)
    return dict(series)


def per_layer_csv(rows: Iterable[tuple[str, int, str, str, float]]) -> str:
    """CSV text with header layer,tap,stat,value (rows of one eval)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["layer", "tap", "stat", "value"])
    for _, layer, tap, stat, value in rows:
        w.writerow([layer, tap, stat, repr(value)])
    return buf.getvalue()


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


def _chunks(items: list, n: int) -> Iterable[list]:
    """`items` in lists of at most `n`."""
    for i in range(0, len(items), n):
        yield items[i:i + n]


# ---------------------------------------------------------------- the tracker

class Tracker:
    """Logs result files of one results directory to one mlflow experiment (see the module docstring)."""

    def __init__(self, results_dir: str | Path, tracking_uri: str | None = None, experiment: str | None = None,
                 log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)):
        """Remember where to log; nothing is imported or contacted until the first result is logged."""
        self.results_dir = Path(results_dir).resolve()
        self.uri = resolve_tracking_uri(tracking_uri, self.results_dir)
        self.experiment_name = experiment
        self.log = log
        self._client = None
        self._experiment_id: str | None = None
        self._parent_id: str | None = None
        self._parent_keys: set[str] = set()
        self.parent_key = hashlib.sha256(f"{socket.gethostname()}:{self.results_dir}".encode()).hexdigest()[:16]
        self.run_ids: dict[str, str] = {}
        self.disabled = False  # set after a failure during `run`: no more calls to the store
        self._open_child: str | None = None  # a child run being logged (closed as KILLED if interrupted)

    # -- connection

    @property
    def client(self):
        """The MlflowClient, created on first use (checks the server is up for http URIs)."""
        if self._client is None:
            try:
                from mlflow.tracking import MlflowClient
            except ImportError:
                raise TrackingError("mlflow is not installed (pip install 'evalharness[tracking]')") from None
            for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
                logging.getLogger(name).setLevel(logging.WARNING)
            if self.uri.startswith(("http://", "https://")):
                for k, v in HTTP_DEFAULTS.items():
                    os.environ.setdefault(k, v)
                self._check_server()
            elif self.uri.startswith("sqlite:///"):
                Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def _check_server(self) -> None:
        """Fail fast (5 s) when nothing answers at an http tracking URI (any HTTP answer counts as up)."""
        import requests

        try:
            requests.get(self.uri.rstrip("/") + "/health", timeout=5)
        except requests.RequestException as exc:
            raise TrackingError(f"tracking server {self.uri} is unreachable ({type(exc).__name__}: {exc})") from None

    def _artifact_location(self) -> str | None:
        """For a sqlite store: `<db folder>/mlartifacts` (a file URI); servers and other stores choose their own."""
        if self.uri.startswith("sqlite:///"):
            return (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
        return None

    def experiment_id(self, suite_name: str | None = None) -> str:
        """Find or create the experiment (restoring a deleted one)."""
        if self._experiment_id is None:
            name = self.experiment_name or default_experiment(suite_name)
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                self._experiment_id = self.client.create_experiment(name, artifact_location=self._artifact_location())
            else:
                if exp.lifecycle_stage == "deleted":
                    self.client.restore_experiment(exp.experiment_id)
                self._experiment_id = exp.experiment_id
            self.experiment_name = name
        return self._experiment_id

    def _search(self, flt: str, max_results: int = 1000, order_by: list[str] | None = None) -> list:
        """Active runs of the experiment matching an mlflow filter string."""
        return list(self.client.search_runs([self.experiment_id()], filter_string=flt, max_results=max_results,
                                            order_by=order_by))

    # -- parent run (one per suite invocation / results dir generation)

    def _children_keys(self, parent_id: str) -> set[str]:
        """run_keys of the active children of a parent run."""
        runs = self._search(f"tags.`mlflow.parentRunId` = '{parent_id}'")
        return {r.data.tags.get("run_key") for r in runs}

    def _parent_for(self, doc: dict[str, Any]) -> str:
        """The parent run for this result: the current one unless it already holds this run_key, else the
        latest parent of this results dir unless that one holds another version of the run_key (then this is
        a new invocation: a new parent)."""
        key = doc["run_key"]
        if self._parent_id is None or key in self._parent_keys:
            latest = self._search(f"tags.parent_key = '{self.parent_key}'", max_results=1,
                                  order_by=["attributes.start_time DESC"])
            keys = self._children_keys(latest[0].info.run_id) if latest else set()
            if latest and key not in keys:
                self._parent_id, self._parent_keys = latest[0].info.run_id, keys
            else:
                self._parent_id, self._parent_keys = self._create_parent(doc), set()
        self._parent_keys.add(key)
        return self._parent_id

    def _create_parent(self, doc: dict[str, Any]) -> str:
        """A new parent run: suite tags and params, suite.json as an artifact."""
        from mlflow.entities import Param, RunTag

        suite = doc.get("suite") or {}
        prov = doc.get("provenance") or {}
        spec = doc.get("spec") or {}
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        tags = {"kind": "suite", "parent_key": self.parent_key, "results_dir": str(self.results_dir),
                "host": socket.gethostname(), "suite": suite.get("name"), "suite_sha": suite.get("sha256"),
                "git_sha": prov.get("git_sha"),
                "hardware_class": (prov.get("hardware") or {}).get("hardware_class")}
        run = self.client.create_run(self.experiment_id(suite.get("name")),
                                     tags={k: _short(v, MAX_TAG_LEN) for k, v in tags.items() if v},
                                     run_name=f"{suite.get('name', 'suite')} {self.results_dir.name} {stamp}")
        rid = run.info.run_id
        params = {"suite": suite.get("name"), "backend": spec.get("backend"), "seed": spec.get("seed"),
                  "results_dir": str(self.results_dir)}
        self.client.log_batch(rid, params=[Param(k, _short(v, MAX_PARAM_LEN)) for k, v in params.items()
                                           if v is not None], tags=[RunTag("logged", "complete")])
        manifest = self.results_dir / "suite.json"
        if manifest.exists():
            self.client.log_artifact(rid, str(manifest), "suite")
        return rid

    def gate_files(self) -> list[Path]:
        """The gate summary / JUnit files in the results dir (written by `evalharness gate --summary/--junit`)."""
        return [self.results_dir / n for n in GATE_FILES if (self.results_dir / n).is_file()]

    def log_gate_files(self, run_id: str) -> list[str]:
        """Log the gate files (if any) under `gate/` of a run and tag it with the verdict; returns their names."""
        found = self.gate_files()
        for f in found:
            self.client.log_artifact(run_id, str(f), "gate")
        verdict = _gate_verdict(found)
        if verdict:
            self.client.set_tag(run_id, "gate", verdict)
        return [f.name for f in found]

    # -- one result

    def log_result(self, path: str | Path, doc: dict[str, Any] | None = None, force: bool = False) -> Logged:
        """Log one result file as a child run (idempotent by run_key + file sha); raises TrackingError."""
        try:
            return self._log_result(Path(path), doc, force)
        except TrackingError:
            raise
        except ImportError as exc:
            raise TrackingError(f"a tracking dependency is missing: {exc}") from None
        except Exception as exc:  # mlflow raises many types (MlflowException, requests, sqlalchemy)
            raise TrackingError(f"{Path(path).name}: {type(exc).__name__}: {exc}") from exc

    def _log_result(self, path: Path, doc: dict[str, Any] | None, force: bool) -> Logged:
        """The body of `log_result`."""
        if doc is None:
            from evalharness.results import load_result

            doc = load_result(path)
        sha = file_sha256(path)
        key = doc["run_key"]
        self.experiment_id((doc.get("suite") or {}).get("name"))
        existing = self._search(f"tags.run_key = '{key}' and tags.result_sha = '{sha}'")
        complete = [r for r in existing if r.data.tags.get("logged") == "complete"]
        if complete and not force:
            r = complete[0]
            self.run_ids[key] = r.info.run_id
            return Logged(key, "unchanged", r.info.run_id, r.data.tags.get("mlflow.parentRunId"))
        for r in existing:  # partial (interrupted) or forced: replace
            self.client.delete_run(r.info.run_id)
            if r.data.tags.get("mlflow.parentRunId") == self._parent_id:
                self._parent_keys.discard(key)
        parent = self._parent_for(doc)
        rid = self._log_child(path, doc, sha, parent)
        self.run_ids[key] = rid
        return Logged(key, "replaced" if existing else "logged", rid, parent)

    def _log_child(self, path: Path, doc: dict[str, Any], sha: str, parent: str) -> str:
        """Create the child run and log params, tags, metrics, step series and artifacts."""
        from mlflow.entities import Metric, Param, RunTag

        tags = result_tags(doc, sha)
        tags.update({"mlflow.parentRunId": parent, "logged": "partial"})
        run = self.client.create_run(self.experiment_id(), tags=tags, run_name=doc["run_key"])
        rid = self._open_child = run.info.run_id
        params = [Param(k, v) for k, v in flat_params(doc).items()]
        for chunk in _chunks(params, BATCH_PARAMS_TAGS):
            self.client.log_batch(rid, params=chunk)
        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, 0) for k, v in flat_metrics(doc).items()]
        for name, pts in step_series(doc).items():
            metrics += [Metric(name, v, ts, step) for step, v in pts]
        for chunk in _chunks(metrics, BATCH_METRICS):
            self.client.log_batch(rid, metrics=chunk)
        with tempfile.TemporaryDirectory(prefix="evalharness-mlflow-") as tmp:
            tmpd = Path(tmp)
            self.client.log_artifact(rid, str(path), "result")
            rows = per_layer_rows(doc.get("metrics") or {})
            for ev in sorted({r[0] for r in rows}):
                csv_path = tmpd / f"{ev}.csv"
                csv_path.write_text(per_layer_csv(r for r in rows if r[0] == ev))
                self.client.log_artifact(rid, str(csv_path), "per_layer")
            plots = write_plots(doc, tmpd / "plots")
            if plots:
                self.client.log_artifacts(rid, str(tmpd / "plots"), "plots")
        self.log_gate_files(rid)
        self.client.log_batch(rid, tags=[RunTag("logged", "complete")])
        self.client.set_terminated(rid, "FINISHED" if doc.get("status") == "ok" else "FAILED")
        self._open_child = None
        return rid

    # -- a whole directory

    def log_dir(self, force: bool = False) -> list[Logged]:
        """Log every result file of the results dir (plus gate files to the parent); raises TrackingError."""
        results = list(iter_results(self.results_dir))  # ResultError (bad input) propagates
        out = [self.log_result(p, d, force=force) for p, d in results]
        if self._parent_id is None and out:  # everything unchanged: the parent they are under
            self._parent_id = out[-1].parent_id
        if self.gate_files():  # a gate ran since the runs were logged: attach its summary
            try:
                for run_id in {self._parent_id} | {o.run_id for o in out if o.action == "unchanged"}:
                    if run_id:
                        self.log_gate_files(run_id)
            except Exception as exc:
                raise TrackingError(f"gate files: {type(exc).__name__}: {exc}") from exc
        self.close()
        return out

    def close(self, status: str = "FINISHED") -> None:
        """Mark the parent run this tracker created (or reused) as ended with `status`, and a child run whose
        logging was interrupted as KILLED (it stays tagged `logged=partial`: the next `log` replaces it)."""
        if self._client is None or self.disabled:
            return
        for run_id, st in ((self._open_child, "KILLED"), (self._parent_id, status)):
            if run_id is None:
                continue
            try:
                self.client.set_terminated(run_id, st)
            except Exception as exc:
                self.log(f"warning: tracking: could not end mlflow run {run_id}: {exc}")
        self._open_child = None

    def summary(self) -> str | None:
        """One line for the end of `run`: how many results went where (None when nothing was logged)."""
        if self.disabled or not self.run_ids:
            return None
        return f"mlflow: {len(self.run_ids)} result(s) in experiment '{self.experiment_name}' at {self.uri}"

    def ui_hint(self) -> str:
        """Where to look: the compare URL for a server, or the `mlflow ui` command for a local store."""
        ids = list(self.run_ids.values())
        if self.uri.startswith(("http://", "https://")):
            return f"compare in the mlflow UI: {compare_url(self.uri, ids, [self._experiment_id or '0'])}"
        return (f"browse: mlflow ui --backend-store-uri {self.uri} --port 5000, then open "
                f"{compare_url('http://127.0.0.1:5000', ids, [self._experiment_id or '0'])}")


def _gate_verdict(files: list[Path]) -> str | None:
    """PASS / FAIL / ERROR from a gate markdown summary's first line ('# Numerics gate: PASS')."""
    for f in files:
        if f.suffix == ".md":
            first = f.read_text(errors="replace").splitlines()[:1]
            if first and first[0].startswith("# Numerics gate:"):
                return first[0].split(":", 1)[1].strip().split()[0]
    return None


def make_result_logger(results_dir: str | Path, tracking_uri: str | None, experiment: str | None = None,
                       log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)
                       ) -> tuple[Callable[[Path, dict], None] | None, Tracker | None]:
    """A `run_suite(on_result=...)` hook that logs each result and never raises: the first failure prints
    one warning and turns tracking off for the rest of the invocation (results stay on disk)."""
    tracker = Tracker(results_dir, tracking_uri, experiment, log=log)
    state = {"off": False}

    def on_result(path: Path, doc: dict) -> None:
        """Log one freshly written result; warn (once) and disable on failure."""
        if state["off"]:
            return
        try:
            tracker.log_result(path)  # re-read from disk: the file is the source of truth
        except TrackingError as exc:
            state["off"] = tracker.disabled = True
            log(f"warning: mlflow tracking off for this run: {exc}. Results are on disk; log them later with "
                f"`evalharness log {results_dir}" + (f" --tracking-uri {tracking_uri}`" if tracking_uri else "`"))

    return on_result, tracker
