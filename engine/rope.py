"""Rotary position embeddings: frequency tables (default, linear, llama3, YaRN) and the two layouts.

* rotate-half (Llama / Qwen / Mixtral / OLMoE, DeepSeek-V3 with
  ``rope_interleave: false``): pairs (x_i, x_{i+d/2});
* interleaved (DeepSeek-V2, DeepSeek-V3 with ``rope_interleave: true``): pairs
  (x_{2i}, x_{2i+1}). `apply_rope_interleaved` de-interleaves first and returns
  the rotated pairs in rotate-half order [even | odd]; applied to q and k alike,
  this permutation of the rope dims leaves every q.k score unchanged.

YaRN (Peng et al. 2023, as in DeepSeek-V2/V3): frequencies blend interpolation
(``inv / factor``) and extrapolation with a linear ramp between the correction
dims of ``beta_fast`` / ``beta_slow`` rotations; cos/sin are multiplied by the
attention factor ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
(1 for DeepSeek's checkpoints) and DeepSeek's softmax scale gets the extra
``mscale(factor, mscale_all_dim) ** 2`` (`softmax_scale`), where
``mscale(s, m) = 0.1 * m * ln(s) + 1`` for s > 1, else 1.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from engine.config import ModelConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rope_kind(rs: Mapping[str, Any] | None) -> str | None:
    """The rope scaling type of a `rope_scaling` mapping (None when absent)."""
    rs = rs or {}
    return rs.get("rope_type", rs.get("type"))


def _yarn_factor(cfg: ModelConfig, rs: Mapping[str, Any]) -> float:
    """YaRN's context factor (DeepSeek: derived from max_position when absent)."""
    factor = rs.get("factor")
    if factor is None:
        factor = cfg.max_position / float(rs["original_max_position_embeddings"])
    return float(factor)


def _yarn_inv_freq(cfg: ModelConfig, rs: Mapping[str, Any], dim: int) -> torch.Tensor:
    """YaRN inverse frequencies (dim/2,): interpolation/extrapolation blended by a linear ramp."""
    base = cfg.rope_theta
    factor = _yarn_factor(cfg, rs)
    beta_fast = float(rs.get("beta_fast") or 32)
    beta_slow = float(rs.get("beta_slow") or 1)
    old_ctx = float(rs["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        """The dimension index completing `rotations` turns over the original context."""
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 = extrapolate (high-frequency dims keep their frequency)
    return interpolation * (1 - keep) + extrapolation * keep


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (rope_dim/2,) in fp32, with linear / llama3 / yarn scaling."""
    hd = cfg.rope_dim
    rs = cfg.rope_scaling or {}
    kind = _rope_kind(rs)
    if kind == "yarn":
        return _yarn_inv_freq(cfg, rs, hd)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
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


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor multiplying cos/sin (YaRN's attention factor; 1 otherwise)."""
    rs = cfg.rope_scaling or {}
    if _rope_kind(rs) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = _yarn_factor(cfg, rs)
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all:
        return float(_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all)))
    return _yarn_mscale(factor)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """DeepSeek's attention softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under scaled RoPE."""
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim ** (-0.5)
    rs = cfg.rope_scaling or {}
    if _rope_kind(rs) not in (None, "default") and rs.get("mscale_all_dim"):
        m = _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def rope_tables(inv_freq: torch.Tensor, pos: torch.Tensor, attention_factor: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (..., rope_dim) for absolute positions `pos` (t,) or (batch, t)."""
    freqs = pos.float()[..., None] * inv_freq  # (..., rope_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (t, rope_dim)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x (batch, heads, t, d), cos/sin (t, d)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE: x (batch, heads, t, d) with pairs (x_2i, x_2i+1); returns [rot_even | rot_odd]."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]  # (t, d/2): the per-pair angle
    xe, xo = x[..., 0::2], x[..., 1::2]  # (batch, heads, t, d/2) each
    return torch.cat((xe * c - xo * s, xo * c + xe * s), dim=-1)
