"""Real-LLM activation structure planted in a trained checkpoint by function-preserving rescalings.

A model source `outliers:FOLDER` (`engine.loading.parse_source`) loads the HF model in FOLDER and applies
`add_outliers` to its fp32 weights before anything else sees them, so the engine and the FP32 reference run the
same transformed weights. Every step multiplies one tensor's rows (or entries) by s and divides the consumer's
matching input columns by s, where the function between them is linear in that channel:

* **massive MLP channels** (the down projection's input): the up projection's row j x s, the down projection's
  column j / s, in every dense MLP, shared expert and routed expert; SiLU(gate) x up is linear in up.
* **outlier hidden channels** (the inputs of q/k/v or the MLA down projections, and of gate/up, router and
  experts): the RMSNorm gain's channel c x s, every linear reading that norm's output: column c / s. The same
  channels in every layer, as outlier features are systematic across layers. The MLA q latent norm and its
  q_b_proj likewise.
* **an outlier KV head** (GQA): K head g's k_proj rows x s, the q_proj rows of every query head of its group / s
  (RoPE is linear per head, the scores are unchanged); V head g' rows x s, the o_proj columns of its query
  heads / s (the attention output is linear in V).
* **an outlier channel in the MLA latent cache**: kv_a_layernorm's channel x s, kv_b_proj's column / s.

Every factor is a power of two, so each rescaled weight is exact in binary floating point and every product
x_j w_j of a GEMM is the same number as before: the FP32 forward pass matches the original up to the
accumulation order of the ops (tests/engine/test_outliers.py measures it). Quantization sees the outliers: a
block or tensor scale that contains a scaled channel or head is set by it.

Not reachable this way: outliers in the residual stream itself (RMSNorm's denominator sees them), larger
attention logits (they are the function), a different router distribution (its scores are the function).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

from engine.config import ModelConfig
from engine.errors import WeightsError

SUPPORTED = ("llama", "mistral", "deepseek_v3")


def _pow2(name: str, value: float) -> None:
    """Raise unless `value` is a power of two >= 1 (exact rescaling in binary floating point)."""
    if value < 1 or 2.0 ** round(math.log2(value)) != value:
        raise ValueError(f"OutlierPlan.{name} = {value}: must be a power of two >= 1 (an exact rescaling)")


@dataclasses.dataclass(frozen=True)
class OutlierPlan:
    """What `add_outliers` plants (counts per layer and power-of-two factors); the source `outliers:` uses the
    defaults. seed picks the channels and heads (torch.Generator)."""

    mlp_channels: int = 2          # massive channels of each MLP's intermediate (per dense MLP / expert)
    mlp_scale: float = 256.0
    hidden_channels: int = 2       # outlier channels of the post-norm hidden (same channels in every layer)
    hidden_scale: float = 64.0
    k_heads: int = 1               # KV heads whose K is scaled up (GQA models)
    k_scale: float = 32.0
    v_heads: int = 1               # KV heads whose V is scaled up (GQA models)
    v_scale: float = 16.0
    latent_channels: int = 1       # MLA latent cache channels (kv_a_layernorm -> kv_b_proj)
    latent_scale: float = 32.0
    seed: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name.endswith("_scale"):
                _pow2(f.name, getattr(self, f.name))
            elif getattr(self, f.name) < 0:
                raise ValueError(f"OutlierPlan.{f.name} = {getattr(self, f.name)}: must be >= 0")

    def tag(self) -> str:
        """A short digest of the plan (mixed into the transformed model's sha256)."""
        return hashlib.sha256(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]


DEFAULT_PLAN = OutlierPlan()


def _scale_rows(w: dict[str, torch.Tensor], name: str, rows: torch.Tensor, s: float) -> None:
    """w[name][rows] x s (and the matching bias entries, when the linear has a bias)."""
    t = w[name].clone()
    t[rows] *= s
    w[name] = t
    bias = name.removesuffix(".weight") + ".bias"
    if name.endswith(".weight") and bias in w:
        b = w[bias].clone()
        b[rows] *= s
        w[bias] = b


def _scale_cols(w: dict[str, torch.Tensor], name: str, cols: torch.Tensor, s: float) -> None:
    """w[name][..., cols] / s (the input columns of a linear, or of a stack of experts)."""
    t = w[name].clone()
    t[..., cols] /= s
    w[name] = t


def _pick(g: torch.Generator, n: int, k: int) -> torch.Tensor:
    """k distinct indices of range(n), sorted."""
    return torch.randperm(n, generator=g)[:min(k, n)].sort().values


def _mlp(w: dict[str, torch.Tensor], p: str, inter: int, plan: OutlierPlan, g: torch.Generator) -> None:
    """Massive channels in a SwiGLU MLP named p + {up_proj, down_proj}.weight."""
    j = _pick(g, inter, plan.mlp_channels)
    _scale_rows(w, p + "up_proj.weight", j, plan.mlp_scale)
    _scale_cols(w, p + "down_proj.weight", j, plan.mlp_scale)


def _experts(w: dict[str, torch.Tensor], p: str, n_exp: int, inter: int, plan: OutlierPlan,
             g: torch.Generator) -> None:
    """Massive channels in each routed expert of the stacks p + experts.{gate_up_proj, down_proj}."""
    gu, down = w[p + "experts.gate_up_proj"].clone(), w[p + "experts.down_proj"].clone()
    for e in range(n_exp):
        j = _pick(g, inter, plan.mlp_channels)
        gu[e, inter + j] *= plan.mlp_scale  # (2*inter, d): up rows follow the gate rows
        down[e][:, j] /= plan.mlp_scale      # (d, inter)
    w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"] = gu, down


def _norm(w: dict[str, torch.Tensor], norm: str, consumers: list[str], c: torch.Tensor, s: float) -> None:
    """The norm's channels c x s, every consumer's input columns c / s."""
    _scale_rows(w, norm, c, s)
    for name in consumers:
        _scale_cols(w, name, c, s)


def _gqa_heads(w: dict[str, torch.Tensor], cfg: ModelConfig, a: str, plan: OutlierPlan, g: torch.Generator) -> None:
    """An outlier K head (q rows of its group / s) and an outlier V head (o_proj columns of its group / s)."""
    hd, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads

    def rows(heads: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in heads.tolist()])

    def queries(kv: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.arange(k * group, (k + 1) * group) for k in kv.tolist()])

    kh = _pick(g, cfg.num_kv_heads, plan.k_heads)
    if kh.numel():
        _scale_rows(w, a + "k_proj.weight", rows(kh), plan.k_scale)
        _scale_rows(w, a + "q_proj.weight", rows(queries(kh)), 1.0 / plan.k_scale)
    vh = _pick(g, cfg.num_kv_heads, plan.v_heads)
    if vh.numel():
        _scale_rows(w, a + "v_proj.weight", rows(vh), plan.v_scale)
        _scale_cols(w, a + "o_proj.weight", rows(queries(vh)), plan.v_scale)


def add_outliers(cfg: ModelConfig, weights: dict[str, torch.Tensor], plan: OutlierPlan = DEFAULT_PLAN,
                 where: str = "outliers") -> dict[str, torch.Tensor]:
    """Plant `plan` in `weights` (HF names, routed experts stacked; the tensors changed are replaced, not written
    in place) and return the dict. Function-preserving in exact arithmetic (module docstring)."""
    if cfg.model_type not in SUPPORTED:
        raise WeightsError(f"{where}: outliers: supports model types {SUPPORTED}, not '{cfg.model_type}'")
    if cfg.qk_norm is not None or cfg.clip_qkv is not None:
        raise WeightsError(f"{where}: outliers: a q/k norm or clip_qkv is not linear in K; not supported")
    w = weights
    g = torch.Generator().manual_seed(plan.seed)
    d = cfg.hidden_size
    hidden = _pick(g, d, plan.hidden_channels)
    m = cfg.mla
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        if m is None:
            attn_in = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        else:
            attn_in = [a + ("q_proj.weight" if m.q_lora_rank is None else "q_a_proj.weight"),
                       a + "kv_a_proj_with_mqa.weight"]
        _norm(w, p + "input_layernorm.weight", attn_in, hidden, plan.hidden_scale)
        if cfg.is_moe(i):
            moe = cfg.moe
            mlp_in = [p + "mlp.gate.weight", p + "mlp.experts.gate_up_proj"]
            if moe.shared_intermediate_size:
                mlp_in += [p + "mlp.shared_experts.gate_proj.weight", p + "mlp.shared_experts.up_proj.weight"]
        else:
            mlp_in = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        _norm(w, p + "post_attention_layernorm.weight", mlp_in, hidden, plan.hidden_scale)
        if cfg.is_moe(i):
            _experts(w, p + "mlp.", moe.num_experts, moe.intermediate_size, plan, g)
            if moe.shared_intermediate_size:
                _mlp(w, p + "mlp.shared_experts.", moe.shared_intermediate_size, plan, g)
        else:
            _mlp(w, p + "mlp.", cfg.intermediate_size, plan, g)
        if m is None:
            _gqa_heads(w, cfg, a, plan, g)
            continue
        if m.q_lora_rank is not None:
            _norm(w, a + "q_a_layernorm.weight", [a + "q_b_proj.weight"], _pick(g, m.q_lora_rank,
                                                                                plan.hidden_channels),
                  plan.hidden_scale)
        _norm(w, a + "kv_a_layernorm.weight", [a + "kv_b_proj.weight"], _pick(g, m.kv_lora_rank,
                                                                              plan.latent_channels),
              plan.latent_scale)
    return w
