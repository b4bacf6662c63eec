"""The FP32 reference stage by stage: transformers' own modules, one decoder layer's weights at a time.

The HF model is built on the meta device, as `evalharness.reference.build_hf_model` builds it, with the same tap
hooks (`ReferenceLM._install_hooks`). A streamed pass then gives it one stage's fp32 tensors at a time
(`engine.streaming.LayerStore.load`, shared with the engine on the same device) and takes them back afterwards:

* ``embed``: transformers' forward runs with every decoder layer replaced by a stand-in that records the
  arguments the model passes to that layer (attention mask, position embeddings, position ids, ...) and hands
  the hidden states on unchanged; the last stand-in stops the forward. The layer-0 input is the embedding as the
  model's own forward computed it, and the per-layer arguments are the model's own;
* layer i: the real decoder layer (transformers' class, its weights assigned) on each batch with the recorded
  arguments;
* ``head``: the final norm and the LM head, as the causal-LM forward applies them.

So each batch goes through the same transformers code with the same arguments as in the resident reference,
and gets the same bits on the same device.
"""

from __future__ import annotations

import collections
from typing import Callable, Mapping, Optional

import torch

from engine.streaming import Stage, StreamedGenerationError, stages
from evalharness.reference import ReferenceLM, _first, _hf_config, _rebuild_buffers, disable_tf32


class _Stop(Exception):
    """Ends the embedding stage's forward after the last layer's arguments are recorded."""


class _Recorder(torch.nn.Module):
    """Stands in for decoder layer `index` during the embedding stage: records its call, passes hidden states on."""

    def __init__(self, index: int, last: bool, seen: dict, attention_type: str | None):
        super().__init__()
        self.index, self.last, self.seen = index, last, seen
        if attention_type is not None:
            self.attention_type = attention_type  # models that pick a mask per layer type read it

    def forward(self, hidden_states, *args, **kwargs):
        """Record (hidden states of layer 0, arguments of every layer); stop after the last."""
        if self.index == 0:
            self.seen["hidden"] = hidden_states
        self.seen.setdefault("kwargs", []).append((args, kwargs))
        if self.last:
            raise _Stop()
        return hidden_states


class StreamedReference(ReferenceLM):
    """`ReferenceLM` whose weights arrive stage by stage (`bind` / `run` / `release`); `logits` streams one batch.

    `store` is the model's `engine.streaming.LayerStore` (its config, and the reads `logits` makes)."""

    streamed = True

    def __init__(self, store, device: str | torch.device = "cpu"):
        import transformers

        disable_tf32()
        self.device = torch.device(device)
        self.precision = "fp32"
        self.store = store
        self.cfg = store.cfg
        self.config = _hf_config(store)
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=torch.float32,
                                                                       attn_implementation="eager").eval()
        layers = self.model.model.layers
        self.model.model.layers = torch.nn.ModuleList()  # the RoPE tables and other buffers outside the layers
        _rebuild_buffers(self.model, self.config)
        self.model.model.layers = layers
        for mod in self.model.modules():  # those rebuilt buffers onto the device (parameters stay on meta)
            for name, buf in list(mod.named_buffers(recurse=False)):
                if not buf.is_meta:
                    mod.register_buffer(name, buf.to(self.device), persistent=name not in mod._non_persistent_buffers_set)
        self.work: collections.Counter = collections.Counter()
        self._tap: Optional[Callable[[str, torch.Tensor], None]] = None
        self._install_hooks()
        self._args: dict[tuple, list] = {}  # batch shape -> per-layer (args, kwargs) the model passes

    def _modules(self, stage: Stage, master: Mapping[str, torch.Tensor]) -> list[tuple[torch.nn.Module, dict]]:
        """(module, its state dict) pairs that take a stage's tensors (transformers' in-memory names)."""
        base = self.model.model
        if stage == "embed":
            return [(base.embed_tokens, {"weight": master["model.embed_tokens.weight"]})]
        if stage == "head":
            head = master.get("lm_head.weight", master.get("model.embed_tokens.weight"))
            return [(base.norm, {"weight": master["model.norm.weight"]}), (self.model.lm_head, {"weight": head})]
        prefix = f"model.layers.{stage}."
        return [(base.layers[stage], {k[len(prefix):]: t for k, t in master.items() if k.startswith(prefix)})]

    def bind(self, stage: Stage, master: Mapping[str, torch.Tensor]) -> None:
        """Give a stage's modules their fp32 tensors (`LayerStore.load`: no copy on the same device)."""
        for mod, state in self._modules(stage, master):
            state = {k: t.to(self.device) for k, t in state.items()}
            mod.load_state_dict(state, strict=True, assign=True)
            if any(b.is_meta for b in mod.buffers()):
                _rebuild_buffers(mod, self.config)

    def release(self, stage: Stage) -> None:
        """Take a stage's tensors back (its modules return to the meta device)."""
        base = self.model.model
        mods = {"embed": [base.embed_tokens], "head": [base.norm, self.model.lm_head]}.get(stage)
        for mod in mods if mods is not None else [base.layers[stage]]:
            mod.to("meta")

    def _record(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding stage: layer 0's input, and the arguments of every layer for this batch shape."""
        base = self.model.model
        real = base.layers
        n = len(real)
        seen: dict = {}
        base.layers = torch.nn.ModuleList(_Recorder(i, i == n - 1, seen, getattr(real[i], "attention_type", None))
                                          for i in range(n))
        try:
            self.model(input_ids=tokens, use_cache=False)
        except _Stop:
            pass
        finally:
            base.layers = real
        self._args.setdefault(tuple(tokens.shape), seen["kwargs"])
        return seen["hidden"]

    @torch.no_grad()
    def run(self, stage: Stage, inp, tap: Optional[Callable[[str, torch.Tensor], None]] = None):
        """One stage on one batch: tokens -> hidden ('embed'), hidden -> hidden (layer i), hidden -> logits."""
        self._tap = tap
        try:
            if stage == "embed":
                tokens = inp.to(self.device)
                self.work["forward_tokens"] += tokens.numel()
                h = self._record(tokens)
                return h, tuple(tokens.shape)
            h, shape = inp
            if stage == "head":
                out = self.model.lm_head(self.model.model.norm(h)).float()
                if tap is not None:
                    tap("logits", out)
                return out
            args, kwargs = self._args[shape][stage]
            return _first(self.model.model.layers[stage](h, *args, **kwargs)), shape
        finally:
            self._tap = None

    @staticmethod
    def hidden(state) -> torch.Tensor:
        """The residual stream (batch, t, d) of a between-stages state."""
        return state[0]

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, tap: Optional[Callable[[str, torch.Tensor], None]] = None,
               observer=None) -> torch.Tensor:
        """Logits (batch, t, vocab) of one batch, every stage read from the store and run in turn."""
        state = tokens
        for stage in stages(self.cfg):
            self.bind(stage, self.store.load(stage, self.device))
            try:
                state = self.run(stage, state, tap)
            finally:
                self.release(stage)
        return state

    def generation_error(self, what: str = "generation") -> StreamedGenerationError:
        """The error for generation asked of this reference (`what`: who asked)."""
        return StreamedGenerationError(
            f"{what}: the FP32 reference of '{self.store.where}' runs layer-streamed: generation reads every layer at "
            "each decode step and needs the whole model resident (tensor / expert parallelism over more GPUs, "
            "docs/guide/multi-gpu.md, or `execution: resident`)")

    def generate_batch(self, requests, max_batch: int = 8, step_stats: bool = False, keep_logits: bool = False):
        """Not available when streamed."""
        raise self.generation_error()

    def generate(self, prompt, max_new_tokens, stop_ids=(), return_logits=False):
        """Not available when streamed."""
        raise self.generation_error()
