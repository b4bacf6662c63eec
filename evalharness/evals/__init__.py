"""Evaluations: each takes an `EvalContext` and returns (metrics, samples).

* ``layer_error``: per-tap error statistics, engine vs reference (streaming).
* ``ppl_kld``: perplexity of both models with intervals, PPL ratio, token KLD, top-1 agreement.

Metric names are ``<eval>.<metric>`` or ``<eval>.<tap>.<stat>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from evalharness.data import Windows, load_corpus_tokens, make_windows

# name -> {setting: (type, default)}; the suite validator uses this table.
EVAL_SETTINGS: dict[str, dict[str, tuple[type | tuple[type, ...], Any]]] = {
    "layer_error": {"windows": (int, 2), "seq_len": (int, 128), "bos": (bool, True), "taps": (list, None)},
    "ppl_kld": {"seq_len": (int, 128), "stride": (int, None), "max_windows": (int, 16), "max_tokens": (int, 200_000),
                "bos": (bool, True)},
}


def validate_eval_config(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Check an eval's settings (unknown keys, types, ranges); return them with defaults filled in."""
    table = EVAL_SETTINGS[name]
    unknown = [k for k in cfg if k not in table]
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; allowed: {sorted(table)}")
    out = {}
    for key, (typ, default) in table.items():
        value = cfg.get(key, default)
        if value is not None and not isinstance(value, typ) or isinstance(value, bool) and typ is int:
            raise ValueError(f"'{key}' must be {typ.__name__ if isinstance(typ, type) else typ}, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"'{key}' must be positive, got {value}")
        out[key] = value
    return out


@dataclasses.dataclass
class EvalContext:
    """What an eval gets: the two models, the data, the serving config and a cache shared across recipes."""

    engine: Any  # engine.api.Engine (or any object with the same interface)
    reference: Any  # evalharness.reference.ReferenceLM
    tokenizer: Any
    corpus: str
    vocab_size: int
    batch_size: int
    seed: int
    cache: dict[str, Any]  # shared by all runs of one model in this invocation (reference outputs)
    bos_id: int | None = None  # BOS inserted at the start of every window (tokenizer's, else the config's)
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    data_hashes: dict[str, str] = dataclasses.field(default_factory=dict)

    def windows(self, seq_len: int, stride: int | None, max_windows: int | None, max_tokens: int,
                bos: bool) -> Windows:
        """Token windows of the corpus (tokenized once per model, cached)."""
        key = ("tokens", self.corpus, max_tokens)
        if key not in self.cache:
            self.cache[key] = load_corpus_tokens(self.corpus, self.tokenizer, self.vocab_size, max_tokens)
        bos_id = self.bos_id if bos else None
        win = make_windows(self.cache[key], seq_len, stride, max_windows, bos_id)
        self.data_hashes[f"{self.corpus}|seq{seq_len}|stride{stride}|n{win.n}|bos{bos_id}"] = win.sha256
        return win

    def reference_cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """Reference outputs cached across the recipes of one model; counts actual reference passes."""
        if key not in self.cache:
            self.counters["reference_passes"] = self.counters.get("reference_passes", 0) + 1
            self.cache[key] = compute()
        else:
            self.counters["reference_cache_hits"] = self.counters.get("reference_cache_hits", 0) + 1
        return self.cache[key]


def run_eval(name: str, ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Run one eval by name; returns (metrics without the eval prefix, per-sample arrays)."""
    settings = validate_eval_config(name, cfg)
    if name == "layer_error":
        from evalharness.evals.layer_error import run_layer_error

        return run_layer_error(ctx, settings)
    if name == "ppl_kld":
        from evalharness.evals.ppl_kld import run_ppl_kld

        return run_ppl_kld(ctx, settings)
    raise ValueError(f"unknown eval '{name}'")


def finite_or_nan(x: torch.Tensor) -> float:
    """A Python float; NaN when not finite."""
    v = float(x)
    return v if v == v and abs(v) != float("inf") else float("nan")
