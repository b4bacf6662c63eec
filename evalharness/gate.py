"""The regression gate: results vs stored baselines, one verdict per (run, metric, rule).

Rules come from the suite's `gate:` section (recorded in the results dir's
`suite.json`), else `DEFAULT_RULES`::

    gate:
      alpha: 0.05              # significance for paired tests
      correction: holm         # holm | bh | none: multiple-testing control across all tested verdicts
      rules:
        - metric: ppl_kld.kld_mean      # fnmatch glob over metric names
          direction: lower              # which way is better: lower | higher
          abs_tol: 1.0e-4               # allowed worsening: max(abs_tol, rel_tol * |baseline|)
          rel_tol: 0.25
          samples: ppl_kld.window_kld   # per-window samples -> paired one-sided test vs the baseline
          severity: fail                # fail | warn
        - metric: ppl_kld.nonfinite_frac
          max: 0                        # absolute limit, no baseline needed

Verdicts: PASS, WARN (beyond tolerance but not significant, or a warn-only
rule), FAIL (beyond tolerance and significant, or an absolute limit broken,
or a non-finite value, or the run itself failed). Every verdict carries its
evidence: baseline, value, delta, threshold, interval and p-value.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from pathlib import Path
from typing import Any

from evalharness import stats
from evalharness.errors import ResultError
from evalharness.results import iter_results, load_result

RULE_KEYS = ("metric", "direction", "abs_tol", "rel_tol", "samples", "severity", "max", "min")
DEFAULT_RULES: list[dict[str, Any]] = [
    {"metric": "ppl_kld.nonfinite_frac", "max": 0.0},
    {"metric": "ppl_kld.kld_mean", "direction": "lower", "abs_tol": 1e-5, "rel_tol": 0.25,
     "samples": "ppl_kld.window_kld"},
    {"metric": "ppl_kld.ppl_ratio", "direction": "lower", "abs_tol": 0.005, "rel_tol": 0.0,
     "samples": None},
    {"metric": "ppl_kld.top1_agree", "direction": "higher", "abs_tol": 0.01, "rel_tol": 0.0,
     "samples": "ppl_kld.window_top1"},
    {"metric": "layer_error.logits.rel_l2", "direction": "lower", "abs_tol": 1e-4, "rel_tol": 0.25},
    {"metric": "layer_error.*.rel_l2", "direction": "lower", "abs_tol": 1e-3, "rel_tol": 0.5, "severity": "warn"},
]


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

    def evidence(self) -> str:
        """One line: value vs baseline, delta vs threshold, interval, p-value."""
        def f(x):
            return "n/a" if x is None else f"{x:.6g}"

        parts = [f"value={f(self.value)}", f"baseline={f(self.baseline)}", f"delta={f(self.delta)}",
                 f"threshold={f(self.threshold)}"]
        if self.interval is not None:
            parts.append(f"delta 95% CI=[{f(self.interval[0])}, {f(self.interval[1])}]")
        if self.p_value is not None:
            parts.append(f"p={f(self.p_value)}")
        text = ", ".join(parts)
        return f"{text}; {self.message}" if self.message else text


def validate_rules(gate_cfg: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """Check a `gate:` section; returns {alpha, correction, rules} with defaults filled in."""
    gate_cfg = dict(gate_cfg or {})
    unknown = [k for k in gate_cfg if k not in ("alpha", "correction", "rules")]
    if unknown:
        raise ResultError(f"{where}: gate: unknown key(s) {unknown}; allowed: alpha, correction, rules")
    alpha = float(gate_cfg.get("alpha", 0.05))
    correction = gate_cfg.get("correction", "none")
    if correction not in ("none", "holm", "bh"):
        raise ResultError(f"{where}: gate.correction must be none, holm or bh, got '{correction}'")
    rules = gate_cfg.get("rules") or DEFAULT_RULES
    for i, r in enumerate(rules):
        if not isinstance(r, dict) or "metric" not in r:
            raise ResultError(f"{where}: gate.rules[{i}] must be a mapping with a 'metric' glob")
        bad = [k for k in r if k not in RULE_KEYS]
        if bad:
            raise ResultError(f"{where}: gate.rules[{i}]: unknown key(s) {bad}; allowed: {list(RULE_KEYS)}")
        if r.get("direction", "lower") not in ("lower", "higher"):
            raise ResultError(f"{where}: gate.rules[{i}].direction must be 'lower' or 'higher'")
        if r.get("severity", "fail") not in ("fail", "warn"):
            raise ResultError(f"{where}: gate.rules[{i}].severity must be 'fail' or 'warn'")
    return {"alpha": alpha, "correction": correction, "rules": rules}


def _samples(doc: dict[str, Any], ref: str | None) -> list[float] | None:
    """Per-sample array `eval.name` from a result document, if present."""
    if not ref:
        return None
    ev, _, name = ref.partition(".")
    arr = (doc.get("samples") or {}).get(ev, {}).get(name)
    return [float(x) for x in arr] if isinstance(arr, list) and arr and isinstance(arr[0], (int, float)) else None


def _check_metric(run_key: str, metric: str, rule: dict[str, Any], cur: dict, base: dict | None,
                  alpha: float) -> Verdict:
    """Apply one rule to one metric of one run."""
    value = cur["metrics"].get(metric)
    sev_fail = rule.get("severity", "fail") == "fail"
    v = Verdict(run_key, metric, "PASS", value=value)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        v.verdict, v.message = "FAIL", "value is NaN/Inf (non-finite outputs)"
        return v
    if "max" in rule and value > float(rule["max"]):
        v.verdict = "FAIL" if sev_fail else "WARN"
        v.threshold, v.message = float(rule["max"]), f"above the absolute limit max={rule['max']}"
        return v
    if "min" in rule and value < float(rule["min"]):
        v.verdict = "FAIL" if sev_fail else "WARN"
        v.threshold, v.message = float(rule["min"]), f"below the absolute limit min={rule['min']}"
        return v
    if "abs_tol" not in rule and "rel_tol" not in rule:
        v.message = "within absolute limits"
        return v
    if base is None:
        v.verdict, v.message = "WARN", "no baseline for this run"
        return v
    bval = base["metrics"].get(metric)
    if bval is None:
        v.verdict, v.message = "WARN", "metric absent (or non-finite) in the baseline"
        return v
    sign = 1.0 if rule.get("direction", "lower") == "lower" else -1.0
    v.baseline = bval
    v.delta = value - bval
    worse = sign * v.delta
    v.threshold = max(float(rule.get("abs_tol", 0.0)), float(rule.get("rel_tol", 0.0)) * abs(bval))
    cs, bs = _samples(cur, rule.get("samples")), _samples(base, rule.get("samples"))
    if cs is not None and bs is not None and len(cs) == len(bs):
        diffs = [c - b for c, b in zip(cs, bs)]
        ci = stats.mean_ci(diffs)
        v.interval = (ci["lo"], ci["hi"])
        # stats.paired_test(x, y) tests y - x: here current - baseline, one-sided towards "worse".
        test = stats.paired_test(bs, cs, method="wilcoxon", alternative="greater" if sign > 0 else "less")
        v.p_value = test["p_value"]
    if worse > v.threshold:
        if v.p_value is not None and v.p_value >= alpha:
            v.verdict = "WARN"
            v.message = f"worse than baseline beyond tolerance but not significant (p >= alpha={alpha})"
        else:
            v.verdict = "FAIL" if sev_fail else "WARN"
            v.message = "regression: worse than baseline beyond tolerance"
    else:
        v.message = "within tolerance"
    return v


def baseline_path(baselines_dir: str | Path, suite_name: str, key: str) -> Path:
    """Where the baseline of `key` lives: baselines/<suite>/<run_key>.json."""
    return Path(baselines_dir) / suite_name / f"{key}.json"


def gate_results(results_dir: str | Path, baselines_dir: str | Path, gate_cfg: dict[str, Any] | None = None,
                 allow_missing: bool = False) -> tuple[list[Verdict], list[str]]:
    """All verdicts for the results in `results_dir`; returns (verdicts, missing-baseline messages)."""
    results_dir = Path(results_dir)
    manifest_path = results_dir / "suite.json"
    suite_name = None
    if manifest_path.exists():
        import json

        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise ResultError(f"{manifest_path}: corrupt JSON ({exc}); re-run the suite") from None
        suite_name = manifest.get("name")
        if gate_cfg is None:
            gate_cfg = manifest.get("gate")
    cfg = validate_rules(gate_cfg, str(manifest_path if manifest_path.exists() else results_dir))
    verdicts: list[Verdict] = []
    missing: list[str] = []
    docs = list(iter_results(results_dir))
    if not docs:
        raise ResultError(f"{results_dir}: no result files to gate (run `evalharness run SUITE --out {results_dir}`)")
    for path, doc in docs:
        key = doc["run_key"]
        sname = suite_name or (doc.get("suite") or {}).get("name", "default")
        bpath = baseline_path(baselines_dir, sname, key)
        base = load_result(bpath) if bpath.exists() else None
        if base is None:
            missing.append(f"{key}: no baseline at {bpath} (create it with `evalharness baseline update {results_dir}`)")
        if doc["status"] != "ok":
            err = doc.get("error") or {}
            verdicts.append(Verdict(key, "status", "FAIL", message=f"run failed: {err.get('type')}: {err.get('message')}"))
            continue
        seen: set[str] = set()
        for rule in cfg["rules"]:
            for metric in sorted(doc["metrics"]):
                if metric in seen or not fnmatch.fnmatchcase(metric, rule["metric"]):
                    continue
                seen.add(metric)
                verdicts.append(_check_metric(key, metric, rule, doc, base, cfg["alpha"]))
    _correct(verdicts, cfg)
    if missing and allow_missing:
        missing = []
    return verdicts, missing


def _correct(verdicts: list[Verdict], cfg: dict[str, Any]) -> None:
    """Holm / BH across every tested verdict: a FAIL whose adjusted p is not significant becomes WARN."""
    if cfg["correction"] == "none":
        return
    tested = [v for v in verdicts if v.p_value is not None]
    if not tested:
        return
    fn = stats.holm if cfg["correction"] == "holm" else stats.benjamini_hochberg
    adj = fn([v.p_value for v in tested], cfg["alpha"])
    for v, p in zip(tested, adj["adjusted"]):
        v.p_value = p
        if v.verdict == "FAIL" and p >= cfg["alpha"]:
            v.verdict = "WARN"
            v.message += f" (not significant after {cfg['correction']} correction)"


def exit_code(verdicts: list[Verdict], missing: list[str]) -> int:
    """0 all pass (WARN allowed), 1 any FAIL, 2 missing baselines (bad input)."""
    if any(v.verdict == "FAIL" for v in verdicts):
        return 1
    if missing:
        return 2
    return 0
