"""Evaluations: each takes an `EvalContext` and returns (metrics, samples).

* ``layer_error``: per-tap error statistics, engine vs reference (streaming).
* ``ppl_kld``: perplexity of both models with intervals, PPL ratio, token KLD, top-1 agreement.
* ``invariance``: the same requests under other serving configs (batch size, chunked prefill), determinism.
* ``tasks``: lm-eval's own tasks and groups (data from the data dir: ``evalharness.taskdata``), paired statistics.
* ``longctx``: long greedy generations (degeneration, first divergence), passkey retrieval, KLD by position.
* ``switching``: per-request high-precision path for sensitive modules: quality recovered, latency, memory.
* ``threeway``: FP32 vs bit-exact emulation vs native kernels: error attributed to the format or the kernel.

Metric names are ``<eval>.<metric>`` or ``<eval>.<tap>.<stat>``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from pydantic import ValidationError

from evalharness.data import Windows, load_corpus_tokens, make_windows, tokens_needed
from evalharness.evals.settings import EVAL_SETTINGS, NEEDS
from evalharness.progress import Progress, no_bars
from evalharness.schema import messages


def validate_eval_config(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Check an eval's settings against its schema (`evalharness.evals.settings`); return them with the defaults
    filled in. A ValueError lists every refused setting as `evals.<name>.<key> must be ..., got ...`."""
    schema = EVAL_SETTINGS[name]
    try:
        return schema.model_validate(cfg).model_dump()
    except ValidationError as exc:
        raise ValueError("; ".join(messages(exc, cfg, schema, f"evals.{name}", NEEDS))) from None


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
    data_dir: str | None = None  # the suite's data dir (--data-dir), for evals that read task files
    ref_cache_dir: str | None = None  # on-disk reference cache (top-k log-probs), shared across invocations
    model_sha: str | None = None  # checkpoint hash: part of every reference-cache key
    # engine_for(tp, ep): this run's engine at another parallel degree (invariance variants); None = only `engine`
    engine_for: Callable[[int, int], Any] | None = None
    parallel: tuple[int, int] = (1, 1)  # (tp, ep) of `engine`
    # Wall seconds of an eval's parts, '<eval>.<part>_s' (e.g. 'tasks.hellaswag.eng_s'): the runner adds them to
    # the result's `timing` next to the whole eval's '<eval>_s'.
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    # Bars inside an eval (windows, requests), on a terminal only: `progress.bar(iterable, total, desc, unit)`
    progress: Progress = dataclasses.field(default_factory=no_bars)

    def windows(self, seq_len: int, stride: int | None, max_windows: int | None, max_tokens: int,
                bos: bool) -> Windows:
        """Token windows of the corpus. The corpus is tokenized only as far as these windows need
        (`tokens_needed`), once per model: a later call that needs more reads further."""
        need = tokens_needed(seq_len, stride, max_windows, max_tokens, bos and self.bos_id is not None)
        key = ("tokens", self.corpus)
        have = self.cache.get(key)  # (tokens, how many were asked for)
        if have is None or (have[1] < need and len(have[0]) >= have[1]):  # more exist than were read
            have = self.cache[key] = (load_corpus_tokens(self.corpus, self.tokenizer, self.vocab_size, need), need)
        bos_id = self.bos_id if bos else None
        win = make_windows(have[0][:need], seq_len, stride, max_windows, bos_id)
        self.data_hashes[f"{self.corpus}|seq{seq_len}|stride{stride}|n{win.n}|bos{bos_id}"] = win.sha256
        return win

    def batches(self, win: Windows, desc: str):
        """`win.batches(self.batch_size)` under a bar counting windows (`desc`: the eval and the side)."""
        bar = self.progress.bar(total=win.n, desc=desc, unit="window")
        with bar:
            for start, inputs, targets in win.batches(self.batch_size):
                yield start, inputs, targets
                bar.update(inputs.shape[0])

    def reference_cached(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """Reference outputs cached across the recipes of one model; counts actual reference passes and adds
        their wall seconds to `timing['reference_s']` (so a run's reference and engine time can be told apart)."""
        if key not in self.cache:
            self.counters["reference_passes"] = self.counters.get("reference_passes", 0) + 1
            _sync()
            t0 = time.perf_counter()
            self.cache[key] = compute()
            _sync()
            self.timing["reference_s"] = self.timing.get("reference_s", 0.0) + time.perf_counter() - t0
        else:
            self.counters["reference_cache_hits"] = self.counters.get("reference_cache_hits", 0) + 1
        return self.cache[key]


def _sync() -> None:
    """Wait for the GPU (when there is one), so that wall time covers the work launched."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_eval(name: str, ctx: EvalContext, cfg: dict[str, Any]) -> tuple[dict[str, float], dict[str, list]]:
    """Run one eval by name; returns (metrics without the eval prefix, per-sample arrays).

    Each eval lives in `evalharness.evals.<name>` as `run_<name>(ctx, settings)`, imported on first
    use (the tasks eval pulls in lm-eval, which CPU-only or GPU boxes may lack).
    """
    if name not in EVAL_SETTINGS:
        raise ValueError(f"unknown eval '{name}'; available: {sorted(EVAL_SETTINGS)}")
    settings = validate_eval_config(name, cfg)
    import importlib

    module = importlib.import_module(f"evalharness.evals.{name}")
    return getattr(module, f"run_{name}")(ctx, settings)


def finite_or_nan(x: torch.Tensor) -> float:
    """A Python float; NaN when not finite."""
    v = float(x)
    return v if v == v and abs(v) != float("inf") else float("nan")
