"""Serving-configuration invariance: the same requests under different serving configs.

The run's own serving config (batch size from the suite's `serving`, no
chunking) is config A; each entry of `variants` is a config B
(`{name, batch_size, prefill_chunk}`). For each B, on the same windows:

* `bitwise_equal_frac`: fraction of token positions whose logits row is
  bit-identical between A and B;
* `kld_mean` / `kld_max`: KL(A || B) per token, `top1_agree` between A and B,
  and `top1_vs_ref` of B against the FP32 reference;
* `greedy_equal_frac`: fraction of prompts whose greedy continuation
  (`greedy_tokens` long) under B's batch composition equals A's.

`determinism_distinct` counts distinct logits results over `reruns` identical
reruns of A (1 = deterministic), as serving engines' batch-invariance tests
count distinct outputs. Per-tensor dynamic scales (`fp8-tensor`) and per-head
KV scales computed over a chunk (`fp8-kv`) make results depend on batch
composition and chunking; per-token 1x128 groups (`fp8-block`) do not.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from evalharness.evals import EvalContext

VARIANT_KEYS = ("name", "batch_size", "prefill_chunk")


def _logits(ctx: EvalContext, inputs: torch.Tensor, batch_size: int, chunk: int | None) -> torch.Tensor:
    """Engine logits for all windows, batched `batch_size` at a time, optionally chunk-prefilled."""
    parts = []
    for s in range(0, inputs.shape[0], batch_size):
        x = inputs[s:s + batch_size]
        parts.append(ctx.engine.logits(x, prefill_chunk=chunk).float().cpu() if chunk
                     else ctx.engine.logits(x).float().cpu())
    return torch.cat(parts)  # (windows, t, vocab)


def _greedy_batch(ctx: EvalContext, prompts: torch.Tensor, n_new: int, batch_size: int) -> list[list[int]]:
    """Greedy continuations computed in lockstep batches (full recompute per step: batch composition matters)."""
    outs: list[list[int]] = []
    for s in range(0, prompts.shape[0], batch_size):
        seq = prompts[s:s + batch_size]
        for _ in range(n_new):
            nxt = ctx.engine.logits(seq)[:, -1].argmax(-1).cpu()  # (batch,)
            seq = torch.cat([seq, nxt[:, None].to(seq.device)], dim=1)
        outs.extend(seq[:, prompts.shape[1]:].tolist())
    return outs


def validate_variants(variants: Any) -> list[dict[str, Any]]:
    """Check the `variants` setting; returns normalized dicts."""
    if not isinstance(variants, list) or not variants:
        raise ValueError("'variants' must be a non-empty list of {name, batch_size, prefill_chunk}")
    out = []
    for i, v in enumerate(variants):
        if not isinstance(v, dict) or [k for k in v if k not in VARIANT_KEYS]:
            raise ValueError(f"variants[{i}] must be a mapping with keys {VARIANT_KEYS}, got {v!r}")
        bs, ch = v.get("batch_size", 1), v.get("prefill_chunk")
        if not isinstance(bs, int) or bs < 1 or ch is not None and (not isinstance(ch, int) or ch < 1):
            raise ValueError(f"variants[{i}]: batch_size must be >= 1 and prefill_chunk null or >= 1")
        out.append({"name": str(v.get("name", f"b{bs}" + (f"-c{ch}" if ch else ""))), "batch_size": bs,
                    "prefill_chunk": ch})
    return out


def run_invariance(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Invariance metrics of the engine between the run's serving config and each variant."""
    variants = validate_variants(cfg["variants"])
    win = ctx.windows(cfg["seq_len"], None, cfg["windows"], max(cfg["windows"] * cfg["seq_len"] * 2, 4096), True)
    a = _logits(ctx, win.inputs, ctx.batch_size, None)
    ref = ctx.reference_cached(("invariance_ref", win.sha256),
                               lambda: torch.cat([ctx.reference.logits(x).float().cpu()
                                                  for _, x, _ in win.batches(ctx.batch_size)]))
    metrics: dict[str, float] = {"top1_vs_ref": float((a.argmax(-1) == ref.argmax(-1)).double().mean())}
    digests = {hashlib.sha256(a.numpy().tobytes()).hexdigest()}
    for _ in range(cfg["reruns"] - 1):
        digests.add(hashlib.sha256(_logits(ctx, win.inputs, ctx.batch_size, None).numpy().tobytes()).hexdigest())
    metrics["determinism_distinct"] = float(len(digests))
    prompts = win.inputs[:, : cfg["prompt_len"]]
    greedy_a = _greedy_batch(ctx, prompts, cfg["greedy_tokens"], ctx.batch_size)
    la = torch.log_softmax(a.double(), -1)
    samples: dict[str, list] = {}
    for v in variants:
        b = _logits(ctx, win.inputs, v["batch_size"], v["prefill_chunk"])
        lb = torch.log_softmax(b.double(), -1)
        kld = (la.exp() * (la - lb)).sum(-1)  # (windows, t)
        p = v["name"]
        metrics[f"{p}.bitwise_equal_frac"] = float((a == b).all(-1).double().mean())
        metrics[f"{p}.kld_mean"] = float(kld.mean())
        metrics[f"{p}.kld_max"] = float(kld.max())
        metrics[f"{p}.top1_agree"] = float((a.argmax(-1) == b.argmax(-1)).double().mean())
        metrics[f"{p}.top1_vs_ref"] = float((b.argmax(-1) == ref.argmax(-1)).double().mean())
        if v["prefill_chunk"] is None:
            greedy_b = _greedy_batch(ctx, prompts, cfg["greedy_tokens"], v["batch_size"])
            metrics[f"{p}.greedy_equal_frac"] = sum(x == y for x, y in zip(greedy_a, greedy_b)) / len(greedy_a)
        samples[f"{p}.window_kld"] = kld.mean(-1).tolist()
    return metrics, samples
