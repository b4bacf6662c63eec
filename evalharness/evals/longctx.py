"""Long-context behaviour, engine vs FP32 reference side by side.

Four parts (setting ``parts``; all by default):

* ``degeneration``: greedy continuations of ``new_tokens`` tokens (EOS
  ignored) from real corpus prompts of several lengths up to the model's
  context minus ``new_tokens``, by both models. Scored for rep-2/3/4,
  distinct-1/2, loops (smallest period of the tail and its onset; see
  :mod:`evalharness.evals.degeneration`), zlib compression ratio and entropy
  collapse (mean predictive entropy of the last ``entropy_window`` steps over
  the first). The same generations give the **first divergence** of the
  engine's tokens from the reference's, with the reference's top-1/top-2
  logit margin there: a margin below ``tie_margin`` is a near-tie flip (any
  rounding could do that), a larger one a real error.
* ``passkey``: "The pass key is NNNNN. Remember it." hidden at depth d in
  filler text of total length L tokens, then "What is the pass key? The pass
  key is"; greedy decode, exact match of the first number. Accuracy per
  (L, d) and per L with Wilson intervals over ``passkey_trials`` random keys.
* ``kld``: KL(reference || engine) at every position of ``kld_docs``
  full-context corpus windows, averaged in ``kld_buckets`` equal position
  buckets, with the growth (last bucket / first) and the slope per 1k
  positions: FP8 accumulation errors that grow with context (e.g. a recipe's
  ``accumulate: tc14``) show up here before they show up in accuracy. Above
  512 MB of reference logits (or with ``ref_topk: K``) the reference enters as
  top-k records (`evalharness.evals.tokenstats`), as in ``ppl_kld``.

On a layer-streamed model (docs/guide/big-models.md) only ``kld`` runs (layer-major passes, the resident
metrics bit for bit): ``degeneration`` and ``passkey`` generate, and every decode step reads every layer. The
eval then ends with `evalharness.errors.PartlyRunError` naming the parts not run, the memory generation needs and
the multi-GPU route; the runner keeps the ``kld`` metrics and makes the run an error result (bad input), so a gate
FAILs it with that message rather than passing a run without them (ask for ``parts: [kld]`` on such a model).

Metrics ``longctx.<name>``: ``<measure>_eng`` / ``<measure>_ref`` pairs,
``div_*``, ``passkey_*``, ``passkey.L<L>.d<pct>.acc_{eng,ref}``, ``kld_*``.
Per-prompt, per-trial and per-position arrays go into the samples. The
reference side of every part is computed once per model and reused by every
recipe (``EvalContext.reference_cached``). Wall seconds of each part go into
the result's timing as ``longctx.<part>_s``, of which ``longctx.<part>.reference_s`` were the
reference's (computed once, then cached).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import time
from typing import Any

import numpy as np
import torch

from engine.generation import GenerationRequest
from evalharness import stats
from evalharness.errors import DataError, PartlyRunError
from evalharness.evals import EvalContext
from evalharness.evals.degeneration import (compression_ratio, detect_loop, distinct_n, entropy_collapse,
                                            first_divergence, rep_n)
from evalharness.evals.ppl_kld import DEFAULT_TOPK, reference_for
from evalharness.evals.tokenstats import compare, select
from evalharness.generation import generate_many
from evalharness.streamed import is_streamed, map_logits

PARTS = ("degeneration", "passkey", "kld")
GENERATING_PARTS = ("degeneration", "passkey")  # not run on a layer-streamed model
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"
PASSKEY_NEW_TOKENS = 8  # a 5-digit key takes at most 6 tokens in byte-fallback vocabularies
_KLD_CACHE_LIMIT_BYTES = 512 * 2**20


def _max_context(ctx: EvalContext) -> int:
    """The engine's maximum context length."""
    m = getattr(ctx.engine, "max_seq_len", None) or ctx.engine.cfg.max_position
    return int(m)


def _digest(obj: Any) -> str:
    """Short sha256 of a JSON-able object (cache keys, data provenance)."""
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:24]


def _mean(xs) -> float:
    """Mean of the finite values; NaN when none."""
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return sum(v) / len(v) if v else math.nan


# --------------------------------------------------------------------------- generations

def _generate(ctx: EvalContext, model: Any, prompts: list[list[int]], new_tokens: int) -> list[dict[str, list]]:
    """Greedy continuations of all prompts (EOS ignored), decoded together, with per-step entropy and top-1/top-2
    margin."""
    reqs = [GenerationRequest(tuple(p), new_tokens) for p in prompts]
    return [{"tokens": g.tokens, "entropy": g.entropy, "margin": g.margin}
            for g in _decode(ctx, model, reqs, "generations", step_stats=True)]


def _decode(ctx: EvalContext, model: Any, reqs: list[GenerationRequest], what: str, step_stats: bool = False):
    """`generate_many` with a bar counting the requests as they finish."""
    side = "engine" if model is ctx.engine else "reference"
    with ctx.progress.bar(total=len(reqs), desc=f"{side} {what}", unit="req") as bar:
        return generate_many(model, reqs, ctx.batch_size, step_stats=step_stats, on_done=bar.update)


def _as_text(ctx: EvalContext, tokens: list[int]) -> bytes:
    """Bytes of a generation for the compression ratio: decoded text, else the raw token ids."""
    if ctx.tokenizer is not None:
        return ctx.tokenizer.decode(tokens).encode("utf-8")
    return np.asarray(tokens, dtype=np.int32).tobytes()


def degeneration_stats(ctx: EvalContext, gen: dict[str, list], window: int, loop_min_len: int) -> dict[str, float]:
    """Repetition, distinctness, loop, compression and entropy-collapse measures of one generation."""
    toks = gen["tokens"]
    period, onset = detect_loop(toks, min_repeats=3, min_len=loop_min_len)
    first, last, ratio = entropy_collapse(gen["entropy"], window)
    return {"rep2": rep_n(toks, 2), "rep3": rep_n(toks, 3), "rep4": rep_n(toks, 4),
            "distinct1": distinct_n(toks, 1), "distinct2": distinct_n(toks, 2),
            "loop": float(period > 0), "loop_period": float(period), "loop_onset": float(onset),
            "compression": compression_ratio(_as_text(ctx, toks)),
            "entropy_first": first, "entropy_last": last, "entropy_ratio": ratio}


def _prompt_lengths(cfg: dict[str, Any], limit: int) -> list[int]:
    """Prompt lengths: the setting (capped at `limit`), else a quarter, half and all of `limit`."""
    if cfg.get("prompt_lens"):
        lens = sorted({min(int(x), limit) for x in cfg["prompt_lens"]})
    else:
        lens = sorted({max(8, limit // 4), max(8, limit // 2), limit})
    if not lens or min(lens) < 2:
        raise DataError(f"longctx: prompt lengths {lens} are too short (need >= 2 tokens)")
    return lens


def _corpus_prompts(ctx: EvalContext, length: int, count: int, cfg: dict[str, Any]) -> list[list[int]]:
    """`count` corpus windows of `length` tokens (BOS first), spread evenly over the corpus."""
    win = ctx.windows(length, None, None, cfg["max_tokens"], cfg["bos"])
    idx = np.linspace(0, win.n - 1, num=min(count, win.n)).round().astype(int)
    return [win.inputs[int(i)].tolist() for i in sorted(set(idx.tolist()))]


def run_degeneration(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Part (a) + (b): long greedy generations of both models, degeneration measures and first divergence."""
    limit = _max_context(ctx)
    new = min(cfg["new_tokens"], limit // 2)
    lens = _prompt_lengths(cfg, limit - new)
    prompts, plen = [], []
    for length in lens:
        for p in _corpus_prompts(ctx, length, cfg["prompts_per_len"], cfg):
            prompts.append(p)
            plen.append(length)
    key = ("longctx_gen", _digest(prompts), new)
    ref = ctx.reference_cached(key, lambda: _generate(ctx, ctx.reference, prompts, new))
    eng = _generate(ctx, ctx.engine, prompts, new)
    ctx.data_hashes[f"longctx:prompts|lens{lens}|n{len(prompts)}"] = key[1]

    per: dict[str, dict[str, list]] = {"eng": {}, "ref": {}}
    for side, gens in (("eng", eng), ("ref", ref)):
        for g in gens:
            for k, v in degeneration_stats(ctx, g, cfg["entropy_window"], cfg["loop_min_len"]).items():
                per[side].setdefault(k, []).append(v)
    metrics: dict[str, float] = {"new_tokens": float(new), "n_prompts": float(len(prompts))}
    for k in per["eng"]:
        metrics[f"{k}_eng"] = _mean(per["eng"][k])
        metrics[f"{k}_ref"] = _mean(per["ref"][k])
    samples: dict[str, list] = {"prompt_len": plen}
    for side in ("eng", "ref"):
        for k in ("rep4", "loop_period", "loop_onset", "compression", "entropy_ratio"):
            samples[f"{k}_{side}"] = per[side][k]

    # (b) first divergence and the reference's decision margin there.
    div_idx, ref_margin, eng_margin, kind = [], [], [], []
    for g_ref, g_eng in zip(ref, eng):
        i = first_divergence(g_ref["tokens"], g_eng["tokens"])
        if i is None:
            div_idx.append(len(g_ref["tokens"]))
            ref_margin.append(math.nan)
            eng_margin.append(math.nan)
            kind.append("none")
            continue
        div_idx.append(i)
        ref_margin.append(g_ref["margin"][i])
        eng_margin.append(g_eng["margin"][i])
        kind.append("near_tie" if g_ref["margin"][i] < cfg["tie_margin"] else "real_error")
    n = len(prompts)
    diverged = [k != "none" for k in kind]
    metrics.update({
        "div_frac": sum(diverged) / n,
        "div_index_mean": _mean(div_idx),
        "div_index_min": float(min(div_idx)),
        "div_agree_frac": _mean([i / new for i in div_idx]),
        "div_near_tie": float(kind.count("near_tie")),
        "div_real_error": float(kind.count("real_error")),
        "div_real_error_frac": kind.count("real_error") / n,
        "div_ref_margin_mean": _mean(ref_margin) if any(diverged) else 0.0,
    })
    samples.update({"div_index": div_idx, "div_ref_margin": [m if m == m else None for m in ref_margin],
                    "div_eng_margin": [m if m == m else None for m in eng_margin], "div_kind": kind})
    return metrics, samples


# --------------------------------------------------------------------------- passkey

def _passkey_text(n_fill: int, depth: float, key: str) -> str:
    """Intro, filler sentences with the needle after round(depth * n_fill) of them, then the question."""
    cut = int(round(depth * n_fill))
    parts = [PASSKEY_INTRO] + [PASSKEY_FILLER] * cut + [PASSKEY_NEEDLE.format(key=key)]
    parts += [PASSKEY_FILLER] * (n_fill - cut) + [PASSKEY_QUESTION]
    return " ".join(parts)


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str) -> list[int]:
    """The longest passkey prompt (whole filler sentences) of at most `length` tokens, BOS first."""
    def size(k: int) -> int:
        """Prompt length in tokens with k filler sentences."""
        return len(tokenizer.encode(_passkey_text(k, depth, key), bos=True))

    base = size(0)
    if base > length:
        raise DataError(f"longctx: passkey length {length} is shorter than the bare prompt ({base} tokens)")
    per = max(1, size(1) - base)
    k = max(0, (length - base) // per)
    while k > 0 and size(k) > length:
        k -= 1
    while size(k + 1) <= length:
        k += 1
    return tokenizer.encode(_passkey_text(k, depth, key), bos=True)


def _answer(tokenizer: Any, tokens: list[int]) -> str:
    """The first number in a decoded answer ('' when there is none)."""
    m = re.search(r"\d+", tokenizer.decode(tokens))
    return m.group(0) if m else ""


def run_passkey(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Part (c): passkey retrieval accuracy by (length, depth) for both models."""
    if ctx.tokenizer is None:
        return {"passkey_n": 0.0}, {}
    limit = _max_context(ctx) - PASSKEY_NEW_TOKENS
    if cfg.get("passkey_lens"):
        lens = sorted({min(int(x), limit) for x in cfg["passkey_lens"]})
    else:  # a quarter, half and all of the context, those that fit the bare prompt (small vocabularies need more)
        bare = len(ctx.tokenizer.encode(_passkey_text(0, 0.0, "00000"), bos=True))
        lens = sorted({x for x in (limit // 4, limit // 2, limit) if x >= bare})
        if not lens:
            raise DataError(f"longctx: the model's context ({limit + PASSKEY_NEW_TOKENS}) cannot hold the bare "
                            f"passkey prompt ({bare} tokens) plus the answer")
    depths = [float(d) for d in cfg["passkey_depths"]]
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise DataError(f"longctx: passkey_depths must lie in [0, 1], got {depths}")
    cells, prompts, keys = [], [], []
    for length in lens:
        for d in depths:
            for t in range(cfg["passkey_trials"]):
                key = str(random.Random(f"passkey-{ctx.seed}-{length}-{d}-{t}").randint(10000, 99999))
                prompts.append(passkey_prompt(ctx.tokenizer, length, d, key))
                keys.append(key)
                cells.append((length, d))
    digest = _digest(prompts)
    reqs = [GenerationRequest(tuple(p), PASSKEY_NEW_TOKENS) for p in prompts]
    ref_out = ctx.reference_cached(("longctx_passkey", digest), lambda: [
        g.tokens for g in _decode(ctx, ctx.reference, reqs, "passkeys")])
    eng_out = [g.tokens for g in _decode(ctx, ctx.engine, reqs, "passkeys")]
    ctx.data_hashes[f"longctx:passkey|lens{lens}|n{len(prompts)}"] = digest
    ans_ref = [_answer(ctx.tokenizer, o) for o in ref_out]
    ans_eng = [_answer(ctx.tokenizer, o) for o in eng_out]
    ok_ref = [int(a == k) for a, k in zip(ans_ref, keys)]
    ok_eng = [int(a == k) for a, k in zip(ans_eng, keys)]
    n = len(prompts)
    metrics: dict[str, float] = {"passkey_n": float(n),
                                 "passkey_agree": sum(a == b for a, b in zip(ans_ref, ans_eng)) / n,
                                 "passkey_mcnemar_p": stats.mcnemar_exact(ok_ref, ok_eng)["p_value"]}

    def put(prefix: str, idx: list[int]) -> None:
        """Accuracy of both models (Wilson interval) over the trials `idx`."""
        for side, ok in (("eng", ok_eng), ("ref", ok_ref)):
            ci = stats.binomial_ci(sum(ok[i] for i in idx), len(idx))
            metrics[f"{prefix}acc_{side}"] = ci["p"]
            metrics[f"{prefix}acc_{side}_lo"] = ci["lo"]
            metrics[f"{prefix}acc_{side}_hi"] = ci["hi"]

    put("passkey_", list(range(n)))
    for length in lens:
        put(f"passkey.L{length}.", [i for i, c in enumerate(cells) if c[0] == length])
        for d in depths:
            put(f"passkey.L{length}.d{int(round(d * 100))}.", [i for i, c in enumerate(cells) if c == (length, d)])
    samples = {"passkey_len": [c[0] for c in cells], "passkey_depth": [c[1] for c in cells],
               "passkey_prompt_tokens": [len(p) for p in prompts],
               "passkey_correct_eng": ok_eng, "passkey_correct_ref": ok_ref}
    return metrics, samples


# --------------------------------------------------------------------------- KLD by position

def run_kld_by_position(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Part (d): mean KL(reference || engine) per position bucket over full-context corpus windows (reduced on the
    engine's device, `evalharness.evals.tokenstats`; the reference's full logits or, for large vocabularies, its
    top-k records, once per model)."""
    seq = min(cfg.get("kld_seq_len") or _max_context(ctx), _max_context(ctx))
    win = ctx.windows(seq, None, cfg["kld_docs"], cfg["max_tokens"], cfg["bos"])
    topk = cfg.get("ref_topk")
    if topk is None and win.n * seq * ctx.vocab_size * 4 > _KLD_CACHE_LIMIT_BYTES:
        topk = DEFAULT_TOPK
    ref_all = reference_for(ctx, win, topk, "longctx_kld_ref")

    def row(logits: torch.Tensor, batch: tuple) -> torch.Tensor:
        """KL per position of one batch (batch, t), non-finite as +inf."""
        start, inputs, targets = batch
        kl = compare(select(ref_all, start, inputs.shape[0]), logits, targets)["kld"].clamp_min(0.0)  # (batch, t)
        return torch.where(torch.isfinite(kl), kl, torch.full_like(kl, float("inf")))

    # batch by batch on a resident engine, layer-major passes on a streamed one (evalharness.streamed)
    kld = torch.cat(map_logits(ctx.engine, ctx.batches(win, "longctx kld engine"), row, ctx.counters)).cpu()
    # kld: (docs, seq)
    nb = min(cfg["kld_buckets"], seq)
    edges = np.linspace(0, seq, nb + 1).round().astype(int).tolist()
    per_doc = torch.stack([kld[:, a:b].mean(-1) for a, b in zip(edges[:-1], edges[1:])], dim=1)  # (docs, buckets)
    bucket = per_doc.mean(0)
    pos_mean = kld.mean(0)  # (seq,)
    x = torch.arange(seq, dtype=torch.float64)
    xc = x - x.mean()
    slope = float((xc * (pos_mean - pos_mean.mean())).sum() / (xc * xc).sum()) * 1000.0 if seq > 1 else 0.0
    metrics = {"kld_seq_len": float(seq), "kld_docs": float(win.n), "kld_mean": float(kld.mean()),
               "kld_first": float(bucket[0]), "kld_last": float(bucket[-1]),
               "kld_growth": float(bucket[-1] / bucket[0]) if float(bucket[0]) > 0 else (
                   1.0 if float(bucket[-1]) == 0 else math.inf),
               "kld_slope_per_1k": slope}
    for i, v in enumerate(bucket.tolist()):
        metrics[f"kld_bucket{i}"] = v
    samples = {"kld_bucket_edges": edges, "kld_by_bucket": bucket.tolist(), "kld_by_position": pos_mean.tolist(),
               "kld_last_bucket_docs": per_doc[:, -1].tolist()}
    return metrics, samples


def run_longctx(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """The `longctx` eval: the selected parts, merged into one metrics / samples pair."""
    parts = list(cfg.get("parts") or PARTS)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise DataError(f"longctx: unknown part(s) {bad}; available: {list(PARTS)}")
    metrics: dict[str, float] = {}
    samples: dict[str, list] = {}
    runners = {"degeneration": run_degeneration, "passkey": run_passkey, "kld": run_kld_by_position}
    streamed = next((m for m in (ctx.engine, ctx.reference) if is_streamed(m)), None)
    not_run = [p for p in GENERATING_PARTS if p in parts] if streamed is not None else []
    for part in PARTS:
        if part in parts and part not in not_run:
            t0, ref0 = time.perf_counter(), ctx.timing.get("reference_s", 0.0)
            m, s = runners[part](ctx, cfg)
            ctx.timing[f"longctx.{part}_s"] = time.perf_counter() - t0  # engine and (uncached) reference
            ctx.timing[f"longctx.{part}.reference_s"] = ctx.timing.get("reference_s", 0.0) - ref0
            metrics.update(m)
            samples.update(s)
    if not_run:  # the parts that ran are kept; the run is an error naming the parts that did not
        raise PartlyRunError(str(streamed.generation_error(f"longctx: part(s) {not_run} were not run (they generate)")),
                             metrics, samples)
    return metrics, samples
