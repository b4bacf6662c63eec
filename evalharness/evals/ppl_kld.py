"""Perplexity and token-level KL divergence, engine vs FP32 reference, with intervals.

Per scored token: NLL under both models, KL(reference || engine) over the full
vocabulary, top-1 agreement, and delta-p of the target token. Tokens of one
window are correlated, so intervals treat windows as clusters. The
reference's log-probabilities are cached per (model, windows hash) for the
whole invocation, so a matrix of N recipes runs the reference once.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from evalharness import stats
from evalharness.evals import EvalContext

_CACHE_LIMIT_BYTES = 512 * 2**20
POSITION_BUCKETS = 4  # metrics ppl_kld.pos{lo}_{hi}.* over equal slices of the window


def _ref_logprobs(ctx: EvalContext, inputs: torch.Tensor) -> torch.Tensor:
    """Reference log-softmax (batch, t, vocab) in float64 on CPU."""
    return torch.log_softmax(ctx.reference.logits(inputs).double().cpu(), dim=-1)


def run_ppl_kld(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """PPL of reference and engine (with CIs), PPL ratio (paired CI), KLD mean/p99/p99.9/max, top-1, delta-p."""
    win = ctx.windows(cfg["seq_len"], cfg["stride"], cfg["max_windows"], cfg["max_tokens"], cfg["bos"])
    cache_ok = win.n * win.inputs.shape[1] * ctx.vocab_size * 8 <= _CACHE_LIMIT_BYTES
    ref_all = None
    if cache_ok:
        ref_all = ctx.reference_cached(("ppl_kld_ref", win.sha256),
                                       lambda: torch.cat([_ref_logprobs(ctx, x) for _, x, _ in win.batches(ctx.batch_size)]))
    nll_r, nll_e, kld, agree, dp, cluster, position = [], [], [], [], [], [], []
    nonfinite = 0
    total = 0
    for start, inputs, targets in win.batches(ctx.batch_size):
        lr = ref_all[start:start + inputs.shape[0]] if ref_all is not None else _ref_logprobs(ctx, inputs)
        le = torch.log_softmax(ctx.engine.logits(inputs).double().cpu(), dim=-1)  # (batch, t, vocab)
        mask = targets >= 0  # (batch, t) scored positions
        tgt = targets.clamp_min(0)
        finite = torch.isfinite(le).all(-1)  # (batch, t)
        total += int(mask.sum())
        nonfinite += int((mask & ~finite).sum())
        keep = mask & finite
        win_ids = (torch.arange(inputs.shape[0]) + start)[:, None].expand_as(mask)
        pos_ids = torch.arange(inputs.shape[1])[None, :].expand_as(mask)
        lr_t = lr.gather(-1, tgt[..., None])[..., 0]
        le_t = le.gather(-1, tgt[..., None])[..., 0]
        k = (lr.exp() * (lr - le)).sum(-1)  # (batch, t) KL(ref || eng)
        nll_r.append(-lr_t[keep])
        nll_e.append(-le_t[keep])
        kld.append(k[keep].clamp_min(0.0))
        agree.append((lr.argmax(-1) == le.argmax(-1))[keep].double())
        dp.append((le_t.exp() - lr_t.exp())[keep])
        cluster.append(win_ids[keep])
        position.append(pos_ids[keep])

    metrics: dict[str, float] = {"n_tokens": float(total), "n_windows": float(win.n),
                                 "nonfinite_frac": nonfinite / max(total, 1)}
    nll_r_t, nll_e_t, kld_t = torch.cat(nll_r), torch.cat(nll_e), torch.cat(kld)
    agree_t, dp_t, cl, pos = torch.cat(agree), torch.cat(dp), torch.cat(cluster), torch.cat(position)
    samples: dict[str, list] = {}
    if kld_t.numel() == 0:
        for name in ("ppl_ref", "ppl_eng", "ppl_ratio", "kld_mean", "kld_p99", "kld_max", "top1_agree"):
            metrics[name] = math.nan
        return metrics, samples
    clusters = cl.tolist()
    pr = stats.ppl_ci(nll_r_t.tolist(), clusters=clusters)
    pe = stats.ppl_ci(nll_e_t.tolist(), clusters=clusters)
    ratio = stats.ppl_ratio_ci(nll_r_t.tolist(), nll_e_t.tolist(), clusters=clusters)
    km = stats.mean_ci(kld_t.tolist(), clusters=clusters)
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
