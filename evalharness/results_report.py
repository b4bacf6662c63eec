"""`evalharness report RESULTS_DIR --out DIR`: a markdown report with PNG plots of one results dir.

What it writes (DIR/):

* ``report.md``: the run table (PPL ratio, KLD mean with 95% intervals, KLD
  tails p99 / p99.9 / max, top-1 agreement, logits rel-L2, time), failed runs
  with their errors, task deltas when ``tasks.*`` metrics exist, the long-context
  probes when ``longctx.*`` metrics exist (naming the models whose reference retrieves
  no passkey), the plots,
  and (with ``--history``) the trend of every gated metric over the nightlies.
* ``error_vs_depth_<model>.png``: rel-L2 of ``layers.{i}.resid_out`` vs layer
  index (log scale), one line per recipe: where error enters and grows.
* ``kld_<model>.png``: mean token KLD per recipe with its 95% interval (log scale).
* ``ppl_ratio_<model>.png``: PPL ratio (engine / reference) per recipe with its
  paired 95% interval; the dashed line is 1.
* ``task_deltas_<model>.png``: accuracy delta (engine - reference) per task and
  recipe with paired-bootstrap intervals (only when ``tasks.*`` metrics exist).

Plots use matplotlib's Agg backend (no display). Only the first serving
config of each (model, recipe) appears in the plots (the table has them all).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from evalharness.plotting import pyplot
from evalharness.results import load_dir

_LAYER_TAP = re.compile(r"^layer_error\.layers\.(\d+)\.resid_out\.rel_l2$")
_TASK_DELTA = re.compile(r"^tasks\.(.+)\.delta$")
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def _fmt(x: Any, digits: int = 4) -> str:
    """Compact number formatting for markdown tables ('-' for missing, 'NaN' for null)."""
    if x is None:
        return "NaN"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _ci(m: dict[str, Any], key: str) -> str:
    """'value [lo, hi]' of a metric with a stored interval; '-' when absent."""
    if key not in m:
        return "-"
    lo, hi = m.get(f"{key}_lo"), m.get(f"{key}_hi")
    if lo is None or hi is None:
        return _fmt(m[key])
    return f"{_fmt(m[key])} [{_fmt(lo)}, {_fmt(hi)}]"


def _names(doc: dict[str, Any]) -> tuple[str, str, str]:
    """(model, recipe, serving) of a result, from its spec (else from the run key)."""
    spec = doc.get("spec") or {}
    parts = doc["run_key"].split("__") + ["", "", ""]
    model = (spec.get("model") or {}).get("name") or parts[0]
    recipe = (spec.get("recipe") or {}).get("name") or parts[1]
    serving = (spec.get("serving") or {}).get("name") or parts[2]
    return model, recipe, serving


def _backend(doc: dict[str, Any]) -> str:
    """The backend a result ran on (spec, else the run key's last part)."""
    return (doc.get("spec") or {}).get("backend") or (doc["run_key"].split("__") + ["", "", "", ""])[3]


def _by_model(docs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """model -> recipe label -> result (ok runs; the first serving config seen for each pair).

    With several backends in one results dir the label is `recipe/backend`, so plots keep them apart."""
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    several = len({_backend(d) for d in docs}) > 1
    for d in docs:
        if d.get("status") != "ok":
            continue
        model, recipe, _ = _names(d)
        out[model].setdefault(f"{recipe}/{_backend(d)}" if several else recipe, d)
    return out


def _threeway_table(docs: list[dict[str, Any]]) -> list[str]:
    """Markdown table of the three-way comparison (only when threeway.* metrics exist)."""
    rows = []
    for d in sorted(docs, key=lambda d: (_names(d), _backend(d))):
        m = d.get("metrics") or {}
        if "threeway.format.kld_mean" not in m:
            continue
        model, recipe, serving = _names(d)
        first = int(m.get("threeway.first_kernel_tap", -1))
        rows.append(f"| {model} | {recipe} | {serving} | {_backend(d)} | {_ci(m, 'threeway.format.kld_mean')} | "
                    f"{_ci(m, 'threeway.kernel.kld_mean')} | {_ci(m, 'threeway.total.kld_mean')} | "
                    f"{_fmt(m.get('threeway.kernel_share'))} | {'none' if first < 0 else first} |")
    if not rows:
        return []
    return (["## Three-way: FP32 (R) vs emulation (E) vs native (N)", "",
             "| model | recipe | serving | backend | KL(R‖E) format [95% CI] | KL(E‖N) kernel [95% CI] | "
             "KL(R‖N) total [95% CI] | kernel share | first kernel tap |",
             "|---|---|---|---|---|---|---|---|---|"] + rows + [""])


def plot_error_vs_depth(model: str, runs: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """rel-L2 of each layer's residual output vs depth, one line per recipe (log y)."""
    series = {}
    for recipe, d in runs.items():
        pts = sorted((int(m.group(1)), v) for k, v in d["metrics"].items()
                     if (m := _LAYER_TAP.match(k)) and isinstance(v, (int, float)))
        if pts and any(v > 0 for _, v in pts):
            series[recipe] = pts
    if not series:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for recipe, pts in series.items():
        ax.plot([p[0] for p in pts], [max(p[1], 1e-12) for p in pts], marker="o", label=recipe)
    ax.set_yscale("log")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("rel L2 error of resid_out vs FP32 reference")
    ax.set_title(f"{model}: error vs depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _interval_plot(model: str, runs: dict[str, dict[str, Any]], key: str, ylabel: str, title: str, path: Path,
                   log: bool = False, ref_line: float | None = None) -> Path | None:
    """Points with 95% interval bars of metric `key` per recipe."""
    rows = [(r, d["metrics"][key], d["metrics"].get(f"{key}_lo"), d["metrics"].get(f"{key}_hi"))
            for r, d in runs.items() if isinstance(d["metrics"].get(key), (int, float))]
    if log:
        rows = [r for r in rows if r[1] > 0]  # fp32 has KLD 0: nothing to draw on a log axis
    if not rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows) + 2), 4))
    xs = range(len(rows))
    vals = [r[1] for r in rows]
    lo = [r[1] - r[2] if r[2] is not None else 0.0 for r in rows]
    hi = [r[3] - r[1] if r[3] is not None else 0.0 for r in rows]
    if log:
        lo = [min(l, v * 0.999) for l, v in zip(lo, vals)]  # keep the lower bar above zero
    ax.errorbar(list(xs), vals, yerr=[lo, hi], fmt="o", capsize=4)
    if ref_line is not None:
        ax.axhline(ref_line, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r[0] for r in rows], rotation=30, ha="right")
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_task_deltas(model: str, runs: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Accuracy delta (engine - reference) with intervals, grouped by task, one marker series per recipe."""
    tasks = sorted({m.group(1) for d in runs.values() for k in d["metrics"] if (m := _TASK_DELTA.match(k))})
    if not tasks:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks) + 2), 4))
    recipes = list(runs)
    width = 0.8 / max(len(recipes), 1)
    for j, recipe in enumerate(recipes):
        m = runs[recipe]["metrics"]
        xs, ys, lo, hi = [], [], [], []
        for i, t in enumerate(tasks):
            v = m.get(f"tasks.{t}.delta")
            if not isinstance(v, (int, float)):
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(v)
            lo.append(v - m.get(f"tasks.{t}.delta_lo", v))
            hi.append(m.get(f"tasks.{t}.delta_hi", v) - v)
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=recipe)
    ax.axhline(0.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels(tasks, rotation=30, ha="right")
    ax.set_ylabel("accuracy delta (engine - reference)")
    ax.set_title(f"{model}: task accuracy deltas (95% intervals)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _run_table(docs: list[dict[str, Any]]) -> list[str]:
    """Markdown table: one row per run."""
    out = ["| model | recipe | serving | backend | status | PPL ratio [95% CI] | KLD mean [95% CI] | KLD p99 | "
           "KLD p99.9 | KLD max | top-1 [95% CI] | logits rel L2 | time s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in sorted(docs, key=lambda d: (_names(d), _backend(d))):
        m = d.get("metrics") or {}
        model, recipe, serving = _names(d)
        out.append(f"| {model} | {recipe} | {serving} | {_backend(d)} | {d['status']} | "
                   f"{_ci(m, 'ppl_kld.ppl_ratio')} | "
                   f"{_ci(m, 'ppl_kld.kld_mean')} | {_fmt(m.get('ppl_kld.kld_p99', '-'))} | "
                   f"{_fmt(m.get('ppl_kld.kld_p999', '-'))} | {_fmt(m.get('ppl_kld.kld_max', '-'))} | "
                   f"{_ci(m, 'ppl_kld.top1_agree')} | {_fmt(m.get('layer_error.logits.rel_l2', '-'))} | "
                   f"{_fmt((d.get('timing') or {}).get('total_s', '-'), 3)} |")
    return out


def _task_table(docs: list[dict[str, Any]]) -> list[str]:
    """Markdown table of task deltas (only when tasks.* metrics exist): the tasks `evalharness.report.table_tasks`
    picks (each run's configured tasks, a group such as `mmlu` by its pooled statistics; its subjects stay in the
    result files)."""
    from evalharness.report import table_tasks

    tasks = table_tasks(docs)
    rows = []
    for d in sorted(docs, key=lambda d: _names(d)):
        m = d.get("metrics") or {}
        model, recipe, serving = _names(d)
        for task in tasks:
            k = f"tasks.{task}.delta"
            if k in m:
                rows.append(f"| {model} | {recipe} | {serving} | {task} | {_fmt(m.get(f'tasks.{task}.acc_ref'))} | "
                            f"{_fmt(m.get(f'tasks.{task}.acc_eng'))} | {_ci(m, k)} | "
                            f"{_fmt(m.get(f'tasks.{task}.mcnemar_p', '-'))} | {_fmt(m.get(f'tasks.{task}.n', '-'))} |")
    if not rows:
        return []
    return (["## Task deltas", "", "| model | recipe | serving | task | acc ref | acc eng | delta [95% CI] | "
             "McNemar p | n |", "|---|---|---|---|---|---|---|---|---|"] + rows + [""])


def _pair(m: dict[str, Any], key: str) -> str:
    """'engine / reference' of a long-context measure kept for both (`<key>_eng`, `<key>_ref`)."""
    return f"{_fmt(m.get(f'{key}_eng', '-'))} / {_fmt(m.get(f'{key}_ref', '-'))}"


def _longctx_table(docs: list[dict[str, Any]]) -> list[str]:
    """Markdown table of the long-context probes (only when longctx.* metrics exist), and the models whose FP32
    reference retrieves no passkey: there the passkey probe cannot tell a recipe's loss from the model's."""
    rows, blind = [], set()
    for d in sorted(docs, key=lambda d: (_names(d), _backend(d))):
        m = d.get("metrics") or {}
        if not any(k.startswith("longctx.") for k in m):
            continue
        model, recipe, serving = _names(d)
        if m.get("longctx.passkey_n") and m.get("longctx.passkey_acc_ref") == 0:
            blind.add(model)
        div = (f"{_fmt(m['longctx.div_frac'])} ({_fmt(m.get('longctx.div_real_error_frac', '-'))})"
               if "longctx.div_frac" in m else "-")
        kld = (f"{_fmt(m.get('longctx.kld_first'))} → {_fmt(m.get('longctx.kld_last'))} "
               f"(x{_fmt(m.get('longctx.kld_growth'), 3)})" if "longctx.kld_first" in m else "-")
        rows.append(f"| {model} | {recipe} | {serving} | {_ci(m, 'longctx.passkey_acc_eng')} | "
                    f"{_ci(m, 'longctx.passkey_acc_ref')} | {_fmt(m.get('longctx.passkey_mcnemar_p', '-'))} | {div} | "
                    f"{_pair(m, 'longctx.rep3')} | {_pair(m, 'longctx.loop')} | {kld} |")
    if not rows:
        return []
    notes = ([f"The FP32 reference retrieves no passkey on {', '.join(sorted(blind))}: there the passkey columns "
              "cannot show a recipe's loss.", ""] if blind else [])
    return (["## Long context", "",
             "Passkey retrieval accuracy (engine, reference; paired McNemar p), the share of greedy generations that "
             "part from the reference's (of them, those where the reference's top-1 margin was not a near-tie), "
             "3-gram repetition and loop rates (engine / reference), and the token KLD from the first to the last "
             "position bucket.", "",
             "| model | recipe | serving | passkey eng [95% CI] | passkey ref [95% CI] | McNemar p | diverged (real "
             "error) | rep-3 eng / ref | loops eng / ref | KLD first → last (growth) |",
             "|---|---|---|---|---|---|---|---|---|---|"] + rows + [""] + notes)


def build_report(results_dir: str | Path, out_dir: str | Path, history: list[str | Path] | None = None,
                 ) -> Path:
    """Write report.md and the PNG plots of `results_dir` into `out_dir`; returns the report path."""
    manifest, docs = load_dir(results_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = [d for d in docs if d.get("status") == "ok"]
    bad = [d for d in docs if d.get("status") != "ok"]
    prov = (ok or docs)[0].get("provenance") or {}
    hw = prov.get("hardware") or {}
    lines = [f"# Numerics report: {manifest.get('name') or (docs[0].get('suite') or {}).get('name', '?')}", "",
             f"Results: `{Path(results_dir)}` - {len(docs)} run(s), {len(ok)} ok, {len(bad)} error.  ",
             f"git {prov.get('git_sha', '?')}, created {prov.get('created_at', '?')}, "
             f"hardware: {hw.get('gpu') or hw.get('cpu') or '?'}.", ""]
    if manifest.get("skipped"):
        lines += ["Skipped: " + "; ".join(manifest["skipped"]), ""]
    lines += ["## Runs", ""] + _run_table(docs) + [""]
    if bad:
        lines += ["## Failed runs", ""]
        for d in bad:
            err = d.get("error") or {}
            lines.append(f"- `{d['run_key']}`: {err.get('type')}: {err.get('message')}")
        lines.append("")
    lines += _threeway_table(docs)
    lines += _task_table(docs)
    lines += _longctx_table(docs)
    plots: list[tuple[str, Path]] = []
    for model, runs in sorted(_by_model(docs).items()):
        safe = _SAFE.sub("-", model)
        for title, p in (
            ("error vs depth", plot_error_vs_depth(model, runs, out / f"error_vs_depth_{safe}.png")),
            ("KLD by recipe", _interval_plot(model, runs, "ppl_kld.kld_mean", "mean token KLD (nats)",
                                             f"{model}: KLD(reference || engine), 95% CI", out / f"kld_{safe}.png",
                                             log=True)),
            ("PPL ratio", _interval_plot(model, runs, "ppl_kld.ppl_ratio", "PPL engine / PPL reference",
                                         f"{model}: PPL ratio, paired 95% CI", out / f"ppl_ratio_{safe}.png",
                                         ref_line=1.0)),
            ("task deltas", plot_task_deltas(model, runs, out / f"task_deltas_{safe}.png")),
        ):
            if p is not None:
                plots.append((f"{model}: {title}", p))
    if plots:
        lines += ["## Plots", ""] + [f"### {t}\n\n![{t}]({p.name})\n" for t, p in plots]
    if history:
        from evalharness.trend import build_trend

        trend = build_trend(history, out / "trend")
        lines += ["## Trend over the nightly history", "", f"See `trend/trend.md` ({trend['n_dirs']} results dirs, "
                  f"{len(trend['metrics'])} gated metrics).", ""] + trend["summary_lines"] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path

