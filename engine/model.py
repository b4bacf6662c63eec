"""One config-driven decoder-only transformer: Llama / Mistral / Qwen2 / Qwen3 (dense), Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE (MoE), DeepSeek-V2/V3 (MLA + DeepSeekMoE).

Weights are kept under HF parameter names (experts one tensor per expert, see
`engine.weights`), in fp32, so that an HF checkpoint loads unchanged and the
FP32 reference can be built from the same tensors. All arithmetic goes
through `engine.numerics.Numerics` (the recipe decides). Blocks live in
`engine.attention` (GQA, MLA, KV cache), `engine.moe` (dense MLP, MoE) and
`engine.rope`.

Canonical taps emitted per forward (ARCHITECTURE.md):

* every model: ``embed``, ``layers.{i}.attn_norm`` (input of the attention
  projections), ``layers.{i}.attn.out`` (attention output, input of o_proj),
  ``layers.{i}.attn.o_proj``, ``layers.{i}.resid_mid``, ``layers.{i}.mlp_norm``,
  ``layers.{i}.mlp.out`` (the MLP or whole MoE block output),
  ``layers.{i}.resid_out``, ``final_norm``, ``logits``;
* GQA layers: ``layers.{i}.attn.{q,k,v}`` = q_proj / k_proj / v_proj outputs
  (batch, t, heads*head_dim), before q/k norm and RoPE; with q/k norm (Qwen3,
  OLMoE) also ``layers.{i}.attn.q_norm`` / ``.k_norm`` = the normed q / k,
  flattened to (batch, t, heads*head_dim), before RoPE;
* MLA layers: ``layers.{i}.attn.q_a`` = q_a_proj output (batch, t, q_lora_rank)
  (q LoRA only); ``attn.q`` = q_b_proj (or q_proj) output (batch, t,
  heads*(nope+rope)), before RoPE; ``attn.kv_a`` = kv_a_proj_with_mqa output
  (batch, t, kv_lora_rank+rope) = [latent | k_pe] before norm and RoPE;
  ``attn.kv`` = kv_b_proj output (batch, t, heads*(nope+v_head_dim));
  ``attn.k`` = per-head key before RoPE, [k_nope_h | k_pe] per head (batch, t,
  heads*(nope+rope)) and ``attn.v`` (batch, t, heads*v_head_dim): both are the
  split of attn.kv (+ the rope part of attn.kv_a), so the reference derives
  them from the same two module outputs;
* dense MLP layers: ``layers.{i}.mlp.act`` (SwiGLU output, input of down_proj);
* MoE layers: ``layers.{i}.moe.router_logits`` (tokens, experts) fp32 logits
  before scoring; ``layers.{i}.moe.topk`` (tokens, k) int64 expert ids
  (compared as sets: order within a token is unspecified);
  ``layers.{i}.moe.shared`` (tokens, d) = shared expert output before its gate
  (when there is one); ``mlp_norm`` is the experts' input (post-attention RMSNorm output
  at the ``moe.input`` site).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from engine.attention import KVCache, gqa_attention, mla_attention
from engine.config import ModelConfig
from engine.formats import QTensor
from engine.moe import dense_block, moe_block
from engine.numerics import Numerics
from engine.rope import apply_rope, mla_softmax_scale, rope_attention_factor, rope_inv_freq, rope_tables
from engine.weights import canonical_weights, check_weights, expected_shapes, module_path, weight_site

__all__ = ["KVCache", "Transformer", "apply_rope", "check_weights", "expected_shapes", "rope_inv_freq",
           "_module_path"]

_module_path = module_path  # kept for importers of the old private name


@dataclasses.dataclass
class LayerState:
    """What one decoder layer reads: the residual stream x (batch, t, d), its attn_norm hn (batch, t, d), the
    positions with their RoPE tables (shared by all layers), and hq: the quantization of hn that the norm's
    backend computed in the same pass (`Numerics.rmsnorm_quant`), None when it made none."""

    x: torch.Tensor
    hn: torch.Tensor
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    hq: Optional[QTensor] = None


def prepare_weight(nx: Numerics, name: str, w: torch.Tensor) -> torch.Tensor:
    """One weight in its recipe format (`Numerics.prepare_weight` at the tensor's site); fp32 sites: `w` itself."""
    site = weight_site(name)
    if site is None:
        return w
    return nx.prepare_weight(w, site, site if site in ("embed", "lm_head") else module_path(name))


class Transformer:
    """The engine's model: fp32 master weights + the forward pass through `Numerics`.

    `weights` maps HF names to tensors (canonicalised, then checked against
    the config). fp32 tensors are kept as they are, not copied (`.float()`
    returns an fp32 tensor itself; stacked experts become views), so the master
    weights share storage with the loader's tensors and the FP32 reference's
    parameters (docs/guide/models-and-data.md, "Memory"). The model holds no recipe;
    `engine.api.Engine` pairs it with one and prepares weights.
    """

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], where: str = "<weights>"):
        weights = canonical_weights(weights)
        check_weights(cfg, weights, where)
        self.cfg = cfg
        self.weights = {n: weights[n].float() for n in expected_shapes(cfg)}
        if cfg.tie_word_embeddings:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.inv_freq = rope_inv_freq(cfg)
        self.rope_factor = rope_attention_factor(cfg)
        self.softmax_scale = mla_softmax_scale(cfg) if cfg.mla is not None else None

    def to(self, device: torch.device | str) -> "Transformer":
        """Move the master weights to `device` (in place); returns self."""
        self.weights = {n: t.to(device) for n, t in self.weights.items()}
        if self.cfg.tie_word_embeddings:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.inv_freq = self.inv_freq.to(device)
        return self

    @property
    def device(self) -> torch.device:
        """Device of the master weights."""
        return self.weights["model.embed_tokens.weight"].device

    def prepare(self, nx: Numerics) -> dict[str, torch.Tensor]:
        """Quantize every weight into its recipe format once (dequantized values, fp32); see `weight_site`.

        Sites the recipe keeps in fp32 (all of them under `fp32`) return the master tensor itself, no copy.

        Under tensor / expert parallelism (`nx.parallel`) each weight is quantized whole, then
        this rank keeps its shard (as a pre-quantized checkpoint is sharded); other ranks'
        routed experts are skipped.
        """
        par = nx.parallel
        out: dict[str, torch.Tensor] = {}
        for name, w in self.weights.items():
            if par is not None and not par.holds(name):
                continue
            out[name] = prepare_weight(nx, name, w)
            if par is not None:
                out[name] = par.shard_weight(name, out[name], nx.slice_prepared)
        return out

    def forward(self, nx: Numerics, w: Mapping[str, torch.Tensor], tokens: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """Logits (batch, t, vocab) fp32 for `tokens` (batch, t); appends to `cache` when given.

        The three stages (`forward_start`, `forward_layer` per layer, `forward_end`) are what the layer-streamed
        execution (`engine.streaming`) runs one at a time over many batches: the same calls, the same bits."""
        state = self.forward_start(nx, w, tokens, cache)
        for i in range(self.cfg.num_layers):
            state = self.forward_layer(nx, w, i, state, cache)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.forward_end(nx, w, state)

    def forward_start(self, nx: Numerics, w: Mapping[str, torch.Tensor], tokens: torch.Tensor,
                      cache: KVCache | None = None) -> LayerState:
        """Embedding, its residual rounding and layer 0's attn_norm: the state layer 0 reads.

        Needs `model.embed_tokens.weight` and `model.layers.0.input_layernorm.weight` (or `model.norm.weight`)."""
        cfg = self.cfg
        t = tokens.shape[1]
        if cache is not None and hasattr(cache, "positions"):  # paged runtime: each sequence at its own position
            pos = cache.positions(t)  # (batch, t) on the device
            cos, sin = rope_tables(self.inv_freq, pos, self.rope_factor)  # (batch, t, rope_dim)
            cos, sin = cos[:, None], sin[:, None]  # (batch, 1, t, rope_dim): broadcast over heads
        else:
            start = cache.length if cache is not None else 0
            pos = torch.arange(start, start + t, device=tokens.device)
            cos, sin = rope_tables(self.inv_freq, pos, self.rope_factor)  # (t, rope_dim) each

        x = nx.embed(tokens, w["model.embed_tokens.weight"])  # (batch, t, d) fp32
        x = nx.round(x, "residual", "embed")
        nx.emit("embed", x)
        # Each residual add is taken together with the RMSNorm that reads its result (`Numerics.residual_norm`:
        # the next layer's attn_norm, or final_norm after the last layer), so a backend can fuse them.
        norm_w, norm_name = self.norm_after(w, -1)
        hn, hq = nx.rmsnorm_quant(x, norm_w, cfg.rms_norm_eps, norm_name)
        return LayerState(x, hn, pos, cos, sin, hq)

    def norm_after(self, w: Mapping[str, torch.Tensor], i: int) -> tuple[torch.Tensor, str]:
        """(weight, module name) of the RMSNorm that reads layer i's output: layer i+1's attn_norm, or final_norm."""
        if i + 1 < self.cfg.num_layers:
            return w[f"model.layers.{i + 1}.input_layernorm.weight"], f"layers.{i + 1}.attn_norm"
        return w["model.norm.weight"], "final_norm"

    def forward_layer(self, nx: Numerics, w: Mapping[str, torch.Tensor], i: int, state: LayerState,
                      cache: KVCache | None = None) -> LayerState:
        """Decoder layer i, then the residual add and the norm after it (`norm_after`): the next layer's state."""
        x, m = self._layer(nx, w, i, state, cache)
        norm_w, norm_name = self.norm_after(w, i)
        x, hn, hq = nx.residual_norm(x, m, norm_w, self.cfg.rms_norm_eps, f"layers.{i}.resid_out", norm_name)
        return dataclasses.replace(state, x=x, hn=hn, hq=hq)

    def forward_end(self, nx: Numerics, w: Mapping[str, torch.Tensor], state: LayerState) -> torch.Tensor:
        """The final norm's output (computed by the last layer's step) through the head: logits (batch, t, vocab)."""
        nx.emit("final_norm", state.hn)
        logits = nx.lm_head(state.hn, w["lm_head.weight"], state.hq)  # (batch, t, vocab) fp32
        nx.emit("logits", logits)
        return logits

    def _layer(self, nx: Numerics, w: Mapping[str, torch.Tensor], i: int, s: LayerState,
               cache: KVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer on the residual stream s.x and its attn_norm s.hn: (x + attn(hn) = resid_mid,
        mlp(norm(resid_mid))) -- the caller adds the MLP output (with the next norm)."""
        cfg = self.cfg
        p, tp = f"model.layers.{i}.", f"layers.{i}."
        if cfg.mla is not None:
            o = mla_attention(nx, w, cfg, i, s.hn, s.pos, s.cos, s.sin, cache, self.softmax_scale, fused=s.hq)
        else:
            o = gqa_attention(nx, w, cfg, i, s.hn, s.pos, s.cos, s.sin, cache, fused=s.hq)
        x, hn, hq = nx.residual_norm(s.x, o, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps,
                                     tp + "resid_mid", tp + "mlp_norm")
        # the MoE block quantizes its (tokens, d) view of hn at `moe.input` itself
        m = moe_block(nx, w, cfg, i, hn) if cfg.is_moe(i) else dense_block(nx, w, i, hn, fused=hq)
        return x, m
