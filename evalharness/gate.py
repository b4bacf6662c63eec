"""The regression gate: results vs stored baselines, one verdict per (run, metric, rule).

Rules come from the suite's `gate:` section (recorded in the results dir's
`suite.json`), else `DEFAULT_RULES`. The schema, the noise-floor definitions
and their validation live in `evalharness.gate_rules`; in short::

    gate:
      alpha: 0.05              # significance for paired tests
      correction: holm         # holm | bh | none: multiple-testing control across all regression tests
      rules:
        - metric: ppl_kld.kld_mean      # fnmatch glob over metric names (first matching rule wins)
          direction: lower              # which way is better: lower | higher
          abs_tol: 1.0e-4               # allowed worsening: max(abs_tol, rel_tol * |baseline|, noise_k * noise)
          rel_tol: 0.25
          samples: ppl_kld.window_kld   # per-window samples -> paired one-sided test vs the baseline
          test: wilcoxon                # wilcoxon | t | sign
          severity: fail                # fail | warn
        - metric: ppl_kld.ppl_ratio
          direction: lower
          noninferiority_margin: 0.002  # or tost_margin: equivalence; both need samples
        - metric: ppl_kld.nonfinite_frac
          max: 0                        # absolute limit, no baseline needed

Each result is compared with a baseline of the same run measured the same
way (`evalharness.fingerprint.baseline_mismatch`: run key, checkpoint,
tokenizer, corpus, eval settings); another one is a baseline problem (exit 2),
other sample counts a WARN on the run's `baseline` line.

Verdicts: PASS, WARN (beyond tolerance but not significant, or a warn-only
rule), FAIL (beyond tolerance and significant, non-inferiority / equivalence
not shown, an absolute limit broken, a non-finite value, or the run itself
failed). Every verdict carries its evidence: the rule, baseline, value, delta,
threshold (and its parts: tolerance, noise floor), interval, test and p-value
(raw and, under a correction, adjusted with the family size).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
from pathlib import Path
from typing import Any

from evalharness import stats
from evalharness.errors import ResultError
from evalharness.gate_rules import (DEFAULT_RULES, RULE_KEYS, describe_rule, noise_floor_runs,
                                    noise_floor_se, resolve_margin, rule_mode)
from evalharness.gate_rules import validate_rules as _validate_rules
from evalharness.results import iter_results, load_result

__all__ = ["Verdict", "validate_rules", "gate_results", "exit_code", "baseline_path", "RULE_KEYS",
           "DEFAULT_RULES"]


@dataclasses.dataclass
class Verdict:
    """One gate decision with its evidence."""

    run_key: str
    metric: str
    verdict: str  # PASS | WARN | FAIL
    value: float | None = None
    baseline: float | None = None
    delta: float | None = None
    threshold: float | None = None
    interval: tuple[float, float] | None = None
    p_value: float | None = None
    message: str = ""
    rule: str | None = None  # "rules[i]: <rule>" that produced the verdict
    mode: str | None = None  # limit | tolerance | noninferiority | equivalence | status
    test: str | None = None  # wilcoxon | t | sign | noninferiority-t | tost
    noise_floor: float | None = None
    noise_source: str | None = None
    p_adjusted: float | None = None
    correction: str | None = None  # e.g. "holm over 24 tests"
    regression_test: bool = False  # p_value is a test for "worse" (subject to the correction)
    direction: str | None = None  # lower | higher: which way is better for this metric

    def worsening(self) -> float | None:
        """How much worse than the baseline (delta signed so that > 0 is worse); None without a delta."""
        if self.delta is None:
            return None
        return -self.delta if self.direction == "higher" else self.delta

    def evidence(self) -> str:
        """One line: value vs baseline, delta vs threshold, noise floor, interval, test and p-value."""
        def f(x):
            """6 significant digits, 'n/a' for None."""
            return "n/a" if x is None else f"{x:.6g}"

        if self.mode in ("status", "baseline"):  # about the run or its baseline, not a metric: the message says it
            return self.message

        parts = [f"value={f(self.value)}", f"baseline={f(self.baseline)}", f"delta={f(self.delta)}",
                 f"threshold={f(self.threshold)}"]
        if self.noise_floor is not None:
            parts.append(f"noise floor={f(self.noise_floor)} ({self.noise_source})")
        elif self.noise_source:
            parts.append(f"noise floor=n/a ({self.noise_source})")
        if self.interval is not None:
            label = {"noninferiority": "delta one-sided bound", "equivalence": "delta 90% CI"}.get(
                self.mode or "", "delta 95% CI")
            parts.append(f"{label}=[{f(self.interval[0])}, {f(self.interval[1])}]")
        if self.p_value is not None:
            parts.append(f"p={f(self.p_value)}" + (f" ({self.test})" if self.test else ""))
        if self.p_adjusted is not None:
            parts.append(f"p_adj={f(self.p_adjusted)} ({self.correction})")
        text = ", ".join(parts)
        text = f"{text}; {self.message}" if self.message else text
        if self.rule and self.rule.startswith("rules["):
            text += f" [{self.rule.split(':', 1)[0]}]"  # which rule of the suite decided
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (with the evidence line)."""
        out = dataclasses.asdict(self)
        out["interval"] = list(self.interval) if self.interval is not None else None
        out["evidence"] = self.evidence()
        return out


def validate_rules(gate_cfg: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """Check a `gate:` section (see `evalharness.gate_rules.validate_rules`)."""
    return _validate_rules(gate_cfg, where)


def _samples(doc: dict[str, Any], ref: str | None) -> list[float] | None:
    """Per-sample array `eval.name` from a result document, if present."""
    if not ref:
        return None
    ev, _, name = ref.partition(".")
    arr = (doc.get("samples") or {}).get(ev, {}).get(name)
    if not (isinstance(arr, list) and arr and all(isinstance(x, (int, float)) and x is not None for x in arr)):
        return None
    vals = [float(x) for x in arr]
    return vals if all(math.isfinite(x) for x in vals) else None


def _paired(rule: dict[str, Any], cur: dict, base: dict, v: Verdict) -> tuple[list[float], list[float]] | None:
    """The (baseline, current) per-window arrays of the rule, or None (reason appended to the message)."""
    ref = rule.get("samples")
    if not ref:
        return None
    cs, bs = _samples(cur, ref), _samples(base, ref)
    if cs is None or bs is None:
        v.message = f"samples '{ref}' missing or non-finite in the {'result' if cs is None else 'baseline'}"
        return None
    if len(cs) != len(bs):
        v.message = f"samples '{ref}' differ in length ({len(cs)} vs baseline {len(bs)}): windows changed"
        return None
    return bs, cs


def _check_limits(rule: dict[str, Any], v: Verdict, sev: str) -> bool:
    """Absolute limits max/min; True when a limit decided the verdict."""
    if "max" in rule and v.value > float(rule["max"]):
        v.verdict, v.threshold = sev, float(rule["max"])
        v.message = f"above the absolute limit max={rule['max']}"
        return True
    if "min" in rule and v.value < float(rule["min"]):
        v.verdict, v.threshold = sev, float(rule["min"])
        v.message = f"below the absolute limit min={rule['min']}"
        return True
    return False


def _check_tolerance(rule: dict[str, Any], cur: dict, base: dict, v: Verdict, sev: str, alpha: float,
                     noise: tuple[float | None, str]) -> None:
    """Tolerance mode: worse than max(abs_tol, rel_tol*|b|, noise_k*noise) and significant -> FAIL."""
    sign = 1.0 if rule.get("direction", "lower") == "lower" else -1.0
    parts = [float(rule.get("abs_tol", 0.0)), float(rule.get("rel_tol", 0.0)) * abs(v.baseline)]
    if "noise_k" in rule:
        v.noise_floor, v.noise_source = noise
        if v.noise_floor is not None:
            parts.append(float(rule["noise_k"]) * v.noise_floor)
            v.noise_source = f"k={rule['noise_k']:g} x {v.noise_source}"
        elif "abs_tol" not in rule and "rel_tol" not in rule:
            v.verdict = "WARN"
            v.message = f"no noise floor: {noise[1]}; cannot set a threshold"
            return
    v.threshold = max(parts)
    worse = sign * v.delta
    pair = _paired(rule, cur, base, v)
    if pair is not None:
        bs, cs = pair
        diffs = [c - b for c, b in zip(cs, bs)]
        ci = stats.mean_ci(diffs)
        v.interval = (ci["lo"], ci["hi"])
        v.test = rule.get("test", "wilcoxon")
        # stats.paired_test(x, y) tests y - x: here current - baseline, one-sided towards "worse".
        res = stats.paired_test(bs, cs, method=v.test, alternative="greater" if sign > 0 else "less")
        v.p_value, v.regression_test = res["p_value"], True
    note = f" ({v.message})" if v.message else ""
    if worse > v.threshold:
        if v.p_value is not None and v.p_value >= alpha:
            v.verdict = "WARN"
            v.message = f"worse than baseline beyond tolerance but not significant (p >= alpha={alpha})"
        else:
            v.verdict = sev
            v.message = "regression: worse than baseline beyond tolerance" + note
            if sev == "WARN":
                v.message += " (advisory rule: severity warn)"
    else:
        v.message = "within tolerance" + note


def _check_margin_test(rule: dict[str, Any], cur: dict, base: dict, v: Verdict, sev: str, alpha: float,
                       mode: str) -> None:
    """Non-inferiority / equivalence (TOST) on the paired per-window arrays: PASS only when shown."""
    key = "noninferiority_margin" if mode == "noninferiority" else "tost_margin"
    margin = resolve_margin(rule[key], v.baseline)
    v.threshold = margin
    pair = _paired(rule, cur, base, v)
    if pair is None:
        v.verdict = "WARN"
        v.message = f"{mode} not testable: {v.message}"
        return
    bs, cs = pair
    if mode == "noninferiority":
        res = stats.noninferiority(bs, cs, margin=margin, alpha=alpha,
                                   higher_is_better=rule.get("direction", "lower") == "higher")
        v.test, v.p_value, ok = "noninferiority-t", res["p_value"], res["noninferior"]
        b = res["bound"]
        v.interval = (b, b) if math.isfinite(b) else None
        what = f"{'lower' if res['higher_is_better'] else 'upper'} {1 - alpha:.0%} bound of the mean delta"
        v.message = (f"non-inferior: {what} {b:.6g} is within the margin {margin:.6g}" if ok else
                     f"non-inferiority not shown: {what} {b:.6g} vs margin {margin:.6g}")
    else:
        res = stats.tost_equivalence(bs, cs, margin=margin, alpha=alpha)
        v.test, v.p_value, ok = "tost", res["p_value"], res["equivalent"]
        v.interval = (res["lo"], res["hi"])
        v.message = (f"equivalent within +-{margin:.6g} (TOST)" if ok else
                     f"equivalence within +-{margin:.6g} not shown (TOST)")
    v.verdict = "PASS" if ok else sev


def _severity(rule: dict[str, Any]) -> str:
    """The verdict a rule gives a regression: FAIL, or WARN for an advisory rule (`severity: warn`)."""
    return "FAIL" if rule.get("severity", "fail") == "fail" else "WARN"


def _check_metric(run_key: str, metric: str, rule: dict[str, Any], cur: dict, base: dict | None,
                  alpha: float, noise: tuple[float | None, str] = (None, "not requested"),
                  rule_index: int | None = None) -> Verdict:
    """Apply one rule to one metric of one run."""
    value = cur["metrics"].get(metric)
    sev = _severity(rule)
    mode = rule_mode(rule)
    label = f"rules[{rule_index}]: " if rule_index is not None else ""
    v = Verdict(run_key, metric, "PASS", value=value, rule=label + describe_rule(rule), mode=mode,
                direction=rule.get("direction", "lower"))
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        v.verdict, v.message = "FAIL", "value is NaN/Inf (non-finite outputs)"
        return v
    if _check_limits(rule, v, sev):
        v.mode = "limit"
        return v
    if mode == "limit":
        v.message = "within absolute limits"
        return v
    if base is None:
        v.verdict, v.message = "WARN", "no baseline for this run"
        return v
    bval = base["metrics"].get(metric)
    if bval is None:
        v.verdict, v.message = "WARN", "metric absent (or non-finite) in the baseline"
        return v
    v.baseline = bval
    v.delta = value - bval
    if mode == "tolerance":
        _check_tolerance(rule, cur, base, v, sev, alpha, noise)
    else:
        _check_margin_test(rule, cur, base, v, sev, alpha, mode)
    return v


def _noise(rule: dict[str, Any], metric: str, doc: dict, base: dict | None, docs: list[dict],
           cfg: dict[str, Any]) -> tuple[float | None, str]:
    """The noise floor of (rule, metric) for one run (see evalharness.gate_rules)."""
    if "noise_k" not in rule:
        return None, "not requested"
    if rule.get("noise", "se") == "runs":
        model = ((doc.get("spec") or {}).get("model") or {}).get("name", "")
        return noise_floor_runs(metric, model, docs, cfg["noise_floor"]["runs"])
    if base is None:
        return None, "no baseline"
    return noise_floor_se(metric, base, _samples(base, rule.get("samples")))


def hardware_class(doc: dict[str, Any]) -> str | None:
    """The hardware class a result was measured on (provenance), e.g. 'h200'; None for old results."""
    return ((doc.get("provenance") or {}).get("hardware") or {}).get("hardware_class")


def baseline_path(baselines_dir: str | Path, suite_name: str, key: str, hw: str | None = None) -> Path:
    """Where the baseline of `key` lives.

    CPU runs: baselines/<suite>/<run_key>.json, one baseline for every CPU. The emulated formats are bit-exact,
    but the fp32 arithmetic around them (the reference's GEMMs, the engine's fp32 ops) runs on the CPU's own
    math library, whose kernels differ between CPU models (vector width, blocking, accumulation order): a
    baseline written on an AMD EPYC differs from an Intel Xeon's in the last bits of fp32, which reaches the
    metrics as small relative differences. The rules' tolerances absorb them (the smoke suite's committed
    baselines, from an AMD EPYC, pass on an Intel Xeon with advisory WARNs only); the result's provenance names
    the CPU it ran on.
    GPU runs are keyed by hardware class as well, because kernels and accumulation order differ
    between GPUs: baselines/<suite>/<hardware_class>/<run_key>.json (e.g. .../h200/...).
    """
    if hw and hw != "cpu":
        return Path(baselines_dir) / suite_name / hw / f"{key}.json"
    return Path(baselines_dir) / suite_name / f"{key}.json"


def missing_baseline_message(baselines_dir: str | Path, suite_name: str, key: str, hw: str | None,
                             results_dir: str | Path) -> str:
    """Why there is no baseline: none at all, or none for this hardware class (naming the classes that have one)."""
    bpath = baseline_path(baselines_dir, suite_name, key, hw)
    if hw and hw != "cpu":
        others = sorted(p.parent.name for p in (Path(baselines_dir) / suite_name).glob(f"*/{key}.json"))
        if others:
            return (f"{key}: no baseline for hardware class '{hw}' at {bpath} (baselines exist for: "
                    f"{', '.join(others)}); GPU baselines are per hardware class: run the suite on this "
                    f"hardware and `evalharness baseline update {results_dir}`")
    return f"{key}: no baseline at {bpath} (create it with `evalharness baseline update {results_dir}`)"


def _manifest(results_dir: Path, have_rules: bool) -> dict[str, Any]:
    """The results folder's suite.json (its suite name and gate rules); without it the rules must come from
    elsewhere (`--suite`): a folder without suite.json is an error, never silently gated by the default rules."""
    path = results_dir / "suite.json"
    if not path.exists():
        if have_rules or not results_dir.is_dir():
            return {}
        raise ResultError(f"{path} is missing, so the suite's gate rules are unknown: gate a folder written by "
                          "`evalharness run`, or give the rules with --suite SUITE.yaml")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultError(f"{path}: corrupt JSON ({exc}); re-run the suite, or give the rules with --suite") from None
    if not isinstance(manifest, dict):
        raise ResultError(f"{path}: expected a JSON object (the suite's manifest); re-run the suite")
    return manifest


def _baseline_for(doc: dict[str, Any], bpath: Path, results_dir: Path) -> tuple[dict | None, str | None,
                                                                              Verdict | None]:
    """(baseline, problem, warning) for one result: the baseline when it is one of this run measured like it
    (`evalharness.fingerprint.baseline_mismatch`), else None and the problem; a WARN verdict when only the sample
    counts differ."""
    from evalharness.fingerprint import baseline_mismatch

    base = load_result(bpath)
    errors, warnings = baseline_mismatch(doc, base)
    key = doc["run_key"]
    if errors:
        return None, (f"{key}: baseline {bpath} does not match this result ({'; '.join(errors)}): it measured "
                      "something else; gate against the baseline of this run, or promote this run with "
                      f"`evalharness baseline update {results_dir}`"), None
    warn = None
    if warnings:
        warn = Verdict(key, "baseline", "WARN", mode="baseline", message="; ".join(warnings) + f" ({bpath})")
    return base, None, warn


def gate_results(results_dir: str | Path, baselines_dir: str | Path, gate_cfg: dict[str, Any] | None = None,
                 allow_missing: bool = False, where: str | None = None) -> tuple[list[Verdict], list[str]]:
    """All verdicts for the results in `results_dir`; returns (verdicts, baseline problems).

    `gate_cfg` (a suite's `gate:` section) overrides the rules recorded in the
    results' suite.json (which must exist otherwise); `where` names its file in
    validation errors. A baseline problem is a run without a baseline (dropped
    with `allow_missing`) or with one that measured something else: another
    run key, checkpoint, tokenizer, corpus or eval settings
    (`evalharness.fingerprint.baseline_mismatch`); such a run is gated as if it
    had no baseline, and the problems make the exit code 2.
    """
    results_dir = Path(results_dir)
    manifest_path = results_dir / "suite.json"
    manifest = _manifest(results_dir, have_rules=gate_cfg is not None)
    suite_name = manifest.get("name")
    if gate_cfg is None:
        gate_cfg = manifest.get("gate")
        where = where or str(manifest_path)
    cfg = validate_rules(gate_cfg, where or str(manifest_path if manifest_path.exists() else results_dir))
    verdicts: list[Verdict] = []
    missing: list[str] = []
    mismatched: list[str] = []
    docs = [doc for _, doc in iter_results(results_dir)]
    if not docs:
        raise ResultError(f"{results_dir}: no result files to gate (run `evalharness run SUITE --out {results_dir}`)")
    for doc in docs:
        key = doc["run_key"]
        sname = suite_name or (doc.get("suite") or {}).get("name", "default")
        hw = hardware_class(doc)
        bpath = baseline_path(baselines_dir, sname, key, hw)
        base = None
        if bpath.exists():
            base, problem, warn = _baseline_for(doc, bpath, results_dir)
            if problem:
                mismatched.append(problem)
            if warn is not None:
                verdicts.append(warn)
        else:
            missing.append(missing_baseline_message(baselines_dir, sname, key, hw, results_dir))
        if doc["status"] != "ok":
            err = doc.get("error") or {}
            verdicts.append(Verdict(key, "status", "FAIL", mode="status",
                                    message=f"run failed: {err.get('type')}: {err.get('message')}"))
            continue
        seen: set[str] = set()
        for i, rule in enumerate(cfg["rules"]):
            for metric in sorted(doc["metrics"]):
                if metric in seen or not fnmatch.fnmatchcase(metric, rule["metric"]):
                    continue
                seen.add(metric)
                noise = _noise(rule, metric, doc, base, docs, cfg)
                verdicts.append(_check_metric(key, metric, rule, doc, base, cfg["alpha"], noise, rule_index=i))
        if base is not None:
            verdicts += _lost_metrics(key, doc, base, cfg["rules"])
    _correct(verdicts, cfg)
    if missing and allow_missing:
        missing = []
    return verdicts, missing + mismatched


def _lost_metrics(key: str, doc: dict, base: dict, rules: list[dict[str, Any]]) -> list[Verdict]:
    """A gated metric of the baseline that this result lacks: the eval, tap or task that produced it did not run
    (or no longer reports it). Judged by the first rule matching it, with that rule's severity."""
    out = []
    for metric in sorted(set(base["metrics"]) - set(doc["metrics"])):
        for i, rule in enumerate(rules):
            if fnmatch.fnmatchcase(metric, rule["metric"]):
                out.append(Verdict(key, metric, _severity(rule), baseline=base["metrics"][metric],
                                   rule=f"rules[{i}]: {describe_rule(rule)}", mode=rule_mode(rule),
                                   message="in the baseline, absent from this result: what produced it did not run"))
                break
    return out


def _correct(verdicts: list[Verdict], cfg: dict[str, Any]) -> None:
    """Holm / BH across every regression test of the whole matrix (all runs, all metrics).

    Each tested verdict keeps its raw p-value and gets `p_adjusted` and the
    family size in its evidence; a FAIL whose adjusted p is not significant
    becomes WARN. Non-inferiority and equivalence tests are not in the family:
    they must each be shown (an intersection-union test needs no correction).
    """
    if cfg["correction"] == "none":
        return
    tested = [v for v in verdicts if v.p_value is not None and v.regression_test]
    if not tested:
        return
    fn = stats.holm if cfg["correction"] == "holm" else stats.benjamini_hochberg
    adj = fn([v.p_value for v in tested], cfg["alpha"])
    family = f"{cfg['correction']} over {len(tested)} tests"
    for v, p in zip(tested, adj["adjusted"]):
        v.p_adjusted, v.correction = p, family
        if v.verdict == "FAIL" and p >= cfg["alpha"]:
            v.verdict = "WARN"
            v.message += f" (not significant after {cfg['correction']} correction: p_adj >= {cfg['alpha']})"


def exit_code(verdicts: list[Verdict], missing: list[str]) -> int:
    """0 all pass (WARN allowed), 1 any FAIL, 2 baseline problems (missing or mismatched: bad input)."""
    if any(v.verdict == "FAIL" for v in verdicts):
        return 1
    if missing:
        return 2
    return 0
