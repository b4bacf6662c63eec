"""The independent FP32 reference: HF `transformers` in FP32 with TF32 disabled.

Forward hooks map HF module names to the engine's canonical tap names, so the
per-layer eval can compare the two implementations tap by tap. An FP64 CPU
reference (`precision="fp64"`) measures the reference's own noise floor.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from engine.loading import LoadedModel

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def disable_tf32() -> None:
    """Make fp32 matmuls really fp32 on GPUs (no TF32 tensor-core shortcut)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def build_hf_model(loaded: LoadedModel, precision: str = "fp32"):
    """An HF causal LM with the same weights: `from_pretrained` for directories, else from the state dict."""
    import transformers

    dtype = _DTYPES[precision]
    if loaded.directory is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            loaded.directory, dtype=dtype, local_files_only=True, attn_implementation="eager")
    else:
        config = transformers.AutoConfig.for_model(**loaded.hf_config)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
        state = {k: v.to(dtype) for k, v in loaded.weights.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and loaded.cfg.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"reference for {loaded.source}: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if loaded.cfg.tie_word_embeddings:
            model.tie_weights()
    return model.eval()


def _first(out):
    """A module's output tensor (decoder layers may return tuples)."""
    return out[0] if isinstance(out, (tuple, list)) else out


class ReferenceLM:
    """HF model wrapped in the engine interface: `logits(tokens, tap=...)` and `generate(...)`."""

    def __init__(self, loaded: LoadedModel, device: str | torch.device = "cpu", precision: str = "fp32"):
        disable_tf32()
        self.device = torch.device(device)
        self.precision = precision
        self.model = build_hf_model(loaded, precision).to(self.device)
        self.cfg = loaded.cfg
        self._tap: Optional[Callable[[str, torch.Tensor], None]] = None
        self._install_hooks()

    @property
    def vocab_size(self) -> int:
        """Output vocabulary size."""
        return self.cfg.vocab_size

    def _emit(self, name: str, x: torch.Tensor) -> None:
        """Forward a hooked activation to the current tap callback as fp32."""
        if self._tap is not None:
            self._tap(name, x.detach().float())

    def _install_hooks(self) -> None:
        """Register hooks producing canonical tap names (see engine.model)."""
        base = self.model.model

        def out_hook(name):
            return lambda mod, args, out: self._emit(name, _first(out))

        def in_hook(name):
            return lambda mod, args: self._emit(name, args[0])

        base.embed_tokens.register_forward_hook(out_hook("embed"))
        for i, layer in enumerate(base.layers):
            p = f"layers.{i}."
            layer.input_layernorm.register_forward_hook(out_hook(p + "attn_norm"))
            layer.self_attn.q_proj.register_forward_hook(out_hook(p + "attn.q"))
            layer.self_attn.k_proj.register_forward_hook(out_hook(p + "attn.k"))
            layer.self_attn.v_proj.register_forward_hook(out_hook(p + "attn.v"))
            layer.self_attn.o_proj.register_forward_pre_hook(in_hook(p + "attn.out"))
            layer.self_attn.o_proj.register_forward_hook(out_hook(p + "attn.o_proj"))
            layer.post_attention_layernorm.register_forward_pre_hook(in_hook(p + "resid_mid"))
            layer.post_attention_layernorm.register_forward_hook(out_hook(p + "mlp_norm"))
            layer.mlp.down_proj.register_forward_pre_hook(in_hook(p + "mlp.act"))
            layer.mlp.register_forward_hook(out_hook(p + "mlp.out"))
            layer.register_forward_hook(out_hook(p + "resid_out"))
        base.norm.register_forward_hook(out_hook("final_norm"))

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, tap: Optional[Callable[[str, torch.Tensor], None]] = None,
               observer=None) -> torch.Tensor:
        """Full-sequence logits (batch, t, vocab) as fp32; `tap` sees the canonical taps."""
        self._tap = tap
        try:
            out = self.model(input_ids=tokens.to(self.device), use_cache=False).logits.float()
        finally:
            self._tap = None
        if tap is not None:
            tap("logits", out)
        return out

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                 return_logits: bool = False):
        """Greedy continuation with HF's KV cache; optionally the per-step logits (new_tokens, vocab)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        x = torch.tensor([prompt], device=self.device)
        out: list[int] = []
        steps = []
        limit = min(len(prompt) + max_new_tokens, self.cfg.max_position)
        while len(prompt) + len(out) < limit:
            res = self.model(input_ids=x, past_key_values=cache, use_cache=True)
            logits = res.logits[:, -1].float()
            cache = res.past_key_values
            if return_logits:
                steps.append(logits[0].cpu())
            nxt = int(logits.argmax(-1))
            out.append(nxt)
            if nxt in stop_ids or len(out) >= max_new_tokens:
                break
            x = torch.tensor([[nxt]], device=self.device)
        if return_logits:
            return out, torch.stack(steps)
        return out
