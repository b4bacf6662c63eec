"""Three-way comparison: FP32 reference vs bit-exact emulation vs native kernels, on the same recipe.

Error against FP32 has two sources: the *format* (what the recipe's number
formats lose, measured exactly by the emulation) and the *kernel* (what the
native kernels add on top: accumulation order, tensor-core accumulation
width, bf16 P in attention, or a bug). On the same windows this eval runs

* R = the FP32 reference, E = the recipe on `emulated` (default
  `cuda-emulated`), N = the recipe on `native` (default `cuda-native`),

and reports, each as a mean over tokens with its 95% interval:

* ``format.kld_mean`` = KL(R || E), ``kernel.kld_mean`` = KL(E || N),
  ``total.kld_mean`` = KL(R || N); top-1 agreement for each pair;
* ``kernel_share`` = kernel / (format + kernel) KLD: near 0 when the native
  path adds nothing beyond the format, near 1 when the kernel dominates;
* per canonical tap: ``tap.<name>.format_rel_l2`` (E vs R) and
  ``tap.<name>.kernel_rel_l2`` (N vs E);
* ``first_kernel_tap``: the shallowest tap whose kernel rel-L2 exceeds
  both `kernel_floor` and `kernel_factor` x its format rel-L2, i.e. where a
  kernel first goes wrong (index into ``tap_order``; -1 if none). A correct
  kernel differs from the emulation by accumulation order, which flips a
  few FP8 roundings downstream: its error re-draws the format's rounding
  noise and stays of the format's size (measured on the H200: KL(E || N)
  0.5-1x KL(R || E) for FP8 recipes), never far above it; a wrong kernel
  (a bad scale layout, a dropped promotion) sits well above it at the first
  GEMM it touches;
* ``attribution`` = 1.0 (kernel) / 0.0 (format) by which KLD is larger.

The engines are built from the run's model and recipe through
`engine.api.Engine`; the eval does not care which backends they are, so the
same code compares any two (the CPU tests use a deliberately broken
variant in place of the native kernels).
"""

from __future__ import annotations

from typing import Any

import torch

from evalharness.evals import EvalContext
from evalharness.evals.errorstats import ErrorAccumulator
from evalharness.evals.tokenstats import kl_from_logprobs

ID_SUFFIX = ".moe.topk"


def _mean_ci(x: torch.Tensor) -> tuple[float, float, float]:
    """Mean with its Student-t 95% interval over per-window KL divergences (`evalharness.stats.mean_ci`, bounded
    below by 0)."""
    from evalharness.stats import mean_ci

    if not bool(torch.isfinite(x).all()):
        # NaN / inf logits in some window (a broken kernel can overflow): an unbounded divergence, reported
        # as inf with no interval rather than an error, so the attribution still names the culprit
        return float("inf"), float("nan"), float("nan")
    values = x.double().flatten().tolist()
    if len(values) < 2:
        return values[0], values[0], values[0]
    ci = mean_ci(values, lower=0.0)
    return ci["mean"], ci["lo"], ci["hi"]


def make_engines(ctx: EvalContext, emulated: str, native: str,
                 native_options: dict | None = None) -> tuple[Any, Any]:
    """(E, N): the run's recipe on the two backends (the run's own engine is reused when it is one of them).

    `native_options` are kernel options of N (e.g. `attn_block`, `options`).
    """
    from engine import api

    base, recipe = ctx.engine.model, ctx.engine.recipe

    def build(backend: str, options: dict):
        if getattr(ctx.engine, "backend", None) == backend and not options:
            return ctx.engine
        return api.Engine(base, recipe, backend=backend, **options)

    return build(emulated, {}), build(native, dict(native_options or {}))


def run_threeway(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """FP32 vs emulation vs native on `windows` windows of `seq_len` tokens (module docstring)."""
    from engine import api

    for key in ("emulated", "native"):
        if cfg[key] not in api.BACKENDS:
            raise ValueError(f"threeway.{key}: unknown backend '{cfg[key]}'; available: {api.BACKENDS}")
    emu, nat = make_engines(ctx, cfg["emulated"], cfg["native"], cfg["native_options"])
    win = ctx.windows(cfg["seq_len"], None, cfg["windows"], max(cfg["windows"] * cfg["seq_len"] * 2, 4096), True)
    fmt_acc: dict[str, ErrorAccumulator] = {}
    ker_acc: dict[str, ErrorAccumulator] = {}
    order: list[str] = []
    kld = {"format": [], "kernel": [], "total": []}
    top1 = {"format": [], "kernel": [], "total": []}
    for _, inputs, _ in ctx.batches(win, "threeway"):
        taps: dict[str, dict[str, torch.Tensor]] = {"R": {}, "E": {}}

        def sink(which: str):
            def put(name: str, t: torch.Tensor) -> None:
                if not name.endswith(ID_SUFFIX):
                    taps[which][name] = t.detach().float().cpu()
            return put

        def nat_sink(name: str, t: torch.Tensor) -> None:
            if name.endswith(ID_SUFFIX) or name not in taps["E"]:
                return
            if name not in ker_acc:
                order.append(name)
                fmt_acc[name], ker_acc[name] = ErrorAccumulator(), ErrorAccumulator()
            e = taps["E"].pop(name)
            ker_acc[name].update(t.detach().float().cpu(), e)
            if name in taps["R"]:
                fmt_acc[name].update(e, taps["R"].pop(name))

        r = ctx.reference.logits(inputs, tap=sink("R")).double().cpu()
        e = emu.logits(inputs, tap=sink("E")).double().cpu()
        n = nat.logits(inputs, tap=nat_sink).double().cpu()
        lr, le, ln = (torch.log_softmax(x, -1) for x in (r, e, n))
        for key, (a, b, la, lb) in {"format": (r, e, lr, le), "kernel": (e, n, le, ln),
                                    "total": (r, n, lr, ln)}.items():
            kld[key].append(kl_from_logprobs(la, lb).mean(-1))  # (batch,) per window
            top1[key].append((a.argmax(-1) == b.argmax(-1)).double().mean(-1))
    metrics: dict[str, float] = {}
    samples: dict[str, list] = {"tap_order": order}
    for key in kld:
        per_win = torch.cat(kld[key])
        m, lo, hi = _mean_ci(per_win)
        metrics.update({f"{key}.kld_mean": m, f"{key}.kld_mean_lo": lo, f"{key}.kld_mean_hi": hi,
                        f"{key}.top1_agree": float(torch.cat(top1[key]).mean()),
                        f"{key}.nonfinite_windows": float((~torch.isfinite(per_win)).sum())})
        samples[f"{key}.window_kld"] = per_win.tolist()
    f, k = metrics["format.kld_mean"], metrics["kernel.kld_mean"]
    metrics["kernel_share"] = k / (f + k) if f + k > 0 else 0.0
    metrics["attribution"] = 1.0 if k > f else 0.0
    first = -1
    for i, name in enumerate(order):
        fr = fmt_acc[name].result()["rel_l2"] if fmt_acc[name].count else float("nan")
        kr = ker_acc[name].result()["rel_l2"]
        metrics[f"tap.{name}.format_rel_l2"] = fr
        metrics[f"tap.{name}.kernel_rel_l2"] = kr
        if first < 0 and kr > cfg["kernel_floor"] and not kr <= cfg["kernel_factor"] * fr:
            first = i
    metrics["first_kernel_tap"] = float(first)
    samples["first_kernel_tap"] = [order[first]] if first >= 0 else []
    metrics["n_windows"] = float(win.n)
    return metrics, samples
