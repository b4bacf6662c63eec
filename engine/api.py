"""The engine's narrow interface to the harness: score tokens, generate, expose taps.

A third-party engine plugs into `evalharness` by offering the same three
methods (`logits`, `generate`, and the `tap` argument).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from engine.model import KVCache, Transformer
from engine.numerics import Numerics, QuantObserver
from engine.recipe import Recipe, load_recipe

BACKENDS = ("cpu-emulated", "cuda-emulated")


class Engine:
    """A `Transformer` paired with a recipe: weights prepared once, then served.

    `backend` is `cpu-emulated` or `cuda-emulated` (the same bit-exact
    emulation on either device); the model is moved to the backend's device.
    """

    def __init__(self, model: Transformer, recipe: Recipe | str, backend: str = "cpu-emulated"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend '{backend}'; available: {BACKENDS}")
        if backend == "cuda-emulated" and not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda-emulated' needs a CUDA GPU; none is visible (use cpu-emulated)")
        self.backend = backend
        self.device = torch.device("cuda" if backend.startswith("cuda") else "cpu")
        self.model = model if model.device == self.device else model.to(self.device)
        self.recipe = load_recipe(recipe)
        self.nx = Numerics(self.recipe)
        self.weights = self.model.prepare(self.nx)
        self.cfg = self.model.cfg

    @property
    def vocab_size(self) -> int:
        """Size of the output distribution."""
        return self.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        """Longest context the model was configured for."""
        return self.cfg.max_position

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, tap: Optional[Callable[[str, torch.Tensor], None]] = None,
               observer: Optional[QuantObserver] = None, prefill_chunk: int | None = None) -> torch.Tensor:
        """Full-sequence logits (batch, t, vocab) in fp32; `tap(name, tensor)` sees every canonical tap.

        With `prefill_chunk`, the sequence is prefilled in chunks of that many tokens through the
        KV cache (chunked prefill, as a serving engine does): each chunk attends to the cached,
        already-quantized keys/values of the earlier chunks.
        """
        self.nx.tap, self.nx.observer = tap, observer
        tokens = tokens.to(self.device)
        try:
            if prefill_chunk is None or prefill_chunk >= tokens.shape[1]:
                return self.model.forward(self.nx, self.weights, tokens)
            cache = KVCache.empty(self.cfg, tokens.shape[0], tokens.shape[1], self.device)
            parts = [self.model.forward(self.nx, self.weights, tokens[:, s:s + prefill_chunk], cache)
                     for s in range(0, tokens.shape[1], prefill_chunk)]
            return torch.cat(parts, dim=1)  # (batch, t, vocab)
        finally:
            self.nx.tap, self.nx.observer = None, None

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                 return_logits: bool = False) -> list[int] | tuple[list[int], torch.Tensor]:
        """Greedy continuation of one prompt with the KV cache (prefill, then one token per step).

        With `return_logits`, also returns the (new_tokens, vocab) logits of every step.
        """
        max_tokens = min(len(prompt) + max_new_tokens, self.cfg.max_position)
        cache = KVCache.empty(self.cfg, 1, max_tokens, self.device)
        x = torch.tensor([prompt], device=self.device)
        out: list[int] = []
        steps = []
        while len(prompt) + len(out) < max_tokens:
            logits = self.model.forward(self.nx, self.weights, x, cache)[:, -1]  # (1, vocab)
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
