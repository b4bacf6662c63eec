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

from evalharness.data import Windows, load_corpus_tokens, make_windows, tokens_needed
from evalharness.progress import Progress, no_bars

# name -> {setting: (type, default)}; the suite validator uses this table.
EVAL_SETTINGS: dict[str, dict[str, tuple[type | tuple[type, ...], Any]]] = {
    "layer_error": {"windows": (int, 2), "seq_len": (int, 128), "bos": (bool, True), "taps": (list, None),
                    "local": (bool, True), "layer_local": (bool, False)},
    "ppl_kld": {"seq_len": (int, 128), "stride": (int, None), "max_windows": (int, 16), "max_tokens": (int, 200_000),
                "bos": (bool, True), "ref_topk": (int, None)},
    "invariance": {"variants": (list, None), "windows": (int, 4), "seq_len": (int, 64), "reruns": (int, 2),
                   "prompt_len": (int, 16), "greedy_tokens": (int, 8)},
    # --- tasks / longctx (evalharness/evals/tasks.py, longctx.py) ---
    "tasks": {"tasks": (list, None), "limit": ((int, dict), None), "num_fewshot": ((int, dict), None),
              "batch_size": (int, None), "include_paths": (list, None), "max_gen_toks": (int, None),
              "data_dir": (str, None)},
    "longctx": {"parts": (list, None), "new_tokens": (int, 1024), "prompt_lens": (list, None),
                "prompts_per_len": (int, 2), "entropy_window": (int, 64), "loop_min_len": (int, 16),
                "tie_margin": ((int, float), 0.5), "passkey_lens": (list, None),
                "passkey_depths": (list, [0.0, 0.25, 0.5, 0.75, 1.0]), "passkey_trials": (int, 4),
                "kld_docs": (int, 4), "kld_seq_len": (int, None), "kld_buckets": (int, 8), "ref_topk": (int, None),
                "max_tokens": (int, 200_000), "bos": (bool, True)},
    "threeway": {"windows": (int, 4), "seq_len": (int, 128), "emulated": (str, "cuda-emulated"),
                 "native": (str, "cuda-native"), "kernel_factor": ((int, float), 2.0),
                 "kernel_floor": ((int, float), 1.0e-3),
                 "native_options": (dict, None)},
    "switching": {"modules": (list, None), "high": (str, "bf16"), "windows": (int, 4), "seq_len": (int, 128),
                  "reps": (int, 3)},
}
# Integer settings for which 0 is meaningful (all other integer settings must be positive).
ZERO_ALLOWED = frozenset({"num_fewshot"})


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
        zero_ok = value == 0 and key in ZERO_ALLOWED
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0 and not zero_ok:
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
