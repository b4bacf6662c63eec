"""Attention blocks: GQA/MQA (with optional q/k RMSNorm, qkv clipping) and DeepSeek MLA, plus the KV cache.

Both blocks take the layer's normed hidden state and return the o_proj output,
emitting the canonical taps (see `engine.model` for their definitions). Every
GEMM goes through `Numerics.linear`, attention through `Numerics.attention`.

MLA (DeepSeek-V2/V3) runs in the "naive" expanded form: the cache holds the
compressed latent c_kv = norm(kv_a(x))[:kv_lora_rank] and the RoPE'd shared key
k_pe, as DeepSeek serves it; per-head K_nope / V are re-expanded from the
cached latent with kv_b_proj at every call. Cache formats: the latent is
stored at site ``kv.v`` (V is a linear function of it, and it is the bulk of
the cache), the rope key at ``kv.k``; ``<fmt>:head`` treats each as one head.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from engine.config import ModelConfig
from engine.formats import QTensor
from engine.numerics import Numerics
from engine.rope import apply_rope, apply_rope_interleaved


@dataclasses.dataclass
class KVCache:
    """A contiguous per-layer KV cache, stored in cache format.

    GQA: k, v (batch, kv_heads, max_tokens, head_dim). MLA: k = the RoPE'd
    shared key (batch, 1, max_tokens, qk_rope_head_dim), v = the normed latent
    c_kv (batch, 1, max_tokens, kv_lora_rank).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_tokens: int, device: torch.device) -> "KVCache":
        """Allocate an empty cache."""
        if cfg.mla is not None:
            k_shape = (batch, 1, max_tokens, cfg.mla.qk_rope_head_dim)
            v_shape = (batch, 1, max_tokens, cfg.mla.kv_lora_rank)
        else:
            k_shape = v_shape = (batch, cfg.num_kv_heads, max_tokens, cfg.head_dim)
        return cls([torch.zeros(k_shape, device=device) for _ in range(cfg.num_layers)],
                   [torch.zeros(v_shape, device=device) for _ in range(cfg.num_layers)])

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this call's k/v (batch, heads, t, dim) at the current length; return everything cached so far."""
        s, t = self.length, k.shape[2]
        self.k[layer][:, :, s:s + t] = k
        self.v[layer][:, :, s:s + t] = v
        return self.k[layer][:, :, :s + t], self.v[layer][:, :, :s + t]


def _attn_output(nx: Numerics, w: Mapping[str, torch.Tensor], a: torch.Tensor, p: str, tp: str,
                 fused: QTensor | None = None) -> torch.Tensor:
    """attn.out rounding/quantization (FP8 output feeds o_proj directly), then o_proj; emits attn.out, attn.o_proj.
    `fused`: the attention kernel stored `a` in the attn.out format already and quantized it for o_proj
    (`Numerics.paged_attention`)."""
    out_spec = nx.recipe.spec("attn.out", tp + "attn.o_proj")
    a_in: torch.Tensor | QTensor
    if fused is not None:
        nx.emit(tp + "attn.out", a)
        a_in = nx.act_quant(a, tp + "attn.o_proj", fused=fused)
    elif out_spec in ("fp32", "bf16", "fp16"):
        a_in = nx.round(a, "attn.out", tp + "attn.o_proj")
        nx.emit(tp + "attn.out", a_in)
    else:  # FP8 attention output: the QTensor feeds o_proj directly (no re-quantization)
        a_in = nx.quant(a, "attn.out", tp + "attn.o_proj")
        if nx.tapping:
            nx.emit(tp + "attn.out", a_in.dequantize())
    o = nx.linear(a_in, w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"), tp + "attn.o_proj")
    nx.emit(tp + "attn.o_proj", o)
    return o


def _store(nx: Numerics, cache: KVCache | None, i: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
           module: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This call's K and V (batch, kv_heads, t, d) in their cache formats (`Numerics.kv_store`), appended to the
    contiguous cache of layer `i` when there is one: (every cached K, V so far, their positions (tk,))."""
    k, v = nx.kv_store(k, "kv.k", module), nx.kv_store(v, "kv.v", module)
    if cache is None:
        return k, v, pos
    t = k.shape[2]
    k, v = cache.append(i, k, v)
    return k, v, torch.arange(0, cache.length + t, device=k.device)


def gqa_attention(nx: Numerics, w: Mapping[str, torch.Tensor], cfg: ModelConfig, i: int, hn: torch.Tensor,
                  pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                  fused: QTensor | None = None) -> torch.Tensor:
    """Multi-head / grouped-query attention of layer `i` on the normed input hn (batch, t, d) -> (batch, t, d);
    `fused`: the norm's own quantization of hn (`Numerics.rmsnorm_quant`), if it made one.

    Optional q/k RMSNorm (`cfg.qk_norm`: per head for Qwen3, over the whole
    projection for OLMoE) between projection and RoPE, and OLMoE's clip_qkv.
    """
    p, tp = f"model.layers.{i}.", f"layers.{i}."
    b, t, _ = hn.shape
    hd, h, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    hq = nx.act_quant(hn, tp + "attn.qkv", fused=fused)  # fused RMSNorm -> quant, shared by q/k/v
    if nx.tapping:
        nx.emit(tp + "attn_norm", hq.dequantize())
    names = ("q_proj", "k_proj", "v_proj")
    q, k, v = nx.linears(hq, [w[f"{p}self_attn.{n}.weight"] for n in names],
                         [w.get(f"{p}self_attn.{n}.bias") for n in names], [f"{tp}attn.{n}" for n in names])
    nx.emit(tp + "attn.q", q)
    nx.emit(tp + "attn.k", k)
    nx.emit(tp + "attn.v", v)
    if cfg.qk_norm is not None:
        qw, kw = w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"]
        if cfg.qk_norm == "head":
            q = nx.rmsnorm(q.view(b, t, h, hd), qw, cfg.rms_norm_eps, tp + "attn.q_norm").reshape(b, t, h * hd)
            k = nx.rmsnorm(k.view(b, t, hkv, hd), kw, cfg.rms_norm_eps, tp + "attn.k_norm").reshape(b, t, hkv * hd)
        else:
            q = nx.rmsnorm(q, qw, cfg.rms_norm_eps, tp + "attn.q_norm")  # (batch, t, heads*hd)
            k = nx.rmsnorm(k, kw, cfg.rms_norm_eps, tp + "attn.k_norm")  # (batch, t, kv_heads*hd)
        nx.emit(tp + "attn.q_norm", q)
        nx.emit(tp + "attn.k_norm", k)
    if cfg.clip_qkv is not None:
        c = cfg.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    # (batch, heads, t, hd), (batch, kv_heads, t, hd)
    q, k = nx.rope(q.view(b, t, h, hd).transpose(1, 2), k.view(b, t, hkv, hd).transpose(1, 2), cos, sin)
    v = v.view(b, t, hkv, hd).transpose(1, 2)  # (batch, kv_heads, t, hd)
    if cache is not None and hasattr(cache, "attend"):  # paged runtime: the cache stores (in format) and attends
        a, a_fused = cache.attend(nx, i, q, k, v, tp + "attn", cfg.window(i))
        return _attn_output(nx, w, a, p, tp, a_fused)
    k, v, k_pos = _store(nx, cache, i, k, v, pos, tp + "attn")
    a = nx.attention(q, k, v, pos, k_pos, tp + "attn", cfg.window(i))  # (batch, t, heads*hd)
    return _attn_output(nx, w, a, p, tp)


def mla_attention(nx: Numerics, w: Mapping[str, torch.Tensor], cfg: ModelConfig, i: int, hn: torch.Tensor,
                  pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                  scale: float, fused: QTensor | None = None) -> torch.Tensor:
    """DeepSeek multi-head latent attention of layer `i`: hn (batch, t, d) -> (batch, t, d).

    q = q_b(norm(q_a(x))) or q_proj(x), per head [q_nope | q_pe]; [c_kv | k_pe] =
    kv_a_proj_with_mqa(x); c_kv = norm(c_kv) and RoPE(k_pe) are cached; per head
    [k_nope | v] = kv_b_proj(c_kv); K = [k_nope | RoPE(k_pe)], Q = [q_nope | RoPE(q_pe)];
    softmax scale `scale` (qk_head_dim^-0.5 with YaRN's mscale correction).
    """
    m = cfg.mla
    assert m is not None
    p, tp, a = f"model.layers.{i}.", f"layers.{i}.", f"model.layers.{i}.self_attn."
    b, t, _ = hn.shape
    h, nope, rope, dv = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    hq = nx.act_quant(hn, tp + "attn.qkv", fused=fused)  # fused RMSNorm -> quant, shared by q_a / q and kv_a
    if nx.tapping:
        nx.emit(tp + "attn_norm", hq.dequantize())
    if m.q_lora_rank is None:
        q = nx.linear(hq, w[a + "q_proj.weight"], None, tp + "attn.q_proj")
    else:
        qa = nx.linear(hq, w[a + "q_a_proj.weight"], w.get(a + "q_a_proj.bias"), tp + "attn.q_a_proj")
        nx.emit(tp + "attn.q_a", qa)
        qa, qa_fused = nx.rmsnorm_quant(qa, w[a + "q_a_layernorm.weight"], m.latent_norm_eps,
                                        tp + "attn.q_a_layernorm")
        qa_q = nx.act_quant(qa, tp + "attn.q_b_proj", fused=qa_fused)  # fused RMSNorm -> quant
        q = nx.linear(qa_q, w[a + "q_b_proj.weight"], None, tp + "attn.q_b_proj")
    nx.emit(tp + "attn.q", q)  # (batch, t, heads*(nope+rope)), before RoPE
    kv_a = nx.linear(hq, w[a + "kv_a_proj_with_mqa.weight"], w.get(a + "kv_a_proj_with_mqa.bias"),
                     tp + "attn.kv_a_proj_with_mqa")
    nx.emit(tp + "attn.kv_a", kv_a)  # (batch, t, kv_lora_rank + rope)
    c_kv, k_pe = kv_a.split([m.kv_lora_rank, rope], dim=-1)
    c_kv = nx.rmsnorm(c_kv, w[a + "kv_a_layernorm.weight"], m.latent_norm_eps, tp + "attn.kv_a_layernorm")
    rot = apply_rope_interleaved if m.rope_interleave else apply_rope
    q = q.view(b, t, h, nope + rope).transpose(1, 2)  # (batch, heads, t, nope+rope)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q = torch.cat((q_nope, rot(q_pe, cos, sin)), dim=-1)  # (batch, heads, t, nope+rope)
    k_pe_raw = k_pe
    k_pe = rot(k_pe.reshape(b, 1, t, rope), cos, sin)  # (batch, 1, t, rope)
    c_kv = c_kv.reshape(b, 1, t, m.kv_lora_rank)  # (batch, 1, t, kv_lora_rank)
    if cache is not None and hasattr(cache, "attend"):  # paged runtime: every row's pages, padded to the longest
        k_pe, c_kv = nx.paged_latent(cache, i, k_pe, c_kv, tp + "attn")  # (batch, 1, n, rope|kv_lora_rank)
        k_pos = torch.arange(c_kv.shape[2], device=hn.device)  # a row's positions past its query: causally masked
        k, v, kv = _mla_keys(nx, w, cfg, i, k_pe, c_kv)
        new = kv.gather(1, pos[:, :, None].expand(b, t, kv.shape[-1]))  # this call's tokens, at each row's positions
    else:
        k_pe, c_kv, k_pos = _store(nx, cache, i, k_pe, c_kv, pos, tp + "attn")
        k, v, kv = _mla_keys(nx, w, cfg, i, k_pe, c_kv)
        new = kv[:, kv.shape[1] - t:]  # this call's tokens
    nx.emit(tp + "attn.kv", new)
    if nx.tapping:
        k_nope_new, v_new = new.view(b, t, h, nope + dv).split([nope, dv], dim=-1)  # (batch, t, heads, nope|dv)
        k_tap = torch.cat((k_nope_new, k_pe_raw[:, :, None, :].expand(b, t, h, rope)), dim=-1)  # (b, t, h, nope+rope)
        nx.emit(tp + "attn.k", k_tap.reshape(b, t, h * (nope + rope)))
        nx.emit(tp + "attn.v", v_new.reshape(b, t, h * dv))
    out = nx.attention(q, k, v, pos, k_pos, tp + "attn", cfg.window(i), scale=scale)  # (batch, t, heads*dv)
    return _attn_output(nx, w, out, p, tp)


def _mla_keys(nx: Numerics, w: Mapping[str, torch.Tensor], cfg: ModelConfig, i: int, k_pe: torch.Tensor,
              c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's per-head keys and values from the cached RoPE'd key k_pe (batch, 1, tk, rope) and latent c_kv
    (batch, 1, tk, kv_lora_rank) (cache-format values): (k (batch, heads, tk, nope+rope), v (batch, heads, tk, dv),
    the kv_b_proj output (batch, tk, heads*(nope+dv)))."""
    m = cfg.mla
    b, tk = c_kv.shape[0], c_kv.shape[2]
    h, nope, rope, dv = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    a = f"model.layers.{i}.self_attn."
    kv = nx.linear(c_kv[:, 0], w[a + "kv_b_proj.weight"], None, f"layers.{i}.attn.kv_b_proj")  # (b, tk, h*(nope+dv))
    k_nope, v = kv.view(b, tk, h, nope + dv).transpose(1, 2).split([nope, dv], dim=-1)  # (batch, heads, tk, ...)
    return torch.cat((k_nope, k_pe.expand(b, h, tk, rope)), dim=-1), v, kv
