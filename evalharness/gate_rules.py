"""The gate's rule schema: the `gate:` section of a suite YAML, validated.

Schema (every key optional except `metric`; unknown keys are errors that name
the suite file and the rule index)::

    gate:
      alpha: 0.05                  # significance level of every test
      correction: holm             # none | holm | bh: over every regression test of the matrix
      noise_floor:                 # designated noise-floor runs (for rules with `noise: runs`)
        runs: "*__bf16__*"         # run-key glob in the same results dir; >= 2 runs per model
      rules:
        - metric: ppl_kld.kld_mean          # fnmatch glob over metric names; first matching rule wins
          direction: lower                  # which way is better: lower | higher
          # --- tolerance mode (default): FAIL when worse than the threshold (and significant) ---
          abs_tol: 1.0e-6                   # threshold = max(abs_tol, rel_tol * |baseline|,
          rel_tol: 0.25                     #                 noise_k * noise floor)
          noise_k: 3                        # k x the measured noise floor (see below)
          noise: se                         # se | runs: where the noise floor comes from
          samples: ppl_kld.window_kld       # per-window arrays: paired one-sided test vs the baseline
          test: wilcoxon                    # wilcoxon | t | sign
          # --- or non-inferiority mode: PASS only when shown not worse than the margin ---
          noninferiority_margin: 0.002      # absolute (metric units) or "25%" of |baseline|; needs samples
          # --- or equivalence mode (TOST): PASS only when shown within +-margin of the baseline ---
          tost_margin: "10%"                # absolute or "N%" of |baseline|; needs samples
          severity: fail                    # fail | warn
          max: 0.0                          # absolute limits, no baseline needed (checked first)
          min: 0.0

Noise floor (``noise_k``): the spread between two runs that should be identical up
to noise, as a standard deviation ``sigma`` of the difference of two measurements:

* ``noise: se`` (default): ``sigma = sqrt(2) * SE``, with SE the *baseline's*
  standard error of the metric: ``sd(samples) / sqrt(n)`` of the baseline's
  per-window array when the rule names ``samples``, else
  ``(hi - lo) / (2 * 1.959964)`` from the baseline's stored 95% interval
  ``<metric>_lo`` / ``<metric>_hi`` (ppl_ratio, kld_mean, top1_agree, ...).
  sqrt(2): the difference of two independent measurements with that SE.
* ``noise: runs``: ``sigma = max - min`` of the metric over the noise-floor runs
  of the same model in the results dir being gated (``noise_floor.runs``, e.g.
  bf16 under two batch sizes: same recipe, different serving, which must agree
  up to numerical noise).

A rule with ``noise_k`` whose noise floor cannot be measured (no interval, no
samples, fewer than two noise-floor runs) uses its other tolerances, or WARNs
with "no noise floor" when it has none.
"""

from __future__ import annotations

import fnmatch
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from evalharness.errors import ResultError
from evalharness.schema import CUSTOM, Schema, messages

GATE_KEYS = ("alpha", "correction", "noise_floor", "rules")
RULE_KEYS = ("metric", "direction", "abs_tol", "rel_tol", "noise_k", "noise", "samples", "test",
             "noninferiority_margin", "tost_margin", "severity", "max", "min")
NOISE_FLOOR_KEYS = ("runs",)
CORRECTIONS = ("none", "holm", "bh")
TESTS = ("wilcoxon", "t", "sign")
NOISE_SOURCES = ("se", "runs")
Z975 = 1.959963984540054  # two-sided 95% normal quantile: stored intervals -> standard error

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
_PCT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*%\s*$")


def _num(value: Any, what: str, where: str, minimum: float = 0.0, strict: bool = False) -> float:
    """A finite number >= minimum (> minimum when strict), else a ResultError naming `where` and `what`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        ok = float(value) > minimum if strict else float(value) >= minimum
    if not ok:
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ResultError(f"{where}: {what} must be a finite number {bound}, got {value!r}")
    return float(value)


def parse_margin(value: Any, what: str, where: str) -> tuple[float, bool]:
    """A margin: a positive number (absolute, metric units) or 'N%' (relative to |baseline|).

    Returns (amount, relative): `(0.25, True)` for "25%".
    """
    if isinstance(value, str):
        m = _PCT.match(value)
        if not m or not float(m.group(1)) > 0:
            raise ResultError(f"{where}: {what} must be a positive number or a percentage like '25%', got {value!r}")
        return float(m.group(1)) / 100.0, True
    return _num(value, what, where, strict=True), False


def resolve_margin(value: Any, baseline: float) -> float:
    """The absolute margin of a validated `value` for a baseline value."""
    amount, relative = parse_margin(value, "margin", "rule")
    return amount * abs(baseline) if relative else amount


def rule_mode(rule: dict[str, Any]) -> str:
    """'limit' (only max/min), 'noninferiority', 'equivalence' or 'tolerance'."""
    if "noninferiority_margin" in rule:
        return "noninferiority"
    if "tost_margin" in rule:
        return "equivalence"
    if any(k in rule for k in ("abs_tol", "rel_tol", "noise_k")):
        return "tolerance"
    return "limit"


Number = Annotated[Union[StrictInt, StrictFloat], Field(allow_inf_nan=False)]  # no bool, no "1.0" string, finite
Margin = Union[StrictInt, StrictFloat, StrictStr]


class Rule(Schema):
    """One gate rule (module docstring); the checks across keys are in `_modes`."""

    metric: Annotated[StrictStr, Field(min_length=1)]
    direction: Literal["lower", "higher"] = "lower"
    abs_tol: Annotated[Number, Field(ge=0)] | None = None
    rel_tol: Annotated[Number, Field(ge=0)] | None = None
    noise_k: Annotated[Number, Field(gt=0)] | None = None
    noise: Literal[NOISE_SOURCES] | None = None  # type: ignore[valid-type]
    samples: StrictStr | None = None
    test: Literal[TESTS] | None = None  # type: ignore[valid-type]
    noninferiority_margin: Margin | None = None
    tost_margin: Margin | None = None
    severity: Literal["fail", "warn"] = "fail"
    max: Number | None = None
    min: Number | None = None

    @field_validator("samples")
    @classmethod
    def _array_name(cls, v: str | None) -> str | None:
        if v is not None and "." not in v:
            raise ValueError("no '.'")
        return v

    @field_validator("noninferiority_margin", "tost_margin")
    @classmethod
    def _margin(cls, v: Any) -> Any:
        if v is not None:
            try:
                parse_margin(v, "margin", "rule")
            except ResultError as exc:
                raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _modes(self) -> "Rule":
        given = self.model_fields_set
        if "noise" in given and "noise_k" not in given:
            raise PydanticCustomError(CUSTOM, "'noise: {noise}' needs 'noise_k' (the multiple of the noise floor)",
                                      {"noise": self.noise})
        modes = [k for k in ("noninferiority_margin", "tost_margin") if k in given]
        if len(modes) > 1:
            raise PydanticCustomError(CUSTOM, "give either noninferiority_margin or tost_margin, not both")
        for key in modes:
            if not self.samples:
                raise PydanticCustomError(CUSTOM, "{key} needs 'samples' (a per-window array for the paired test)",
                                          {"key": key})
            clash = [k for k in ("abs_tol", "rel_tol", "noise_k", "test") if k in given]
            if clash:
                raise PydanticCustomError(CUSTOM, "{key} is a test of its own; drop {clash} (or put them in a "
                                          "separate rule)", {"key": key, "clash": str(clash)})
        if "test" in given and not self.samples:
            raise PydanticCustomError(CUSTOM, "'test: {test}' needs 'samples' (the per-window arrays it compares)",
                                      {"test": self.test})
        return self


class NoiseFloor(Schema):
    """`gate.noise_floor`: the run-key glob of the noise-floor runs."""

    runs: StrictStr | None = None


class Gate(Schema):
    """The `gate:` section (module docstring)."""

    alpha: Annotated[Number, Field(gt=0, lt=1)] = 0.05
    correction: Literal[CORRECTIONS] = "none"  # type: ignore[valid-type]
    noise_floor: NoiseFloor | None = None
    rules: list[Rule] | None = None


# What a value must be, by key: the message of a value the schema refuses.
_NEEDS = {
    "metric": "a non-empty metric name or glob", "abs_tol": "a finite number >= 0", "rel_tol": "a finite number >= 0",
    "noise_k": "a finite number > 0", "max": "a finite number", "min": "a finite number",
    "samples": "a per-sample array as '<eval>.<array>' (e.g. ppl_kld.window_kld)",
    "noninferiority_margin": "a positive number or a percentage like '25%'",
    "tost_margin": "a positive number or a percentage like '25%'",
    "alpha": "a number in (0, 1)", "runs": "a run-key glob string",
    "noise_floor": "a mapping like {runs: '*__bf16__*'}",
    "rules": "a list of rules",
}
def validate_rules(gate_cfg: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """Check a `gate:` section against the schema (`Gate`, `Rule`, `NoiseFloor`); returns {alpha, correction,
    noise_floor, rules} with defaults filled in, each rule as written.

    `where` names the file the section came from (the suite YAML or the results'
    suite.json); every error message starts with it and names the key / rule index, what the value must be and the
    value given (all refused keys, one per line).
    """
    if gate_cfg is not None and not isinstance(gate_cfg, dict):
        raise ResultError(f"{where}: gate must be a mapping with keys {list(GATE_KEYS)}")
    raw = dict(gate_cfg or {})
    if not raw.get("rules"):
        raw["rules"] = DEFAULT_RULES  # absent or empty: the defaults
    if raw.get("noise_floor") is None:
        raw.pop("noise_floor", None)
    try:
        gate = Gate.model_validate(raw)
    except ValidationError as exc:
        raise ResultError("\n".join(f"{where}: {m}" for m in messages(exc, raw, Gate, "gate", _NEEDS))) from None
    nf = raw.get("noise_floor") or {}
    runs = gate.noise_floor.runs if gate.noise_floor is not None else None
    for i, r in enumerate(gate.rules or []):
        if r.noise == "runs" and runs is None:
            raise ResultError(f"{where}: gate.rules[{i}] uses 'noise: runs' but gate.noise_floor.runs "
                              "(the run-key glob of the noise-floor runs) is not set")
    return {"alpha": float(gate.alpha), "correction": gate.correction, "noise_floor": dict(nf),
            "rules": [dict(r) for r in raw["rules"]]}


def describe_rule(rule: dict[str, Any]) -> str:
    """A compact one-line rendering of a rule (for evidence and reports)."""
    parts = [f"{k}={rule[k]}" for k in RULE_KEYS[1:] if k in rule and rule[k] is not None]
    return f"{rule['metric']} [{', '.join(parts)}]"


def noise_floor_se(metric: str, base: dict[str, Any], base_samples: list[float] | None) -> tuple[float | None, str]:
    """sqrt(2) x the baseline's standard error of `metric` (see module docstring), and how it was measured."""
    if base_samples is not None and len(base_samples) >= 2:
        n = len(base_samples)
        mean = sum(base_samples) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in base_samples) / (n - 1))
        return math.sqrt(2.0) * sd / math.sqrt(n), f"sqrt(2)*baseline SE from {n} samples"
    m = base.get("metrics", {})
    lo, hi = m.get(f"{metric}_lo"), m.get(f"{metric}_hi")
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and hi >= lo:
        return math.sqrt(2.0) * (hi - lo) / (2.0 * Z975), "sqrt(2)*baseline SE from its 95% interval"
    return None, "no interval or samples in the baseline"


def noise_floor_runs(metric: str, model: str, docs: list[dict[str, Any]], pattern: str) -> tuple[float | None, str]:
    """Spread (max - min) of `metric` over the noise-floor runs of `model` (run keys matching `pattern`)."""
    values, keys = [], []
    for d in docs:
        if d.get("status") != "ok" or not fnmatch.fnmatchcase(d["run_key"], pattern):
            continue
        if ((d.get("spec") or {}).get("model") or {}).get("name") != model:
            continue
        v = d["metrics"].get(metric)
        if isinstance(v, (int, float)) and math.isfinite(v):
            values.append(float(v))
            keys.append(d["run_key"])
    if len(values) < 2:
        return None, f"{len(values)} noise-floor run(s) matching '{pattern}' for model '{model}' (need 2)"
    return max(values) - min(values), f"spread of {len(values)} noise-floor runs ({', '.join(keys)})"
