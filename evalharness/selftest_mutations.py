"""`evalharness selftest --mutations`: the gate's detection power against faults planted in the emulation.

For each suite the catalog (`suites/selftest/mutations.yaml`) names:

1. run the baseline recipes of its mutations, unmutated, into `OUT/<suite>/baseline/` and promote them to the
   private baselines folder `OUT/<suite>/baselines/`;
2. run the nulls (`rerun`: each baseline recipe's cells again; `seed-1`: the first baseline recipe with
   another seed) and gate them: they must PASS (0 false alarms);
3. for each mutation, run the baseline recipe's cells of the models it applies to with the fault planted
   (`evalharness.mutations.patched`), carry the other cells over, gate the folder with the suite's own rules
   and report: caught / MISSED / n/a (a fault that changes no metric of any cell: it never fires on these
   models), the first FAIL's metric and rule, the effect size in noise floors (`selftest.effect_size`: the
   largest worsening of kld_mean / top1_agree / ppl_ratio over sqrt(2) x the baseline's standard error) and
   `n_min`, the number of windows at which the end-to-end paired rule would catch it (`min_windows`).

`device: gpu` entries (native-kernel faults, run under their own cuda-native suites) run where CUDA is available;
elsewhere they are listed as `gpu` with their injection point. Every outcome is
written to `OUT/<suite>/mutations/<id>.json` as it finishes and the report to `OUT/mutations.json` / `.md` after
each outcome (`complete: false` until the last), each atomically (a temporary file renamed over the old one).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from evalharness.errors import SuiteError
from evalharness.mutations import MUTATIONS, REPO, Mutation, load_mutations, patched
from evalharness.selftest import Entry, _applicable_models, select_ids, _gate_variant, _strongest_fail, _variant_runs

NULLS = (("rerun", None), ("seed-1", 1))
POWER = 0.8
# (metric, its per-window samples) whose paired rule gives the windows needed to catch an effect end to end
E2E = (("ppl_kld.kld_mean", "ppl_kld.window_kld", "lower"), ("ppl_kld.top1_agree", "ppl_kld.window_top1", "higher"))


def _write_json(path: Path, doc: Any) -> None:
    """Write `doc` as JSON atomically (temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    """Write `text` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rule_for(rules: list[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The suite's rule for `metric` (first matching glob, as the gate takes it)."""
    return next((r for r in rules if fnmatch.fnmatchcase(metric, r["metric"])), None)


def min_windows(cur: dict, base: dict, rule: dict[str, Any], samples: str, direction: str, alpha: float,
                n_tests: int) -> dict[str, Any] | None:
    """Windows at which `rule` catches this cell's worsening of its metric (None without paired samples).

    n_min = max(n_t, n_floor, n_rank): n_t, the paired one-sided t test's required n for the observed mean
    paired worsening and its sd at power 0.8 (`stats.power.required_n_mean_diff`, the inverse of the MDE);
    n_floor, the n at which noise_k x sqrt(2) x SE(baseline) drops below that worsening; n_rank =
    ceil(log2(n_tests / alpha)), the fewest windows at which a rank test survives Holm over n_tests tests.
    Infinite when the worsening is not above the rule's fixed tolerance max(abs_tol, rel_tol |baseline|):
    no sample size makes the rule fire.
    """
    from evalharness.gate import _samples
    from evalharness.stats.power import required_n_mean_diff

    c, b = _samples(cur, samples), _samples(base, samples)
    if c is None or b is None or len(c) != len(b) or len(c) < 2:
        return None
    sign = 1.0 if direction == "lower" else -1.0
    d = [sign * (x - y) for x, y in zip(c, b)]
    worse, sd = statistics.fmean(d), statistics.stdev(d)
    ref = abs(statistics.fmean(b))
    fixed = max(float(rule.get("abs_tol", 0.0)), float(rule.get("rel_tol", 0.0)) * ref)
    out = {"metric": rule["metric"], "n": len(c), "worsening": worse, "sd_paired": sd, "fixed_tol": fixed}
    if worse <= fixed or worse <= 0:
        return {**out, "n_min": math.inf, "why": "worsening not above the rule's fixed tolerance"}
    n_t = required_n_mean_diff(worse, sd, alpha=alpha, power=POWER, alternative="greater") if sd > 0 else 2
    k = float(rule.get("noise_k", 0.0))
    sd_b = statistics.stdev(b)
    n_floor = math.ceil((k * math.sqrt(2.0) * sd_b / worse) ** 2) if k and sd_b else 1
    n_rank = math.ceil(math.log2(max(n_tests, 1) / alpha))
    return {**out, "n_min": max(n_t, n_floor, n_rank), "n_t": n_t, "n_floor": n_floor, "n_rank": n_rank}


def _n_min(vdir: Path, baselines: Path, keys: set[str], rules: list, alpha: float, n_tests: int) -> dict | None:
    """The smallest end-to-end `min_windows` over the variant's cells and the E2E metrics."""
    from evalharness.selftest import _cells

    best = None
    for _, cur, base in _cells(vdir, baselines, keys):
        if base is None:
            continue
        for metric, samples, direction in E2E:
            rule = _rule_for(rules, metric)
            if rule is None:
                continue
            res = min_windows(cur, base, rule, samples, direction, alpha, n_tests)
            if res is not None and (best is None or res["n_min"] < best["n_min"]):
                best = {**res, "metric": metric}
    return best


def _n_tests(fails: list[dict[str, Any]], vdir: Path, baselines: Path) -> int:
    """The size of the multiple-testing family of a gated folder (from the verdicts' correction note)."""
    from evalharness.gate import gate_results

    verdicts, _ = gate_results(vdir, baselines)
    return max(1, sum(v.regression_test for v in verdicts))


def _suite_models(suite_path: str, sets: list[str], data_dir: str | None, models: list[str] | None) -> dict:
    """The suite's model entries, filtered by --models."""
    from evalharness.suite import load_suite

    s0 = load_suite(suite_path, sets=sets, data_dir=data_dir)
    entries = {r.model["name"]: r.model for r in s0.runs}
    if models:
        entries = {k: v for k, v in entries.items() if k in models}
    return entries


def _run_group(suite_path: str, muts: list[Mutation], out: Path, sets: list[str], data_dir: str | None,
               models: list[str] | None, log: Callable[[str], None],
               done: Callable[[list[dict[str, Any]]], None] = lambda r: None) -> list[dict[str, Any]]:
    """Baselines, nulls and mutations of one suite; returns the outcome dicts. `done` gets the outcomes so far
    after each one (the caller rewrites the report, so an interrupted run leaves a partial one)."""
    from evalharness.baselines import update_baselines
    from evalharness.gate import validate_rules
    from evalharness.runner import run_suite
    from evalharness.suite import Suite, load_suite

    model_entries = _suite_models(suite_path, sets, data_dir, models)
    if not model_entries:
        return [{"id": m.id, "kind": "planted", "status": "n/a", "what": m.what, "baseline": m.baseline,
                 "suite": str(suite_path), "target": m.target, "fault": m.fault, "device": m.device,
                 "reason": f"--models {models}: none of them is in {Path(suite_path).name}"} for m in muts]
    recipes = sorted({m.baseline for m in muts})
    suite = load_suite(suite_path, sets=list(sets) + ["recipe=" + ",".join(recipes)], data_dir=data_dir)
    suite.runs = [r for r in suite.runs if r.model["name"] in model_entries]
    gate_cfg = validate_rules(suite.raw.get("gate"), str(suite.path))
    rules, alpha = gate_cfg["rules"], gate_cfg["alpha"]
    base_dir, baselines = out / "baseline", out / "baselines"
    for sub in ("baseline", "baselines", "variants"):
        shutil.rmtree(out / sub, ignore_errors=True)
    log(f"mutations: {suite.path.name}: baseline matrix {len(suite.runs)} run(s) -> {base_dir}")
    bad = [o.key for o in run_suite(suite, base_dir, log=lambda s: None) if o.status == "error"]
    if bad:
        raise SuiteError(f"{suite_path}: unmutated baseline run(s) failed: {bad} (see {base_dir})")
    update_baselines(base_dir, baselines, log=lambda s: None)

    def run_variant(entry: Entry, mnames: list[str], mutation: Mutation | None) -> dict[str, Any]:
        t0 = time.time()
        runs = _variant_runs(Entry(entry.id, "null", entry.baseline, seed=entry.seed), suite.runs, mnames)
        vdir = out / "variants" / entry.id
        if (base_dir / "ref_cache").is_dir():  # the reference's outputs do not change: reuse the baseline's cache
            vdir.mkdir(parents=True, exist_ok=True)
            if not (vdir / "ref_cache").exists():
                (vdir / "ref_cache").symlink_to((base_dir / "ref_cache").resolve(), target_is_directory=True)
        vsuite = Suite(path=suite.path, raw=suite.raw, data_dir=suite.data_dir, runs=runs, skipped=[],
                       reference_device=suite.reference_device)
        if mutation is None:
            run_suite(vsuite, vdir, log=lambda s: None)
        else:
            with patched(mutation):
                run_suite(vsuite, vdir, log=lambda s: None)
        keys = {r.key for r in runs}
        for p in base_dir.glob("*.json"):  # the unchanged cells (and the manifest) carried over
            if p.stem not in keys:
                shutil.copy2(p, vdir / p.name)
        res = _gate_variant(entry, vdir, baselines, keys, mnames, t0)
        crashed = [k for k in sorted(keys) if (vdir / f"{k}.json").exists()
                   and json.loads((vdir / f"{k}.json").read_text()).get("status") != "ok"]
        if res.status == "n/a":
            res.reason = "never fired: every metric of every cell equals the unmutated baseline's"
        if crashed:  # a fault that crashes the engine is a broken fixture, not a catch
            res.status, res.reason = "error", f"variant run(s) errored: {crashed} (see {vdir})"
        doc = res.to_dict()
        doc.update(suite=str(suite_path), target=mutation.target if mutation else None,
                   fault=mutation.fault if mutation else None, device=mutation.device if mutation else None)
        strongest = _strongest_fail([_Fail(f) for f in res.fails])
        doc["caught_by"] = ({"metric": strongest.metric, "rule": strongest.rule, "run_key": strongest.run_key,
                             "margin": strongest.margin} if strongest else None)
        n_tests = _n_tests(res.fails, vdir, baselines)
        doc["n_tests"] = n_tests
        doc["n_min"] = _n_min(vdir, baselines, keys, rules, alpha, n_tests) if mutation else None
        return doc

    results = []
    for nid, seed in NULLS:
        for recipe in (recipes if seed is None else recipes[:1]):  # another seed: on one recipe
            e = Entry(f"{suite.raw.get('name')}-{recipe}-{nid}", "null", recipe, what=f"{recipe} {nid}", seed=seed)
            doc = run_variant(e, list(model_entries), None)
            _write_json(out / "mutations" / f"{e.id}.json", doc)
            results.append(doc)
            done(results)
            log(f"  null {e.id}: {doc['status']} (gate exit {doc['gate_exit']}) in {doc['seconds']:.0f}s")
    for m in muts:
        e = Entry(m.id, "planted", m.baseline, what=m.what, requires=m.requires)
        mnames = _applicable_models(e, list(model_entries.values()))
        if not mnames:
            doc = {"id": m.id, "kind": "planted", "status": "n/a", "what": m.what, "baseline": m.baseline,
                   "suite": str(suite_path), "target": m.target, "fault": m.fault, "device": m.device,
                   "reason": f"no {m.requires} model in the suite"}
        else:
            doc = run_variant(e, mnames, m)
        _write_json(out / "mutations" / f"{m.id}.json", doc)
        results.append(doc)
        done(results)
        log(f"  mutation {m.id}: {doc['status']} {_caught_text(doc)}")
    return results


class _Fail:
    """A FAIL verdict dict with the attributes `_strongest_fail` reads."""

    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)
        w = self.delta if self.delta is not None else None
        if w is not None and self.direction == "higher":
            w = -w
        self.margin = (w / self.threshold) if (w is not None and self.threshold) else None

    def worsening(self):
        """Signed so that > 0 is worse."""
        return None if self.delta is None else (-self.delta if self.direction == "higher" else self.delta)


def run_mutations(out_dir: str | Path, catalog: str | Path = MUTATIONS, suite: str | None = None,
                  sets: list[str] | None = None, data_dir: str | None = None, only: list[str] | None = None,
                  models: list[str] | None = None, log: Callable[[str], None] | None = None,
                  cuda: bool | None = None) -> dict[str, Any]:
    """Run the mutations of `catalog` (module docstring): the CPU ones, and the GPU ones where CUDA is available
    (`cuda`; default: `torch.cuda.is_available()`); returns the report (also OUT/mutations.json).

    `suite` replaces the default suite (suites/smoke.yaml) of the entries that do not name their own.
    """
    import torch

    log = log or (lambda s: print(s, flush=True))
    t0 = time.time()
    out = Path(out_dir)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    muts = select_ids(load_mutations(catalog), only, "mutation")
    groups: dict[str, list[Mutation]] = {}
    for m in muts:
        if m.device == "cpu" or cuda:
            path = suite if (suite and m.suite == Mutation.suite) else str(REPO / m.suite)
            groups.setdefault(path, []).append(m)
    gpu = [{"id": m.id, "kind": "planted", "status": "gpu", "what": m.what, "baseline": m.baseline,
            "target": m.target, "device": "gpu", "reason": "native kernel: run where CUDA is (no CUDA here)"}
           for m in muts if m.device == "gpu" and not cuda]
    entries: list[dict[str, Any]] = []

    def write(group_so_far: list[dict[str, Any]], final: bool = False) -> dict[str, Any]:
        report = summarize(entries + group_so_far + gpu, catalog=str(catalog), sets=list(sets or []),
                           models=models, seconds=time.time() - t0, complete=final)
        _write_json(out / "mutations.json", report)
        _write_text(out / "mutations.md", "# Mutation selftest\n\n```text\n" + table(report) + "\n```\n")
        return report

    for path, group in groups.items():
        sub = out / Path(path).stem
        entries += _run_group(path, group, sub, list(sets or []), data_dir, models, log, done=write)
    return write([], final=True)


def summarize(entries: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    """Counts: caught / missed / n/a mutations, false alarms of the nulls; `passed` = 0 false alarms, no error."""
    planted = [e for e in entries if e["kind"] == "planted" and e["status"] in ("caught", "MISSED")]
    nulls = [e for e in entries if e["kind"] == "null"]
    alarms = sum(e["status"] == "FALSE ALARM" for e in nulls)
    errors = sum(e["status"] == "error" for e in entries)
    caught = sum(e["status"] == "caught" for e in planted)
    return {"kind": "mutation-selftest", **meta, "entries": entries, "mutations_run": len(planted),
            "caught": caught, "missed": [e["id"] for e in planted if e["status"] == "MISSED"],
            "not_applicable": [e["id"] for e in entries if e["status"] == "n/a"],
            "gpu": [e["id"] for e in entries if e["status"] == "gpu"], "nulls": len(nulls), "false_alarms": alarms,
            "errors": errors, "passed": alarms == 0 and errors == 0,
            "passed_strict": alarms == 0 and errors == 0 and caught == len(planted)}


def _caught_text(e: dict[str, Any]) -> str:
    """'by layer_error.local.linear.accum.rel_l2 [rules[11]] x40' for a caught mutation."""
    c = e.get("caught_by")
    if not c:
        return ""
    rule = (c.get("rule") or "").split(":", 1)[0]
    margin = f" {c['margin']:.3g}x threshold" if c.get("margin") is not None else ""
    return f"by {c['metric']} [{rule}]{margin}"


def _n_text(e: dict[str, Any]) -> str:
    """The end-to-end windows needed: 'kld_mean n>=12' or 'never (kld_mean below tolerance)'."""
    n = e.get("n_min")
    if not n:
        return ""
    name = n["metric"].split(".")[-1]
    if math.isinf(n["n_min"]):
        return f"never ({name}: {n['why']})"
    return f"{name} n>={n['n_min']} (have {n['n']})"


def table(report: dict[str, Any]) -> str:
    """Console table: one line per null and mutation, then the counts."""
    from evalharness.selftest import effect_text

    rows = [["kind", "id", "baseline", "result", "effect (noise floors)", "e2e windows to catch", "caught by"]]
    for e in report["entries"]:
        rows.append([e["kind"], e["id"], e["baseline"], e["status"], effect_text(e.get("effect")),
                     _n_text(e), _caught_text(e) or (e.get("reason") or "")[:90]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    lines.append(f"mutations: caught {report['caught']}/{report['mutations_run']}"
                 f"{' (missed: ' + ', '.join(report['missed']) + ')' if report['missed'] else ''}, "
                 f"n/a {len(report['not_applicable'])}, gpu (not run: no CUDA) {len(report['gpu'])}; "
                 f"false alarms {report['false_alarms']}/{report['nulls']}, errors {report['errors']}: "
                 f"{'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)
