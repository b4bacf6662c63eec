"""A real `mlflow server` on 127.0.0.1 (sqlite backend, artifacts in tmp): `evalharness log --tracking-uri
http://...` reads back with MlflowClient, and headless Chromium (selenium + the system chromedriver) opens
the mlflow 3.x compare-runs page of two recipes and finds both runs and their recipe params."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalharness.cli import main
from evalharness.results import load_result
from tests.conftest import REPO

pytest.importorskip("mlflow", reason="mlflow not installed (pip install -e '.[test]')")
from mlflow.tracking import MlflowClient  # noqa: E402

from evalharness.tracking import compare_url  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")]

KEYS = ("tiny-llama__fp32__default__cpu-emulated", "tiny-llama__fp8-block__default__cpu-emulated")
SERVER_START_S = 120  # bounded readiness wait (a loaded 2-core CI box needs ~10-30 s)
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1600,1200")


def _free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server's process group (the server and its uvicorn worker, all started here)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=15)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` on a free port, sqlite backend and artifact root in tmp; always terminated."""
    import requests

    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp}/server.db",
         "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no GenAI job runners: not used here
    try:
        deadline = time.time() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited ({proc.returncode}):\n{(tmp / 'server.log').read_text()[-3000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                pytest.fail(f"mlflow server not ready after {SERVER_START_S}s:\n"
                            f"{(tmp / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)
        log.close()


@pytest.fixture(scope="module")
def logged(server, tmp_path_factory) -> dict:
    """Two committed smoke baselines (result files of fp32 and fp8-block) logged through the server."""
    res = tmp_path_factory.mktemp("server-results")
    for key in KEYS:
        shutil.copy(REPO / "baselines" / "smoke" / f"{key}.json", res)
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        assert main(["log", str(res), "--tracking-uri", server, "--experiment", "ui-compare"]) == 0
    finally:
        mp.undo()
    client = MlflowClient(tracking_uri=server)
    exp = client.get_experiment_by_name("ui-compare")
    runs = {r.data.tags.get("run_key"): r for r in client.search_runs([exp.experiment_id])}
    return {"dir": res, "client": client, "exp": exp, "runs": runs}


def test_log_through_server(logged):
    """Params, metrics, a per-layer step value, artifacts and the parent, read back over HTTP."""
    client, runs = logged["client"], logged["runs"]
    assert set(KEYS) <= set(runs) and None in runs  # two children + the parent (no run_key tag)
    parent = runs[None]
    run = runs[KEYS[1]]
    doc = load_result(logged["dir"] / f"{KEYS[1]}.json")
    assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert run.data.params["recipe.name"] == "fp8-block" and run.data.params["recipe.linear.input"] == "e4m3:1x128"
    assert run.data.metrics["ppl_kld.kld_mean"] == doc["metrics"]["ppl_kld.kld_mean"]
    hist = {h.step: h.value for h in client.get_metric_history(run.info.run_id, "layer_error.resid_out.rel_l2")}
    assert hist[1] == doc["metrics"]["layer_error.layers.1.resid_out.rel_l2"]
    assert {"result", "per_layer", "plots"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert main(["log", str(logged["dir"]), "--tracking-uri", client.tracking_uri, "--experiment", "ui-compare"]) == 0
    assert len(client.search_runs([logged["exp"].experiment_id])) == 3  # idempotent over HTTP too


def _browser_paths() -> tuple[str, str]:
    """(chromium binary, chromedriver) from PATH, or skip with the reason."""
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                   None)
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("headless browser test needs chromium + chromedriver "
                    "(apt-get install chromium chromium-driver; .ci/run installs them)")
    return browser, driver


def test_compare_view_in_headless_chromium(logged, server, tmp_path, monkeypatch):
    """The compare-runs page of the two recipes renders both run names and their recipe params."""
    browser, driver_path = _browser_paths()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install -e '.[test]')")
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager reach for the network
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in CHROME_FLAGS + (f"--user-data-dir={tmp_path / 'profile'}",):
        opts.add_argument(flag)
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    url = compare_url(server, [logged["runs"][k].info.run_id for k in KEYS], [logged["exp"].experiment_id])
    wanted = ["Comparing 2 Runs", *KEYS, "recipe.linear.input", "e4m3:1x128"]
    try:
        drv.set_page_load_timeout(60)
        drv.get(url)
        body = ""

        def rendered(d) -> bool:
            """All expected strings are on the page (the React app renders after its API calls)."""
            nonlocal body
            body = d.find_element(By.TAG_NAME, "body").text
            return all(w in body for w in wanted)

        try:
            WebDriverWait(drv, 90, poll_frequency=0.5).until(rendered)
        except TimeoutException:
            drv.save_screenshot(str(tmp_path / "compare.png"))
            pytest.fail(f"compare page {url} lacks {[w for w in wanted if w not in body]}; "
                        f"screenshot {tmp_path / 'compare.png'}; page text:\n{body[:2000]}")
        row = next(ln for ln in body.splitlines() if ln.startswith("recipe.name"))
        assert "fp32" in row and "fp8-block" in row
    finally:
        drv.quit()
