"""CI entry points: the GitHub Actions workflows parse and have the expected structure (and are mirrored
under .github/workflows), ci/gate.sh runs end to end, and the nightly suite loads."""

from __future__ import annotations

import os
import re
import shutil
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
NAMES = ["pr-gate.yml", "nightly.yml"]
BASH = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c"]  # GitHub's `shell: bash`


def _load(name: str) -> dict:
    """A workflow file; YAML 1.1 reads the key `on` as True, so normalise it."""
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def _runs(job: dict) -> str:
    """All `run:` scripts of a job, joined."""
    return "\n".join(s.get("run", "") for s in job["steps"])


def _step(job: dict, name: str) -> dict:
    """The step of a job with this name."""
    return next(s for s in job["steps"] if s.get("name") == name)


def _inline_expressions(wf: dict) -> list[str]:
    """`job / step` of every `run:` script that holds a `${{ ... }}` expression: the runner pastes its value into
    the script before the shell parses it (script injection); values go through the step's `env:` instead."""
    return [f"{jn} / {s.get('name', s['run'][:40])}" for jn, job in wf["jobs"].items() for s in job["steps"]
            if "${{" in s.get("run", "")]


def _readme_test_commands() -> list[str]:
    """The pytest commands of the README's "Tests" block, comments cut."""
    text = (REPO / "README.md").read_text()
    block = text[text.index("## Tests"):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [ln.split("  #")[0].strip() for ln in block.splitlines() if " -m pytest " in ln]


def _apt_packages(script: str) -> set[str]:
    """The packages of the `apt-get install` lines of a script."""
    return {w for m in re.finditer(r"apt-get install ([^;}&|\n]*)", script) for w in m.group(1).split()
            if not w.startswith("-")}


@pytest.mark.parametrize("name", NAMES)
def test_workflows_are_mirrored(name):
    """.github/workflows holds the same files as ci/workflows (GitHub only reads the former)."""
    assert sorted(p.name for p in (REPO / ".github" / "workflows").iterdir()) == sorted(p.name for p in
                                                                                       WORKFLOWS.iterdir())
    assert (REPO / ".github" / "workflows" / name).read_text() == (WORKFLOWS / name).read_text()


@pytest.mark.parametrize("name", NAMES)
def test_workflow_structure(name):
    """What GitHub requires of a workflow (the checks actionlint makes that need no network): a name, triggers,
    jobs with a runner, a timeout and steps, each step either `uses` an action at a pinned major version or
    `run`s a script; least-privilege permissions; bash as the shell."""
    wf = _load(name)
    assert wf["name"] and wf["on"] and wf["permissions"] == {"contents": "read"}
    assert wf["defaults"]["run"]["shell"] == "bash"
    for jn, job in wf["jobs"].items():
        assert job["runs-on"] and isinstance(job["timeout-minutes"], int), jn
        assert set(job) <= {"name", "runs-on", "container", "timeout-minutes", "env", "steps", "if", "needs"}, jn
        for s in job["steps"]:
            assert ("uses" in s) != ("run" in s), (jn, s)
            assert set(s) <= {"name", "uses", "with", "run", "if", "env", "continue-on-error"}, (jn, s)
            if "uses" in s:
                assert re.fullmatch(r"actions/[a-z-]+@v\d+", s["uses"]), s["uses"]
            else:
                assert s.get("name"), f"{jn}: a run step without a name"


@pytest.mark.parametrize("name", NAMES)
def test_no_expressions_in_run_scripts(name):
    """No `${{ ... }}` inside any `run:` script (inputs and github context values reach scripts through `env:`)."""
    assert _inline_expressions(_load(name)) == []


def test_inline_expression_check_catches_one():
    """The check above finds an expression pasted into a script (the nightly's old date input did that)."""
    wf = {"jobs": {"n": {"steps": [{"name": "ok", "run": "echo \"$NIGHT\"", "env": {"NIGHT": "${{ inputs.date }}"}},
                                   {"name": "pick", "run": 'night="${{ github.event.inputs.date }}"'}]}}}
    assert _inline_expressions(wf) == ["n / pick"]


def test_pr_gate_workflow():
    """PR gate: CPU runner, CPU torch, editable install with the test extra, ci/gate.sh, artifacts always."""
    wf = _load("pr-gate.yml")
    assert "pull_request" in wf["on"]
    job = wf["jobs"]["gate"]
    assert job["runs-on"] == "ubuntu-latest"
    runs = _runs(job)
    assert "download.pytorch.org/whl/cpu" in runs and "torch==" in runs
    assert "pip install -e '.[test]'" in runs and "ci/gate.sh gate-out" in runs
    assert "GITHUB_STEP_SUMMARY" not in job.get("env", {})  # ci/gate.sh writes the runner's step summary
    upload = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert upload["if"] == "always()"
    paths = upload["with"]["path"]
    assert all(p in paths for p in ("gate-out/results/", "gate-out/junit.xml", "gate-out/summary.md"))


def test_pr_tests_job_runs_the_readme_commands_with_the_browser():
    """The tests job: Debian (its chromium + chromium-driver, the packages .ci/run installs) installed before any
    test; then the README's test commands, each a step with its JUnit XML, each running even after a failed one;
    then every JUnit file rendered into the step summary (always)."""
    job = _load("pr-gate.yml")["jobs"]["tests"]
    assert re.fullmatch(r"python:3\.\d+-(bookworm|trixie)", job["container"])  # Debian, not Ubuntu's snaps
    names = [s.get("name", s.get("uses")) for s in job["steps"]]
    browser = _step(job, "Install chromium + chromedriver (the mlflow UI browser test)")
    assert _apt_packages(browser["run"]) == {"chromium", "chromium-driver"} == _apt_packages(
        (REPO / ".ci" / "run").read_text())
    assert "chromedriver --version" in browser["run"]  # a missing driver fails here, not as a skipped test
    steps = [_step(job, n) for n in ("unit", "interpreter", "slow")]
    assert names.index(browser["name"]) < names.index("unit")
    junit = []
    for s, cmd in zip(steps, _readme_test_commands(), strict=True):
        m = re.fullmatch(r"(.*) --junitxml=(junit/\w+\.xml)", s["run"])
        assert m and m.group(1) == cmd, s["run"]
        junit.append(m.group(2))
    assert [s.get("if") for s in steps] == [None, "!cancelled()", "!cancelled()"]
    summary = _step(job, "JUnit results to the step summary")
    assert summary["if"] == "always()" and names.index(summary["name"]) > names.index("slow")
    assert 'ci/slowest.py -n 15 --markdown "$GITHUB_STEP_SUMMARY"' in summary["run"]
    assert all(j in summary["run"] for j in junit)


def test_pr_tests_summary_step_runs(tmp_path):
    """The tests job's summary step, run as GitHub runs it: the step summary gets the JUnit table, and a step that
    wrote no JUnit file is named."""
    job = _load("pr-gate.yml")["jobs"]["tests"]
    (tmp_path / "ci").symlink_to(REPO / "ci")
    (tmp_path / "junit").mkdir()
    for step in ("unit", "slow"):
        (tmp_path / "junit" / f"{step}.xml").write_text(
            f'<testsuites><testsuite name="pytest" time="2.5"><testcase classname="tests.t" name="{step}_ok" '
            'time="1.25"/></testsuite></testsuites>')
    summary = tmp_path / "step-summary.md"
    p = subprocess.run(BASH + [_step(job, "JUnit results to the step summary")["run"]], cwd=tmp_path,
                       env=dict(os.environ, GITHUB_STEP_SUMMARY=str(summary)), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    text = summary.read_text()
    assert text.startswith("## Tests: FAILED\n\n2 passed, 0 failed, 0 skipped; 1 JUnit file(s) missing")
    assert "| unit | pytest | 1 | 0 | 0 | 2.5 |" in text and "junit/interpreter.xml: no such file" in text


def test_nightly_workflow():
    """Nightly: cron + manual trigger, GPU runner label, nightly suite with --resume, gate summary + JUnit +
    report into the step summary, upload; after the results folder is picked, the steps that run always() need
    one (with NIGHT empty they would take the whole history)."""
    wf = _load("nightly.yml")
    assert wf["on"]["schedule"][0]["cron"] and "workflow_dispatch" in wf["on"]
    job = wf["jobs"]["nightly"]
    assert "gpu" in job["runs-on"] and "self-hosted" in job["runs-on"]
    runs = _runs(job)
    assert "evalharness run suites/nightly.yaml" in runs and "--resume" in runs and "--device cuda" in runs
    assert "evalharness report" in runs and "evalharness trend" in runs
    gate = _step(job, "Gate (advisory)")
    assert "--junit nightly-out/junit.xml --summary nightly-out/gate-summary.md" in gate["run"]
    assert '--baselines "$NIGHTLY_BASELINES"' in gate["run"] and "NIGHTLY_BASELINES" in job["env"]
    promote = _step(job, "Promote this night to the nightly baselines")
    assert wf["on"]["workflow_dispatch"]["inputs"]["promote"]["default"] is False
    assert promote["if"].startswith("success() && inputs.promote")  # by hand, never after a failed step
    summary = _step(job, "Gate summary and JUnit results to the step summary")
    assert 'ci/slowest.py -n 0 --markdown "$GITHUB_STEP_SUMMARY"' in summary["run"]
    assert 'nightly-out/report/report.md >> "$GITHUB_STEP_SUMMARY"' in _step(job, "Report and trend")["run"]
    always = [s for s in job["steps"] if "always()" in str(s.get("if", ""))]
    assert len(always) >= 5 and all("env.NIGHT != ''" in s["if"] for s in always)
    upload = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact"))
    assert "always()" in upload["if"] and "nightly-out/" in upload["with"]["path"]


def test_nightly_promote_then_gate_steps_run(tmp_path):
    """The gate step and the promote step, run as GitHub runs them on a results folder of the H200 (two runs): with
    no nightly baselines every rule WARNs and the gate passes (advisory); promoted, the same night gates against
    them, every rule compared."""
    job = _load("nightly.yml")["jobs"]["nightly"]
    gate, promote = _step(job, "Gate (advisory)"), _step(job, "Promote this night to the nightly baselines")
    history, base = tmp_path / "history", tmp_path / "nightly-baselines"
    shutil.copytree(REPO / "tests" / "data" / "suite_gpu_h200_zoo_moe", history / "2026-12-01")
    env = dict(os.environ, NIGHTLY_HISTORY=str(history), NIGHT="2026-12-01", NIGHTLY_BASELINES=str(base))
    summary = tmp_path / "nightly-out" / "gate-summary.md"

    def step(script: dict) -> str:
        p = subprocess.run(BASH + [script["run"]], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    step(gate)
    assert "4 PASS, 4 WARN, 0 FAIL over 2 run(s)" in summary.read_text() and "no baseline for this run" in \
        summary.read_text()
    assert "2 baseline file(s) written" in step(promote)
    assert len(list(base.glob("gpu/h200/*.json"))) == 2
    step(gate)
    assert "8 PASS, 0 WARN, 0 FAIL over 2 run(s)" in summary.read_text()


@pytest.mark.parametrize("value, night", [
    ("", "today"), ("2026-11-29", "2026-11-29"), ("2026-11-29-rerun.2", "2026-11-29-rerun.2"),
    ("$(touch pwned)", None), ("2026-11-29/../../etc", None), ("2026-11-29; touch pwned", None),
    ("nightly", None), ("2026-11-29\n::add-mask::x", None)])
def test_nightly_date_input(tmp_path, value, night):
    """The date input reaches the script through env: a value of the form YYYY-MM-DD[suffix] becomes NIGHT, an
    empty one today's date (UTC); anything else (a path, shell code) stops the job, runs nothing, sets nothing."""
    step = _step(_load("nightly.yml")["jobs"]["nightly"], "Pick the results folder")
    assert step["env"] == {"NIGHT_INPUT": "${{ inputs.date }}"}
    genv = tmp_path / "github_env"
    genv.write_text("")
    p = subprocess.run(BASH + [step["run"]], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, NIGHT_INPUT=value, GITHUB_ENV=str(genv)))
    assert not (tmp_path / "pwned").exists()
    if night is None:
        assert p.returncode == 2 and genv.read_text() == "" and "::error::" in p.stdout
    else:
        assert p.returncode == 0, p.stdout + p.stderr
        today = subprocess.run(["date", "-u", "+%F"], capture_output=True, text=True).stdout.strip()
        assert genv.read_text() == f"NIGHT={today if night == 'today' else night}\n"


def test_nightly_summary_step_runs(tmp_path):
    """The nightly's summary step, run as GitHub runs it on what `evalharness gate` writes: the step summary
    gets the gate's markdown summary, then its JUnit results with the failing metric; without them it says so."""
    from evalharness.gate import Verdict
    from evalharness.report import write_junit, write_summary

    script = _step(_load("nightly.yml")["jobs"]["nightly"], "Gate summary and JUnit results to the step summary")
    (tmp_path / "ci").symlink_to(REPO / "ci")
    summary = tmp_path / "step-summary.md"
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(summary))
    p = subprocess.run(BASH + [script["run"]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = summary.read_text()
    assert text.startswith("# Numerics gate: no summary") and "nightly-out/junit.xml: no such file" in text
    summary.write_text("")
    verdicts = [Verdict("m__fp32", "ppl_kld.kld_mean", "PASS", value=0.0, baseline=0.0),
                Verdict("m__fp8", "ppl_kld.kld_mean", "FAIL", value=0.09, baseline=0.04, delta=0.05, threshold=0.01,
                        message="kld_mean rose past its threshold")]
    write_junit(tmp_path / "nightly-out" / "junit.xml", verdicts, [])
    write_summary(tmp_path / "nightly-out" / "gate-summary.md", verdicts, [], 1)
    p = subprocess.run(BASH + [script["run"]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = summary.read_text()
    assert text.startswith("# Numerics gate: FAIL (regression)\n")
    junit = text[text.index("## Numerics gate: JUnit results: FAILED"):]
    assert "1 passed, 1 failed, 0 skipped." in junit and "| junit | m__fp8 | 0 | 1 | 0 | - |" in junit
    assert "m__fp8::ppl_kld.kld_mean" in junit and "kld_mean rose past its threshold" in junit


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
    with the summary and the JUnit results appended to $GITHUB_STEP_SUMMARY."""
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
    junit = text[text.index("## Numerics gate: JUnit results: passed\n"):]
    row = r"^\| junit \| tiny-llama__bf16__default__cpu-emulated \| [1-9]\d* \| 0 \| 0 \| - \|$"
    assert re.search(row, junit, re.M)
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
