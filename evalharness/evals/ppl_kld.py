"""Perplexity and token-level KL divergence, engine vs FP32 reference, with intervals.

Per scored token: NLL under both models, KL(reference || engine), top-1
agreement, and delta-p of the target token. Tokens of one window are
correlated, so intervals treat windows as clusters.

The reference runs once per (model, windows) however many recipes are scored:

* full mode (small vocab x tokens): the full reference log-softmax is kept in
  memory for the invocation; KLD is exact;
* top-k mode (`ref_topk: K`, or automatically when the full tensor would not
  fit): per token the reference's top-K log-probs and ids, the tail mass and
  the target's log-prob are cached on disk (`<out>/ref_cache/<key>.safetensors`,
  key = sha256 of model checkpoint, window tokens, K), so memory does not grow
  with the vocabulary and later invocations (nightly, --resume) reuse it. KLD
  is then computed over the top-K ids plus one tail bucket: the KL divergence
  of the coarsened distributions, a lower bound of the full KLD that is tight
  when the reference's tail mass is small (reported as `ref_tail_mass_mean`).
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import torch

from evalharness import stats
from evalharness.evals import EvalContext
from evalharness.evals.tokenstats import TOPK_FIELDS, compare, reference_summary, select
from evalharness.streamed import map_logits

_CACHE_LIMIT_BYTES = 512 * 2**20
POSITION_BUCKETS = 4  # metrics ppl_kld.pos{lo}_{hi}.* over equal slices of the window
DEFAULT_TOPK = 64  # top-k reference cache size when the full logits would not fit in memory
# Metrics that depend on the engine's outputs: all NaN when any scored token's engine distribution is NaN/Inf.
ENGINE_STATS = ("ppl_eng", "ppl_ratio", "nll_delta_mean", "kld_mean", "kld_p99", "kld_p999", "kld_max",
                "kld_worst_window", "top1_agree", "delta_p_mean", "delta_p_rms")


def _read_cache_entry(path: Path, key_src: str, n: int, seq: int, k: int, vocab: int) -> dict[str, torch.Tensor] | None:
    """A reference cache entry if it is the one asked for and intact, else None (then it is recomputed): the file
    must parse, name this key in its metadata, and hold the top-k fields with this window set's shapes, ids inside
    the vocabulary and finite log-probs. A corrupt or foreign entry is never trusted."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != key_src or set(f.keys()) != set(TOPK_FIELDS):
                return None
            rec = {name: f.get_tensor(name) for name in TOPK_FIELDS}
    except Exception:  # safetensors raises several types for a damaged file; all mean "recompute"
        return None
    shapes = {"idx": (n, seq, k), "lp": (n, seq, k), "log_tail": (n, seq), "tgt": (n, seq)}
    if any(tuple(rec[name].shape) != shape for name, shape in shapes.items()):
        return None
    if rec["idx"].dtype != torch.int64 or not bool(((rec["idx"] >= 0) & (rec["idx"] < vocab)).all()):
        return None
    if not all(rec[name].dtype == torch.float64 and bool(torch.isfinite(rec[name]).all())
               for name in ("lp", "log_tail", "tgt")):
        return None
    return rec


def _ref_topk_cached(ctx: EvalContext, win, k: int) -> dict[str, torch.Tensor]:
    """Top-k reference records for all windows (CPU): from the on-disk cache when present and intact
    (`_read_cache_entry`), else computed once (on the reference's device) and saved; a rejected entry is counted
    in the result's counters (`reference_cache_rejected`) and replaced."""
    from safetensors.torch import save_file

    key_src = f"{ctx.model_sha}|{win.sha256}|topk{k}|{getattr(ctx.reference, 'precision', 'fp32')}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    path = Path(ctx.ref_cache_dir) / f"ppl_kld-{key}.safetensors" if ctx.ref_cache_dir and ctx.model_sha else None

    def compute() -> dict[str, torch.Tensor]:
        if path is not None and path.exists():
            rec = _read_cache_entry(path, key_src, win.n, int(win.inputs.shape[1]), k, ctx.vocab_size)
            if rec is not None:
                ctx.counters["reference_disk_hits"] = ctx.counters.get("reference_disk_hits", 0) + 1
                return rec
            ctx.counters["reference_cache_rejected"] = ctx.counters.get("reference_cache_rejected", 0) + 1
            path.unlink(missing_ok=True)
        ctx.counters["reference_passes_topk"] = ctx.counters.get("reference_passes_topk", 0) + 1
        parts = map_logits(ctx.reference, ctx.batches(win, "reference top-k"), lambda lg, batch: {
            n: t.cpu() for n, t in reference_summary(lg, batch[2], k).items()}, ctx.counters)
        rec = {name: torch.cat([p[name] for p in parts]).contiguous() for name in parts[0]}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            save_file(rec, str(tmp), metadata={"key": key_src})
            tmp.replace(path)
        return rec

    return ctx.reference_cached(("ppl_kld_ref_topk", win.sha256, k), compute)


def reference_for(ctx: EvalContext, win, topk: int | None, cache_name: str) -> dict[str, torch.Tensor]:
    """The reference side for all windows of `win`: top-k records (`topk`), or the full fp32 logits kept on the
    reference's device for the invocation (shared by every recipe through the eval context's cache)."""
    if topk:
        return _ref_topk_cached(ctx, win, min(topk, ctx.vocab_size))
    desc = f"{cache_name.removesuffix('_ref')} reference"
    return ctx.reference_cached((cache_name, win.sha256), lambda: {"logits": torch.cat(
        map_logits(
        ctx.reference, ctx.batches(win, desc), lambda lg, batch: lg.float(), ctx.counters))})


def run_ppl_kld(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """PPL of reference and engine (with CIs), PPL ratio (paired CI), KLD mean/p99/p99.9/max, top-1, delta-p."""
    win = ctx.windows(cfg["seq_len"], cfg["stride"], cfg["max_windows"], cfg["max_tokens"], cfg["bos"])
    topk = cfg.get("ref_topk")
    if topk is None and win.n * win.inputs.shape[1] * ctx.vocab_size * 4 > _CACHE_LIMIT_BYTES:
        topk = DEFAULT_TOPK
    ref_all = reference_for(ctx, win, topk, "ppl_kld_ref")
    # per batch: the per-token comparison, on the engine's device until the end
    parts = map_logits(ctx.engine, ctx.batches(win, "ppl_kld engine"), lambda lg, batch: compare(
        select(ref_all, batch[0], batch[1].shape[0]), lg, batch[2]), ctx.counters)
    tok = {name: torch.cat([p[name] for p in parts]).cpu() for name in parts[0]}  # (windows, t) each
    targets = win.targets
    mask = targets >= 0  # (windows, t) scored positions
    keep = mask & tok["finite"]
    total = int(mask.sum())
    nonfinite = int((mask & ~tok["finite"]).sum())
    win_ids = torch.arange(targets.shape[0])[:, None].expand_as(mask)
    pos_ids = torch.arange(targets.shape[1])[None, :].expand_as(mask)
    lr_t, le_t = tok["lr_t"], tok["le_t"]
    nll_r_t, nll_e_t = -lr_t[keep], -le_t[keep]
    kld_t = tok["kld"][keep].clamp_min(0.0)
    agree_t = tok["agree"][keep].double()
    dp_t = (le_t.exp() - lr_t.exp())[keep]
    cl, pos = win_ids[keep], pos_ids[keep]

    metrics: dict[str, float] = {"n_tokens": float(total), "n_windows": float(win.n),
                                 "nonfinite_frac": nonfinite / max(total, 1), "ref_topk": float(topk or 0)}
    if "tail" in tok:
        metrics["ref_tail_mass_mean"] = float(tok["tail"][keep].mean())
    samples: dict[str, list] = {}
    if nonfinite or kld_t.numel() == 0:
        # NaN/Inf engine outputs: every engine statistic is NaN, never a number over the finite tokens alone (a
        # gate rule on any of them then FAILs); the reference's perplexity and where the NaNs were are kept
        for name in ENGINE_STATS:
            metrics[name] = math.nan
        if total:
            pr = stats.ppl_ci((-lr_t[mask]).tolist(), clusters=win_ids[mask].tolist())
            metrics.update({"ppl_ref": pr["ppl"], "ppl_ref_lo": pr["lo"], "ppl_ref_hi": pr["hi"]})
        else:
            metrics["ppl_ref"] = math.nan
        bad_w = (mask & ~tok["finite"]).sum(1).double() / mask.sum(1).clamp_min(1)
        samples["window_nonfinite_frac"] = bad_w.tolist()
        return metrics, samples
    clusters = cl.tolist()
    pr = stats.ppl_ci(nll_r_t.tolist(), clusters=clusters)
    pe = stats.ppl_ci(nll_e_t.tolist(), clusters=clusters)
    ratio = stats.ppl_ratio_ci(nll_r_t.tolist(), nll_e_t.tolist(), clusters=clusters)
    km = stats.mean_ci(kld_t.tolist(), clusters=clusters, lower=0.0)  # a KL divergence is >= 0
    k_agree = int(agree_t.sum())
    top1 = stats.binomial_ci(k_agree, int(agree_t.numel()))
    metrics.update({
        "ppl_ref": pr["ppl"], "ppl_ref_lo": pr["lo"], "ppl_ref_hi": pr["hi"],
        "ppl_eng": pe["ppl"], "ppl_eng_lo": pe["lo"], "ppl_eng_hi": pe["hi"],
        "ppl_ratio": ratio["ratio"], "ppl_ratio_lo": ratio["lo"], "ppl_ratio_hi": ratio["hi"],
        "nll_delta_mean": float((nll_e_t - nll_r_t).mean()),
        "kld_mean": km["mean"], "kld_mean_lo": km["lo"], "kld_mean_hi": km["hi"],
        "kld_p99": float(torch.quantile(kld_t, 0.99)), "kld_p999": float(torch.quantile(kld_t, 0.999)),
        "kld_max": float(kld_t.max()),
        "top1_agree": top1["p"], "top1_agree_lo": top1["lo"], "top1_agree_hi": top1["hi"],
        "delta_p_mean": float(dp_t.mean()), "delta_p_rms": float(dp_t.pow(2).mean().sqrt()),
    })
    # Per-window means: the paired unit for gate tests against a baseline of the same windows.
    n_win = win.n
    counts = torch.bincount(cl, minlength=n_win).clamp_min(1).double()
    for name, values in (("window_kld", kld_t), ("window_nll_ref", nll_r_t), ("window_nll_eng", nll_e_t),
                         ("window_top1", agree_t)):
        samples[name] = (torch.bincount(cl, weights=values, minlength=n_win) / counts).tolist()
    # Worst windows (where to look first) and everything by token position.
    order = sorted(range(n_win), key=lambda i: -samples["window_kld"][i])[:5]
    samples["worst_windows"] = [{"window": i, "kld_mean": samples["window_kld"][i]} for i in order]
    metrics["kld_worst_window"] = samples["window_kld"][order[0]]
    seq = int(win.inputs.shape[1])
    pcount = torch.bincount(pos, minlength=seq).double()
    ok = pcount > 0
    by_pos = torch.bincount(pos, weights=kld_t, minlength=seq) / pcount.clamp_min(1)
    samples["kld_by_position"] = [float(v) if o else None for v, o in zip(by_pos.tolist(), ok.tolist())]
    samples["top1_by_position"] = [float(v) if o else None for v, o in zip(
        (torch.bincount(pos, weights=agree_t, minlength=seq) / pcount.clamp_min(1)).tolist(), ok.tolist())]
    n_buckets = min(POSITION_BUCKETS, seq)
    edges = [round(i * seq / n_buckets) for i in range(n_buckets + 1)]
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (pos >= lo) & (pos < hi)
        if int(sel.sum()) == 0:
            continue
        metrics[f"pos{lo}_{hi}.kld_mean"] = float(kld_t[sel].mean())
        metrics[f"pos{lo}_{hi}.top1_agree"] = float(agree_t[sel].mean())
        metrics[f"pos{lo}_{hi}.nll_delta_mean"] = float((nll_e_t[sel] - nll_r_t[sel]).mean())
    return metrics, samples
