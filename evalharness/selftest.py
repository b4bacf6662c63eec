"""`evalharness selftest`: measure the gate's power on planted regressions and its false-alarm rate on nulls.

The catalog (`suites/selftest/catalog.yaml`) lists

* **planted** regressions: recipe YAMLs that `extends` a baseline recipe and
  break one thing (router in E4M3, per-tensor K-cache scales, E4M3 residual,
  BF16 softmax, tc14 accumulation without promotion, block scales one
  exponent too small). Each must make the gate FAIL.
* **nulls**: the baseline recipe re-run unchanged, with another seed, or with
  another batch size. Each must NOT make the gate FAIL.

Procedure (everything through the real runner and the real gate):

1. Run the suite's recipes plus every baseline recipe the catalog needs into
   `OUT/baseline/` and promote those results to a private baselines dir
   `OUT/baselines/` (the selftest measures the gate, not the committed
   baselines, so it makes its own).
2. For each catalog entry, run the variant cells (the baseline recipe's cells,
   with the planted recipe renamed to the baseline's name, or with the null's
   seed / batch size) into `OUT/variants/<id>/`, carry the other cells of the
   matrix over from step 1 (the emulation is deterministic, so a re-run would
   reproduce them bit for bit) and gate the whole matrix, so multiple-testing
   control sees the same family as in CI.
3. Report: planted caught = gate exit 1; null false alarm = gate exit 1;
   entries whose requirement no suite model meets (router on a dense-only
   suite), that the engine cannot express yet, or that change no metric at
   all (a no-op on these models), are "n/a", neither caught nor missed.
   Each variant also gets its *effect size*: the largest worsening of
   kld_mean / top1_agree / ppl_ratio in units of the gate's noise floor
   (sqrt(2) x the baseline's standard error). A planted change with an
   effect below NOISE_K (3) noise floors is invisible at this suite's
   resolution: no gate can flag it without flagging noise of the same size
   (the null variants show that size). Writes `OUT/selftest.json` and
   `OUT/selftest.md`.

Exit code of the command: 0 when no null fails, nothing errors and every
planted regression above the noise floor is caught (`--strict`: every
planted regression), 1 otherwise, 2 on bad input.

Power note: a paired test on n windows cannot give p below ~2**-n (Wilcoxon,
sign test), and Holm over m tests multiplies the smallest p by m, so a
significant regression needs n >= log2(m / alpha) windows (n = 12 for
m = 10 tests at alpha 0.05); with fewer, only the rules without a paired
test (limits, tolerances without samples) can FAIL.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from engine.errors import RecipeError
from engine.recipe import load_recipe
from evalharness.errors import SuiteError

REPO = Path(__file__).resolve().parent.parent
CATALOG = REPO / "suites" / "selftest" / "catalog.yaml"
ENTRY_KEYS = {"planted": ("id", "recipe", "baseline", "requires", "what"),
              "nulls": ("id", "baseline", "seed", "batch_size", "requires", "what")}
REQUIREMENTS = ("moe",)
_MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
# (metric, direction, per-window samples) whose worsening measures a variant's effect size.
EFFECT_METRICS = (("ppl_kld.kld_mean", "lower", "ppl_kld.window_kld"),
                  ("ppl_kld.top1_agree", "higher", "ppl_kld.window_top1"),
                  ("ppl_kld.ppl_ratio", "lower", None))
NOISE_K = 3.0  # effects below NOISE_K noise floors are "below the suite's resolution"


@dataclasses.dataclass
class Entry:
    """One catalog entry (planted or null)."""

    id: str
    kind: str  # planted | null
    baseline: str
    what: str = ""
    recipe: Path | None = None
    seed: int | None = None
    batch_size: int | None = None
    requires: str | None = None


@dataclasses.dataclass
class Outcome:
    """What the gate said about one entry."""

    entry: Entry
    status: str  # caught | MISSED | ok | FALSE ALARM | n/a | error
    effect: dict[str, Any] | None = None  # largest worsening in noise floors (see effect_size)
    gate_exit: int | None = None
    models: list[str] = dataclasses.field(default_factory=list)
    n_fail: int = 0
    n_warn: int = 0
    evidence: str = ""
    fails: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        e = self.entry
        return {"id": e.id, "kind": e.kind, "baseline": e.baseline, "what": e.what,
                "recipe": str(e.recipe) if e.recipe else None, "seed": e.seed, "batch_size": e.batch_size,
                "requires": e.requires, "status": self.status, "gate_exit": self.gate_exit, "models": self.models,
                "n_fail": self.n_fail, "n_warn": self.n_warn, "evidence": self.evidence, "fails": self.fails,
                "effect": self.effect, "effect_text": effect_text(self.effect),
                "seconds": round(self.seconds, 2), "reason": self.reason}


def read_catalog(path: Path, what: str) -> Any:
    """The YAML document of a catalog file (safe_load); a SuiteError naming `what` and the file when it is missing
    or malformed."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SuiteError(f"{what} not found: {path}") from None
    except yaml.YAMLError as exc:
        raise SuiteError(f"{path}: malformed YAML: {exc}") from None


def select_ids(items: list, only, what: str) -> list:
    """The items whose `id` is in `only` (all of them when `only` is empty); unknown ids are a SuiteError."""
    if not only:
        return items
    unknown = sorted(set(only) - {x.id for x in items})
    if unknown:
        raise SuiteError(f"--only: unknown {what} id(s) {unknown}; catalog ids: {[x.id for x in items]}")
    return [x for x in items if x.id in only]


def load_catalog(path: str | Path = CATALOG) -> list[Entry]:
    """Parse and validate the catalog; errors name the file, section and index."""
    path = Path(path)
    raw = read_catalog(path, "selftest catalog")
    if not isinstance(raw, dict) or set(raw) - {"planted", "nulls"}:
        raise SuiteError(f"{path}: the catalog must be a mapping with the sections 'planted' and 'nulls'")
    entries: list[Entry] = []
    seen: set[str] = set()
    for section, kind in (("planted", "planted"), ("nulls", "null")):
        items = raw.get(section) or []
        if not isinstance(items, list):
            raise SuiteError(f"{path}: '{section}' must be a list of entries")
        for i, item in enumerate(items):
            where = f"{path}: {section}[{i}]"
            if not isinstance(item, dict):
                raise SuiteError(f"{where} must be a mapping")
            bad = [k for k in item if k not in ENTRY_KEYS[section]]
            if bad:
                raise SuiteError(f"{where}: unknown key(s) {bad}; allowed: {list(ENTRY_KEYS[section])}")
            for key in ("id", "baseline"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise SuiteError(f"{where}: '{key}' is required (a string)")
            if item["id"] in seen:
                raise SuiteError(f"{where}: duplicate id '{item['id']}'")
            seen.add(item["id"])
            if item.get("requires") not in (None,) + REQUIREMENTS:
                raise SuiteError(f"{where}: requires must be one of {list(REQUIREMENTS)}, got {item['requires']!r}")
            e = Entry(id=item["id"], kind=kind, baseline=item["baseline"], what=str(item.get("what", "")),
                      requires=item.get("requires"))
            if kind == "planted":
                if not isinstance(item.get("recipe"), str):
                    raise SuiteError(f"{where}: 'recipe' (a recipe YAML next to the catalog) is required")
                e.recipe = (path.parent / item["recipe"]).resolve()
                _check_extends(e, where)
            else:
                for key in ("seed", "batch_size"):
                    v = item.get(key)
                    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "batch_size" else 0)):
                        raise SuiteError(f"{where}: {key} must be a {'positive' if key == 'batch_size' else 'non-negative'} "
                                         f"integer, got {v!r}")
                e.seed, e.batch_size = item.get("seed"), item.get("batch_size")
            entries.append(e)
    return entries


def _check_extends(e: Entry, where: str) -> None:
    """A planted recipe must exist and `extends` its catalog baseline (so the diff is the planted bug only)."""
    if not e.recipe.exists():
        raise SuiteError(f"{where}: recipe file not found: {e.recipe}")
    raw = yaml.safe_load(e.recipe.read_text()) or {}
    if raw.get("extends") != e.baseline:
        raise SuiteError(f"{where}: {e.recipe.name} must 'extends: {e.baseline}' (its catalog baseline), "
                         f"found extends: {raw.get('extends')!r}")


def is_moe(model: dict[str, Any]) -> bool:
    """True when the model's config (a local HF folder or builtin) declares routed experts."""
    from evalharness.fingerprint import model_source

    try:
        source = model_source(model)
        if source.kind == "llama2c":
            return False
        cfg = json.loads((Path(source.path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(isinstance(cfg.get(k), int) and cfg[k] > 0 for k in _MOE_KEYS)


def _applicable_models(entry: Entry, models: list[dict[str, Any]]) -> list[str]:
    """Names of the suite models this entry applies to."""
    if entry.requires == "moe":
        return [m["name"] for m in models if is_moe(m)]
    return [m["name"] for m in models]


def _uninjectable(entries: list[Entry], applicable: dict[str, list[str]]) -> dict[str, str]:
    """Applicable planted entries whose recipe the engine rejects (e.g. an FP8 router before the engine
    supports one): id -> the engine's message. Checked before any run, so no baseline is run for them."""
    out = {}
    for e in entries:
        if e.kind == "planted" and applicable[e.id]:
            try:
                load_recipe(str(e.recipe))
            except RecipeError as exc:
                out[e.id] = str(exc)
    return out


def _variant_runs(entry: Entry, base_runs: list, model_names: list[str]) -> list:
    """The variant's RunSpecs: the baseline recipe's cells with the planted recipe or the null's changes."""
    cells = [r for r in base_runs if r.recipe.name == entry.baseline and r.model["name"] in model_names]
    if entry.kind == "planted":
        planted = load_recipe(str(entry.recipe))
        # Run under the baseline's run key (and so against its baseline); the description says PLANTED.
        planted = dataclasses.replace(planted, name=entry.baseline)
        return [dataclasses.replace(r, recipe=planted) for r in cells]
    out = []
    for r in cells:
        serving = dict(r.serving, batch_size=entry.batch_size) if entry.batch_size else r.serving
        out.append(dataclasses.replace(r, seed=entry.seed if entry.seed is not None else r.seed, serving=serving))
    return out


def _ratio(v: Any) -> float:
    """Worsening / threshold of a tolerance verdict (-inf when not applicable)."""
    w = v.worsening()
    if v.mode != "tolerance" or not v.threshold or w is None:
        return -float("inf")
    return w / v.threshold


def _closest(verdicts: list, keys: set[str]) -> Any:
    """The variant cells' verdict nearest to failing: largest worsening / threshold among tolerance verdicts."""
    mine = [v for v in verdicts if v.run_key in keys and _ratio(v) > -float("inf")]
    return max(mine, key=_ratio) if mine else None


def _strongest_fail(fails: list) -> Any:
    """The most convincing FAIL: the fail-severity tolerance FAIL with the largest worsening / threshold."""
    return max(fails, key=lambda v: (v.mode == "tolerance", _ratio(v))) if fails else None


def _cells(vdir: Path, baselines: Path, keys: set[str]):
    """(run key, variant result, its baseline or None) for each variant cell written under `vdir`."""
    from evalharness.gate import baseline_path, hardware_class
    from evalharness.results import load_result

    suite_name = json.loads((vdir / "suite.json").read_text()).get("name", "default")
    for key in sorted(keys):
        path = vdir / f"{key}.json"
        if not path.exists():
            continue
        cur = load_result(path)
        bpath = baseline_path(baselines, suite_name, key, hardware_class(cur))
        yield key, cur, (load_result(bpath) if bpath.exists() else None)


def effect_size(vdir: Path, baselines: Path, keys: set[str]) -> dict[str, Any] | None:
    """The variant's largest worsening of the primary metrics in units of the gate's noise floor.

    For each variant cell and each metric of `EFFECT_METRICS`: z = worsening / sigma,
    sigma = sqrt(2) x the baseline's standard error (`gate_rules.noise_floor_se`,
    from the per-window array when there is one). |z| < 3 means the planted change
    is below this suite's resolution: no gate could flag it without also flagging
    noise of the same size.
    """
    from evalharness.gate import _samples
    from evalharness.gate_rules import noise_floor_se

    best = None
    for key, cur, base in _cells(vdir, baselines, keys):
        if base is None:
            continue
        for metric, direction, samples in EFFECT_METRICS:
            v, b = cur["metrics"].get(metric), base["metrics"].get(metric)
            if not isinstance(v, (int, float)) or not isinstance(b, (int, float)):
                continue
            sigma, _ = noise_floor_se(metric, base, _samples(base, samples))
            if not sigma:
                continue
            worse = (b - v) if direction == "higher" else (v - b)
            z = worse / sigma
            if best is None or z > best["z"]:
                best = {"run_key": key, "metric": metric, "z": z, "value": v, "baseline": b, "sigma": sigma,
                        "rel": (v - b) / abs(b) if b else None}
    return best


def _no_op(vdir: Path, baselines: Path, keys: set[str]) -> bool:
    """True when each variant cell's metrics equal its baseline's exactly (the planted change did nothing)."""
    seen = 0
    for _, cur, base in _cells(vdir, baselines, keys):
        if base is None or cur["metrics"] != base["metrics"]:
            return False
        seen += 1
    return seen > 0


def _gate_variant(entry: Entry, vdir: Path, baselines: Path, keys: set[str], models: list[str],
                  t0: float) -> Outcome:
    """Gate one variant's results dir and classify the outcome."""
    from evalharness.gate import exit_code, gate_results

    verdicts, missing = gate_results(vdir, baselines)
    code = exit_code(verdicts, missing)
    mine = [v for v in verdicts if v.run_key in keys]
    fails = [v for v in mine if v.verdict == "FAIL"]
    out = Outcome(entry, "", gate_exit=code, models=models, n_fail=len(fails),
                  n_warn=sum(v.verdict == "WARN" for v in mine), seconds=time.time() - t0,
                  fails=[v.to_dict() for v in fails])
    if code == 2:
        out.status, out.reason = "error", "; ".join(missing)
    elif entry.kind == "planted":
        out.status = "caught" if code == 1 else "MISSED"
        if code == 0 and _no_op(vdir, baselines, keys):
            out.status = "n/a"
            out.reason = ("a no-op on these models: every metric of every cell is identical to the baseline's "
                          "(e.g. per-tensor vs per-head K scales with a single cached K head, MLA)")
    else:
        out.status = "FALSE ALARM" if code == 1 else "ok"
    out.effect = effect_size(vdir, baselines, keys)
    if fails:
        v = _strongest_fail(fails)
        out.evidence = f"FAIL {v.run_key} {v.metric}: {v.evidence()}"
    else:
        v = _closest(verdicts, keys)
        if v is not None:
            out.evidence = f"closest: {v.verdict} {v.run_key} {v.metric}: {v.evidence()}"
    return out


def run_selftest(suite_path: str | Path, out_dir: str | Path, sets: list[str] | None = None,
                 data_dir: str | None = None, catalog: str | Path = CATALOG, only: list[str] | None = None,
                 models: list[str] | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the selftest (module docstring); returns the report dict (also written as OUT/selftest.json).

    `log` receives progress lines; by default they go to stderr with progress bars.
    """
    from evalharness.baselines import update_baselines
    from evalharness.gate import validate_rules
    from evalharness.runner import run_suite
    from evalharness.suite import Suite, load_suite

    t_start = time.time()
    out = Path(out_dir)
    progress = None
    if log is None:
        from evalharness.progress import Progress

        log = progress = Progress()
    entries = select_ids(load_catalog(catalog), only, "selftest")
    suite0 = load_suite(suite_path, sets=sets, data_dir=data_dir)
    validate_rules(suite0.raw.get("gate"), str(suite0.path))
    model_entries = {r.model["name"]: r.model for r in suite0.runs}
    if models:
        unknown = sorted(set(models) - set(model_entries))
        if unknown:
            raise SuiteError(f"--models: {unknown} not in the suite (it runs {sorted(model_entries)})")
        model_entries = {k: v for k, v in model_entries.items() if k in models}
    applicable = {e.id: _applicable_models(e, list(model_entries.values())) for e in entries}
    uninjectable = _uninjectable(entries, applicable)
    recipes = [str(r) for r in suite0.raw["recipes"]]
    names = {r.recipe.name for r in suite0.runs}
    for e in entries:
        if applicable[e.id] and e.id not in uninjectable and e.baseline not in names and e.baseline not in recipes:
            recipes.append(e.baseline)
    base_sets = list(sets or []) + ["recipe=" + ",".join(recipes)]
    suite = load_suite(suite_path, sets=base_sets, data_dir=data_dir)
    suite.runs = [r for r in suite.runs if r.model["name"] in model_entries]

    if out.exists():
        for sub in ("baseline", "baselines", "variants"):
            shutil.rmtree(out / sub, ignore_errors=True)
    base_dir, baselines = out / "baseline", out / "baselines"
    runnable = [e for e in entries if applicable[e.id] and e.id not in uninjectable]
    bad = []
    if runnable:  # nothing to run (all n/a): no baseline matrix either
        log(f"selftest: baseline matrix {len(suite.runs)} run(s) -> {base_dir}")
        bad = [o for o in run_suite(suite, base_dir, log=log, progress=progress) if o.status == "error"]
        update_baselines(base_dir, baselines, log=lambda s: None)
    results: list[Outcome] = []
    for k, e in enumerate(entries, 1):
        t0 = time.time()
        mnames = applicable[e.id]
        prefix = f"[{k}/{len(entries)}] {e.kind} {e.id}"
        if not mnames:
            why = f"no {e.requires} model in the suite (models: {', '.join(model_entries)})"
            results.append(Outcome(e, "n/a", reason=why))
            log(f"{prefix}: n/a ({why})")
            continue
        if e.id in uninjectable:
            why = f"not injectable: the engine rejects the planted recipe ({uninjectable[e.id]})"
            results.append(Outcome(e, "n/a", models=mnames, reason=why))
            log(f"{prefix}: n/a ({why})")
            continue
        broken = [o.key for o in bad if o.key.split("__")[0] in mnames and f"__{e.baseline}__" in o.key]
        if broken:
            results.append(Outcome(e, "error", models=mnames, reason=f"baseline run(s) failed: {broken}"))
            log(f"{prefix}: error (baseline run failed: {broken})")
            continue
        runs = _variant_runs(e, suite.runs, mnames)
        vdir = out / "variants" / e.id
        vsuite = Suite(path=suite.path, raw=suite.raw, data_dir=suite.data_dir, runs=runs, skipped=[],
                       reference_device=suite.reference_device)
        run_suite(vsuite, vdir, log=lambda s: None)
        keys = {r.key for r in runs}
        for p in base_dir.glob("*.json"):  # carry the unchanged cells (and the full manifest) over
            if p.stem not in keys:
                shutil.copy2(p, vdir / p.name)
        res = _gate_variant(e, vdir, baselines, keys, mnames, t0)
        results.append(res)
        log(f"{prefix}: {res.status} (gate exit {res.gate_exit}, {res.n_fail} FAIL) in {res.seconds:.1f}s")
    report = summarize(results, suite_path=str(suite_path), sets=base_sets, models=list(model_entries),
                       seconds=time.time() - t_start)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selftest.json").write_text(json.dumps(report, indent=1))
    (out / "selftest.md").write_text(markdown(report))
    return report


def effect_text(effect: dict[str, Any] | None) -> str:
    """'kld_mean +25.0 sigma (+153%)' for a variant's effect size."""
    if not effect:
        return ""
    rel = f", {effect['rel']:+.1%}" if effect.get("rel") is not None else ""
    return f"{effect['metric'].split('.')[-1]} {effect['z']:+.1f} sigma{rel}"


def summarize(results: list[Outcome], **meta: Any) -> dict[str, Any]:
    """Detection rate (planted caught / applicable planted) and false-alarm rate (nulls failing / nulls run).

    Also splits the planted regressions by effect size: `above_noise` (worsening of a
    primary metric >= NOISE_K noise floors: a gate must catch these) and the rest
    (below the suite's resolution: reported, with their effect, as the limit of
    what this suite can see).
    """
    planted = [r for r in results if r.entry.kind == "planted" and r.status != "n/a"]
    nulls = [r for r in results if r.entry.kind == "null" and r.status != "n/a"]
    caught = sum(r.status == "caught" for r in planted)
    alarms = sum(r.status == "FALSE ALARM" for r in nulls)
    errors = sum(r.status == "error" for r in results)
    above = [r for r in planted if r.effect and r.effect["z"] >= NOISE_K]
    det = caught / len(planted) if planted else None
    far = alarms / len(nulls) if nulls else None
    return {"kind": "selftest", **meta, "noise_k": NOISE_K, "entries": [r.to_dict() for r in results],
            "planted_applicable": len(planted), "caught": caught, "detection_rate": det,
            "planted_above_noise": len(above), "caught_above_noise": sum(r.status == "caught" for r in above),
            "missed_below_noise": [r.entry.id for r in planted if r.status == "MISSED" and r not in above],
            "nulls": len(nulls), "false_alarms": alarms, "false_alarm_rate": far,
            "not_applicable": sum(r.status == "n/a" for r in results), "errors": errors,
            # The gate's power criterion: every planted regression it can see (effect >= NOISE_K noise
            # floors) is caught, no null fails, nothing errored. `passed_strict` also needs the ones below.
            "passed": bool(above) and all(r.status == "caught" for r in above) and alarms == 0 and errors == 0,
            "passed_strict": bool(planted) and caught == len(planted) and alarms == 0 and errors == 0}


def table(report: dict[str, Any]) -> str:
    """Console table: one line per entry, then the rates."""
    rows = [["kind", "id", "baseline", "result", "gate", "FAIL", "effect", "evidence"]]
    for e in report["entries"]:
        ev = e["evidence"] or e["reason"]
        rows.append([e["kind"], e["id"], e["baseline"], e["status"],
                     "" if e["gate_exit"] is None else str(e["gate_exit"]), str(e["n_fail"]),
                     e.get("effect_text") or "", ev])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.append(_rates(report))
    return "\n".join(lines)


def _rates(report: dict[str, Any]) -> str:
    """The headline line: detection and false-alarm rates."""
    def pct(x):
        """A rate as a percentage, 'n/a' for None."""
        return "n/a" if x is None else f"{x:.0%}"

    below = report.get("missed_below_noise") or []
    return (f"selftest: detection {report['caught']}/{report['planted_applicable']} ({pct(report['detection_rate'])}; "
            f"{report['caught_above_noise']}/{report['planted_above_noise']} of those above "
            f"{report['noise_k']:g} noise floors), false alarms {report['false_alarms']}/{report['nulls']} "
            f"({pct(report['false_alarm_rate'])}), {report['not_applicable']} n/a, {report['errors']} error(s)"
            + (f"; missed below the noise floor: {', '.join(below)}" if below else "")
            + f": {'PASS' if report['passed'] else 'FAIL'} (strict 100%: {'PASS' if report['passed_strict'] else 'FAIL'})")


def markdown(report: dict[str, Any]) -> str:
    """The selftest report as markdown."""
    out = ["# Gate selftest", "", _rates(report), "",
           f"Suite `{report.get('suite_path')}`, models {', '.join(report.get('models', []))}, "
           f"{report.get('seconds', 0):.0f}s. Effect: the largest worsening of kld_mean / top1_agree / ppl_ratio "
           "in units of the gate's noise floor (sqrt(2) x the baseline's standard error).", "",
           "| kind | id | what | baseline | result | gate exit | FAIL verdicts | effect | evidence |",
           "|---|---|---|---|---|---|---|---|---|"]
    for e in report["entries"]:
        ev = (e["evidence"] or e["reason"]).replace("|", "/")
        out.append(f"| {e['kind']} | {e['id']} | {e['what']} | {e['baseline']} | **{e['status']}** | "
                   f"{'' if e['gate_exit'] is None else e['gate_exit']} | {e['n_fail']} | {e.get('effect_text') or ''} "
                   f"| {ev} |")
    return "\n".join(out) + "\n"
