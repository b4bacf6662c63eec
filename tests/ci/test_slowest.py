"""ci/slowest.py: the JUnit summary of CI's pytest steps and of the numerics gate, as console lines (slowest tests,
closing totals) and as markdown for a GitHub Actions step summary. Read on JUnit XML that real pytest and the real
gate writer (evalharness.report.write_junit) produce."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evalharness.gate import Verdict
from evalharness.report import write_junit
from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("ci_slowest", REPO / "ci" / "slowest.py")
slowest = sys.modules.setdefault("ci_slowest", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(slowest)

# A test module with one test of each outcome; its failure message holds markdown and HTML that must not break the
# summary (a table pipe, a code fence, a tag).
SAMPLE_TESTS = '''
import time
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture could not start")

def test_pass():
    time.sleep(0.3)

def test_fail():
    assert "a | b ```x``` <b>" == "c", "wrong <value> | here"

def test_skip():
    pytest.skip("needs chromium + chromedriver")

def test_setup_error(broken):
    pass
'''


def pytest_env() -> dict[str, str]:
    """The environment for a nested pytest: none of the outer run's PYTEST_* variables (under .ci/run,
    PYTEST_ADDOPTS names the step's own JUnit file, which a nested run must not overwrite), and no plugins
    loaded from entry points (xdist, the project's own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return dict(env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


@pytest.fixture(scope="module")
def pytest_junit(tmp_path_factory) -> Path:
    """JUnit XML written by a real pytest run of SAMPLE_TESTS (1 passed, 1 failed, 1 skipped, 1 setup error)."""
    d = tmp_path_factory.mktemp("sample")
    (d / "pytest.ini").write_text("[pytest]\n")
    (d / "test_sample.py").write_text(SAMPLE_TESTS)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=unit.xml",
                        "test_sample.py"], cwd=d, env=pytest_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "1 failed, 1 passed, 1 skipped, 1 error" in p.stdout, p.stdout + p.stderr
    return d / "unit.xml"


@pytest.fixture
def gate_junit(tmp_path) -> Path:
    """JUnit XML of the gate: two runs, one FAIL and one WARN, plus a missing baseline."""
    verdicts = [Verdict("m__fp32", "ppl_kld.kld_mean", "PASS", value=0.0, baseline=0.0),
                Verdict("m__fp8", "ppl_kld.kld_mean", "FAIL", value=0.09, baseline=0.04, delta=0.05, threshold=0.01,
                        message="kld_mean rose past its threshold"),
                Verdict("m__fp8", "ppl_kld.top1_agree", "WARN", value=0.97, baseline=0.98, delta=-0.01)]
    return write_junit(tmp_path / "junit.xml", verdicts, ["m__bf16: no baseline (baselines/mini/m__bf16.json)"])


def test_reads_real_pytest_junit(pytest_junit):
    """Outcomes, messages and times as pytest wrote them; a setup error counts as failed."""
    suites, problems = slowest.read_suites([pytest_junit])
    assert problems == [] and len(suites) == 1 and suites[0].file == "unit" and suites[0].wall > 0.3
    by_name = {c.name.split("::")[1].split(" ")[0]: c for c in suites[0].cases}
    assert {k: c.outcome for k, c in by_name.items()} == {
        "test_pass": "passed", "test_fail": "failed", "test_skip": "skipped", "test_setup_error": "failed"}
    assert by_name["test_pass"].seconds >= 0.3 > by_name["test_skip"].seconds
    assert "wrong <value> | here" in by_name["test_fail"].detail
    assert "fixture could not start" in by_name["test_setup_error"].detail
    assert by_name["test_skip"].detail == "needs chromium + chromedriver"


def test_markdown_of_pytest_junit(pytest_junit):
    """Headline, the table row of the file, each failure folded with its message in a fence that its own
    backticks cannot close and its name HTML-escaped, the skip reason with its count, the slowest test first."""
    md = slowest.markdown(*slowest.read_suites([pytest_junit]), "Tests", 2)
    assert md.startswith("## Tests: FAILED\n\n1 passed, 2 failed, 1 skipped.\n")
    assert re.search(r"^\| unit \| pytest \| 1 \| 2 \| 1 \| \d+\.\d \|$", md, re.M)
    assert "### Failed tests (2)" in md and md.count("<details>") == md.count("</details>") == 2
    fail = md[md.index("test_fail"):]
    block = fail[fail.index("````text\n") + 9:]
    assert "a | b ```x``` <b>" in block[:block.index("\n````\n")]  # the 3-backtick run stays inside the 4-fence
    assert "| 1 | needs chromium + chromedriver |" in md
    rows = md[md.index("### 2 slowest tests"):].splitlines()[4:6]
    assert "test_pass" in rows[0] and len(rows) == 2


def test_markdown_of_gate_junit(gate_junit):
    """The gate's JUnit: one table row per run plus the baselines suite; the FAIL and the missing baseline are
    the failures; a WARN is a pass (the gate's own summary lists it); no slowest table with -n 0."""
    md = slowest.markdown(*slowest.read_suites([gate_junit]), "Numerics gate: JUnit results", 0)
    assert md.startswith("## Numerics gate: JUnit results: FAILED\n\n2 passed, 2 failed, 0 skipped.")
    for row in ("| junit | m__fp32 | 1 | 0 | 0 | - |", "| junit | m__fp8 | 1 | 1 | 0 | - |",
                "| junit | baselines | 0 | 1 | 0 | - |"):
        assert row in md
    assert "kld_mean rose past its threshold" in md and "no baseline (baselines/mini/m__bf16.json)" in md
    assert "slowest" not in md


def test_missing_and_truncated_files_are_named(tmp_path, pytest_junit):
    """A step that wrote no JUnit, or a cut one, shows in the summary (and makes it FAILED) instead of vanishing."""
    cut = tmp_path / "slow.xml"
    cut.write_text(pytest_junit.read_text()[:200])
    suites, problems = slowest.read_suites([pytest_junit, tmp_path / "interpreter.xml", cut])
    assert len(suites) == 1 and len(problems) == 2
    assert "interpreter.xml: no such file" in problems[0] and "slow.xml: not valid XML" in problems[1]
    clean = tmp_path / "clean.xml"
    clean.write_text('<testsuites><testsuite name="pytest" time="1.5"><testcase classname="t" name="ok" time="1"/>'
                     '</testsuite></testsuites>')
    assert slowest.markdown(*slowest.read_suites([clean]), "T", 5).startswith("## T: passed\n")
    md = slowest.markdown(*slowest.read_suites([clean, tmp_path / "interpreter.xml"]), "T", 5)
    assert md.startswith("## T: FAILED\n") and "### Missing or unreadable JUnit files" in md


def test_cli_prints_totals_and_appends_markdown(tmp_path, pytest_junit):
    """The command: the slowest tests and the closing totals line on stdout, the markdown appended (not
    overwriting what earlier steps wrote), exit 0 even with a missing file."""
    step = tmp_path / "step_summary.md"
    step.write_text("earlier step\n")
    p = subprocess.run([sys.executable, str(REPO / "ci" / "slowest.py"), "-n", "3", "--markdown", str(step),
                        "--title", "Tests", str(pytest_junit), str(tmp_path / "absent.xml")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "3 slowest tests (setup + call + teardown):" and "test_pass" in lines[1]
    assert lines[-1] == "ci: 1 passed, 2 failed, 1 skipped"
    assert "absent.xml: no such file" in p.stderr
    text = step.read_text()
    assert text.startswith("earlier step\n## Tests: FAILED\n") and "### 3 slowest tests" in text
