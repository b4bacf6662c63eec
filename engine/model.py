"""One config-driven decoder-only transformer (Llama family: GQA, RoPE, RMSNorm, SwiGLU).

Weights are kept under HF parameter names, in fp32, so that an HF checkpoint
loads unchanged and the FP32 reference can be built from the same tensors.
All arithmetic goes through `engine.numerics.Numerics` (the recipe decides).

Canonical taps emitted per forward (ARCHITECTURE.md): ``embed``,
``layers.{i}.attn_norm``, ``layers.{i}.attn.{q,k,v}`` (projection outputs,
before RoPE), ``layers.{i}.attn.out`` (attention output, input of o_proj),
``layers.{i}.attn.o_proj``, ``layers.{i}.resid_mid``, ``layers.{i}.mlp_norm``,
``layers.{i}.mlp.act`` (SwiGLU output, input of down_proj),
``layers.{i}.mlp.out``, ``layers.{i}.resid_out``, ``final_norm``, ``logits``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.errors import WeightsError
from engine.formats import QTensor
from engine.numerics import Numerics


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with its shape."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (qd, d),
            p + "self_attn.k_proj.weight": (kvd, d),
            p + "self_attn.v_proj.weight": (kvd, d),
            p + "self_attn.o_proj.weight": (d, qd),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (qd,), p + "self_attn.k_proj.bias": (kvd,),
                           p + "self_attn.v_proj.bias": (kvd,)})
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,), p + "mlp.down_proj.bias": (d,)})
    return shapes


def check_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise `WeightsError` naming the first missing / misshapen / non-finite tensor."""
    shapes = expected_shapes(cfg)
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise WeightsError(f"{where}: checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}")
    for name, shape in shapes.items():
        t = weights[name]
        if tuple(t.shape) != shape:
            raise WeightsError(f"{where}: tensor '{name}' has shape {tuple(t.shape)}, config expects {shape}")
        if not torch.isfinite(t).all():
            raise WeightsError(f"{where}: tensor '{name}' holds NaN/Inf values; the checkpoint is corrupt")


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim/2,) in fp32, with linear / llama3 scaling."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x (batch, heads, t, d), cos/sin (t, d)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


@dataclasses.dataclass
class KVCache:
    """A contiguous per-layer KV cache (batch, kv_heads, max_tokens, head_dim), stored in cache format."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_tokens: int, device: torch.device) -> "KVCache":
        """Allocate an empty cache."""
        shape = (batch, cfg.num_kv_heads, max_tokens, cfg.head_dim)
        return cls([torch.zeros(shape, device=device) for _ in range(cfg.num_layers)],
                   [torch.zeros(shape, device=device) for _ in range(cfg.num_layers)])


class Transformer:
    """The engine's model: fp32 master weights + the forward pass through `Numerics`.

    `weights` maps HF names to tensors (checked against the config). The model
    holds no recipe; `engine.api.Engine` pairs it with one and prepares weights.
    """

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], where: str = "<weights>"):
        check_weights(cfg, weights, where)
        self.cfg = cfg
        self.weights = {n: weights[n].float() for n in expected_shapes(cfg)}
        if cfg.tie_word_embeddings:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.inv_freq = rope_inv_freq(cfg)

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
        """Quantize every weight into its recipe format once (dequantized values, fp32)."""
        out: dict[str, torch.Tensor] = {}
        for name, w in self.weights.items():
            if name.endswith(".bias") or "norm" in name:
                out[name] = w
            elif name == "model.embed_tokens.weight":
                out[name] = nx.prepare_weight(w, "embed", "embed")
            elif name == "lm_head.weight":
                out[name] = nx.prepare_weight(w, "lm_head", "lm_head")
            else:
                out[name] = nx.prepare_weight(w, "linear.weight", _module_path(name))
        return out

    def forward(self, nx: Numerics, w: Mapping[str, torch.Tensor], tokens: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """Logits (batch, t, vocab) fp32 for `tokens` (batch, t); appends to `cache` when given."""
        cfg = self.cfg
        b, t = tokens.shape
        start = cache.length if cache is not None else 0
        pos = torch.arange(start, start + t, device=tokens.device)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # (t, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (t, head_dim)
        cos, sin = emb.cos(), emb.sin()

        x = F.embedding(tokens, w["model.embed_tokens.weight"])  # (batch, t, d)
        x = nx.round(x, "residual", "embed")
        nx.emit("embed", x)
        for i in range(cfg.num_layers):
            x = self._layer(nx, w, i, x, pos, cos, sin, cache)
        if cache is not None:
            cache.length += t
        h = nx.rmsnorm(x, w["model.norm.weight"], cfg.rms_norm_eps, "final_norm")
        nx.emit("final_norm", h)
        head_spec = nx.recipe.spec("lm_head", "lm_head")
        if head_spec in ("fp32", "bf16", "fp16"):
            h = nx.round(h, "lm_head", "lm_head")  # high-precision head: input in the same float type
        else:
            h = nx.quant(h, "linear.input", "lm_head").dequantize()
        logits = F.linear(h, w["lm_head.weight"])  # (batch, t, vocab), fp32 GEMM
        nx.emit("logits", logits)
        return logits

    def _layer(self, nx: Numerics, w: Mapping[str, torch.Tensor], i: int, x: torch.Tensor, pos: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """One decoder layer: x + attn(norm(x)), then + mlp(norm(.))."""
        cfg = self.cfg
        p, tp = f"model.layers.{i}.", f"layers.{i}."
        b, t, _ = x.shape
        hd, h, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

        hn = nx.rmsnorm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps, tp + "attn_norm")
        hq = nx.act_quant(hn, tp + "attn.qkv")  # fused RMSNorm -> quant, shared by q/k/v
        nx.emit(tp + "attn_norm", hq.dequantize())
        q = nx.linear(hq, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"), tp + "attn.q_proj")
        k = nx.linear(hq, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"), tp + "attn.k_proj")
        v = nx.linear(hq, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"), tp + "attn.v_proj")
        nx.emit(tp + "attn.q", q)
        nx.emit(tp + "attn.k", k)
        nx.emit(tp + "attn.v", v)
        q = apply_rope(q.view(b, t, h, hd).transpose(1, 2), cos, sin)  # (batch, heads, t, hd)
        k = apply_rope(k.view(b, t, hkv, hd).transpose(1, 2), cos, sin)  # (batch, kv_heads, t, hd)
        v = v.view(b, t, hkv, hd).transpose(1, 2)  # (batch, kv_heads, t, hd)
        k = nx.kv_store(k, "kv.k", tp + "attn")
        v = nx.kv_store(v, "kv.v", tp + "attn")
        if cache is not None:
            s = cache.length
            cache.k[i][:, :, s:s + t] = k
            cache.v[i][:, :, s:s + t] = v
            k, v = cache.k[i][:, :, :s + t], cache.v[i][:, :, :s + t]
            k_pos = torch.arange(0, s + t, device=x.device)
        else:
            k_pos = pos
        a = nx.attention(q, k, v, pos, k_pos, tp + "attn", cfg.sliding_window)  # (batch, t, heads*hd)
        out_spec = nx.recipe.spec("attn.out", tp + "attn.o_proj")
        a_in: torch.Tensor | QTensor
        if out_spec in ("fp32", "bf16", "fp16"):
            a_in = nx.round(a, "attn.out", tp + "attn.o_proj")
            nx.emit(tp + "attn.out", a_in)
        else:  # FP8 attention output: the QTensor feeds o_proj directly (no re-quantization)
            a_in = nx.quant(a, "attn.out", tp + "attn.o_proj")
            nx.emit(tp + "attn.out", a_in.dequantize())
        o = nx.linear(a_in, w[p + "self_attn.o_proj.weight"], None, tp + "attn.o_proj")
        nx.emit(tp + "attn.o_proj", o)
        x = nx.round(x + o, "residual", tp + "resid_mid")
        nx.emit(tp + "resid_mid", x)

        hn = nx.rmsnorm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps, tp + "mlp_norm")
        hq = nx.act_quant(hn, tp + "mlp.gate_up")  # fused RMSNorm -> quant, shared by gate/up
        nx.emit(tp + "mlp_norm", hq.dequantize())
        g = nx.linear(hq, w[p + "mlp.gate_proj.weight"], w.get(p + "mlp.gate_proj.bias"), tp + "mlp.gate_proj")
        u = nx.linear(hq, w[p + "mlp.up_proj.weight"], w.get(p + "mlp.up_proj.bias"), tp + "mlp.up_proj")
        act = F.silu(g) * u
        aq = nx.act_quant(act, tp + "mlp.down_proj")  # fused SwiGLU -> quant
        nx.emit(tp + "mlp.act", aq.dequantize())
        m = nx.linear(aq, w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias"), tp + "mlp.down_proj")
        nx.emit(tp + "mlp.out", m)
        x = nx.round(x + m, "residual", tp + "resid_out")
        nx.emit(tp + "resid_out", x)
        return x


def _module_path(hf_name: str) -> str:
    """Map an HF weight name to the engine's module path (e.g. 'layers.3.attn.q_proj')."""
    name = hf_name.removeprefix("model.").removesuffix(".weight").removesuffix(".bias")
    return name.replace("self_attn", "attn")
