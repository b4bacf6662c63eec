"""The engine's narrow interface to the harness: score tokens, generate, expose taps.

A third-party engine plugs into `evalharness` by offering the same three
methods (`logits`, `generate`, and the `tap` argument).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Sequence

import torch

from engine.generation import Generation, GenerationRequest, cap_requests
from engine.model import KVCache, Transformer
from engine.numerics import LocalProbe, Numerics, QuantObserver
from engine.parallel import ParallelConfig, ParallelError  # noqa: F401 (ParallelError: re-exported for the harness)
from engine.recipe import Recipe, load_recipe, storage_bits
from engine.serving import ServingConfig

BACKENDS = ("cpu-emulated", "cuda-emulated", "cuda-native")
KERNEL_OPTIONS = ("small_m", "attn_block", "decode_policy", "options")


def make_numerics(recipe: Recipe, backend: str, **kernel_options) -> Numerics:
    """The dispatch object of a backend: the emulation, or `NativeNumerics` for `cuda-native`.

    Kernel options (`small_m`, `attn_block`, `decode_policy`, `options`: an `engine.kernels.options.KernelOptions`)
    only mean something to native kernels; the emulation computes the same math whatever the tiling, so it
    ignores them.
    """
    unknown = set(kernel_options) - set(KERNEL_OPTIONS)
    if unknown:
        raise ValueError(f"unknown kernel options {sorted(unknown)}; known: {', '.join(KERNEL_OPTIONS)}")
    if backend == "cuda-native":
        from engine.backends.native import NativeNumerics

        return NativeNumerics(recipe, **kernel_options)
    return Numerics(recipe)


class Engine:
    """A `Transformer` paired with a recipe: weights prepared once, then served.

    `backend`: `cpu-emulated` / `cuda-emulated` (the same bit-exact
    emulation on either device) or `cuda-native` (real FP8 kernels,
    `engine.backends.native`); the model is moved to the backend's device.
    `kernel_options` go to the native backend (`small_m`, `attn_block`, `decode_policy`, `options`); what they
    chose is `kernel_settings()`.
    `parallel` (tp / ep > 1) shards the model over the process group `group`
    (default: the whole world), see `engine.parallel`; `cfg` stays the whole
    model's config.
    """

    def __init__(self, model: Transformer, recipe: Recipe | str, backend: str = "cpu-emulated",
                 parallel: ParallelConfig | None = None, group=None, **kernel_options):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend '{backend}'; available: {BACKENDS}")
        if backend.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"backend '{backend}' needs a CUDA GPU; none is visible (use cpu-emulated)")
        self.backend = backend
        self.device = torch.device("cuda" if backend.startswith("cuda") else "cpu")
        self.model = model if model.device == self.device else model.to(self.device)
        self.recipe = load_recipe(recipe)
        self.nx = make_numerics(self.recipe, backend, **kernel_options)
        self.default_prefill_chunk: int | None = None  # serving config: chunked prefill for every `logits` call
        self.serving = ServingConfig()  # how `generate_batch` serves (max_tokens is sized per call)
        # work done, for throughput floors: tokens through `logits`, prompt tokens prefilled for generation,
        # decode steps and the rows they carried (summed over steps)
        self.work: collections.Counter = collections.Counter()
        self._runtime = None  # the paged runtime `generate_batch` last used (engine.runtime.PagedRuntime)
        self.kernel_options = dict(kernel_options)
        self.hp_recipe: Recipe | None = None  # precision switching (enable_precision_switch)
        self.hp_nx: Numerics | None = None
        self.hp_weights: dict | None = None
        self.parallel = parallel or ParallelConfig()
        if self.parallel.size > 1:  # this rank's shard of the model (engine.parallel; cuda-native: its kernels on
            from engine.parallel import ParallelContext  # the shards, engine.backends.native_parallel)

            ctx = ParallelContext(self.parallel, self.model.cfg, group, self.device)
            self.nx.parallel = ctx
            self.model = ctx.local_model(self.model)
        self.weights = self.model.prepare(self.nx)
        self.cfg = model.cfg

    def kernel_settings(self) -> dict:
        """What chose this engine's kernels, JSON-ready, for a result's provenance: the backend and, on
        `cuda-native`, its kernel variants (`KernelOptions`), the decode policy's summary, `small_m` and
        `attn_block`. The emulated backends run no kernel: the backend alone."""
        out = {"backend": self.backend}
        settings = getattr(self.nx, "kernel_settings", None)
        if settings is not None:
            out.update(settings())
        return out

    # ------------------------------------------------------- precision switching
    def enable_precision_switch(self, modules: Sequence[str], high: str = "bf16") -> dict[str, float]:
        """Precompile a high-precision variant of the sensitive `modules` (globs over module paths).

        The seed article's runtime switch (§4.4): the matched modules get a
        second, high-precision copy of their weights (every storage site of
        those modules -- GEMM weights and inputs, KV cache, attention output --
        in `high`, where the base recipe is lower); everything else is shared.
        Afterwards `logits(..., high_precision=...)` picks the path per request.
        Returns what the variant costs: extra weight bytes (as stored by the
        recipe's formats) and how many tensors were duplicated.
        """
        from engine.weights import module_path, weight_site

        if self.parallel.size > 1:
            raise ParallelError("precision switching is single-process for now: the high-precision variant is "
                                "not sharded (tp=ep=1)")
        storage = ("linear.weight", "linear.input", "linear.output", "moe.weight", "moe.input",
                   "attn.q", "kv.k", "kv.v", "attn.out")
        sites = {s: high for s in storage if storage_bits(self.recipe.spec(s)) < storage_bits(high)}
        self.hp_recipe = self.recipe.with_overrides(f"{self.recipe.name}+hp", {g: sites for g in modules})
        self.hp_nx = make_numerics(self.hp_recipe, self.backend, **self.kernel_options)
        self.hp_weights = dict(self.weights)
        extra, base, dup = 0.0, 0.0, 0
        for name, w in self.model.weights.items():
            site = weight_site(name)
            if site not in ("linear.weight", "moe.weight"):
                continue
            mod = module_path(name)
            lo, hi = self.recipe.spec(site, mod), self.hp_recipe.spec(site, mod)
            base += w.numel() * storage_bits(lo) / 8
            if lo != hi:
                self.hp_weights[name] = self.hp_nx.prepare_weight(w, site, mod)
                extra += w.numel() * storage_bits(hi) / 8
                dup += 1
        if dup == 0:
            self.hp_recipe = self.hp_nx = self.hp_weights = None
            raise ValueError(f"precision switch: no weight matches {list(modules)} with a format below '{high}'; "
                             "module paths look like 'layers.3.mlp.down_proj' or 'layers.*.attn.o_proj'")
        return {"extra_weight_bytes": extra, "base_weight_bytes": base, "switched_tensors": float(dup)}

    def _path(self, high_precision: bool) -> tuple[Numerics, dict]:
        """(numerics, weights) of the requested precision path."""
        if not high_precision:
            return self.nx, self.weights
        if self.hp_nx is None:
            raise RuntimeError("high_precision=True needs enable_precision_switch(modules) first")
        return self.hp_nx, self.hp_weights

    @property
    def vocab_size(self) -> int:
        """Size of the output distribution."""
        return self.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        """Longest context the model was configured for."""
        return self.cfg.max_position

    def native_coverage(self) -> dict[str, float]:
        """Which ops ran on native kernels, for a result's metrics: per op `<op>.native_frac` (the fraction of its
        calls that ran native) and the raw call counts `<op>:native` / `<op>:fallback:<reason>`. Empty on the
        emulated backends, which run no kernel."""
        summary = getattr(self.nx, "coverage_summary", None)
        return summary() if summary is not None else {}

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, tap: Optional[Callable[[str, torch.Tensor], None]] = None,
               observer: Optional[QuantObserver] = None, prefill_chunk: int | None = None,
               high_precision: bool | Sequence[bool] | torch.Tensor = False,
               local: Optional[LocalProbe] = None) -> torch.Tensor:
        """Full-sequence logits (batch, t, vocab) in fp32; `tap(name, tensor)` sees every canonical tap.

        With `prefill_chunk`, the sequence is prefilled in chunks of that many tokens through the
        KV cache (chunked prefill, as a serving engine does): each chunk attends to the cached,
        already-quantized keys/values of the earlier chunks. `high_precision` (one flag, or one
        per request) routes requests through the precompiled high-precision variant
        (`enable_precision_switch`); a mixed batch runs as two sub-batches. `local` receives the
        op-local conformance sums (`engine.numerics.Numerics`, attribute `local`).
        """
        tokens = tokens.to(self.device)
        flags = torch.as_tensor(high_precision, dtype=torch.bool).flatten().cpu()
        if flags.numel() > 1:
            if flags.numel() != tokens.shape[0]:
                raise ValueError(f"high_precision has {flags.numel()} flags for a batch of {tokens.shape[0]}")
            if bool(flags.all()) or not bool(flags.any()):
                flags = flags[:1]
            else:
                out = torch.empty(tokens.shape[0], tokens.shape[1], self.cfg.vocab_size, device=self.device)
                for want in (False, True):
                    idx = torch.nonzero(flags == want).flatten().to(self.device)
                    out[idx] = self.logits(tokens[idx], tap, observer, prefill_chunk, want, local)
                return out
        nx, weights = self._path(bool(flags[0]))
        nx.tap, nx.observer, nx.local = tap, observer, local
        prefill_chunk = prefill_chunk or self.default_prefill_chunk
        self.work["forward_tokens"] += tokens.numel()
        try:
            if prefill_chunk is None or prefill_chunk >= tokens.shape[1]:
                return self.model.forward(nx, weights, tokens)
            cache = KVCache.empty(self.model.cfg, tokens.shape[0], tokens.shape[1], self.device)
            parts = [self.model.forward(nx, weights, tokens[:, s:s + prefill_chunk], cache)
                     for s in range(0, tokens.shape[1], prefill_chunk)]
            return torch.cat(parts, dim=1)  # (batch, t, vocab)
        finally:
            nx.tap, nx.observer, nx.local = None, None, None

    @torch.no_grad()
    def generate_batch(self, requests: Sequence[GenerationRequest], serving: ServingConfig | None = None,
                       step_stats: bool = False, keep_logits: bool = False,
                       max_batch: int | None = None,
                       on_done: Callable[[int], None] | None = None) -> list[Generation]:
        """Greedy generations of all `requests`, decoded together as the engine is served (`engine.generation`).

        `serving` (default `self.serving`): batch size (`max_batch`), page size, chunked prefill, CUDA graphs;
        its `max_tokens` is sized to the requests here, and `max_batch` (when given) replaces its batch size.
        They go through the paged runtime (continuous batching, KV pages in the recipe's cache format; under tensor
        parallelism each rank's pages hold its KV heads). `step_stats`: per generated token, the entropy and top-2
        margin of its distribution; `keep_logits`: the step logits too (small models only); `on_done(n)`: n more
        requests finished (a progress bar).
        """
        serving = serving or self.serving
        if max_batch is not None and max_batch != serving.max_batch:
            serving = dataclasses.replace(serving, max_batch=max_batch)
        requests = cap_requests(requests, self.cfg.max_position)
        if not requests:
            return []
        from engine.runtime import PagedRuntime

        need = max(len(r.prompt) + r.max_new_tokens for r in requests)
        need = -(-need // 256) * 256  # KV pages sized in steps of 256 tokens, so similar calls share a runtime
        rt = self._runtime
        if rt is None or dataclasses.replace(rt.config, max_tokens=serving.max_tokens) != serving or \
                rt.config.max_tokens < need:
            self._runtime = rt = None  # free the old pages before allocating the new ones
            rt = PagedRuntime(self, dataclasses.replace(serving, max_tokens=need))
            self._runtime = rt
        return rt.serve(requests, step_stats=step_stats, keep_logits=keep_logits, on_done=on_done)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                 return_logits: bool = False,
                 high_precision: bool = False) -> list[int] | tuple[list[int], torch.Tensor]:
        """Greedy continuation of one prompt with the KV cache (prefill, then one token per step).

        With `return_logits`, also returns the (new_tokens, vocab) logits of every step;
        `high_precision` runs the request on the precompiled high-precision path.
        """
        nx, weights = self._path(high_precision)
        max_tokens = min(len(prompt) + max_new_tokens, self.cfg.max_position)
        cache = KVCache.empty(self.model.cfg, 1, max_tokens, self.device)
        x = torch.tensor([prompt], device=self.device)
        out: list[int] = []
        steps = []
        while len(prompt) + len(out) < max_tokens:
            logits = self.model.forward(nx, weights, x, cache)[:, -1]  # (1, vocab)
            if return_logits:
                steps.append(logits[0].float().cpu())
            nxt = int(logits.argmax(-1))
            out.append(nxt)
            if nxt in stop_ids or len(out) >= max_new_tokens:
                break
            x = torch.tensor([[nxt]], device=self.device)
        if return_logits:
            return out, torch.stack(steps)
        return out
