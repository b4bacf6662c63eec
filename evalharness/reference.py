"""The independent FP32 reference: HF `transformers` in FP32 with TF32 disabled.

Forward hooks map HF module names to the engine's canonical tap names, so the
per-layer eval can compare the two implementations tap by tap. An FP64 CPU
reference (`precision="fp64"`) measures the reference's own noise floor.

Memory: the HF model is built on the meta device (no storage) and then takes
the loader's fp32 tensors as its parameters (`load_state_dict(assign=True)`),
so for an fp32 reference on the device the weights already live on, the
reference costs no weight memory of its own: it shares every tensor with the
engine's master weights (`engine.loading`). Only RoPE tables (non-persistent
buffers) are computed afresh. On another device (``ReferenceLM(loaded,
device="cpu")`` next to a CUDA engine) it holds its own copy there; the evals
bring engine and reference tensors to one device before comparing them.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

import torch

from engine.generation import Generation, GenerationRequest, Recorder, cap_requests, lockstep_step
from engine.loading import LoadedModel

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# Attention scores of one prefill chunk of the batched reference generation: at most this many bytes
# (eager attention materializes (batch, heads, chunk, context) fp32 scores).
_SCORE_BYTES = 1 << 30
# Eager attention memory of one `logits` call (scores, probabilities and a temporary, fp32) before it is split.
_ATTN_BYTES = 16 << 30


def disable_tf32() -> None:
    """Make fp32 matmuls really fp32 on GPUs (no TF32 tensor-core shortcut)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def _hf_config(loaded: LoadedModel):
    """The transformers config object of `loaded` (read from its folder when it has one)."""
    import transformers

    if loaded.directory is not None:
        return transformers.AutoConfig.from_pretrained(loaded.directory, local_files_only=True)
    return transformers.AutoConfig.for_model(**loaded.hf_config)


def _rebuild_buffers(model, config) -> None:
    """Give the meta-device model real non-persistent buffers (RoPE `inv_freq`): they are in no checkpoint.

    Each module owning such a buffer (transformers' rotary embeddings: no parameters, built from the
    config alone) is instantiated once on the CPU and its buffers are taken over.
    """
    for name, mod in model.named_modules():
        if not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        if any(True for _ in mod.parameters(recurse=False)):
            raise RuntimeError(f"reference: module '{name}' ({type(mod).__name__}) holds parameters and meta "
                               "buffers; this transformers version builds it differently than expected")
        try:
            fresh = type(mod)(getattr(mod, "config", config))
        except TypeError as exc:
            raise RuntimeError(f"reference: cannot rebuild module '{name}' ({type(mod).__name__}) from the config "
                               f"({exc}); this transformers version is not supported") from None
        for bname, buf in fresh.named_buffers(recurse=False):
            mod.register_buffer(bname, buf, persistent=False)


def build_hf_model(loaded: LoadedModel, precision: str = "fp32"):
    """An HF causal LM (eval mode, eager attention) whose parameters ARE `loaded.weights` (fp32: no copy).

    The model is built on the meta device, then each parameter / persistent buffer is assigned the
    loader's tensor of the same name (transformers' in-memory names; routed experts stacked as
    transformers holds them). `precision="fp64"` converts each tensor (a copy, for the noise floor).
    """
    import transformers

    dtype = _DTYPES[precision]
    config = _hf_config(loaded)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    tied = loaded.cfg.tie_word_embeddings
    state, missing = {}, []
    for key, meta in model.state_dict().items():
        t = loaded.weights.get(key)
        if t is None:
            if not (key == "lm_head.weight" and tied):
                missing.append(key)
            continue
        if tuple(t.shape) != tuple(meta.shape):
            raise RuntimeError(f"reference for {loaded.source}: tensor '{key}' has shape {tuple(t.shape)}, "
                               f"transformers expects {tuple(meta.shape)}")
        state[key] = t if t.dtype == dtype else t.to(dtype)
    if missing:
        raise RuntimeError(f"reference for {loaded.source}: no weight for {len(missing)} transformers "
                           f"parameter(s), e.g. {missing[:3]} (transformers >= 5 names are expected)")
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    _rebuild_buffers(model, config)
    still_meta = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if still_meta:
        raise RuntimeError(f"reference for {loaded.source}: tensors left without storage: {still_meta[:3]}")
    return model.eval()


def _first(out):
    """A module's output tensor (decoder layers may return tuples)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _per_token(x: torch.Tensor) -> torch.Tensor:
    """(batch, t, heads, n) per-head activations as (batch, t, heads*n)."""
    return x.reshape(x.shape[0], x.shape[1], -1)


def _latent(x: torch.Tensor) -> torch.Tensor:
    """An MLA activation viewed as one head, (batch, 1, t, n), as (batch, t, n)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Any activation as (tokens, n)."""
    return x.reshape(-1, x.shape[-1])


class ReferenceLM:
    """HF model wrapped in the engine interface: `logits(tokens, tap=...)` and `generate(...)`."""

    def __init__(self, loaded: LoadedModel, device: str | torch.device = "cpu", precision: str = "fp32"):
        disable_tf32()
        self.device = torch.device(device)
        self.precision = precision
        self.model = build_hf_model(loaded, precision).to(self.device)
        self.cfg = loaded.cfg
        # work done, as the engine counts it (`engine.api.Engine.work`): forward / prefill tokens, decode steps, rows
        self.work: collections.Counter = collections.Counter()
        self._tap: Optional[Callable[[str, torch.Tensor], None]] = None
        self._install_hooks()

    @property
    def vocab_size(self) -> int:
        """Output vocabulary size."""
        return self.cfg.vocab_size

    def _emit(self, name: str, x: torch.Tensor) -> None:
        """Forward a hooked activation to the current tap callback (fp32; integer ids stay integer)."""
        if self._tap is not None:
            x = x.detach()
            self._tap(name, x.float() if x.is_floating_point() else x)

    def _install_hooks(self) -> None:
        """Register hooks producing canonical tap names (definitions in engine.model's docstring).

        The hooks are chosen per block from the HF module names: GQA attention
        (q/k/v_proj, optional q_norm/k_norm), MLA attention (q_a_proj, q_b_proj or
        q_proj, kv_a_proj_with_mqa, kv_b_proj), dense MLP (down_proj) or MoE block
        (gate, shared_expert(s)).
        """
        base = self.model.model
        base.embed_tokens.register_forward_hook(self._out_hook("embed"))
        for i, layer in enumerate(base.layers):
            p = f"layers.{i}."
            layer.input_layernorm.register_forward_hook(self._out_hook(p + "attn_norm"))
            attn = layer.self_attn
            if hasattr(attn, "kv_a_proj_with_mqa"):
                self._hook_mla(attn, p)
            else:
                self._hook_gqa(attn, p)
            attn.o_proj.register_forward_pre_hook(self._in_hook(p + "attn.out"))
            attn.o_proj.register_forward_hook(self._out_hook(p + "attn.o_proj"))
            layer.post_attention_layernorm.register_forward_pre_hook(self._in_hook(p + "resid_mid"))
            layer.post_attention_layernorm.register_forward_hook(self._out_hook(p + "mlp_norm"))
            mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe")
            if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
                self._hook_moe(mlp, p)
            else:
                mlp.down_proj.register_forward_pre_hook(self._in_hook(p + "mlp.act"))
            mlp.register_forward_hook(self._out_hook(p + "mlp.out"))
            layer.register_forward_hook(self._out_hook(p + "resid_out"))
        base.norm.register_forward_hook(self._out_hook("final_norm"))

    def _out_hook(self, name: str, view=None):
        """A forward hook emitting a module's output (reshaped by `view` when given)."""
        def hook(mod, args, out):
            """Emit the (reshaped) output."""
            x = _first(out)
            self._emit(name, view(x) if view is not None else x)
        return hook

    def _in_hook(self, name: str):
        """A forward pre-hook emitting a module's first input."""
        return lambda mod, args: self._emit(name, args[0])

    def _hook_gqa(self, attn, p: str) -> None:
        """q/k/v projection outputs, plus the normed q/k of Qwen3 / OLMoE (flattened per token)."""
        attn.q_proj.register_forward_hook(self._out_hook(p + "attn.q"))
        attn.k_proj.register_forward_hook(self._out_hook(p + "attn.k"))
        attn.v_proj.register_forward_hook(self._out_hook(p + "attn.v"))
        if getattr(attn, "q_norm", None) is not None:
            attn.q_norm.register_forward_hook(self._out_hook(p + "attn.q_norm", _per_token))
            attn.k_norm.register_forward_hook(self._out_hook(p + "attn.k_norm", _per_token))

    def _hook_mla(self, attn, p: str) -> None:
        """MLA taps: q_a, q, kv_a from module outputs; kv, k, v derived from kv_b_proj's output + kv_a's rope part."""
        nope, rope = attn.qk_nope_head_dim, attn.qk_rope_head_dim
        heads, lora = attn.num_heads, attn.kv_lora_rank
        latest: dict[str, torch.Tensor] = {}
        if getattr(attn, "q_a_proj", None) is not None:
            attn.q_a_proj.register_forward_hook(self._out_hook(p + "attn.q_a"))
            attn.q_b_proj.register_forward_hook(self._out_hook(p + "attn.q"))
        else:
            attn.q_proj.register_forward_hook(self._out_hook(p + "attn.q"))

        def kv_a_hook(mod, args, out):
            """Emit [latent | k_pe]; keep k_pe for the attn.k tap."""
            if self._tap is None:
                return
            latest["k_pe"] = out[..., lora:]  # (batch, t, rope), before RoPE
            self._emit(p + "attn.kv_a", out)

        def kv_b_hook(mod, args, out):
            """Emit attn.kv and its per-head split: attn.k = [k_nope | k_pe], attn.v."""
            if self._tap is None:
                return
            kv = _latent(out)  # (batch, t, heads*(nope+v))
            self._emit(p + "attn.kv", kv)
            b, t = kv.shape[:2]
            per_head = kv.view(b, t, heads, -1)  # (batch, t, heads, nope+v)
            k_pe = latest.pop("k_pe")[:, :, None, :].expand(b, t, heads, rope)  # (batch, t, heads, rope)
            k = torch.cat((per_head[..., :nope], k_pe), dim=-1)  # (batch, t, heads, nope+rope)
            self._emit(p + "attn.k", k.reshape(b, t, -1))  # (batch, t, heads*(nope+rope))
            self._emit(p + "attn.v", per_head[..., nope:].reshape(b, t, -1))  # (batch, t, heads*v)

        attn.kv_a_proj_with_mqa.register_forward_hook(kv_a_hook)
        attn.kv_b_proj.register_forward_hook(kv_b_hook)

    def _hook_moe(self, mlp, p: str) -> None:
        """Router logits and top-k ids from the gate's (logits, weights, ids) output; shared expert output."""
        def gate_hook(mod, args, out):
            """Emit router logits (tokens, experts) and top-k ids (tokens, k)."""
            self._emit(p + "moe.router_logits", out[0])
            self._emit(p + "moe.topk", out[2])

        mlp.gate.register_forward_hook(gate_hook)
        shared = getattr(mlp, "shared_expert", None) or getattr(mlp, "shared_experts", None)
        if shared is not None:
            shared.register_forward_hook(self._out_hook(p + "moe.shared", _rows))

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, tap: Optional[Callable[[str, torch.Tensor], None]] = None,
               observer=None) -> torch.Tensor:
        """Full-sequence logits (batch, t, vocab) as fp32; `tap` sees the canonical taps.

        Without taps, a batch whose eager attention scores would pass `_ATTN_BYTES` runs in sub-batches, and a
        sequence too long even alone is prefilled in query chunks through the KV cache (each row's softmax still
        spans the same keys); small batches -- every CPU test -- take the one call as before.
        """
        self._tap = tap
        self.work["forward_tokens"] += tokens.numel()
        b, t = tokens.shape
        per_seq = 3 * self.model.config.num_attention_heads * t * t * 4  # scores, probabilities, one temporary
        try:
            if tap is not None or b * per_seq <= _ATTN_BYTES:
                out = self.model(input_ids=tokens.to(self.device), use_cache=False).logits.float()
            elif per_seq <= _ATTN_BYTES:
                step = _ATTN_BYTES // per_seq
                out = torch.cat([self.model(input_ids=tokens[i:i + step].to(self.device), use_cache=False)
                                 .logits.float() for i in range(0, b, step)])
            else:
                out = torch.cat([self._chunked(tokens[i:i + 1]) for i in range(b)])
        finally:
            self._tap = None
        if tap is not None:
            tap("logits", out)
        return out

    def _chunked(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (1, t, vocab) of one long sequence, prefilled in query chunks through HF's KV cache."""
        from transformers import DynamicCache

        t = tokens.shape[1]
        chunk = max(1, _ATTN_BYTES // (3 * self.model.config.num_attention_heads * t * 4))
        ids = tokens.to(self.device)
        cache, parts = DynamicCache(), []
        for s in range(0, t, chunk):
            pos = torch.arange(s, min(t, s + chunk), device=self.device)[None]
            parts.append(self.model(input_ids=ids[:, s:s + chunk], position_ids=pos,
                                    **self._cache_kwargs(cache)).logits.float())
        return torch.cat(parts, dim=1)

    def _cache_kwargs(self, cache) -> dict:
        """The KV-cache argument of the HF forward: `cache=` (transformers >= 5.24), else `past_key_values=`."""
        import inspect

        if not hasattr(self, "_cache_arg"):
            params = inspect.signature(self.model.forward).parameters
            self._cache_arg = "cache" if "cache" in params else "past_key_values"
        return {self._cache_arg: cache, "use_cache": True}

    @torch.no_grad()
    def generate_batch(self, requests: Sequence[GenerationRequest], max_batch: int = 8, step_stats: bool = False,
                       keep_logits: bool = False, on_done: Callable[[int], None] | None = None) -> list[Generation]:
        """Greedy generations of all `requests` with HF's KV cache, `max_batch` at a time.

        Requests are sorted by prompt length and left-padded to the longest of their batch (attention mask and
        position ids make padding invisible to the real tokens); prompts are prefilled in chunks whose attention
        scores stay under 1 GiB; a finished request (budget or stop id) leaves the batch and its cache rows.
        Per-step results stay on the device (`engine.generation.Recorder`) until the end. `on_done(n)`: n more
        requests finished (a progress bar).
        """
        from transformers import DynamicCache

        requests = cap_requests(requests, self.cfg.max_position)
        dev = self.device
        rec = Recorder(len(requests), max((r.max_new_tokens for r in requests), default=1), dev, step_stats,
                       keep_logits)
        lengths = [0] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].prompt), i))
        heads = self.model.config.num_attention_heads
        for g in range(0, len(order), max_batch):
            live = order[g:g + max_batch]
            plen = max(len(requests[i].prompt) for i in live)
            total = plen + max(requests[i].max_new_tokens for i in live)
            ids = torch.zeros((len(live), plen), dtype=torch.long)
            mask = torch.zeros((len(live), plen), dtype=torch.long)
            for j, i in enumerate(live):  # left padding
                p = requests[i].prompt
                ids[j, plen - len(p):] = torch.tensor(p)
                mask[j, plen - len(p):] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            positions = (mask.cumsum(-1) - 1).clamp_min(0)  # (b, plen)
            cache = DynamicCache()
            self.work["prefill_tokens"] += ids.numel()
            chunk = max(1, _SCORE_BYTES // (len(live) * heads * total * 4))
            for s in range(0, plen, chunk):
                out = self.model(input_ids=ids[:, s:s + chunk], attention_mask=mask[:, :s + chunk],
                                 position_ids=positions[:, s:s + chunk], logits_to_keep=1,
                                 **self._cache_kwargs(cache))
            last = out.logits[:, -1].float()  # (b, vocab)
            for step in range(total - plen):
                nxt, keep = lockstep_step(rec, requests, live, step, last, lengths, on_done)
                if not keep:
                    break
                if len(keep) < len(live):  # finished requests leave the batch and the cache
                    sel = torch.tensor(keep, dtype=torch.long, device=dev)
                    cache.batch_select_indices(sel)
                    mask, nxt = mask.index_select(0, sel), nxt.index_select(0, sel)
                    live = [live[j] for j in keep]
                self.work["decode_steps"] += 1
                self.work["decode_rows"] += len(live)
                pos = mask.sum(-1, keepdim=True)  # (b, 1): the new token's position
                mask = torch.cat([mask, torch.ones_like(pos)], dim=1)
                out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                                 **self._cache_kwargs(cache))
                last = out.logits[:, -1].float()
        return rec.results(lengths)

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
            res = self.model(input_ids=x, **self._cache_kwargs(cache))
            logits = res.logits[:, -1].float()
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
