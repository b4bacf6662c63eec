"""Per-layer error on the canonical taps: engine vs FP32 reference, streaming.

For each batch of windows the reference runs once with a tap sink that keeps
this batch's activations; the engine then runs with a sink that folds each
tap straight into its `ErrorAccumulator`. Only one batch of reference
activations is alive at a time. Format statistics of every quantization the
engine performs (saturation, underflow) are aggregated per site.
"""

from __future__ import annotations

import fnmatch
from collections import defaultdict
from typing import Any

import torch

from evalharness.evals import EvalContext
from evalharness.evals.errorstats import ErrorAccumulator

REPORTED = ("rel_l2", "cosine", "sqnr_db", "max_abs", "mean_abs", "p99_abs")


def _selected(name: str, patterns: list[str] | None) -> bool:
    """Tap filter: all taps when no patterns are given."""
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def run_layer_error(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Per-tap rel_l2 / cosine / SQNR / max / mean / p99 abs error, plus quantization statistics per site."""
    win = ctx.windows(cfg["seq_len"], None, cfg["windows"], max(cfg["windows"] * cfg["seq_len"] * 2, 4096), cfg["bos"])
    acc: dict[str, ErrorAccumulator] = {}
    order: list[str] = []
    sat = defaultdict(lambda: [0.0, 0.0, 0.0])  # site -> [saturated, underflowed, elements]
    patterns = cfg["taps"]

    def observe(module: str, site: str, q) -> None:
        stats_fn = getattr(q, "stats", None)
        if stats_fn is None:
            return
        st = stats_fn()
        n = float(torch.Size(q.shape).numel())
        rec = sat[site]
        rec[0] += st.get("saturation_frac", 0.0) * n
        rec[1] += st.get("underflow_frac", 0.0) * n
        rec[2] += n

    for start, inputs, _ in win.batches(ctx.batch_size):
        ref_taps: dict[str, torch.Tensor] = {}

        def ref_sink(name: str, t: torch.Tensor) -> None:
            if _selected(name, patterns):
                ref_taps[name] = t.detach().float()

        def eng_sink(name: str, t: torch.Tensor) -> None:
            if name not in ref_taps:
                return
            if name not in acc:
                acc[name] = ErrorAccumulator()
                order.append(name)
            acc[name].update(t, ref_taps.pop(name))

        ctx.reference.logits(inputs, tap=ref_sink)
        ctx.engine.logits(inputs, tap=eng_sink, observer=observe)
        missing = [n for n in ref_taps]
        if missing:
            raise RuntimeError(f"layer_error: the engine emitted no tap for reference tap(s) {missing[:5]}")

    metrics: dict[str, float] = {}
    worst, worst_rel = None, -1.0
    for name in order:
        res = acc[name].result()
        for stat in REPORTED:
            metrics[f"{name}.{stat}"] = res[stat]
        if res["nonfinite_frac"] > 0:
            metrics[f"{name}.nonfinite_frac"] = res["nonfinite_frac"]
        if name != "logits" and res["rel_l2"] > worst_rel:
            worst, worst_rel = name, res["rel_l2"]
    metrics["max_rel_l2"] = worst_rel
    metrics["n_taps"] = float(len(order))
    metrics["n_tokens"] = float(win.inputs.numel())
    for site, (s, u, n) in sorted(sat.items()):
        if n:
            metrics[f"quant.{site}.saturation_frac"] = s / n
            metrics[f"quant.{site}.underflow_frac"] = u / n
    samples = {"tap_order": order, "worst_tap": [worst] if worst else []}
    return metrics, samples
