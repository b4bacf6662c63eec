"""mlflow under faults: an unreachable tracking server and one that dies in the middle of a suite. Tracking is a
view of the result files: `run` warns once, keeps every result, exits 0, and `evalharness log` catches up."""

from __future__ import annotations

import pytest

from evalharness.results import load_result
from tests.faults.support import MlflowServer, cli, free_port, model, token_corpus, write_suite

mlflow = pytest.importorskip("mlflow", reason="mlflow not installed (pip install -e '.[test]')")
from mlflow.tracking import MlflowClient  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")
KEYS = ("m__fp32__default__cpu-emulated", "m__bf16__default__cpu-emulated", "m__fp8-block__default__cpu-emulated")


@pytest.fixture
def fast_http(monkeypatch):
    """No retries, short timeouts: a dead server is noticed in seconds."""
    for k, v in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _suite(tmp_path, recipes):
    entry = {"name": "m", "path": str(model(tmp_path, "m")), "corpus": str(token_corpus(tmp_path / "c.json"))}
    return write_suite(tmp_path / "s.yaml", [entry], recipes=recipes)


def test_unreachable_server(tmp_path, capsys, fast_http):
    """Nothing listens at the tracking URI: one warning naming it, the result on disk, exit 0; `log` to it exits 1."""
    uri = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    code, text = cli(capsys, "run", _suite(tmp_path, ("fp32",)), "--out", out, "--tracking-uri", uri)
    assert code == 0, text
    assert text.count("warning: mlflow tracking off") == 1 and "unreachable" in text and uri in text
    assert load_result(out / f"{KEYS[0]}.json")["status"] == "ok"
    code, text = cli(capsys, "log", out, "--tracking-uri", uri)
    assert code == 1 and "unreachable" in text


@pytest.mark.slow
def test_server_dies_during_the_suite(tmp_path, capsys, fast_http, monkeypatch):
    """The server is killed while the second run computes: the first result is logged (FINISHED), one warning,
    every result on disk, exit 0; `evalharness log` into the same store afterwards adds the other two."""
    import evalharness.runner as runner

    server = MlflowServer(tmp_path)
    try:
        real, calls = runner.run_eval, {"n": 0}

        def kill_server_midway(name, ctx, cfg):
            calls["n"] += 1
            if calls["n"] == 3:  # the first eval of the second run
                server.kill()
            return real(name, ctx, cfg)

        monkeypatch.setattr(runner, "run_eval", kill_server_midway)
        out = tmp_path / "out"
        code, text = cli(capsys, "run", _suite(tmp_path, ("fp32", "bf16", "fp8-block")), "--out", out,
                         "--tracking-uri", server.url)
    finally:
        server.stop()
    assert code == 0, text
    assert text.count("warning: mlflow tracking off") == 1
    for key in KEYS:
        assert load_result(out / f"{key}.json")["status"] == "ok"
    client = MlflowClient(server.store)  # the dead server's store, read directly
    exp = client.get_experiment_by_name("evalharness-faults")
    logged = {r.data.tags["run_key"]: r.info.status for r in client.search_runs([exp.experiment_id])
              if r.data.tags.get("kind") == "result"}
    assert logged == {KEYS[0]: "FINISHED"}
    code, text = cli(capsys, "log", out, "--tracking-uri", server.store)
    assert code == 0, text
    logged = {r.data.tags["run_key"]: r.info.status for r in client.search_runs([exp.experiment_id])
              if r.data.tags.get("kind") == "result"}
    assert logged == {k: "FINISHED" for k in KEYS}
