"""Views of results and verdicts: console tables, markdown summary, JUnit XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from evalharness.gate import Verdict

SUMMARY_METRICS = (
    ("ppl_ref", "ppl_kld.ppl_ref"),
    ("ppl_eng", "ppl_kld.ppl_eng"),
    ("ppl_ratio", "ppl_kld.ppl_ratio"),
    ("kld_mean", "ppl_kld.kld_mean"),
    ("kld_p99", "ppl_kld.kld_p99"),
    ("top1", "ppl_kld.top1_agree"),
    ("logits_rel_l2", "layer_error.logits.rel_l2"),
    ("max_tap_rel_l2", "layer_error.max_rel_l2"),
)


def _fmt(x: Any) -> str:
    """Compact number formatting for tables."""
    if x is None:
        return "NaN"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def nonfinite_frac(doc: dict[str, Any]) -> float:
    """The largest share of NaN/Inf outputs a result reports (`<eval>.nonfinite_frac`, per tap included); 0 when
    none."""
    return max((float(v) for k, v in (doc.get("metrics") or {}).items()
                if k.endswith("nonfinite_frac") and isinstance(v, (int, float))), default=0.0)


def table_tasks(docs: list[dict[str, Any]]) -> list[str]:
    """The tasks the results table shows: each run's configured names (`evals.tasks.tasks`, a group by its pooled
    statistics) that have accuracies, else every task with accuracies except the members of a group whose name
    prefixes theirs (lm-eval's naming: `mmlu` holds `mmlu_humanities`, `mmlu_abstract_algebra`, ...); in order."""
    names: dict[str, None] = {}
    for d in docs:
        m = d.get("metrics") or {}
        have = [k[len("tasks."):-len(".acc_ref")] for k in m if k.startswith("tasks.") and k.endswith(".acc_ref")]
        configured = ((((d.get("spec") or {}).get("evals") or {}).get("tasks") or {}).get("tasks")) or []
        if configured:
            names.update(dict.fromkeys(t for t in configured if t in have))
        else:
            names.update(dict.fromkeys(t for t in have if not any(t.startswith(g + "_") for g in have)))
    return list(names)


def _task_cell(m: dict[str, Any], task: str) -> str:
    """`acc_ref/acc_eng/delta` of one task in one result, '-' when it did not run."""
    k = f"tasks.{task}"
    if f"{k}.acc_ref" not in m:
        return "-"
    delta = m.get(f"{k}.delta")
    return (f"{_fmt(m[f'{k}.acc_ref'])}/{_fmt(m.get(f'{k}.acc_eng'))}/"
            + (f"{delta:+.4g}" if isinstance(delta, (int, float)) else _fmt(delta)))


def results_table(docs: Iterable[dict[str, Any]]) -> str:
    """A fixed-width table of the key metrics of each result. When a run had NaN/Inf outputs a `nonfinite`
    column gives their largest share, and such a run's status reads `ok (NaN/Inf)`: its metrics are NaN. When
    tasks ran, one column per task (`table_tasks`): accuracy of the reference / of the engine / engine - reference
    (the interval and McNemar p are in `report`'s task table and the result files)."""
    docs = list(docs)
    shares = [nonfinite_frac(d) for d in docs]
    extra = ["nonfinite"] if any(shares) else []
    tasks = table_tasks(docs)
    header = (["run_key", "status"] + [h for h, _ in SUMMARY_METRICS] + [f"{t} ref/eng/delta" for t in tasks]
              + extra + ["time_s"])
    rows = [header]
    for d, share in zip(docs, shares):
        m = d.get("metrics", {})
        status = f"{d['status']} (NaN/Inf)" if share and d["status"] == "ok" else d["status"]
        rows.append([d["run_key"], status] + [_fmt(m.get(k)) if k in m else "-" for _, k in SUMMARY_METRICS]
                    + [_task_cell(m, t) for t in tasks]
                    + ([_fmt(float(share))] if extra else [])
                    + [_fmt((d.get("timing") or {}).get("total_s")) if (d.get("timing") or {}).get("total_s")
                       is not None else "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def verdict_table(verdicts: list[Verdict], show_pass: bool = False) -> str:
    """Console lines for the gate: every FAIL/WARN (and PASS with show_pass) with evidence."""
    lines = []
    for v in verdicts:
        if v.verdict == "PASS" and not show_pass:
            continue
        lines.append(f"{v.verdict:4}  {v.run_key}  {v.metric}: {v.evidence()}")
    counts = defaultdict(int)
    for v in verdicts:
        counts[v.verdict] += 1
    family = next((v.correction for v in verdicts if v.correction), None)
    lines.append(f"gate: {counts['PASS']} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL "
                 f"over {len({v.run_key for v in verdicts})} run(s)" + (f"; p-values adjusted: {family}" if family else ""))
    return "\n".join(lines)


def write_summary(path: str | Path, verdicts: list[Verdict], missing: list[str], code: int) -> Path:
    """Markdown summary (for a CI step summary): outcome, failures with evidence, then all verdicts per run."""
    path = Path(path)
    status = {0: "PASS", 1: "FAIL (regression)", 2: "ERROR (bad input / missing or mismatched baseline)"}[code]
    out = [f"# Numerics gate: {status}", ""]
    counts = defaultdict(int)
    for v in verdicts:
        counts[v.verdict] += 1
    out += [f"{counts['PASS']} PASS, {counts['WARN']} WARN, {counts['FAIL']} FAIL over "
            f"{len({v.run_key for v in verdicts})} run(s).", ""]
    family = next((v.correction for v in verdicts if v.correction), None)
    if family:
        demoted = sum("correction" in (v.message or "") and v.verdict == "WARN" for v in verdicts)
        out += [f"Multiple-testing control: {family} (the whole matrix); {demoted} regression(s) "
                "not significant after correction (shown as WARN).", ""]
    bad = [v for v in verdicts if v.verdict != "PASS"]
    if missing:
        out += ["## Baseline problems", ""] + [f"- {m}" for m in missing] + [""]
    if bad:
        out += ["## Failures and warnings", "",
                "| verdict | run | metric | value | baseline | delta | threshold | noise floor | CI | p | p adj | why |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in bad:
            ci = f"[{_fmt(v.interval[0])}, {_fmt(v.interval[1])}]" if v.interval else ""
            p = f"{_fmt(v.p_value)} ({v.test})" if v.p_value is not None else ""
            padj = f"{_fmt(v.p_adjusted)} ({v.correction})" if v.p_adjusted is not None else ""
            nf = _fmt(v.noise_floor) if v.noise_floor is not None else ""
            why = (v.message or "").replace("|", "/")
            out.append(f"| {v.verdict} | {v.run_key} | {v.metric} | {_fmt(v.value)} | {_fmt(v.baseline)} | "
                       f"{_fmt(v.delta)} | {_fmt(v.threshold)} | {nf} | {ci} | {p} | {padj} | {why} |")
        out.append("")
    by_run = defaultdict(list)
    for v in verdicts:
        by_run[v.run_key].append(v)
    out += ["## Runs", "", "| run | PASS | WARN | FAIL |", "|---|---|---|---|"]
    for key, vs in by_run.items():
        c = defaultdict(int)
        for v in vs:
            c[v.verdict] += 1
        out.append(f"| {key} | {c['PASS']} | {c['WARN']} | {c['FAIL']} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")
    return path


def write_junit(path: str | Path, verdicts: list[Verdict], missing: list[str]) -> Path:
    """JUnit XML: one testsuite per run, one testcase per gated metric; FAIL -> failure, WARN -> system-out."""
    path = Path(path)
    root = ET.Element("testsuites", name="evalharness-gate")
    by_run = defaultdict(list)
    for v in verdicts:
        by_run[v.run_key].append(v)
    for key, vs in by_run.items():
        fails = sum(v.verdict == "FAIL" for v in vs)
        ts = ET.SubElement(root, "testsuite", name=key, tests=str(len(vs)), failures=str(fails), errors="0")
        for v in vs:
            tc = ET.SubElement(ts, "testcase", classname=key, name=v.metric)
            if v.verdict == "FAIL":
                f = ET.SubElement(tc, "failure", message=v.message or "regression", type="NumericsRegression")
                f.text = v.evidence()
            elif v.verdict == "WARN":
                so = ET.SubElement(tc, "system-out")
                so.text = "WARN: " + v.evidence()
    if missing:
        ts = ET.SubElement(root, "testsuite", name="baselines", tests=str(len(missing)), failures="0",
                           errors=str(len(missing)))
        for m in missing:
            tc = ET.SubElement(ts, "testcase", classname="baselines", name=m.split(":")[0])
            kind = "missing" if ": no baseline" in m else "mismatched"
            e = ET.SubElement(tc, "error", message=f"{kind} baseline", type=f"{kind.capitalize()}Baseline")
            e.text = m
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path
