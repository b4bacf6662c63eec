"""`--resume` keyed by content: a result records the fingerprint of what produced it, and a run whose recipe, eval
settings, checkpoint, tokenizer or corpus changed is run again, saying what changed (row of the fault table: the old
result was reused silently, and stale numbers were reported and gated). And kill -9 at random points of a suite, then
`--resume`: the results equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalharness.results import load_result
from tests.conftest import REPO
from tests.faults.support import cli, model, token_corpus, write_suite

KEYS = ("m__fp32__default__cpu-emulated", "m__mine__default__cpu-emulated")


def _setup(tmp_path) -> tuple[Path, Path]:
    """A suite of one model under fp32 and a recipe file `mine.yaml` (fp8-block)."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: mine\nextends: fp8-block\n")
    entry = {"name": "m", "path": str(model(tmp_path, "m")), "corpus": str(token_corpus(tmp_path / "c.json"))}
    return write_suite(tmp_path / "s.yaml", [entry], recipes=("fp32", str(recipe))), recipe


def _mtimes(out: Path) -> dict[str, int]:
    return {k: (out / f"{k}.json").stat().st_mtime_ns for k in KEYS}


def test_resume_reruns_a_run_whose_recipe_file_changed(tmp_path, capsys):
    """Unchanged: both runs skipped. The recipe file edited: that run is run again (and says why), the other kept;
    the new result holds the new recipe's numbers."""
    suite, recipe = _setup(tmp_path)
    out = tmp_path / "out"
    assert cli(capsys, "run", suite, "--out", out, "--no-tracking")[0] == 0
    before = _mtimes(out)
    kld = load_result(out / f"{KEYS[1]}.json")["metrics"]["ppl_kld.kld_mean"]
    code, log = cli(capsys, "run", suite, "--out", out, "--no-tracking", "--resume")
    assert code == 0 and log.count("already finished (resume)") == 2 and _mtimes(out) == before
    recipe.write_text("name: mine\nextends: fp8-block\nresidual: e4m3:tensor\n")
    code, log = cli(capsys, "run", suite, "--out", out, "--no-tracking", "--resume")
    assert code == 0, log
    assert f"resume: {KEYS[1]}: recipe changed since its result was written: running it again" in log
    assert f"{KEYS[0]}: already finished (resume)" in log
    after = _mtimes(out)
    assert after[KEYS[0]] == before[KEYS[0]] and after[KEYS[1]] != before[KEYS[1]]
    doc = load_result(out / f"{KEYS[1]}.json")
    assert doc["spec"]["recipe"]["residual"] == "e4m3:tensor" and doc["metrics"]["ppl_kld.kld_mean"] > kld


def test_resume_reruns_runs_whose_eval_settings_or_corpus_changed(tmp_path, capsys):
    """An eval setting changed with --set: both runs again, naming the eval; then the corpus file's content
    changed (same path): both again, naming the corpus."""
    suite, _ = _setup(tmp_path)
    out = tmp_path / "out"
    assert cli(capsys, "run", suite, "--out", out, "--no-tracking")[0] == 0
    code, log = cli(capsys, "run", suite, "--out", out, "--no-tracking", "--resume",
                    "--set", "evals.ppl_kld.max_windows=3")
    assert code == 0 and log.count("evals.ppl_kld changed since its result was written") == 2, log
    assert load_result(out / f"{KEYS[0]}.json")["metrics"]["ppl_kld.n_windows"] == 3
    token_corpus(tmp_path / "c.json", n=401)
    code, log = cli(capsys, "run", suite, "--out", out, "--no-tracking", "--resume",
                    "--set", "evals.ppl_kld.max_windows=3")
    assert code == 0 and log.count("corpus changed since its result was written") == 2, log


def test_resume_reruns_results_without_a_fingerprint(tmp_path, capsys):
    """A result of an older harness (no fingerprint) is not trusted: it runs again."""
    suite, _ = _setup(tmp_path)
    out = tmp_path / "out"
    assert cli(capsys, "run", suite, "--out", out, "--no-tracking", "--set", "recipe=fp32")[0] == 0
    path = out / f"{KEYS[0]}.json"
    doc = json.loads(path.read_text())
    del doc["fingerprint"]
    path.write_text(json.dumps(doc))
    code, log = cli(capsys, "run", suite, "--out", out, "--no-tracking", "--resume", "--set", "recipe=fp32")
    assert code == 0 and "no fingerprint (written by an older harness)" in log
    assert "fingerprint" in load_result(path)


def _run_cli(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "evalharness.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_equals_an_uninterrupted_run(tmp_path):
    """A suite killed with SIGKILL at random points (between and inside runs, during a result write or the model
    load) and resumed each time until it is complete: every result equals the uninterrupted run's, metrics,
    samples and fingerprint alike, and no temporary file is left behind."""
    entry = {"name": "m", "path": str(model(tmp_path, "m")), "corpus": str(token_corpus(tmp_path / "c.json", n=2000))}
    evals = {"layer_error": {"windows": 4, "seq_len": 64}, "ppl_kld": {"seq_len": 64, "max_windows": 16}}
    suite = write_suite(tmp_path / "s.yaml", [entry], evals=evals,
                        recipes=("fp32", "bf16", "fp8-tensor", "fp8-block", "fp8-kv", "mxfp8"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = ["run", str(suite), "--no-tracking"]
    ref_out, out = tmp_path / "uninterrupted", tmp_path / "killed"
    assert subprocess.run([sys.executable, "-m", "evalharness.cli", *base, "--out", str(ref_out)], cwd=REPO, env=env,
                          capture_output=True).returncode == 0
    keys = sorted(p.name for p in ref_out.glob("m__*.json"))
    rng = random.Random(35)
    kills = 0
    for attempt in range(4):  # then one last --resume completes the suite
        done = len(list(out.glob("m__*.json")))
        if done == len(keys):
            break
        proc = _run_cli(base + ["--out", str(out), "--resume"], env)
        target = done + rng.randrange(0, 2)  # die before or after the next result, at a random moment
        delay = rng.uniform(0.0, 0.6)
        deadline = time.monotonic() + 120
        while proc.poll() is None and len(list(out.glob("m__*.json"))) < target and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    assert kills >= 2  # it really was interrupted, more than once
    proc = subprocess.run([sys.executable, "-m", "evalharness.cli", *base, "--out", str(out), "--resume"], cwd=REPO,
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("m__*.json")) == keys
    for name in keys:
        a, b = load_result(ref_out / name), load_result(out / name)
        assert a["status"] == b["status"] == "ok"
        assert a["metrics"] == b["metrics"] and a["samples"] == b["samples"], name
        assert a["fingerprint"] == b["fingerprint"], name
    assert not list(out.glob(".*.tmp"))
