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


def _local_inputs(name: str, n_layers: int) -> tuple[int, str] | None:
    """(layer, role) of a reference tap that a layer's fed run needs: 'in' (embed = layer 0's input, layer i-1's
    resid_out = layer i's input) and / or 'out' (layer i's resid_out); None for other taps."""
    if name == "embed":
        return 0, "in"
    if name.startswith("layers.") and name.endswith(".resid_out"):
        return int(name.split(".")[1]), "out"
    return None


def run_layer_error(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Per-tap rel_l2 / cosine / SQNR / max / mean / p99 abs error, plus quantization statistics per site.

    With ``layer_local: true``, also each layer's *local* error: the engine's layer fed the reference's input of
    that layer, against the reference's output (``layers.{i}.layer_local.<stat>``), next to the propagated error
    of the same output (``layers.{i}.resid_out.<stat>``). Resident models run batch by batch; layer-streamed
    ones (`evalharness.streamed`) in one layer-major pass, with the same results."""
    from evalharness.streamed import co_stream, is_streamed

    win = ctx.windows(cfg["seq_len"], None, cfg["windows"], max(cfg["windows"] * cfg["seq_len"] * 2, 4096), cfg["bos"])
    acc: dict[str, ErrorAccumulator | OverlapAccumulator] = {}
    order: list[str] = []
    # (site, module) -> [saturated, underflowed, elements]: summed per module in the order the modules first
    # appear, then per site, so that batch-major and layer-major passes add in the same order
    sat = defaultdict(lambda: [0.0, 0.0, 0.0])
    patterns = cfg["taps"]
    local = LocalSums() if cfg.get("local", True) else None
    fed: dict[int, ErrorAccumulator] = {}  # layer -> its local (reference-fed) error
    streamed = is_streamed(ctx.engine) or is_streamed(ctx.reference)

    def observe(module: str, site: str, q) -> None:
        counts = getattr(q, "counts", None)  # a QTensor's 0-d count tensors, on its device: summed there and read
        if counts is None:                   # once at the end (`QTensor.stats` would synchronize per quantization)
            return
        rec = sat[(site, module)]
        for k, key in ((0, "saturated"), (1, "underflow")):
            if key in counts:
                rec[k] = rec[k] + counts[key]
        rec[2] += float(torch.Size(q.shape).numel())

    def fold_fed(i: int, y: torch.Tensor, ref_out: torch.Tensor) -> None:
        fed.setdefault(i, ErrorAccumulator()).update(y, ref_out.float())

    def sinks(resid: dict | None):
        """(reference tap sink, engine tap sink, the batch's pending reference taps)."""
        ref_taps: dict[str, torch.Tensor] = {}

        def ref_sink(name: str, t: torch.Tensor) -> None:
            if resid is not None and _local_inputs(name, 0) is not None:
                resid[name] = t.detach().float()
            if _selected(name, patterns):
                ref_taps[name] = t.detach() if name.endswith(ID_TAP_SUFFIX) else t.detach().float()

        def eng_sink(name: str, t: torch.Tensor) -> None:
            if name not in ref_taps:
                return
            if name not in acc:
                acc[name] = OverlapAccumulator() if name.endswith(ID_TAP_SUFFIX) else ErrorAccumulator()
                order.append(name)
            acc[name].update(t, ref_taps.pop(name))

        return ref_sink, eng_sink, ref_taps

    batches = list(win.batches(ctx.batch_size))
    if streamed:
        made = [sinks(None) for _ in batches]
        co_stream([x for _, x, _ in batches], ctx.reference, ctx.engine, ref_tap=lambda b: made[b][0],
                  eng_tap=lambda b: made[b][1], observer=observe, local=local,
                  layer_fed=(lambda i, b, y, r: fold_fed(i, y, r)) if cfg["layer_local"] else None,
                  counters=ctx.counters)
        pending = [made[b][2] for b in range(len(batches))]
    else:
        pending = []
        for start, inputs, _ in batches:
            resid: dict | None = {} if cfg["layer_local"] else None
            ref_sink, eng_sink, ref_taps = sinks(resid)
            ctx.reference.logits(inputs, tap=ref_sink)
            if local is None:
                ctx.engine.logits(inputs, tap=eng_sink, observer=observe)
            else:
                ctx.engine.logits(inputs, tap=eng_sink, observer=observe, local=local)
            pending.append(ref_taps)
            if resid is not None:
                _fed_resident(ctx.engine, inputs, resid, fold_fed)
    for ref_taps in pending:
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
    per_site: dict[str, list[float]] = {}
    for (site, _module), rec in sat.items():
        tot = per_site.setdefault(site, [0.0, 0.0, 0.0])
        for k in range(3):
            tot[k] += float(rec[k])
    for site, (s, u, n) in sorted(per_site.items()):
        if n:
            metrics[f"quant.{site}.saturation_frac"] = s / n
            metrics[f"quant.{site}.underflow_frac"] = u / n
    for i in sorted(fed):
        res = fed[i].result()
        for stat in REPORTED:
            metrics[f"layers.{i}.layer_local.{stat}"] = res[stat]
    samples = {"tap_order": order, "worst_tap": [worst] if worst else []}
    if local is not None:
        lm, worst_modules = local.result()
        metrics.update(lm)
        samples["local_worst_module"] = worst_modules
    return metrics, samples


def _fed_resident(engine, inputs: torch.Tensor, resid: dict[str, torch.Tensor], fold) -> None:
    """Each layer of a resident engine fed the reference's input of that layer (`engine.streaming.layer_fed`):
    `fold(i, output, reference output)` per layer, from the reference's embed / resid_out taps of this batch."""
    from engine.streaming import layer_fed

    if getattr(engine, "parallel", None) is not None and engine.parallel.size > 1:
        raise ValueError("layer_error.layer_local: not available under tensor / expert parallelism (tp=ep=1)")
    model, nx, w = engine.model, engine.nx, engine.weights
    like = model.forward_start(nx, w, inputs.to(engine.device))
    for i in range(model.cfg.num_layers):
        x_in = resid["embed" if i == 0 else f"layers.{i - 1}.resid_out"].to(engine.device)
        fold(i, layer_fed(model, nx, w, i, x_in, like), resid[f"layers.{i}.resid_out"])
