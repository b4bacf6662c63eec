"""The gate compares like with like, and bad gate input is a clear exit 2. Rows of the fault table:

* a baseline that belongs to another run (another run key, other eval settings): accepted, PASS before;
* a baseline metric that is a string: a traceback, exit 1 (the regression code) before;
* `baseline update` on a NaN result: promoted without a word before;
* a results folder without suite.json: gated by the default rules, silently, before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from evalharness.cli import main
from evalharness.results import load_result
from tests.faults.support import cli, model, token_corpus, write_suite

FP8 = "m__fp8-block__default__cpu-emulated.json"
FP32 = "m__fp32__default__cpu-emulated.json"
GATE = {"rules": [{"metric": "ppl_kld.kld_mean", "direction": "lower", "abs_tol": 1e-6, "rel_tol": 0.25,
                   "samples": "ppl_kld.window_kld"}]}


@pytest.fixture(scope="module")
def gated(tmp_path_factory) -> dict[str, Path]:
    """One small suite run (fp32, fp8-block) and its promoted baselines, shared by the tests (which copy them)."""
    tmp = tmp_path_factory.mktemp("gated")
    entry = {"name": "m", "path": str(model(tmp, "m")), "corpus": str(token_corpus(tmp / "c.json"))}
    suite = write_suite(tmp / "s.yaml", [entry], recipes=("fp32", "fp8-block"), gate=GATE)
    out, base = tmp / "out", tmp / "baselines"
    assert main(["run", str(suite), "--out", str(out), "--no-tracking"]) == 0
    assert main(["baseline", "update", str(out), "--baselines", str(base)]) == 0
    assert main(["gate", str(out), "--baselines", str(base)]) == 0
    return {"suite": suite, "out": out, "base": base, "entry": entry, "tmp": tmp}


def _copy(gated, tmp_path) -> tuple[Path, Path]:
    out, base = tmp_path / "out", tmp_path / "baselines"
    shutil.copytree(gated["out"], out)
    shutil.copytree(gated["base"], base)
    return out, base


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def test_baseline_of_another_run_key_is_an_error(gated, tmp_path, capsys):
    """fp8-block's baseline file holding fp32's baseline (copied over it): exit 2, naming both run keys and the
    file, instead of a comparison with fp32's numbers."""
    out, base = _copy(gated, tmp_path)
    shutil.copy(base / "faults" / FP32, base / "faults" / FP8)
    code, text = cli(capsys, "gate", out, "--baselines", base)
    assert code == 2, text
    assert "does not match this result" in text and "m__fp32__default__cpu-emulated" in text
    assert str(base / "faults" / FP8) in text and "baseline update" in text


def test_baseline_with_other_eval_settings_is_an_error(gated, tmp_path, capsys):
    """A baseline measured on 64-token windows gating a run on 32-token ones: exit 2 naming the setting."""
    out, base = _copy(gated, tmp_path)
    _edit(base / "faults" / FP8, lambda d: d["spec"]["evals"]["ppl_kld"].update(seq_len=64))
    code, text = cli(capsys, "gate", out, "--baselines", base)
    assert code == 2 and "evals.ppl_kld" in text and "seq_len=32 (baseline 64)" in text, text


def test_baseline_of_another_checkpoint_is_an_error(gated, tmp_path, capsys):
    """Same run key and settings, another checkpoint hash: exit 2."""
    out, base = _copy(gated, tmp_path)
    _edit(base / "faults" / FP8, lambda d: d["provenance"].update(model_sha256="0" * 64))
    code, text = cli(capsys, "gate", out, "--baselines", base)
    assert code == 2 and "another checkpoint" in text, text


def test_baseline_with_other_sample_counts_is_a_warn(gated, tmp_path, capsys):
    """Only the number of windows differs: the gate compares, and a WARN on the run says so; exit 0."""
    out, base = _copy(gated, tmp_path)
    _edit(base / "faults" / FP8, lambda d: d["spec"]["evals"]["ppl_kld"].update(max_windows=4))
    code, text = cli(capsys, "gate", out, "--baselines", base)
    assert code == 0, text
    line = next(ln for ln in text.splitlines() if ln.startswith("WARN") and "  baseline: " in ln)
    assert "m__fp8-block" in line and "max_windows=2 (baseline 4)" in line and "number of samples" in line


def test_string_metric_in_a_baseline_is_exit_2(gated, tmp_path, capsys):
    """A baseline metric that is a string: exit 2 naming the file and the metric, not a traceback."""
    out, base = _copy(gated, tmp_path)
    _edit(base / "faults" / FP8, lambda d: d["metrics"].update({"ppl_kld.kld_mean": "0.05"}))
    code, text = cli(capsys, "gate", out, "--baselines", base)
    assert code == 2, text
    assert FP8 in text and "metric 'ppl_kld.kld_mean' is '0.05'" in text and "not a number" in text


def test_baseline_update_refuses_nan_results(gated, tmp_path, capsys):
    """`baseline update` of a result with a NaN metric: exit 2 naming the run and metric, nothing written;
    --force promotes it with a warning."""
    out = tmp_path / "out"
    shutil.copytree(gated["out"], out)
    _edit(out / FP8, lambda d: d["metrics"].update({"ppl_kld.kld_mean": None}))
    base = tmp_path / "fresh"
    code, text = cli(capsys, "baseline", "update", out, "--baselines", base)
    assert code == 2 and "m__fp8-block__default__cpu-emulated" in text and "ppl_kld.kld_mean" in text, text
    assert "--force" in text and not base.exists()
    code, text = cli(capsys, "baseline", "update", out, "--baselines", base, "--force")
    assert code == 0 and "warning" in text
    assert load_result(base / "faults" / FP8)["metrics"]["ppl_kld.kld_mean"] is None


def test_results_without_suite_json_need_suite(gated, tmp_path, capsys):
    """No suite.json: exit 2 saying to pass --suite; with --suite the suite file's rules gate it."""
    out, base = _copy(gated, tmp_path)
    (out / "suite.json").unlink()
    code, text = cli(capsys, "gate", out, "--baselines", base)
    assert code == 2 and "suite.json is missing" in text and "--suite" in text, text
    code, text = cli(capsys, "gate", out, "--baselines", base, "--suite", gated["suite"], "-v")
    assert code == 0 and "ppl_kld.kld_mean" in text and "layer_error" not in text, text
