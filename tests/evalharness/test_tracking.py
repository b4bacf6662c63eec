"""mlflow tracking: a small smoke run logged to the default sqlite store and read back with MlflowClient
(params, tags, metrics, per-layer step series, artifacts, parent/child), idempotent re-logs, position
series and non-finite tags, and an unreachable tracking server that must not fail `evalharness run`."""

from __future__ import annotations

import csv
import io
import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from evalharness.cli import main
from evalharness.results import load_result
from tests.conftest import REPO

mlflow = pytest.importorskip("mlflow", reason="mlflow not installed (pip install -e '.[test]')")
from mlflow.tracking import MlflowClient  # noqa: E402

from evalharness import tracking  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")

SMOKE = str(REPO / "suites" / "smoke.yaml")
TINY = ["--set", "models=[{name: tiny-llama, path: 'builtin:tiny-llama', corpus: 'builtin:tiny-llama'}]",
        "--set", "evals.ppl_kld.max_windows=4", "--set", "evals.ppl_kld.seq_len=64",
        "--set", "evals.layer_error.windows=1", "--set", "evals.layer_error.seq_len=64"]
FP8 = "tiny-llama__fp8-block__default__cpu-emulated"
FP32 = "tiny-llama__fp32__default__cpu-emulated"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    """No data dir and no ambient tracking URI: the default store beside the results is under test."""
    monkeypatch.delenv("EVALHARNESS_DATA_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> dict:
    """`run` (fp32 + fp8-block, tiny limits) logging to the default sqlite store, then `gate --summary`
    and `log` (which must add the gate summary and nothing else)."""
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    mp.delenv("EVALHARNESS_DATA_DIR", raising=False)
    out = tmp_path_factory.mktemp("tracked")
    try:
        assert main(["run", SMOKE, "--out", str(out), "--set", "recipe=fp32,fp8-block"] + TINY) == 0
        base = tmp_path_factory.mktemp("tracked-baselines")
        assert main(["baseline", "update", str(out), "--baselines", str(base)]) == 0
        assert main(["gate", str(out), "--baselines", str(base), "--summary", str(out / "summary.md")]) == 0
        assert main(["log", str(out)]) == 0
    finally:
        mp.undo()
    client = MlflowClient(tracking_uri=tracking.default_tracking_uri(out))
    exp = client.get_experiment_by_name("evalharness-smoke")
    runs = client.search_runs([exp.experiment_id])
    return {"out": out, "client": client, "exp": exp, "runs": runs,
            "child": {r.data.tags.get("run_key"): r for r in runs if r.data.tags.get("kind") == "result"},
            "parents": [r for r in runs if r.data.tags.get("kind") == "suite"]}


@pytest.mark.slow
def test_store_is_sqlite_beside_results(logged):
    """The default store is <out>/mlflow.db with artifacts in <out>/mlartifacts."""
    out = logged["out"]
    assert (out / "mlflow.db").is_file()
    assert logged["exp"].artifact_location == (out / "mlartifacts").resolve().as_uri()
    assert (out / "mlartifacts").is_dir()


@pytest.mark.slow
def test_parent_and_children(logged):
    """One parent run (the suite invocation) with both recipes as nested children; `log` added none."""
    assert len(logged["parents"]) == 1 and set(logged["child"]) == {FP32, FP8}
    parent = logged["parents"][0]
    assert parent.data.tags["suite"] == "smoke" and parent.data.tags["results_dir"] == str(logged["out"].resolve())
    for r in logged["child"].values():
        assert r.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert r.info.status == "FINISHED" and r.data.tags["logged"] == "complete"
    assert len(logged["runs"]) == 3
    assert parent.data.tags.get("gate") == "PASS"
    names = {a.path for a in logged["client"].list_artifacts(parent.info.run_id, "gate")}
    assert "gate/summary.md" in names
    assert [a.path for a in logged["client"].list_artifacts(parent.info.run_id, "suite")] == ["suite/suite.json"]


@pytest.mark.slow
def test_params_and_tags(logged):
    """Flat params (model, recipe name + every site, serving, backend, seed, suite) and provenance tags."""
    run = logged["child"][FP8]
    doc = load_result(logged["out"] / f"{FP8}.json")
    p, t = run.data.params, run.data.tags
    assert p["recipe.name"] == "fp8-block" and p["recipe.linear.input"] == "e4m3:1x128"
    assert p["recipe.linear.weight"] == "e4m3:128x128" and p["recipe.accumulate"] == "fp32"
    from engine.recipe import SITES

    assert all(f"recipe.{s}" in p for s in SITES)
    assert p["model.name"] == "tiny-llama" and p["serving.batch_size"] == "8" and p["serving.name"] == "default"
    assert p["backend"] == "cpu-emulated" and p["seed"] == "0" and p["suite"] == "smoke"
    assert p["evals.ppl_kld.max_windows"] == "4"
    assert t["run_key"] == FP8 and t["status"] == "ok" and t["suite"] == "smoke"
    assert t["suite_sha"] == doc["suite"]["sha256"] and t["git_sha"] == doc["provenance"]["git_sha"]
    assert t["hardware_class"] == "cpu" and t["cpu"] == doc["provenance"]["hardware"]["cpu"]
    assert t["result_sha"] == tracking.file_sha256(logged["out"] / f"{FP8}.json")
    assert t["mlflow.runName"] == FP8 and "nonfinite_metrics" not in t


@pytest.mark.slow
def test_metrics_and_per_layer_step_series(logged):
    """Every finite metric is logged as is; per-layer stats are step series indexed by layer."""
    client, run = logged["client"], logged["child"][FP8]
    m = load_result(logged["out"] / f"{FP8}.json")["metrics"]
    assert run.data.metrics["ppl_kld.kld_mean"] == m["ppl_kld.kld_mean"]
    assert run.data.metrics["0_headline/ppl_kld.kld_mean"] == m["ppl_kld.kld_mean"]
    assert run.data.metrics["0_headline/gate.fail"] == 0 and run.data.tags["gate"] == "PASS"
    assert not any(".layers." in k or ".pos0_" in k for k in run.data.metrics)  # series, not flat keys
    assert len(run.data.metrics) < sum(1 for k in m if m[k] is not None) / 2
    buckets = {h.step: h.value for h in client.get_metric_history(run.info.run_id, "ppl_kld.pos_bucket.kld_mean")}
    first = next(k for k in m if k.startswith("ppl_kld.pos0_") and k.endswith(".kld_mean"))
    assert min(buckets) == 0 and buckets[0] == m[first] and len(buckets) == 4
    hist = client.get_metric_history(run.info.run_id, "layer_error.mlp.out.rel_l2")
    by_step = {h.step: h.value for h in hist}
    n_layers = 1 + max(int(k.split(".")[2]) for k in m if k.startswith("layer_error.layers."))
    assert sorted(by_step) == list(range(n_layers)) == [0, 1, 2, 3]
    assert by_step[2] == m["layer_error.layers.2.mlp.out.rel_l2"]
    assert by_step[0] == m["layer_error.layers.0.mlp.out.rel_l2"]
    sqnr = {h.step: h.value for h in client.get_metric_history(run.info.run_id, "layer_error.attn.q.sqnr_db")}
    assert sqnr[3] == m["layer_error.layers.3.attn.q.sqnr_db"]
    by_pos = load_result(logged["out"] / f"{FP8}.json")["samples"]["ppl_kld"].get("kld_by_position")
    if by_pos:  # the ppl_kld eval records KLD by position: logged as a step series (step = position)
        hist = {h.step: h.value for h in client.get_metric_history(run.info.run_id, "ppl_kld.kld_by_position")}
        assert hist == {i: v for i, v in enumerate(by_pos) if v is not None}


@pytest.mark.slow
def test_artifacts(logged, tmp_path):
    """Result JSON, per-layer CSV (layer, tap, stat, value), error-vs-depth PNGs and the gate summary."""
    client, run = logged["client"], logged["child"][FP8]
    rid = run.info.run_id
    top = {a.path for a in client.list_artifacts(rid)}
    assert {"result", "per_layer", "gate", "error_vs_depth_rel_l2.png", "error_vs_depth_sqnr_db.png"} <= top
    assert [a.path for a in client.list_artifacts(rid, "result")] == [f"result/{FP8}.json"]
    local = Path(client.download_artifacts(rid, "per_layer/layer_error.csv", str(tmp_path)))
    rows = list(csv.DictReader(io.StringIO(local.read_text())))
    assert list(rows[0]) == ["layer", "tap", "stat", "value"]
    m = load_result(logged["out"] / f"{FP8}.json")["metrics"]
    row = next(r for r in rows if r["layer"] == "1" and r["tap"] == "attn.o_proj" and r["stat"] == "rel_l2")
    assert float(row["value"]) == m["layer_error.layers.1.attn.o_proj.rel_l2"]
    png = Path(client.download_artifacts(rid, "error_vs_depth_rel_l2.png", str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(Path(client.download_artifacts(rid, f"result/{FP8}.json", str(tmp_path))).read_text())
    assert doc == load_result(logged["out"] / f"{FP8}.json")


@pytest.mark.slow
def test_relog_is_idempotent_and_force_replaces(logged, capsys):
    """`log` again changes nothing; `log --force` replaces each child (same count, new ids, same parent)."""
    out, client, exp = logged["out"], logged["client"], logged["exp"]
    before = {r.info.run_id for r in client.search_runs([exp.experiment_id])}
    assert main(["log", str(out)]) == 0
    assert "unchanged" in capsys.readouterr().out
    assert {r.info.run_id for r in client.search_runs([exp.experiment_id])} == before
    assert main(["log", str(out), "--force"]) == 0
    assert "replaced" in capsys.readouterr().out
    after = client.search_runs([exp.experiment_id])
    children = [r for r in after if r.data.tags.get("kind") == "result"]
    assert len(after) == 3 and len(children) == 2
    assert not ({r.info.run_id for r in children} & before)
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {logged["parents"][0].info.run_id}


@pytest.mark.slow
def test_position_series_and_nonfinite(logged, tmp_path):
    """A result with `samples.ppl_kld.kld_by_position` and a null metric: a step series and a tag."""
    src = load_result(logged["out"] / f"{FP32}.json")
    src["samples"]["ppl_kld"]["kld_by_position"] = [0.5, 0.25, None, 0.125]
    src["metrics"]["ppl_kld.kld_p999"] = None
    d = tmp_path / "synthetic"
    d.mkdir()
    (d / f"{FP32}.json").write_text(json.dumps(src))
    tr = tracking.Tracker(d, tracking.default_tracking_uri(logged["out"]), "synthetic")
    [item] = tr.log_dir()
    client = logged["client"]
    hist = {h.step: h.value for h in client.get_metric_history(item.run_id, "ppl_kld.kld_by_position")}
    assert hist == {0: 0.5, 1: 0.25, 3: 0.125}
    run = client.get_run(item.run_id)
    assert run.data.tags["nonfinite_metrics"] == "ppl_kld.kld_p999"
    assert "ppl_kld.kld_p999" not in run.data.metrics
    assert "ppl_kld_kld_by_position.png" in {a.path for a in client.list_artifacts(item.run_id)}


def test_headline_and_series_of_a_result():
    """Headline copies (KLD, PPL ratio, top-1, each configured task's delta / interval / p) in logging order; the
    per-layer, position-bucket and indexed-bucket keys become step series and leave the flat metrics."""
    doc = load_result(REPO / "baselines" / "smoke" / f"{FP8}.json")
    m = doc["metrics"]
    doc["metrics"] = {**m, "tasks.mmlu.delta": -0.02, "tasks.mmlu.delta_lo": -0.05, "tasks.mmlu.delta_hi": 0.01,
                      "tasks.mmlu.mcnemar_p": 0.2, "tasks.mmlu_anatomy.delta": 0.1, "tasks.arc_easy.delta": 0.0,
                      "longctx.kld_bucket0": 0.1, "longctx.kld_bucket1": 0.3}
    doc["spec"]["evals"]["tasks"] = {"tasks": ["mmlu"]}
    doc["samples"]["longctx"] = {"kld_bucket_edges": [0, 512, 1024]}
    head = tracking.headline_metrics(doc)
    assert list(head)[:4] == [f"0_headline/ppl_kld.{k}" for k in ("kld_mean", "ppl_ratio", "top1_agree", "kld_p99")]
    assert head["0_headline/ppl_kld.ppl_ratio"] == m["ppl_kld.ppl_ratio"]
    assert [k for k in head if "tasks" in k] == [f"0_headline/tasks.mmlu.{s}" for s in
                                                  ("delta", "delta_lo", "delta_hi", "mcnemar_p")]
    flat, series = tracking.split_metrics(doc)
    assert series["longctx.kld_bucket"] == [(0, 0.1), (512, 0.3)]
    lo = sorted(int(k.split(".")[1][3:].split("_")[0]) for k in m if k.startswith("ppl_kld.pos") and
                k.endswith(".kld_mean"))
    assert [s for s, _ in series["ppl_kld.pos_bucket.kld_mean"]] == lo and len(lo) == 4
    assert series["layer_error.mlp.out.rel_l2"][3] == (3, m["layer_error.layers.3.mlp.out.rel_l2"])
    assert not [k for k in flat if ".layers." in k or ".pos" in k or "bucket" in k]
    assert flat["ppl_kld.kld_mean"] == m["ppl_kld.kld_mean"] and "tasks.mmlu.delta" in flat


def test_gate_counts_from_summary_and_junit(tmp_path):
    """Per-run verdict counts from the gate's markdown summary and from its JUnit XML agree."""
    from evalharness.gate import Verdict
    from evalharness.report import write_junit, write_summary

    vs = [Verdict(run_key=k, metric=f"m{i}", verdict=v)
          for i, (k, v) in enumerate([("a", "PASS"), ("a", "FAIL"), ("b", "WARN"), ("b", "PASS")])]
    md = write_summary(tmp_path / "summary.md", vs, ["c: no baseline at x"], 1)
    xml = write_junit(tmp_path / "junit.xml", vs, ["c: no baseline at x"])
    for files in ([md], [xml]):
        counts, problems = tracking.gate_counts(files)
        assert counts == {"a": {"PASS": 1, "WARN": 0, "FAIL": 1}, "b": {"PASS": 1, "WARN": 1, "FAIL": 0}}
        assert problems == {"c"}
        assert [tracking.run_verdict(counts[k]) for k in "ab"] == ["FAIL", "WARN"]


def test_ui_hint_one_compare_link_per_model(tmp_path):
    """`log` prints the runs table link ("Model training" view) and one compare link per model."""
    tr = tracking.Tracker(tmp_path, "http://mlflow.example:5000")
    tr._experiment_id = "3"
    tr.run_ids = {"a__fp32": "r1", "b__fp32": "r2", "a__fp8": "r3"}
    tr.run_models = {"a__fp32": "a", "b__fp32": "b", "a__fp8": "a"}
    lines = tr.ui_hint().splitlines()
    assert lines[0].endswith("http://mlflow.example:5000/#/experiments/3/runs?workflowType=machine_learning")
    assert lines[1] == "  compare a: " + tracking.compare_url("http://mlflow.example:5000", ["r1", "r3"], ["3"])
    assert lines[2] == "  compare b: " + tracking.compare_url("http://mlflow.example:5000", ["r2"], ["3"])


def test_metric_by_position_keys_become_a_series():
    """`<eval>.<name>_by_position.<pos>` metrics are a step series too (no store needed)."""
    doc = {"run_key": "k", "metrics": {"ppl_kld.kld_by_position.0": 0.1, "ppl_kld.kld_by_position.64": 0.3,
                                       "layer_error.layers.0.mlp.out.rel_l2": 0.2}}
    series = tracking.step_series(doc)
    assert series["ppl_kld.kld_by_position"] == [(0, 0.1), (64, 0.3)]
    assert series["layer_error.mlp.out.rel_l2"] == [(0, 0.2)]


def _free_port() -> int:
    """A TCP port nobody listens on (bound then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_unreachable_server_does_not_fail_run(tmp_path, monkeypatch, capsys):
    """`run --tracking-uri http://<nothing>`: exit 0, every result on disk and valid, one warning, fast."""
    for k, v in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "res"
    uri = f"http://127.0.0.1:{_free_port()}"
    t0 = time.time()
    code = main(["run", SMOKE, "--out", str(out), "--set", "recipe=fp32,bf16", "--tracking-uri", uri] + TINY)
    err = capsys.readouterr().err
    assert code == 0, err
    assert time.time() - t0 < 300
    for key in (FP32, "tiny-llama__bf16__default__cpu-emulated"):
        assert load_result(out / f"{key}.json")["status"] == "ok"
    assert err.count("warning: mlflow tracking off") == 1 and "unreachable" in err
    assert f"evalharness log {out} --tracking-uri {uri}" in err
    assert not (out / "mlflow.db").exists()
    assert main(["log", str(out), "--tracking-uri", uri]) == 1
    assert "unreachable" in capsys.readouterr().err


def test_failing_hook_never_loses_a_result(tmp_path):
    """The runner's hook guard: an exception from the logging hook is a warning; the file stays."""
    from evalharness.runner import _notify

    msgs: list[str] = []
    path = tmp_path / "r.json"
    path.write_text("{}")

    def boom(p, d):
        """A logging hook whose store is broken."""
        raise RuntimeError("store exploded")

    _notify(boom, path, {}, msgs.append)
    assert path.read_text() == "{}" and "store exploded" in msgs[0] and "on disk" in msgs[0]


def test_no_tracking_flag(tmp_path):
    """`--no-tracking` writes results and no store."""
    out = tmp_path / "res"
    assert main(["run", SMOKE, "--out", str(out), "--set", "recipe=fp32", "--no-tracking"] + TINY) == 0
    assert (out / f"{FP32}.json").exists() and not (out / "mlflow.db").exists()


def test_compare_url_shape():
    """The mlflow 3.x compare-runs route with JSON lists of run and experiment ids (URL-encoded)."""
    url = tracking.compare_url("http://h:5000/", ["a1", "b2"], ["7"])
    assert url == "http://h:5000/#/compare-runs?runs=%5B%22a1%22%2C%22b2%22%5D&experiments=%5B%227%22%5D"


def test_log_missing_dir_is_bad_input(tmp_path, capsys):
    """`log` on a folder that does not exist: exit 2 naming it."""
    assert main(["log", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.slow
def test_same_file_from_another_folder_is_unchanged(logged, tmp_path):
    """The same result file logged from another folder is recognised by its sha: no duplicate."""
    d = tmp_path / "copy"
    d.mkdir()
    shutil.copy(logged["out"] / f"{FP8}.json", d)
    [item] = tracking.Tracker(d, tracking.default_tracking_uri(logged["out"]), "evalharness-smoke").log_dir()
    assert item.action == "unchanged"


def test_missing_mlflow_warns_once_and_keeps_results(tmp_path, monkeypatch):
    """Without mlflow the run hook warns once (with the install hint) and never raises."""
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # import of mlflow.tracking now fails
    with pytest.raises(tracking.TrackingError, match="not installed"):
        tracking.Tracker(tmp_path).client
    msgs: list[str] = []
    on_result, tracker = tracking.make_result_logger(tmp_path, None, log=msgs.append)
    for key in (FP32, FP8):
        src = REPO / "baselines" / "smoke" / f"{key}.json"
        shutil.copy(src, tmp_path)
        on_result(tmp_path / src.name, {})
    assert len(msgs) == 1 and "evalharness[tracking]" in msgs[0] and tracker.disabled
    assert tracker.summary() is None
