"""mlflow tracking: a view of the result files, never their keeper.

Each result JSON becomes one mlflow run, nested under a parent run that
stands for the suite invocation (the results directory), so mlflow's
compare view puts the recipes of one suite side by side. What a run holds is
decided in :mod:`evalharness.mlflow_view`:

* **params** (flat): `0_headline/recipe` (the recipe name, the first param),
  `model.*`, `recipe.name` and every recipe site (`recipe.linear.weight`,
  `recipe.kv.k`, ...), `serving.*`, `backend`, `seed`, `suite`, `evals.*`;
* **tags**: `suite`, `suite_sha`, `git_sha`, `hardware_class`, `cpu`, `gpu`,
  `run_key`, `model`, `status`, `result_sha` (sha256 of the file),
  `nonfinite_metrics` (metrics stored as null, which mlflow cannot hold) and,
  once a gate summary is logged, `gate` (this run's verdict);
* **metrics**: headline copies `0_headline/...` first (the compare table's
  first rows), then the result's single-value metrics and `timing.*`, and step
  series for per-layer statistics (step = layer), position buckets and
  per-position arrays (step = position) instead of one flat key per layer or
  bucket; with a gate summary, `0_headline/gate.fail`;
* **artifacts**: the plots (error vs depth per tap kind, KLD by position) at the
  artifact root, where the compare page's "Artifacts" section shows them side by
  side, `result/<run_key>.json`, `per_layer/<eval>.csv` (layer, tap, stat,
  value) and `gate/*` when the results dir holds a gate summary.

The experiment is created with the tag `mlflow.experimentKind =
custom_model_development` ("Machine learning" in mlflow 3's kind switch); the
links `ui_hint` prints open the "Model training" view (`workflowType=
machine_learning`) and compare the runs of one model at a time.

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

import dataclasses
import hashlib
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from evalharness.mlflow_view import (EXPERIMENT_KIND_TAG, HEADLINE, MAX_PARAM_LEN, MAX_TAG_LEN, _short, compare_url,
                                     experiment_url, flat_metrics, flat_params, gate_counts, headline_metrics,
                                     model_name, per_layer_csv, per_layer_rows, position_series, result_tags,
                                     run_verdict, split_metrics, step_series, write_plots)
from evalharness.results import iter_results

__all__ = ["Logged", "Tracker", "TrackingError", "compare_url", "default_experiment", "default_tracking_uri",
           "experiment_url", "file_sha256", "flat_metrics", "flat_params", "gate_counts", "headline_metrics",
           "make_result_logger", "position_series", "resolve_tracking_uri", "result_tags", "run_verdict",
           "split_metrics", "step_series"]

GATE_FILES = ("summary.md", "gate_summary.md", "gate.md", "junit.xml", "gate_junit.xml")
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
        self.run_models: dict[str, str] = {}  # run_key -> model name (one compare link per model)
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
            kind_key, kind = EXPERIMENT_KIND_TAG
            if exp is None:
                self._experiment_id = self.client.create_experiment(name, artifact_location=self._artifact_location(),
                                                                    tags={kind_key: kind})
            else:
                if exp.lifecycle_stage == "deleted":
                    self.client.restore_experiment(exp.experiment_id)
                self._experiment_id = exp.experiment_id
                if kind_key not in exp.tags:  # an experiment of an older evalharness; a kind a user chose stays
                    self.client.set_experiment_tag(self._experiment_id, kind_key, kind)
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

    def log_gate_files(self, run_id: str, run_key: str | None = None) -> list[str]:
        """Log the gate files (if any) under `gate/` of a run and tag it with a verdict; returns their names.

        The parent run (`run_key` None) gets the suite's verdict; a result's run gets its own (FAIL / WARN / PASS,
        ERROR for a baseline problem) and the metric `0_headline/gate.fail` (its count of failed checks)."""
        from mlflow.entities import Metric

        found = self.gate_files()
        for f in found:
            self.client.log_artifact(run_id, str(f), "gate")
        verdict = _gate_verdict(found)
        if found and run_key is not None:
            counts, problems = gate_counts(found)
            if run_key in counts:
                verdict = run_verdict(counts[run_key])
                ts = int(time.time() * 1000)
                self.client.log_batch(run_id, metrics=[Metric(f"{HEADLINE}gate.fail", counts[run_key]["FAIL"], ts, 0)])
            elif run_key in problems:
                verdict = "ERROR"
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
        self.run_models[key] = model_name(doc)
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
        flat, series = split_metrics(doc)
        # Headline first: the UI lists a run's metrics in the order the store returns them (insertion order), and
        # the compare page's parallel-coordinates plot colours by the first one.
        metrics = [Metric(k, v, ts, 0) for k, v in {**headline_metrics(doc), **flat}.items()]
        for name, pts in series.items():
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
            if write_plots(doc, tmpd / "plots"):  # at the root: the compare page lists common root files only
                self.client.log_artifacts(rid, str(tmpd / "plots"))
        self.log_gate_files(rid, doc["run_key"])
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
                keys = {self._parent_id: None} | {o.run_id: o.run_key for o in out if o.action == "unchanged"}
                for run_id, key in keys.items():
                    if run_id:
                        self.log_gate_files(run_id, key)
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
        """Where to look: the experiment's runs table and one compare page per model (its runs across recipes);
        for a local store, first the `mlflow ui` command that serves it."""
        exp = self._experiment_id or "0"
        server = self.uri.startswith(("http://", "https://"))
        base = self.uri if server else "http://127.0.0.1:5000"
        lines = [] if server else [f"browse: mlflow ui --backend-store-uri {self.uri} --port 5000, then open"]
        lines.append(f"  runs:    {experiment_url(base, exp)}")
        by_model: dict[str, list[str]] = {}
        for key, run_id in self.run_ids.items():
            by_model.setdefault(self.run_models.get(key, key.split("__")[0]), []).append(run_id)
        for model, ids in by_model.items():
            lines.append(f"  compare {model}: {compare_url(base, ids, [exp])}")
        return "\n".join(lines)


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
