"""The pytest plugin (evalharness/pytest_plugin.py), exercised the way a user's repo would: pytester writes
a test module that uses the fixtures and helpers and runs it on the smoke suite with tiny limits (in-process:
a fresh interpreter per run would cost more CPU than the runs themselves).

1. `--numerics-update-baselines` writes baselines (the session does not gate);
2. the same session settings gate against them and pass, reusing the results (`--numerics-out`);
3. a planted bad recipe under the fp8-block key fails `assert_gate_passes` and `assert_metric` with the
   gate's evidence (value, baseline, delta, threshold, CI, p) in the failure output.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import REPO

pytest_plugins = ["pytester"]

SMOKE = str(REPO / "suites" / "smoke.yaml")
FP8 = "tiny-llama__fp8-block__default__cpu-emulated"
# The user's pyproject: the smoke suite cut down to tiny-llama with tiny limits (ini numerics_set; the
# command line's --numerics-set adds the recipes). Options are passed as --opt=VALUE so that pytest does not
# take their paths for test paths when it looks for the rootdir.
PYPROJECT = textwrap.dedent(f"""
    [tool.pytest.ini_options]
    numerics_suite = "{SMOKE}"
    numerics_set = [
      "models=[{{name: tiny-llama, path: 'builtin:tiny-llama', corpus: 'builtin:tiny-llama'}}]",
      "evals.ppl_kld.max_windows=12",
      "evals.ppl_kld.seq_len=64",
      "evals.layer_error.windows=1",
      "evals.layer_error.seq_len=64",
    ]
""")

USER_TESTS = textwrap.dedent('''
    """A user's numerics tests: nothing but the plugin's fixtures and helpers."""
    import pytest
    import torch

    from evalharness.pytest_plugin import assert_gate_passes, assert_metric

    pytestmark = pytest.mark.numerics
    FP8 = "tiny-llama__fp8-block__default__cpu-emulated"


    def test_suite_is_loaded_with_overrides(numerics_suite):
        """The ini numerics_suite with its numerics_set overrides."""
        assert numerics_suite.name == "smoke"
        assert {r.model["name"] for r in numerics_suite.runs} == {"tiny-llama"}
        assert all(r.evals["ppl_kld"]["max_windows"] == 12 for r in numerics_suite.runs)


    def test_fp8_block_metrics(numerics_results):
        """Absolute limit and baseline-relative check on one run."""
        r = numerics_results[FP8]
        assert_metric(r, "ppl_kld.nonfinite_frac", max=0.0)
        assert_metric(r, "ppl_kld.kld_mean", max=1.0, rel_to_baseline=0.25, abs_tol=1e-6)


    def test_gate(numerics_results):
        """The suite's gate rules against the baselines."""
        assert_gate_passes(numerics_results)


    def test_engine_pair_fp32_is_the_reference(numerics_engine):
        """fp32 engine == reference bit for bit; fp8-block differs; the model is loaded once."""
        engine, reference = numerics_engine("tiny-llama", "fp32")
        tokens = torch.arange(24).unsqueeze(0)
        assert torch.equal(engine.logits(tokens), reference.logits(tokens))
        fp8, ref2 = numerics_engine("builtin:tiny-llama", "fp8-block")
        assert ref2 is reference  # one model + reference per session
        assert not torch.equal(fp8.logits(tokens), reference.logits(tokens))
''')


@pytest.fixture(scope="module")
def _reference_imported():
    """Build a reference once before any pytester exists. Pytester drops the modules imported while it lives
    (in-process runs included), which leaves transformers' lazy modules and torch's operator registrations
    broken for the next run; imported here first, they stay."""
    from engine.loading import load_model
    from evalharness.data import builtin_path
    from evalharness.reference import ReferenceLM

    ReferenceLM(load_model(str(builtin_path("tiny-llama"))))


@pytest.fixture
def user_repo(_reference_imported, pytester):
    """A scratch repo with the user's numerics tests and one unmarked test."""
    pytester.makepyfile(test_user_numerics=USER_TESTS)
    pytester.makepyfile(test_unmarked='def test_not_numerics():\n    """Not marked: -m numerics deselects it."""\n')
    return pytester


def test_update_then_gate_then_planted_regression(user_repo, tmp_path):
    """Baselines written, then gated (pass), then a planted regression fails with the evidence lines."""
    user_repo.makepyprojecttoml(PYPROJECT)
    baselines, out = tmp_path / "baselines", tmp_path / "results"
    common = ["-m", "numerics", "-p", "no:cacheprovider", f"--numerics-baselines={baselines}"]
    first = user_repo.runpytest_inprocess(*common, "--numerics-set=recipe=fp32,fp8-block", f"--numerics-out={out}",
                                "--numerics-update-baselines")
    first.assert_outcomes(passed=4, deselected=1)
    assert sorted(p.name for p in (baselines / "smoke").glob("*.json")) == [
        "tiny-llama__fp32__default__cpu-emulated.json", f"{FP8}.json"]
    first.stdout.fnmatch_lines(["*numerics*", "*2 baseline file(s) written to*"])

    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("tiny-llama__*.json")}
    second = user_repo.runpytest_inprocess(*common, "--numerics-set=recipe=fp32,fp8-block", f"--numerics-out={out}")
    second.assert_outcomes(passed=4, deselected=1)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("tiny-llama__*.json")} == stamps  # reused, not re-run

    planted = tmp_path / "planted.yaml"
    planted.write_text("name: fp8-block\nextends: fp8-block\nresidual: e4m3:tensor\n")
    third = user_repo.runpytest_inprocess(*common, f"--numerics-set=recipe={planted}")
    third.assert_outcomes(passed=2, failed=2, deselected=1)
    third.stdout.fnmatch_lines([
        "*numerics gate FAIL (regression)*",
        f"FAIL  {FP8}  ppl_kld.kld_mean: value=*, baseline=*, delta=*, threshold=*, delta 95% CI=[[]*], p=*",
    ])
    third.stdout.fnmatch_lines([
        f"FAIL  {FP8}  ppl_kld.kld_mean: value=*, baseline=*, delta=*, threshold=*; regression: worse than "
        "baseline beyond tolerance (lower is better)",
    ])
    text = third.stdout.str()
    gate_line = next(ln for ln in text.splitlines() if ln.startswith(f"FAIL  {FP8}  ppl_kld.kld_mean") and "p=" in ln)
    value = float(gate_line.split("value=")[1].split(",")[0])
    base = float(gate_line.split("baseline=")[1].split(",")[0])
    assert value > 1.25 * base  # the planted E4M3 residual really is worse


def test_missing_suite_skips_with_reason(user_repo):
    """Without --numerics-suite (or ini numerics_suite) the fixtures skip, saying what to pass."""
    res = user_repo.runpytest_inprocess("-m", "numerics", "-p", "no:cacheprovider", "-rs", "-k", "suite_is_loaded")
    res.assert_outcomes(skipped=1, deselected=4)
    res.stdout.fnmatch_lines(["*no numerics suite: pass --numerics-suite PATH*"])


def test_helpers_on_a_result_file():
    """assert_metric works on a result file with explicit baselines; failures are pytest failures."""
    from evalharness.pytest_plugin import assert_metric

    path = REPO / "baselines" / "smoke" / f"{FP8}.json"
    assert assert_metric(path, "ppl_kld.top1_agree", min=0.5) > 0.5
    assert assert_metric(path, "ppl_kld.kld_mean", rel_to_baseline=0.0, baselines=REPO / "baselines") > 0
    with pytest.raises(pytest.fail.Exception, match=r"value=.*threshold=0.01; above the limit max=0.01"):
        assert_metric(path, "ppl_kld.kld_mean", max=0.01)
    with pytest.raises(pytest.fail.Exception, match="did you mean"):
        assert_metric(path, "ppl_kld.kld_men")
