"""Precision switching (seed article §4.4): what a per-request high-precision path recovers, and what it costs.

The engine precompiles a high-precision variant of the sensitive `modules`
(`Engine.enable_precision_switch`); each request carries a flag. On the same
windows this eval measures, against the FP32 reference:

* ``low.kld_mean`` / ``high.kld_mean`` (with 95% intervals) and top-1
  agreement of the two paths; ``recovered_frac`` = 1 - high/low KLD, with
  the paired interval of the per-window KLD reduction (``recovered_lo/hi``);
* ``mixed.rows_equal_frac``: in a batch where every other request is
  flagged, the fraction of requests whose logits are bit-identical to
  running them on their own path alone (1.0 unless the recipe's scales span
  the batch, as per-tensor dynamic scales do);
* latency per batch (median of `reps`): ``latency.low_s``, ``latency.high_s``,
  ``latency.mixed_s``, and ``switch_overhead`` = mixed / mean(low, high)
  (> 1 is the price of splitting a mixed batch into two sub-batches);
* memory: ``extra_weight_bytes`` and ``extra_weight_frac`` of the variant's
  duplicated weights (in their storage formats).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from evalharness.evals import EvalContext
from evalharness.evals.tokenstats import kl_from_logprobs


def _kld_rows(lr: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-window mean token KL(ref || engine) (windows,) from reference log-probs."""
    le = torch.log_softmax(logits.double(), -1)
    return kl_from_logprobs(lr, le).mean(-1)


def _timed(fn, reps: int) -> float:
    """Median wall time of `fn()` over `reps` calls (synchronizing a GPU)."""
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_switching(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Low vs high path quality, mixed-batch exactness, latency and memory of the switch (module docstring)."""
    from evalharness.stats import mean_ci

    if not cfg["modules"]:
        raise ValueError("'modules' must list the sensitive module globs, e.g. ['layers.0.*', '*.mlp.down_proj']")
    eng = ctx.engine
    cost = eng.enable_precision_switch(cfg["modules"], cfg["high"])
    win = ctx.windows(cfg["seq_len"], None, cfg["windows"], max(cfg["windows"] * cfg["seq_len"] * 2, 4096), True)
    ref = ctx.reference_cached(("switching_ref", win.sha256),
                               lambda: torch.cat([ctx.reference.logits(x).float().cpu()
                                                  for _, x, _ in ctx.batches(win, "switching reference")]))
    lr = torch.log_softmax(ref.double(), -1)
    low, high, mixed = [], [], []
    flags_all = [i % 2 == 1 for i in range(win.n)]
    for s, x, _ in ctx.batches(win, "switching engine"):
        low.append(eng.logits(x).float().cpu())
        high.append(eng.logits(x, high_precision=True).float().cpu())
        mixed.append(eng.logits(x, high_precision=flags_all[s:s + x.shape[0]]).float().cpu()
                     if x.shape[0] > 1 else None)
    lo_t, hi_t = torch.cat(low), torch.cat(high)
    k_lo, k_hi = _kld_rows(lr, lo_t), _kld_rows(lr, hi_t)
    m: dict[str, float] = {}
    for name, k, t in (("low", k_lo, lo_t), ("high", k_hi, hi_t)):
        ci = mean_ci(k.tolist(), lower=0.0)  # a KL divergence is >= 0
        mean, lo, hi = ci["mean"], ci["lo"], ci["hi"]
        m.update({f"{name}.kld_mean": mean, f"{name}.kld_mean_lo": lo, f"{name}.kld_mean_hi": hi,
                  f"{name}.top1_agree": float((t.argmax(-1) == ref.argmax(-1)).double().mean())})
    base = float(k_lo.mean())
    m["recovered_frac"] = 1.0 - float(k_hi.mean()) / base if base > 0 else 0.0
    d = mean_ci((k_lo - k_hi).tolist())
    d_lo, d_hi = d["lo"], d["hi"]
    m["recovered_lo"], m["recovered_hi"] = (d_lo / base, d_hi / base) if base > 0 else (0.0, 0.0)
    rows_eq = []
    for (s, x, _), mx in zip(win.batches(ctx.batch_size), mixed):
        if mx is None:
            continue
        for j in range(x.shape[0]):
            own = (high if flags_all[s + j] else low)[s // ctx.batch_size][j]
            rows_eq.append(bool(torch.equal(mx[j], own)))
    m["mixed.rows_equal_frac"] = sum(rows_eq) / len(rows_eq) if rows_eq else float("nan")
    x0 = win.inputs[: ctx.batch_size]
    f0 = flags_all[: x0.shape[0]]
    m["latency.low_s"] = _timed(lambda: eng.logits(x0), cfg["reps"])
    m["latency.high_s"] = _timed(lambda: eng.logits(x0, high_precision=True), cfg["reps"])
    m["latency.mixed_s"] = _timed(lambda: eng.logits(x0, high_precision=f0), cfg["reps"])
    m["switch_overhead"] = m["latency.mixed_s"] / ((m["latency.low_s"] + m["latency.high_s"]) / 2)
    m["extra_weight_bytes"] = cost["extra_weight_bytes"]
    m["extra_weight_frac"] = cost["extra_weight_bytes"] / cost["base_weight_bytes"]
    m["switched_tensors"] = cost["switched_tensors"]
    return m, {"low.window_kld": k_lo.tolist(), "high.window_kld": k_hi.tolist()}
