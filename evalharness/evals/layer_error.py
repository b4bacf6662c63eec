"""Per-layer error on the canonical taps: engine vs FP32 reference, streaming.

For each batch of windows the reference runs once with a tap sink that keeps
this batch's activations; the engine then runs with a sink that folds each
tap straight into its `ErrorAccumulator`. Only one batch of reference
activations is alive at a time. Format statistics of every quantization the
engine performs (saturation, underflow) are aggregated per site.

Op-local conformance (``local: true``, the default): every emulated GEMM,
attention softmax and KV-cache write also measures the error it adds by
itself against float64 on the same inputs (`engine.numerics.Numerics`,
attribute `local`), reported as ``local.<site>.<stat>`` over the whole run
plus ``local.<site>.<stat>_max`` (the worst module) and the worst module's
name in the samples. These see a precision change in one op (BF16 softmax,
a 14-bit accumulator, a shared K scale) that the end-to-end metrics cannot
resolve, deterministically: on the CPU emulation they are exact functions
of the inputs, so a gate can hold them tight without false alarms.

MoE expert choices (``*.moe.topk`` taps, integer ids (tokens, k)) are not
compared numerically: they report ``<tap>.overlap`` = mean over tokens of
|engine set & reference set| / k (1.0 = the same experts everywhere).
"""

from __future__ import annotations

import fnmatch
import math
from collections import defaultdict
from typing import Any

import torch

from evalharness.evals import EvalContext
from evalharness.evals.errorstats import ErrorAccumulator

REPORTED = ("rel_l2", "cosine", "sqnr_db", "max_abs", "mean_abs", "p99_abs")
ID_TAP_SUFFIX = "moe.topk"


def topk_overlap(engine: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-token |engine ids & reference ids| / k for (tokens, k) expert-id tensors (ids unique per row)."""
    if engine.shape != reference.shape:
        raise ValueError(f"top-k shapes differ: engine {tuple(engine.shape)} vs reference {tuple(reference.shape)}")
    e, r = engine.long(), reference.long().to(engine.device)
    hits = (e[:, :, None] == r[:, None, :]).any(dim=-1).sum(dim=-1)  # (tokens,)
    return hits.double() / e.shape[-1]


class OverlapAccumulator:
    """Running mean of the per-token top-k overlap of one `*.moe.topk` tap."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, engine: torch.Tensor, reference: torch.Tensor) -> None:
        """Fold one batch in."""
        ov = topk_overlap(engine, reference)
        self.total += float(ov.sum())
        self.count += int(ov.numel())

    def result(self) -> dict[str, float]:
        """{'overlap': mean over tokens} (NaN before any update)."""
        return {"overlap": self.total / self.count if self.count else float("nan")}


class LocalSums:
    """The `Numerics.local` probe's sink: float64 sums per (site, stat) and per (site, stat, module).

    Sums stay on the tensors' device until `result` (no synchronization per op)."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, str, str], list] = {}

    def __call__(self, module: str, site: str, stat: str, num: torch.Tensor, den: torch.Tensor) -> None:
        key = (site, stat, module)
        rec = self.sums.get(key)
        if rec is None:
            self.sums[key] = [num.detach().double(), den.detach().double()]
        else:
            rec[0] = rec[0] + num.detach().double()
            rec[1] = rec[1] + den.detach().double()

    @staticmethod
    def _value(stat: str, num: float, den: float) -> float:
        if den <= 0:
            return float("nan")
        return (num / den) ** 0.5 if stat == "rel_l2" else num / den

    def result(self) -> tuple[dict[str, float], list[str]]:
        """({local.<site>.<stat>: whole-run value, local.<site>.<stat>_max: worst module's value},
        ['<site>.<stat>: <worst module>', ...])."""
        totals: dict[tuple[str, str], list[float]] = {}
        worst: dict[tuple[str, str], tuple[float, str]] = {}
        for (site, stat, module), (num, den) in sorted(self.sums.items()):
            n, d = float(num), float(den)
            tot = totals.setdefault((site, stat), [0.0, 0.0])
            tot[0] += n
            tot[1] += d
            v = self._value(stat, n, d)
            if v == v and ((site, stat) not in worst or v > worst[(site, stat)][0]):
                worst[(site, stat)] = (v, module)
        metrics: dict[str, float] = {}
        for (site, stat), (n, d) in sorted(totals.items()):
            metrics[f"local.{site}.{stat}"] = self._value(stat, n, d)
            if (site, stat) in worst:
                metrics[f"local.{site}.{stat}_max"] = worst[(site, stat)][0]
        return metrics, [f"{site}.{stat}: {worst[(site, stat)][1]}" for site, stat in sorted(worst)]


def _selected(name: str, patterns: list[str] | None) -> bool:
    """Tap filter: all taps when no patterns are given."""
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def run_layer_error(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Per-tap rel_l2 / cosine / SQNR / max / mean / p99 abs error, plus quantization statistics per site."""
    win = ctx.windows(cfg["seq_len"], None, cfg["windows"], max(cfg["windows"] * cfg["seq_len"] * 2, 4096), cfg["bos"])
    acc: dict[str, ErrorAccumulator | OverlapAccumulator] = {}
    order: list[str] = []
    sat = defaultdict(lambda: [0.0, 0.0, 0.0])  # site -> [saturated, underflowed, elements]
    patterns = cfg["taps"]
    local = LocalSums() if cfg.get("local", True) else None

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
                ref_taps[name] = t.detach() if name.endswith(ID_TAP_SUFFIX) else t.detach().float()

        def eng_sink(name: str, t: torch.Tensor) -> None:
            if name not in ref_taps:
                return
            if name not in acc:
                acc[name] = OverlapAccumulator() if name.endswith(ID_TAP_SUFFIX) else ErrorAccumulator()
                order.append(name)
            acc[name].update(t, ref_taps.pop(name))

        ctx.reference.logits(inputs, tap=ref_sink)
        if local is None:
            ctx.engine.logits(inputs, tap=eng_sink, observer=observe)
        else:
            ctx.engine.logits(inputs, tap=eng_sink, observer=observe, local=local)
        missing = [n for n in ref_taps]
        if missing:
            raise RuntimeError(f"layer_error: the engine emitted no tap for reference tap(s) {missing[:5]}")

    metrics: dict[str, float] = {}
    worst, worst_rel = None, -1.0
    seen = bad = 0  # engine tap elements compared, and how many of them were NaN/Inf
    for name in order:
        res = acc[name].result()
        if isinstance(acc[name], OverlapAccumulator):
            metrics[f"{name}.overlap"] = res["overlap"]
            continue
        for stat in REPORTED:
            metrics[f"{name}.{stat}"] = res[stat]
        if res["nonfinite_frac"] > 0:
            metrics[f"{name}.nonfinite_frac"] = res["nonfinite_frac"]
        seen += acc[name].count + acc[name].nonfinite
        bad += acc[name].nonfinite
        rel = res["rel_l2"]  # the worst tap; a NaN (non-finite outputs) is worse than any number
        if name != "logits" and not math.isnan(worst_rel) and (math.isnan(rel) or rel > worst_rel):
            worst, worst_rel = name, rel
    metrics["max_rel_l2"] = worst_rel
    metrics["nonfinite_frac"] = bad / max(seen, 1)
    metrics["n_taps"] = float(len(order))
    metrics["n_tokens"] = float(win.inputs.numel())
    for site, (s, u, n) in sorted(sat.items()):
        if n:
            metrics[f"quant.{site}.saturation_frac"] = s / n
            metrics[f"quant.{site}.underflow_frac"] = u / n
    samples = {"tap_order": order, "worst_tap": [worst] if worst else []}
    if local is not None:
        lm, worst_modules = local.result()
        metrics.update(lm)
        samples["local_worst_module"] = worst_modules
    return metrics, samples
