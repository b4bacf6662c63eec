"""Gate rules on synthetic result files: schema validation, paired tests, noise floors,
non-inferiority, equivalence, tail rules and multiple-testing control over the whole matrix."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from evalharness.cli import main
from evalharness.errors import ResultError
from evalharness.gate import exit_code, gate_results, validate_rules
from evalharness.report import write_summary
from evalharness.results import write_json_atomic

SUITE = "t"


def _doc(key: str, metrics: dict, samples: dict | None = None, model: str = "m") -> dict:
    """A minimal schema-1 result document."""
    return {"schema_version": 1, "kind": "result", "run_key": key, "status": "ok", "error": None,
            "spec": {"model": {"name": model}}, "metrics": metrics, "samples": samples or {}}


def _write(tmp: Path, gate: dict, runs: dict[str, tuple[dict, dict]], bases: dict[str, tuple[dict, dict]]
           ) -> tuple[Path, Path]:
    """results/ (with suite.json) and baselines/<suite>/ from {key: (metrics, samples)}."""
    res, base = tmp / "results", tmp / "baselines"
    write_json_atomic(res / "suite.json", {"schema_version": 1, "kind": "suite", "name": SUITE, "gate": gate})
    for key, (m, s) in runs.items():
        write_json_atomic(res / f"{key}.json", _doc(key, m, s, model=key.split("__")[0]))
    for key, (m, s) in bases.items():
        write_json_atomic(base / SUITE / f"{key}.json", _doc(key, m, s, model=key.split("__")[0]))
    return res, base


def _one(verdicts, metric: str, key: str | None = None):
    """The verdict of `metric` (of run `key`)."""
    return next(v for v in verdicts if v.metric == metric and (key is None or v.run_key == key))


# ---------------------------------------------------------------- schema

@pytest.mark.parametrize("rule,needle", [
    ({"metric": "a", "tolerance": 1}, "gate.rules[1]: unknown key(s) ['tolerance']"),
    ({"metric": "a", "rel_tol": 0.1, "samples": "e.x", "test": "mannwhitney"}, "gate.rules[1].test must be one of"),
    ({"metric": "a", "noninferiority_margin": 0.1}, "gate.rules[1]: noninferiority_margin needs 'samples'"),
    ({"metric": "a", "samples": "e.x", "noninferiority_margin": 0.1, "tost_margin": 0.1}, "not both"),
    ({"metric": "a", "samples": "e.x", "tost_margin": "ten%"}, "gate.rules[1].tost_margin must be a positive"),
    ({"metric": "a", "samples": "e.x", "tost_margin": 0.1, "rel_tol": 0.2}, "a test of its own"),
    ({"metric": "a", "noise": "se"}, "needs 'noise_k'"),
    ({"metric": "a", "noise_k": 3, "noise": "runs"}, "gate.noise_floor.runs"),
    ({"metric": "a", "noise_k": -1}, "gate.rules[1].noise_k must be a finite number > 0"),
    ({"metric": "a", "abs_tol": "big"}, "gate.rules[1].abs_tol must be a finite number >= 0"),
    ({"metric": "a", "rel_tol": 0.1, "test": "t"}, "needs 'samples'"),
    ({"metric": "a", "direction": "up"}, "gate.rules[1].direction"),
    ({"metric": "a", "samples": "window_kld", "rel_tol": 0.1}, "'<eval>.<array>'"),
])
def test_bad_rules_name_the_file_and_rule_index(rule, needle):
    """Every malformed rule is an error naming the suite file and the rule's index."""
    with pytest.raises(ResultError) as ei:
        validate_rules({"rules": [{"metric": "ok", "max": 0}, rule]}, "suites/x.yaml")
    msg = str(ei.value)
    assert msg.startswith("suites/x.yaml: ") and needle in msg, msg


def test_every_refused_key_is_reported_with_its_value():
    """The schema reports all refused keys of a section at once, each with its key path and the value given."""
    with pytest.raises(ResultError) as ei:
        validate_rules({"alpha": 0, "rules": [{"metric": "a", "abs_tol": "1e-3", "max": float("inf")},
                                              {"metric": "b", "severity": "error"}]}, "suites/x.yaml")
    lines = str(ei.value).splitlines()
    assert sorted(lines) == sorted([
        "suites/x.yaml: gate.alpha must be a number in (0, 1), got 0",
        "suites/x.yaml: gate.rules[0].abs_tol must be a finite number >= 0, got '1e-3'",
        "suites/x.yaml: gate.rules[0].max must be a finite number, got inf",
        "suites/x.yaml: gate.rules[1].severity must be one of 'fail' or 'warn', got 'error'"])


def test_bad_gate_section_keys():
    """Unknown gate keys, a bad correction and an alpha outside (0, 1) are errors."""
    for cfg, needle in (({"rulez": []}, "unknown key(s) ['rulez']"), ({"correction": "bonferroni"}, "correction"),
                        ({"alpha": 1.5}, "gate.alpha"), ({"noise_floor": {"run": "x"}}, "noise_floor")):
        with pytest.raises(ResultError, match="s.yaml"):
            try:
                validate_rules(cfg, "s.yaml")
            except ResultError as exc:
                assert needle in str(exc)
                raise


def test_run_rejects_bad_rules_before_running(tmp_path, capsys):
    """`evalharness run` validates the suite's gate rules first: exit 2 naming the file and rule index."""
    from tests.conftest import REPO

    text = (REPO / "suites" / "smoke.yaml").read_text().replace(
        "- {metric: ppl_kld.nonfinite_frac, max: 0.0}", "- {metric: ppl_kld.nonfinite_frac, maxx: 0.0}", 1)
    bad = tmp_path / "badgate.yaml"
    bad.write_text(text)
    code = main(["run", str(bad), "--out", str(tmp_path / "o"), "--no-tracking"])
    err = capsys.readouterr().err
    assert code == 2 and "badgate.yaml" in err and "gate.rules[0]" in err and "maxx" in err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- paired tests

CUR = [1.0 + 0.1 * i for i in range(12)]
BASE = [c - 0.5 - 0.01 * i for i, c in enumerate(CUR)]  # every window worse by 0.5..0.61


@pytest.mark.parametrize("test,p_max", [("wilcoxon", 0.001), ("t", 1e-6), ("sign", 0.001)])
def test_paired_test_choice(tmp_path, test, p_max):
    """test: wilcoxon | t | sign picks the paired one-sided test; its name and p are in the evidence."""
    gate = {"rules": [{"metric": "e.mean", "direction": "lower", "rel_tol": 0.1, "samples": "e.win", "test": test}]}
    m_cur, m_base = sum(CUR) / 12, sum(BASE) / 12
    res, base = _write(tmp_path, gate, {"m__r": ({"e.mean": m_cur}, {"e": {"win": CUR}})},
                       {"m__r": ({"e.mean": m_base}, {"e": {"win": BASE}})})
    verdicts, missing = gate_results(res, base)
    v = _one(verdicts, "e.mean")
    assert v.verdict == "FAIL" and v.test == test and v.p_value < p_max
    if test == "sign":
        assert v.p_value == pytest.approx(0.5 ** 12)  # all 12 differences positive
    assert f"({test})" in v.evidence() and "rules[0]" in v.rule and v.evidence().endswith("[rules[0]]")
    lo, hi = v.interval
    assert lo < 0.555 < hi  # mean paired difference 0.555


def test_not_significant_is_warn(tmp_path):
    """Beyond tolerance but the paired test is not significant -> WARN (sign test, 6 up 6 down)."""
    cur = [1.0 + (0.5 if i % 2 else -0.1) for i in range(12)]
    gate = {"rules": [{"metric": "e.mean", "rel_tol": 0.01, "samples": "e.win", "test": "sign"}]}
    res, base = _write(tmp_path, gate, {"m__r": ({"e.mean": sum(cur) / 12}, {"e": {"win": cur}})},
                       {"m__r": ({"e.mean": 1.0}, {"e": {"win": [1.0] * 12}})})
    v = _one(gate_results(res, base)[0], "e.mean")
    assert v.verdict == "WARN" and v.p_value == pytest.approx(0.6127, abs=1e-3) and "not significant" in v.message


# ---------------------------------------------------------------- noise floor

def test_noise_k_se_from_samples(tmp_path):
    """noise: se -> noise floor = sqrt(2) * sd(baseline samples)/sqrt(n); threshold = k * floor when larger."""
    bs = [0.1, 0.3, 0.2, 0.4, 0.2, 0.3, 0.1, 0.4]
    n = len(bs)
    mean = sum(bs) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in bs) / (n - 1)) / math.sqrt(n)
    floor = math.sqrt(2) * se
    gate = {"rules": [{"metric": "e.mean", "abs_tol": 1e-6, "noise_k": 3, "samples": "e.win"}]}
    shift = 2.5 * floor  # below 3 x floor: passes
    cur = [b + shift for b in bs]
    res, base = _write(tmp_path, gate, {"m__r": ({"e.mean": mean + shift}, {"e": {"win": cur}})},
                       {"m__r": ({"e.mean": mean}, {"e": {"win": bs}})})
    v = _one(gate_results(res, base)[0], "e.mean")
    assert v.noise_floor == pytest.approx(floor) and v.threshold == pytest.approx(3 * floor)
    assert v.verdict == "PASS" and "noise floor=" in v.evidence() and "k=3" in v.evidence()
    cur = [b + 3.5 * floor for b in bs]  # beyond 3 x floor, and every window worse: FAIL
    res, base = _write(tmp_path / "b", gate, {"m__r": ({"e.mean": mean + 3.5 * floor}, {"e": {"win": cur}})},
                       {"m__r": ({"e.mean": mean}, {"e": {"win": bs}})})
    assert _one(gate_results(res, base)[0], "e.mean").verdict == "FAIL"


def test_noise_k_se_from_interval(tmp_path):
    """Without samples the SE comes from the baseline's stored 95% interval: (hi - lo) / (2 * 1.96)."""
    gate = {"rules": [{"metric": "p.ratio", "noise_k": 2}]}
    bm = {"p.ratio": 1.01, "p.ratio_lo": 1.00, "p.ratio_hi": 1.02}
    res, base = _write(tmp_path, gate, {"m__r": ({"p.ratio": 1.03}, {})}, {"m__r": (bm, {})})
    v = _one(gate_results(res, base)[0], "p.ratio")
    floor = math.sqrt(2) * 0.02 / (2 * 1.959963984540054)
    assert v.noise_floor == pytest.approx(floor) and v.threshold == pytest.approx(2 * floor)
    assert v.verdict == "FAIL"  # delta 0.02 > 2 * 0.0102


def test_noise_k_without_a_floor_warns(tmp_path):
    """noise_k alone on a metric with no interval and no samples: WARN 'no noise floor', never a silent pass."""
    gate = {"rules": [{"metric": "x.y", "noise_k": 3}]}
    res, base = _write(tmp_path, gate, {"m__r": ({"x.y": 2.0}, {})}, {"m__r": ({"x.y": 1.0}, {})})
    v = _one(gate_results(res, base)[0], "x.y")
    assert v.verdict == "WARN" and "no noise floor" in v.message


def test_noise_floor_runs(tmp_path):
    """noise: runs -> floor = spread of the designated runs (bf16 at two batch sizes) of the same model."""
    gate = {"noise_floor": {"runs": "*__bf16__*"},
            "rules": [{"metric": "l.rel", "abs_tol": 1e-9, "noise_k": 3, "noise": "runs"}]}
    runs = {"m__bf16__b8": ({"l.rel": 0.0050}, {}), "m__bf16__b1": ({"l.rel": 0.0052}, {}),
            "m__fp8__b8": ({"l.rel": 0.0307}, {}), "n__fp8__b8": ({"l.rel": 0.0307}, {})}
    bases = {"m__bf16__b8": ({"l.rel": 0.0050}, {}), "m__bf16__b1": ({"l.rel": 0.0052}, {}),
             "m__fp8__b8": ({"l.rel": 0.0300}, {}), "n__fp8__b8": ({"l.rel": 0.0300}, {})}
    res, base = _write(tmp_path, gate, runs, bases)
    verdicts, _ = gate_results(res, base)
    v = _one(verdicts, "l.rel", "m__fp8__b8")
    assert v.noise_floor == pytest.approx(0.0002) and v.threshold == pytest.approx(0.0006)
    assert v.verdict == "FAIL" and "noise-floor runs" in v.noise_source  # delta 0.0007 > 0.0006
    w = _one(verdicts, "l.rel", "n__fp8__b8")  # model n has no noise-floor runs: abs_tol alone
    assert w.noise_floor is None and w.threshold == pytest.approx(1e-9) and w.verdict == "FAIL"
    assert "noise floor=n/a (0 noise-floor run(s)" in w.evidence()


# ---------------------------------------------------------------- non-inferiority / equivalence

def test_noninferiority(tmp_path):
    """noninferiority_margin: PASS when the upper bound of the mean delta is under the margin, else FAIL."""
    base_w = [0.50, 0.52, 0.48, 0.51, 0.49, 0.50, 0.53, 0.47, 0.50, 0.51]
    small = [b + 0.001 * (1 if i % 2 else -1) + 0.0005 for i, b in enumerate(base_w)]
    large = [b + 0.03 + 0.001 * (1 if i % 2 else -1) for i, b in enumerate(base_w)]
    gate = {"rules": [{"metric": "p.nll", "direction": "lower", "noninferiority_margin": 0.01, "samples": "p.win"}]}
    for name, cur, verdict in (("ok", small, "PASS"), ("bad", large, "FAIL")):
        res, base = _write(tmp_path / name, gate, {"m__r": ({"p.nll": sum(cur) / 10}, {"p": {"win": cur}})},
                           {"m__r": ({"p.nll": sum(base_w) / 10}, {"p": {"win": base_w}})})
        v = _one(gate_results(res, base)[0], "p.nll")
        assert v.verdict == verdict and v.mode == "noninferiority" and v.threshold == pytest.approx(0.01)
        assert "noninferiority-t" in v.evidence() and "bound" in v.evidence()
        assert (v.p_value < 0.05) == (verdict == "PASS")
    # "10%" of the baseline (0.501): margin 0.0501 covers the +0.03 shift.
    gate["rules"][0]["noninferiority_margin"] = "10%"
    res, base = _write(tmp_path / "pct", gate, {"m__r": ({"p.nll": sum(large) / 10}, {"p": {"win": large}})},
                       {"m__r": ({"p.nll": sum(base_w) / 10}, {"p": {"win": base_w}})})
    v = _one(gate_results(res, base)[0], "p.nll")
    assert v.threshold == pytest.approx(0.0501) and v.verdict == "PASS"


def test_equivalence_tost(tmp_path):
    """tost_margin: PASS only when the 90% CI of the mean delta lies inside +-margin."""
    base_w = [0.9, 0.8, 0.85, 0.95, 0.9, 0.88, 0.92, 0.86]
    near = [b + (0.002 if i % 2 else -0.002) for i, b in enumerate(base_w)]
    far = [b + 0.05 for b in base_w]
    gate = {"rules": [{"metric": "t.acc", "direction": "higher", "tost_margin": 0.02, "samples": "t.win"}]}
    for name, cur, verdict in (("near", near, "PASS"), ("far", far, "FAIL")):
        res, base = _write(tmp_path / name, gate, {"m__r": ({"t.acc": sum(cur) / 8}, {"t": {"win": cur}})},
                           {"m__r": ({"t.acc": sum(base_w) / 8}, {"t": {"win": base_w}})})
        v = _one(gate_results(res, base)[0], "t.acc")
        assert v.verdict == verdict and v.test == "tost" and "90% CI" in v.evidence()
    # Equivalence is two-sided: better by more than the margin also fails to be "equivalent".
    assert v.delta == pytest.approx(0.05)


def test_margin_test_without_samples_warns(tmp_path):
    """Non-inferiority cannot be shown without the per-window arrays: WARN with the reason."""
    gate = {"rules": [{"metric": "p.nll", "noninferiority_margin": 0.01, "samples": "p.win"}]}
    res, base = _write(tmp_path, gate, {"m__r": ({"p.nll": 1.0}, {})}, {"m__r": ({"p.nll": 1.0}, {"p": {"win": [1.0]}})})
    v = _one(gate_results(res, base)[0], "p.nll")
    assert v.verdict == "WARN" and "not testable" in v.message


# ---------------------------------------------------------------- tails, limits, non-finite

def test_tail_rules(tmp_path):
    """Rules on the KLD tail metrics (p99.9, max): FAIL / WARN beyond their tolerance, absolute max limit."""
    gate = {"rules": [{"metric": "ppl_kld.kld_p999", "rel_tol": 0.5},
                      {"metric": "ppl_kld.kld_max", "rel_tol": 1.0, "severity": "warn"},
                      {"metric": "ppl_kld.nonfinite_frac", "max": 0.0}]}
    m = {"ppl_kld.kld_p999": 0.9, "ppl_kld.kld_max": 5.0, "ppl_kld.nonfinite_frac": 0.0}
    b = {"ppl_kld.kld_p999": 0.5, "ppl_kld.kld_max": 2.0, "ppl_kld.nonfinite_frac": 0.0}
    res, base = _write(tmp_path, gate, {"m__r": (m, {})}, {"m__r": (b, {})})
    verdicts, missing = gate_results(res, base)
    assert _one(verdicts, "ppl_kld.kld_p999").verdict == "FAIL"
    assert _one(verdicts, "ppl_kld.kld_p999").threshold == pytest.approx(0.25)
    assert _one(verdicts, "ppl_kld.kld_max").verdict == "WARN"
    assert _one(verdicts, "ppl_kld.nonfinite_frac").verdict == "PASS"
    assert exit_code(verdicts, missing) == 1


def test_first_matching_rule_wins_and_nonfinite_fails(tmp_path):
    """A specific rule before a glob takes the metric; a null (NaN) value always FAILs."""
    gate = {"rules": [{"metric": "l.logits.rel", "rel_tol": 0.01},
                      {"metric": "l.*.rel", "rel_tol": 10.0, "severity": "warn"}]}
    res, base = _write(tmp_path, gate, {"m__r": ({"l.logits.rel": 0.2, "l.x.rel": None}, {})},
                       {"m__r": ({"l.logits.rel": 0.1, "l.x.rel": 0.1}, {})})
    verdicts, _ = gate_results(res, base)
    assert _one(verdicts, "l.logits.rel").verdict == "FAIL" and "rules[0]" in _one(verdicts, "l.logits.rel").rule
    assert _one(verdicts, "l.x.rel").verdict == "FAIL" and "NaN" in _one(verdicts, "l.x.rel").message


# ---------------------------------------------------------------- multiple testing over the matrix

def _matrix(tmp_path: Path, correction: str) -> list:
    """Four runs; each worse beyond tolerance with a paired sign test of p = 0.5**7 ... (7/8 windows up)."""
    gate = {"correction": correction, "rules": [{"metric": "e.mean", "rel_tol": 0.01, "samples": "e.win",
                                                 "test": "sign"}]}
    runs, bases = {}, {}
    base_w = [1.0] * 8
    ups = {"a": 8, "b": 7, "c": 7, "d": 8}  # windows worse by +1; the rest better by -0.01
    for name, k in ups.items():
        cur = [2.0] * k + [0.99] * (8 - k)
        runs[f"{name}__r"] = ({"e.mean": sum(cur) / 8}, {"e": {"win": cur}})
        bases[f"{name}__r"] = ({"e.mean": 1.0}, {"e": {"win": base_w}})
    res, base = _write(tmp_path / correction, gate, runs, bases)
    return gate_results(res, base)[0]


def test_correction_none_keeps_raw_p(tmp_path):
    """Without correction every run with a significant paired test FAILs; p is the raw one-sided sign-test p."""
    raw = {v.run_key: v for v in _matrix(tmp_path, "none")}
    p8, p7 = 0.5 ** 8, 9 * 0.5 ** 8  # sign test, one-sided: 8/8 up and 7/8 up
    assert raw["a__r"].p_value == pytest.approx(p8) and raw["b__r"].p_value == pytest.approx(p7)
    assert all(v.verdict == "FAIL" and v.p_adjusted is None for v in raw.values())


def test_holm_demotes_and_shows_family(tmp_path):
    """Holm demotes the weaker regressions to WARN and writes 'holm over 4 tests' into the evidence and summary."""
    holm = {v.run_key: v for v in _matrix(tmp_path, "holm")}
    p8, p7 = 0.5 ** 8, 9 * 0.5 ** 8
    assert holm["a__r"].verdict == "FAIL" and holm["d__r"].verdict == "FAIL"
    assert holm["b__r"].verdict == "WARN" and holm["c__r"].verdict == "WARN"
    assert holm["b__r"].p_adjusted == pytest.approx(2 * p7) and "not significant after holm" in holm["b__r"].message
    assert "p_adj=" in holm["b__r"].evidence() and "holm over 4 tests" in holm["b__r"].evidence()
    bh = {v.run_key: v for v in _matrix(tmp_path, "bh")}
    # BH, m = 4: p7 adjusted = min(4 * p7 / 4, ...) = p7 = 0.035 < 0.05: BH keeps every FAIL.
    assert bh["b__r"].p_adjusted == pytest.approx(p7) and bh["b__r"].verdict == "FAIL"
    assert bh["a__r"].p_adjusted == pytest.approx(2 * p8)
    summary = write_summary(tmp_path / "s.md", list(holm.values()), [], 1).read_text()
    assert "holm over 4 tests" in summary and "p adj" in summary and "2 regression(s)" in summary


def test_gate_cli_suite_rules_errors_name_the_suite(tmp_path, capsys):
    """`gate --suite FILE` with a bad rule: exit 2 naming FILE and the rule index."""
    res, base = _write(tmp_path, {}, {"m__r": ({"x": 1.0}, {})}, {"m__r": ({"x": 1.0}, {})})
    suite = tmp_path / "rules.yaml"
    suite.write_text("gate:\n  rules:\n    - {metric: x, rel_tol: 0.1}\n    - {metric: y, tost_margin: 1}\n")
    code = main(["gate", str(res), "--baselines", str(base), "--suite", str(suite)])
    err = capsys.readouterr().err
    assert code == 2 and "rules.yaml" in err and "gate.rules[1]" in err


def test_verdict_json_roundtrip(tmp_path):
    """Verdict.to_dict carries the evidence line and is JSON-serialisable."""
    gate = {"rules": [{"metric": "x", "rel_tol": 0.1}]}
    res, base = _write(tmp_path, gate, {"m__r": ({"x": 2.0}, {})}, {"m__r": ({"x": 1.0}, {})})
    v = gate_results(res, base)[0][0]
    d = json.loads(json.dumps(v.to_dict()))
    assert d["verdict"] == "FAIL" and d["evidence"].startswith("value=2") and d["threshold"] == pytest.approx(0.1)


def test_a_gated_metric_the_result_lost_is_judged_by_its_rule(tmp_path):
    """A metric of the baseline that a rule gates but the result lacks (its eval, tap or task did not run): FAIL
    under a fail rule, WARN under a warn rule, nothing for a metric no rule gates or that both lack."""
    gate = {"rules": [{"metric": "tasks.*.acc_eng", "direction": "higher", "abs_tol": 0.02},
                      {"metric": "layer_error.*.rel_l2", "abs_tol": 1e-4, "severity": "warn"}]}
    base_m = {"tasks.arc.acc_eng": 0.6, "tasks.mmlu.acc_eng": 0.5, "layer_error.l0.rel_l2": 0.01, "other.x": 1.0}
    cur_m = {"tasks.arc.acc_eng": 0.6}
    res, base = _write(tmp_path, gate, {"m__r": (cur_m, {})}, {"m__r": (base_m, {})})
    verdicts, _ = gate_results(res, base)
    by = {v.metric: v for v in verdicts}
    assert by["tasks.arc.acc_eng"].verdict == "PASS"
    lost = by["tasks.mmlu.acc_eng"]
    assert lost.verdict == "FAIL" and lost.baseline == 0.5 and lost.value is None
    assert "absent from this result" in lost.message and lost.rule.startswith("rules[0]")
    assert lost.evidence().startswith("value=n/a, baseline=0.5")
    assert by["layer_error.l0.rel_l2"].verdict == "WARN" and "other.x" not in by
