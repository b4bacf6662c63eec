"""CI entry points: the GitHub Actions workflows parse and have the expected structure (and are mirrored
under .github/workflows), ci/gate.sh runs end to end, and the nightly suite loads."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from engine.recipe import named_recipes
from evalharness.cli import main
from evalharness.errors import SuiteError
from evalharness.gate import validate_rules
from evalharness.suite import load_suite
from tests.conftest import REPO

WORKFLOWS = REPO / "ci" / "workflows"


def _load(name: str) -> dict:
    """A workflow file; YAML 1.1 reads the key `on` as True, so normalise it."""
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def _runs(job: dict) -> str:
    """All `run:` scripts of a job, joined."""
    return "\n".join(s.get("run", "") for s in job["steps"])


@pytest.mark.parametrize("name", ["pr-gate.yml", "nightly.yml"])
def test_workflows_are_mirrored(name):
    """.github/workflows holds the same files as ci/workflows (GitHub only reads the former)."""
    assert (REPO / ".github" / "workflows" / name).read_text() == (WORKFLOWS / name).read_text()


def test_pr_gate_workflow():
    """PR gate: CPU runner, CPU torch, editable install with the test extra, ci/gate.sh, artifacts always."""
    wf = _load("pr-gate.yml")
    assert "pull_request" in wf["on"]
    job = wf["jobs"]["gate"]
    assert job["runs-on"] == "ubuntu-latest"
    runs = _runs(job)
    assert "download.pytorch.org/whl/cpu" in runs and "torch==" in runs
    assert "pip install -e '.[test]'" in runs and "ci/gate.sh gate-out" in runs
    upload = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    paths = upload["with"]["path"]
    assert all(p in paths for p in ("gate-out/results/", "gate-out/junit.xml", "gate-out/summary.md"))
    assert "python -m pytest -q" in _runs(wf["jobs"]["tests"])


def test_nightly_workflow():
    """Nightly: cron + manual trigger, GPU runner label, nightly suite with --resume, report + trend, upload."""
    wf = _load("nightly.yml")
    assert wf["on"]["schedule"][0]["cron"] and "workflow_dispatch" in wf["on"]
    job = wf["jobs"]["nightly"]
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    runs = _runs(job)
    assert "evalharness run suites/nightly.yaml" in runs and "--resume" in runs and "--device cuda" in runs
    assert "evalharness report" in runs and "evalharness trend" in runs and "GITHUB_STEP_SUMMARY" in runs
    upload = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and "nightly-out/" in upload["with"]["path"]


def test_nightly_suite_loads():
    """suites/nightly.yaml: the native engine, every named recipe, valid gate rules, the zoo models + stories260K
    with a data dir, at the sizes of a real nightly (PPL 256 x 512, hundreds of documents per task and in MMLU,
    1024 new tokens)."""
    raw = yaml.safe_load((REPO / "suites" / "nightly.yaml").read_text())
    assert raw["backend"] == "cuda-native"
    assert sorted(raw["recipes"]) == sorted(named_recipes())
    validate_rules(raw["gate"], "suites/nightly.yaml")
    assert [m["name"] for m in raw["models"]] == ["zoo-llama", "zoo-moe", "stories260k"]
    ev = raw["evals"]
    assert (ev["ppl_kld"]["seq_len"], ev["ppl_kld"]["max_windows"]) == (512, 256)
    limits = dict(ev["tasks"]["limit"])
    assert set(limits) == set(ev["tasks"]["tasks"]) and limits.pop("mmlu") * 57 >= 500  # per subject of 57
    assert min(limits.values()) >= 100 and ev["longctx"]["new_tokens"] >= 1024
    # Without a data dir (the corpora live there) there is nothing to run, and the error says what is missing.
    with pytest.raises(SuiteError, match="model 'zoo-llama' needs the data dir"):
        load_suite(REPO / "suites" / "nightly.yaml", data_dir=None)


def test_nightly_suite_with_data_dir(data_dir):
    """With the shared data every model of the matrix is in: 3 models x every recipe x 2 serving configs."""
    suite = load_suite(REPO / "suites" / "nightly.yaml", data_dir=str(data_dir))
    assert len(suite.runs) == 3 * len(named_recipes()) * 2 and not suite.skipped
    assert {r.backend for r in suite.runs} == {"cuda-native"}


def _gate_sh(tmp: Path, baselines: Path, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ci/gate.sh on a tiny suite (tiny-llama, fp32 + bf16, 4 windows)."""
    suite = tmp / "mini.yaml"
    gate = yaml.safe_load((REPO / "suites" / "smoke.yaml").read_text())["gate"]
    suite.write_text(yaml.safe_dump({
        "name": "mini", "backend": "cpu-emulated", "seed": 0,
        "models": [{"name": "tiny-llama", "path": "builtin:tiny-llama", "corpus": "builtin:tiny-llama"}],
        "recipes": ["fp32", "bf16"], "serving": [{"name": "default", "batch_size": 4}],
        "evals": {"layer_error": {"windows": 1, "seq_len": 64}, "ppl_kld": {"seq_len": 64, "max_windows": 4}},
        "gate": gate}, sort_keys=False))
    env = dict(os.environ, SUITE=str(suite), BASELINES=str(baselines), EVALHARNESS=f"{sys.executable} -m evalharness.cli",
               GATE_ARGS="--no-tracking")
    env.pop("EVALHARNESS_DATA_DIR", None)
    env.pop("GITHUB_STEP_SUMMARY", None)
    env.update(extra_env or {})
    return subprocess.run(["bash", str(REPO / "ci" / "gate.sh"), str(tmp / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_gate_sh_end_to_end(tmp_path):
    """ci/gate.sh: exit 2 without baselines (summary + JUnit still written), then 0 once baselines exist,
    with the summary appended to $GITHUB_STEP_SUMMARY."""
    baselines = tmp_path / "baselines"
    p = _gate_sh(tmp_path, baselines)
    assert p.returncode == 2, p.stdout + p.stderr
    out = tmp_path / "out"
    assert (out / "summary.md").read_text().startswith("# Numerics gate: ERROR")
    assert ET.parse(out / "junit.xml").getroot().find("testsuite[@name='baselines']") is not None
    assert "gate exit code: 2" in (out / "gate.log").read_text()
    assert main(["baseline", "update", str(out / "results"), "--baselines", str(baselines)]) == 0
    step = tmp_path / "step_summary.md"
    step.write_text("previous step\n")
    p = _gate_sh(tmp_path, baselines, {"GITHUB_STEP_SUMMARY": str(step)})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "gate: PASS" in p.stdout
    text = step.read_text()
    assert text.startswith("previous step\n# Numerics gate: PASS")
    root = ET.parse(out / "junit.xml").getroot()
    assert {ts.get("name") for ts in root.iter("testsuite")} == {
        "tiny-llama__fp32__default__cpu-emulated", "tiny-llama__bf16__default__cpu-emulated"}
    assert all(ts.get("failures") == "0" for ts in root.iter("testsuite"))


@pytest.mark.slow
def test_gate_sh_bad_suite(tmp_path):
    """A suite that does not parse: exit 2 and a summary saying so."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodels: [\n")
    env = dict(os.environ, SUITE=str(bad), EVALHARNESS=f"{sys.executable} -m evalharness.cli")
    env.pop("GITHUB_STEP_SUMMARY", None)
    p = subprocess.run(["bash", str(REPO / "ci" / "gate.sh"), str(tmp_path / "out")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.startswith("# Numerics gate: ERROR (bad input)") and "malformed YAML" in summary
