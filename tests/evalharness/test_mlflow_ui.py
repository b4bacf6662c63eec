"""A real `mlflow server` on 127.0.0.1 (sqlite backend, artifacts in tmp): `evalharness log --tracking-uri
http://...` reads back with MlflowClient, and headless Chromium (selenium + the system chromedriver) opens the
mlflow 3.x compare-runs page of two recipes (a gate summary and task statistics included) and finds every
headline metric row with both runs' values as the UI formats them, the plots in its Artifacts section, and the
experiment link opening the runs table ("Model training" view)."""

from __future__ import annotations

import json
import math
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

from evalharness.mlflow_view import HEADLINE, headline_metrics  # noqa: E402
from evalharness.tracking import compare_url, experiment_url  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")]

KEYS = ("tiny-llama__fp32__default__cpu-emulated", "tiny-llama__fp8-block__default__cpu-emulated")
SMOKE = str(REPO / "suites" / "smoke.yaml")
WAIT_S = 90  # bounded explicit waits for the React app's API calls (seconds on an idle machine)
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
    _edit(res / f"{KEYS[1]}.json", _double_kld)  # a KLD regression the gate must FAIL (fp32 stays PASS)
    assert main(["gate", str(res), "--baselines", str(REPO / "baselines"), "--suite", SMOKE,
                 "--summary", str(res / "summary.md")]) == 1
    for i, key in enumerate(KEYS):  # task statistics (after the gate: the smoke baselines have no tasks)
        _edit(res / f"{key}.json", lambda doc, flips=4 * i: _add_task(doc, flips))
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


def _edit(path: Path, change) -> None:
    """Rewrite a result file with `change(doc)` applied."""
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _double_kld(doc: dict) -> None:
    """KLD mean and its per-window samples doubled: a regression the paired test detects."""
    doc["metrics"]["ppl_kld.kld_mean"] *= 2
    doc["samples"]["ppl_kld"]["window_kld"] = [2 * x for x in doc["samples"]["ppl_kld"]["window_kld"]]


def _add_task(doc: dict, flips: int) -> None:
    """arc_easy statistics of 40 documents (reference right on 30; the engine loses `flips` of them), computed by
    the tasks eval's own paired statistics."""
    from evalharness.evals.tasks import paired_task_metrics

    ref = [1] * 30 + [0] * 10
    eng = [0] * flips + ref[flips:]
    m, _ = paired_task_metrics({"correct": ref, "pred": ref, "lls": [None] * 40},
                               {"correct": eng, "pred": eng, "lls": [None] * 40})
    doc["metrics"].update({f"tasks.arc_easy.{k}": v for k, v in m.items()})


def ui_number(x: float) -> str:
    """A metric value as mlflow's UI prints it (Utils.formatMetric of mlflow 3.17: 0; 4 significant digits in
    exponent form below 1e-3; else rounded half-up to 3 / 2 / 1 decimals below 10 / 100 / above; JS toString)."""
    if x == 0:
        return "0"
    if abs(x) < 1e-3:
        mant, exp = f"{x:.3e}".split("e")
        return f"{mant}e{int(exp):+d}"
    digits = 3 if abs(x) < 10 else 2 if abs(x) < 100 else 1
    r = math.floor(x * 10 ** digits + 0.5) / 10 ** digits
    return str(int(r)) if r == int(r) else repr(r)


def test_ui_number_matches_mlflows_rules():
    """The formatter the browser test compares with: the cases of mlflow's Utils.formatMetric."""
    assert [ui_number(v) for v in (0.0, 1.0, 0.0513756, 1.0709626, 12.3456, 123.45, 2.5e-5, -0.1)] == \
        ["0", "1", "0.051", "1.071", "12.35", "123.5", "2.500e-5", "-0.1"]


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
    assert run.data.metrics[f"{HEADLINE}ppl_kld.kld_mean"] == doc["metrics"]["ppl_kld.kld_mean"]
    assert run.data.metrics[f"{HEADLINE}tasks.arc_easy.delta"] == doc["metrics"]["tasks.arc_easy.delta"] < 0
    assert run.data.metrics[f"{HEADLINE}gate.fail"] == 1 and run.data.tags["gate"] == "FAIL"
    assert runs[KEYS[0]].data.metrics[f"{HEADLINE}gate.fail"] == 0 and runs[KEYS[0]].data.tags["gate"] == "PASS"
    hist = {h.step: h.value for h in client.get_metric_history(run.info.run_id, "layer_error.resid_out.rel_l2")}
    assert hist[1] == doc["metrics"]["layer_error.layers.1.resid_out.rel_l2"]
    assert {"result", "per_layer", "error_vs_depth_rel_l2.png"} <= {a.path for a in client.list_artifacts(
        run.info.run_id)}
    assert logged["exp"].tags["mlflow.experimentKind"] == "custom_model_development"
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


@pytest.fixture
def browser(tmp_path, monkeypatch):
    """Headless Chromium driven by the system chromedriver (skips without them or selenium); always quit."""
    browser_bin, driver_path = _browser_paths()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager reach for the network
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser_bin
    for flag in CHROME_FLAGS + (f"--user-data-dir={tmp_path / 'profile'}",):
        opts.add_argument(flag)
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    drv.set_page_load_timeout(60)
    try:
        yield drv
    finally:
        drv.quit()


def _wait_for_text(drv, url: str, wanted: list[str], shot: Path) -> str:
    """Open `url` and wait (explicitly, bounded) until the page text holds every `wanted` string."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    drv.get(url)
    body = ""

    def rendered(d) -> bool:
        """All expected strings are on the page (the React app renders after its API calls)."""
        nonlocal body
        body = d.find_element(By.TAG_NAME, "body").text
        return all(w in body for w in wanted)

    try:
        WebDriverWait(drv, WAIT_S, poll_frequency=0.5).until(rendered)
    except TimeoutException:
        drv.save_screenshot(str(shot))
        pytest.fail(f"page {url} lacks {[w for w in wanted if w not in body]}; screenshot {shot}; "
                    f"page text:\n{body[:3000]}")
    return body


# The compare page's metrics table (mlflow 3.17: CompareRunMetricTable) is two react-virtualized grids, the names
# (cells holding a "Plot chart" link) and the values, 45 px rows in a 300 px box; only rows in view are in the DOM.
GRID_JS = """
const links = document.querySelectorAll('a[title="Plot chart"]');
if (!links.length) return null;
const header = links[0].closest('.ReactVirtualized__Grid');
const grids = [...document.querySelectorAll('.ReactVirtualized__Grid')];
const body = grids[grids.indexOf(header) + 1];
if (arguments[0] !== null) body.scrollTop = arguments[0];
const cells = g => [...g.querySelectorAll('.ReactVirtualized__Grid__innerScrollContainer > div')]
  .map(c => [parseInt(c.style.top), parseInt(c.style.left), c.textContent.trim()]);
return {names: cells(header), values: cells(body)};
"""
ROW_PX = 45


def read_metric_rows(drv, n_rows: int) -> list[list[str]]:
    """The first `n_rows` rows of the compare page's metrics table, [name, value of run 1, value of run 2] each,
    scrolling its grid (explicit bounded waits for each window to render)."""
    from selenium.webdriver.support.ui import WebDriverWait

    rows: dict[int, list[str]] = {}
    for first in range(0, n_rows, 4):
        want = range(first, min(first + 4, n_rows))

        def window(d, top=first * ROW_PX):
            """The rows of this window once both grids rendered them (None until then)."""
            grid = d.execute_script(GRID_JS, top)
            if not grid:
                return None
            names = {t // ROW_PX: text for t, _, text in grid["names"]}
            values: dict[int, dict[int, str]] = {}
            for t, left, text in grid["values"]:
                values.setdefault(t // ROW_PX, {})[left] = text
            if not all(r in names and len(values.get(r, {})) == 2 for r in want):
                return None
            return {r: [names[r]] + [v for _, v in sorted(values[r].items())] for r in want}

        rows.update(WebDriverWait(drv, WAIT_S, poll_frequency=0.5).until(window))
    return [rows[r] for r in range(n_rows)]


def test_compare_view_in_headless_chromium(logged, server, browser, tmp_path):
    """The compare page of the two recipes: the metrics table starts with the headline rows, each holding both
    runs' values as the UI formats them, the first of them on screen without scrolling; `0_headline/recipe` is the
    first param; the plots are artifacts common to both runs and open side by side."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    runs = [logged["runs"][k] for k in KEYS]
    docs = [json.loads((logged["dir"] / f"{k}.json").read_text()) for k in KEYS]
    heads = [{**headline_metrics(doc), **{k: v for k, v in run.data.metrics.items() if k.startswith(HEADLINE)}}
             for doc, run in zip(docs, runs)]
    names = sorted(heads[0])
    assert set(names) == set(heads[1]) and len(names) == 9  # gate, 4 of ppl_kld, arc_easy's delta / interval / p
    expected = [[n, ui_number(heads[0][n]), ui_number(heads[1][n])] for n in names]
    assert expected[0] == [f"{HEADLINE}gate.fail", "0", "1"]
    assert expected[5] == [f"{HEADLINE}tasks.arc_easy.delta", "0", "-0.1"]
    url = compare_url(server, [r.info.run_id for r in runs], [logged["exp"].experiment_id])
    body = _wait_for_text(browser, url, ["Comparing 2 Runs", *KEYS, *names[:6], "Artifacts"],
                          tmp_path / "compare.png")
    assert browser.find_element(By.XPATH, f"//a[@title='Plot chart'][.='{names[0]}']").is_displayed()
    got = read_metric_rows(browser, len(names) + 1)
    assert got[:len(names)] == expected, f"compare page {url}: metrics table starts {got}"
    assert not got[-1][0].startswith(HEADLINE)  # then the other metrics
    assert f"{HEADLINE}recipe fp32 fp8-block" in body.splitlines()  # the params table: one line per row
    node = browser.find_element(By.CSS_SELECTOR, "[data-testid='artifact-tree-node']"
                                                  "[artifact-name='error_vs_depth_rel_l2.png']")
    browser.execute_script("arguments[0].click()", node)  # the tree sits in a scroll box selenium calls hidden
    WebDriverWait(browser, WAIT_S, poll_frequency=0.5).until(  # the plot of each run, side by side
        lambda d: len([i for i in d.find_elements(By.TAG_NAME, "img")
                       if (i.get_attribute("src") or "").startswith("blob:") and i.is_displayed()]) == 2)


def test_experiment_link_opens_the_runs_table(logged, server, browser, tmp_path):
    """`experiment_url` opens the experiment's runs table ("Model training" view), not the GenAI overview."""
    url = experiment_url(server, logged["exp"].experiment_id)
    parent = logged["runs"][None].info.run_name  # the results runs are nested under it
    _wait_for_text(browser, url, ["Run Name", parent, "3 matching runs"], tmp_path / "experiment.png")
    assert "workflowType=machine_learning" in browser.current_url and "/runs" in browser.current_url
