"""Serving-configuration invariance: the same requests under different serving configs.

The run's own serving config (batch size from the suite's `serving`, no
chunking, its tp / ep) is config A; each entry of `variants` is a config B
(`{name, batch_size, prefill_chunk, tp, ep, attn_block, small_m,
kv_block_size, cuda_graphs}`; tp / ep default to A's, and a variant with
other degrees runs on the run's model-parallel group: launch with
`torchrun`, see `evalharness.distributed`. `attn_block` / `small_m` are
cuda-native kernel tilings -- attention tile, and the token count up to
which GEMMs take the small-M decode kernel -- and give the variant its own
engine; `kv_block_size` / `cuda_graphs` / `prefix_cache` serve the variant through
`engine.runtime.PagedRuntime`: logits by paged prefill, greedy by batched
KV-cached decode in pages of that size, replayed as CUDA graphs on the
GPU; with `prefix_cache` each window's first half (whole pages) is written
by an earlier request and reused: a prefix-cache hit vs A's miss). For each B, on the same windows:

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
from evalharness.evals.tokenstats import kl_from_logprobs

VARIANT_KEYS = ("name", "batch_size", "prefill_chunk", "tp", "ep", "attn_block", "small_m", "kv_block_size",
                "cuda_graphs", "prefix_cache")
KERNEL_KEYS = ("attn_block", "small_m")  # native kernel tilings: the variant gets its own engine
RUNTIME_KEYS = ("kv_block_size", "cuda_graphs", "prefix_cache")  # served by engine.runtime.PagedRuntime


class _Served:
    """A variant served by the paged runtime: `logits` = paged prefill per row, greedy = batched KV decode."""

    def __init__(self, engine: Any, v: dict[str, Any], max_tokens: int):
        from engine.runtime import PagedRuntime
        from engine.serving import ServingConfig

        self.prefix = bool(v.get("prefix_cache"))
        self.rt = PagedRuntime(engine, ServingConfig(kv_block_size=v.get("kv_block_size") or 16,
                                                     max_batch=max(v["batch_size"], 2 if self.prefix else 1),
                                                     max_tokens=max_tokens, prefill_chunk=v["prefill_chunk"],
                                                     cuda_graphs=bool(v.get("cuda_graphs")),
                                                     prefix_cache=self.prefix))

    def logits(self, x: torch.Tensor, prefill_chunk: int | None = None) -> torch.Tensor:
        if not self.prefix:
            return self.rt.score(x)
        # prefix-cache hit: an earlier request (slot 1) wrote the first half of each row (whole pages);
        # the row then reuses those pages and prefills the rest. Positions of the reused half carry the
        # earlier request's logits, the rest the hit's.
        bs, out = self.rt.config.kv_block_size, []
        for row in x.tolist():
            half = len(row) // 2 // bs * bs
            donor = self.rt.prefill(1, row[:half]) if half else None
            rest = self.rt.prefill(0, row)
            if self.rt.last_prefix_hit != half:
                raise RuntimeError(f"prefix cache: expected a {half}-token hit, got {self.rt.last_prefix_hit}")
            out.append(rest if donor is None else torch.cat([donor, rest]))
        return torch.stack(out)

    def greedy(self, prompts: torch.Tensor, n_new: int) -> list[list[int]]:
        return self.rt.generate(prompts.tolist(), n_new)


def _logits(engine: Any, inputs: torch.Tensor, batch_size: int, chunk: int | None) -> torch.Tensor:
    """Engine logits for all windows, batched `batch_size` at a time, optionally chunk-prefilled."""
    parts = []
    for s in range(0, inputs.shape[0], batch_size):
        x = inputs[s:s + batch_size]
        parts.append(engine.logits(x, prefill_chunk=chunk).float().cpu() if chunk
                     else engine.logits(x).float().cpu())
    return torch.cat(parts)  # (windows, t, vocab)


def _greedy_batch(engine: Any, prompts: torch.Tensor, n_new: int, batch_size: int) -> list[list[int]]:
    """Greedy continuations computed in lockstep batches (full recompute per step: batch composition matters)."""
    outs: list[list[int]] = []
    for s in range(0, prompts.shape[0], batch_size):
        seq = prompts[s:s + batch_size]
        for _ in range(n_new):
            nxt = engine.logits(seq)[:, -1].argmax(-1).cpu()  # (batch,)
            seq = torch.cat([seq, nxt[:, None].to(seq.device)], dim=1)
        outs.extend(seq[:, prompts.shape[1]:].tolist())
    return outs


def validate_variants(variants: Any) -> list[dict[str, Any]]:
    """Check the `variants` setting; returns normalized dicts."""
    if not isinstance(variants, list) or not variants:
        raise ValueError(f"'variants' must be a non-empty list of mappings with keys {VARIANT_KEYS}")
    out = []
    for i, v in enumerate(variants):
        if not isinstance(v, dict) or [k for k in v if k not in VARIANT_KEYS]:
            raise ValueError(f"variants[{i}] must be a mapping with keys {VARIANT_KEYS}, got {v!r}")
        bs, ch = v.get("batch_size", 1), v.get("prefill_chunk")
        if not isinstance(bs, int) or bs < 1 or ch is not None and (not isinstance(ch, int) or ch < 1):
            raise ValueError(f"variants[{i}]: batch_size must be >= 1 and prefill_chunk null or >= 1")
        tp, ep = v.get("tp"), v.get("ep")
        for key, deg in (("tp", tp), ("ep", ep)):
            if deg is not None and (not isinstance(deg, int) or isinstance(deg, bool) or deg < 1):
                raise ValueError(f"variants[{i}]: {key} must be a positive integer (the parallel degree), got {deg!r}")
        if v.get("attn_block") not in (None, 64, 128, 256):
            raise ValueError(f"variants[{i}]: attn_block must be 64, 128 or 256, got {v['attn_block']!r}")
        if v.get("small_m") is not None and (not isinstance(v["small_m"], int) or v["small_m"] < 0):
            raise ValueError(f"variants[{i}]: small_m must be a non-negative integer, got {v['small_m']!r}")
        if v.get("kv_block_size") not in (None, 16, 32, 64, 128, 256):
            raise ValueError(f"variants[{i}]: kv_block_size must be 16, 32, 64, 128 or 256, got {v['kv_block_size']!r}")
        for flag in ("cuda_graphs", "prefix_cache"):
            if v.get(flag) not in (None, True, False):
                raise ValueError(f"variants[{i}]: {flag} must be true or false, got {v[flag]!r}")
        default = f"b{bs}" + (f"-c{ch}" if ch else "") + (f"-tp{tp}" if tp else "") + (f"-ep{ep}" if ep else "")
        out.append({"name": str(v.get("name", default)), "batch_size": bs, "prefill_chunk": ch, "tp": tp, "ep": ep,
                    **{k: v.get(k) for k in KERNEL_KEYS + RUNTIME_KEYS}})
    return out


def _variant_engine(ctx: EvalContext, v: dict[str, Any]) -> Any:
    """The engine of variant `v`: the run's own, the same recipe at the variant's tp / ep, or with the
    variant's native kernel tilings (`attn_block`, `small_m`)."""
    tp = v["tp"] if v["tp"] is not None else ctx.parallel[0]
    ep = v["ep"] if v["ep"] is not None else ctx.parallel[1]
    opts = {k: v[k] for k in KERNEL_KEYS if v.get(k) is not None}
    if opts:
        if (tp, ep) != (1, 1):
            raise ValueError(f"variant '{v['name']}': kernel tilings are for single-process cuda-native runs")
        from engine.api import Engine

        base = dict(getattr(ctx.engine, "kernel_options", {}))
        base.update(opts)
        return Engine(ctx.engine.model, ctx.engine.recipe, backend=ctx.engine.backend, **base)
    if (tp, ep) == tuple(ctx.parallel):
        return ctx.engine
    if ctx.engine_for is None:
        raise ValueError(f"variant '{v['name']}' asks tp={tp}, ep={ep} but this context has no engine factory "
                         "(run it through `evalharness run`, under torchrun)")
    return ctx.engine_for(tp, ep)


def run_invariance(ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Invariance metrics of the engine between the run's serving config and each variant."""
    variants = validate_variants(cfg["variants"])
    win = ctx.windows(cfg["seq_len"], None, cfg["windows"], max(cfg["windows"] * cfg["seq_len"] * 2, 4096), True)
    a = _logits(ctx.engine, win.inputs, ctx.batch_size, None)
    ref = ctx.reference_cached(("invariance_ref", win.sha256),
                               lambda: torch.cat([ctx.reference.logits(x).float().cpu()
                                                  for _, x, _ in ctx.batches(win, "invariance reference")]))
    metrics: dict[str, float] = {"top1_vs_ref": float((a.argmax(-1) == ref.argmax(-1)).double().mean())}
    digests = {hashlib.sha256(a.numpy().tobytes()).hexdigest()}
    for _ in range(cfg["reruns"] - 1):
        digests.add(hashlib.sha256(_logits(ctx.engine, win.inputs, ctx.batch_size, None).numpy().tobytes()).hexdigest())
    metrics["determinism_distinct"] = float(len(digests))
    prompts = win.inputs[:, : cfg["prompt_len"]]
    greedy_a = _greedy_batch(ctx.engine, prompts, cfg["greedy_tokens"], ctx.batch_size)
    la = torch.log_softmax(a.double(), -1)
    samples: dict[str, list] = {}
    for v in variants:
        engine = _variant_engine(ctx, v)
        served = None
        if any(v.get(k) is not None for k in RUNTIME_KEYS):
            served = _Served(engine, v, max(cfg["seq_len"], cfg["prompt_len"] + cfg["greedy_tokens"]))
            engine = served
        b = _logits(engine, win.inputs, v["batch_size"], v["prefill_chunk"])
        lb = torch.log_softmax(b.double(), -1)
        kld = kl_from_logprobs(la, lb)  # (windows, t)
        p = v["name"]
        metrics[f"{p}.bitwise_equal_frac"] = float((a == b).all(-1).double().mean())
        metrics[f"{p}.kld_mean"] = float(kld.mean())
        metrics[f"{p}.kld_max"] = float(kld.max())
        metrics[f"{p}.top1_agree"] = float((a.argmax(-1) == b.argmax(-1)).double().mean())
        metrics[f"{p}.top1_vs_ref"] = float((b.argmax(-1) == ref.argmax(-1)).double().mean())
        if served is not None:  # KV-cached batched decode through the pages (vs A's full recompute)
            greedy_b = served.greedy(prompts, cfg["greedy_tokens"])
            metrics[f"{p}.greedy_equal_frac"] = sum(x == y for x, y in zip(greedy_a, greedy_b)) / len(greedy_a)
        elif v["prefill_chunk"] is None:
            greedy_b = _greedy_batch(engine, prompts, cfg["greedy_tokens"], v["batch_size"])
            metrics[f"{p}.greedy_equal_frac"] = sum(x == y for x, y in zip(greedy_a, greedy_b)) / len(greedy_a)
        samples[f"{p}.window_kld"] = kld.mean(-1).tolist()
    return metrics, samples
