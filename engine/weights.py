"""The weight inventory of a `ModelConfig`: names, shapes, canonical naming and the recipe site of each tensor.

The engine keeps weights under HF checkpoint names. Routed experts are held
one tensor per expert and projection, under the DeepSeek / Qwen checkpoint
spelling ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``;
`canonical_weights` maps the other layouts onto it:

* Mixtral checkpoints: ``block_sparse_moe.gate`` -> ``mlp.gate``, and
  ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` -> ``gate_proj / up_proj / down_proj``;
* transformers-5 fused in-memory layout (a state dict saved without the
  checkpoint conversion): ``mlp.experts.gate_up_proj`` (experts, 2*inter, d),
  gate rows first, and ``mlp.experts.down_proj`` (experts, d, inter).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch

from engine.config import ModelConfig
from engine.errors import WeightsError

_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(\.weight)?$")
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def canonical_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename / split expert tensors into the engine's per-expert names (other tensors pass through)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        m = _MIXTRAL_EXPERT.match(name)
        if m:
            out[f"{m.group(1)}.mlp.experts.{m.group(2)}.{_MIXTRAL_PROJ[m.group(3)]}.weight"] = t
            continue
        if ".block_sparse_moe.gate.weight" in name:
            out[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = t
            continue
        m = _FUSED.match(name)
        if m and t.dim() == 3:
            base = m.group(1)
            if m.group(2) == "gate_up_proj":
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}.{e}.gate_proj.weight"] = t[e, :inter]  # (inter, d)
                    out[f"{base}.{e}.up_proj.weight"] = t[e, inter:]  # (inter, d)
            else:
                for e in range(t.shape[0]):
                    out[f"{base}.{e}.down_proj.weight"] = t[e]  # (d, inter)
            continue
        out[name] = t
    return out


def _mlp_shapes(prefix: str, d: int, f: int, bias: bool) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's gate/up/down tensors under `prefix` (e.g. 'model.layers.0.mlp.')."""
    shapes: dict[str, tuple[int, ...]] = {prefix + "gate_proj.weight": (f, d), prefix + "up_proj.weight": (f, d),
                                          prefix + "down_proj.weight": (d, f)}
    if bias:
        shapes.update({prefix + "gate_proj.bias": (f,), prefix + "up_proj.bias": (f,), prefix + "down_proj.bias": (d,)})
    return shapes


def _attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The attention tensors of one layer (prefix `p` = 'model.layers.{i}.')."""
    d, hd, h = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    a = p + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.mla is not None:
        m = cfg.mla
        if m.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (h * m.qk_head_dim, d)
        else:
            shapes.update({a + "q_a_proj.weight": (m.q_lora_rank, d), a + "q_a_layernorm.weight": (m.q_lora_rank,),
                           a + "q_b_proj.weight": (h * m.qk_head_dim, m.q_lora_rank)})
            if cfg.attention_bias:
                shapes[a + "q_a_proj.bias"] = (m.q_lora_rank,)
        shapes.update({a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, d),
                       a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
                       a + "kv_b_proj.weight": (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                       a + "o_proj.weight": (d, h * m.v_head_dim)})
        if cfg.attention_bias:
            shapes[a + "kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
    else:
        qd, kvd = h * hd, cfg.num_kv_heads * hd
        shapes.update({a + "q_proj.weight": (qd, d), a + "k_proj.weight": (kvd, d), a + "v_proj.weight": (kvd, d),
                       a + "o_proj.weight": (d, qd)})
        if cfg.attention_bias:
            shapes.update({a + "q_proj.bias": (qd,), a + "k_proj.bias": (kvd,), a + "v_proj.bias": (kvd,)})
        if cfg.qk_norm == "head":
            shapes.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        elif cfg.qk_norm == "full":
            shapes.update({a + "q_norm.weight": (qd,), a + "k_norm.weight": (kvd,)})
    if cfg.o_proj_bias:
        shapes[a + "o_proj.bias"] = (d,)
    return shapes


def _moe_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The MoE block tensors of one layer: router, routed experts, shared expert (+ gate)."""
    moe, d = cfg.moe, cfg.hidden_size
    assert moe is not None
    shapes: dict[str, tuple[int, ...]] = {p + "mlp.gate.weight": (moe.num_experts, d)}
    if moe.correction_bias:
        shapes[p + "mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", d, moe.intermediate_size, False))
    if moe.shared_intermediate_size:
        if moe.shared_gate:  # Qwen2-MoE: shared_expert + sigmoid shared_expert_gate
            shapes.update(_mlp_shapes(p + "mlp.shared_expert.", d, moe.shared_intermediate_size, False))
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, d)
        else:  # DeepSeek: shared_experts (n_shared_experts fused into one wider MLP)
            shapes.update(_mlp_shapes(p + "mlp.shared_experts.", d, moe.shared_intermediate_size, cfg.mlp_bias))
    return shapes


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by (canonical) HF name, with its shape."""
    d = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        shapes.update(_attention_shapes(cfg, p))
        if cfg.is_moe(i):
            shapes.update(_moe_shapes(cfg, p))
        else:
            shapes.update(_mlp_shapes(p + "mlp.", d, cfg.intermediate_size, cfg.mlp_bias))
    return shapes


def _all_finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """No NaN / Inf in `t`, checked about `chunk` elements at a time along dim 0 (views: no full-size temporaries,
    which `isfinite` of a whole embedding would allocate several times over)."""
    if t.dim() == 0:
        return bool(torch.isfinite(t))
    rows = max(1, chunk // max(1, t[0].numel())) if t.dim() > 1 else chunk
    return all(bool(torch.isfinite(part).all()) for part in t.split(rows))


def check_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor], where: str,
                  names: Iterable[str] | None = None) -> None:
    """Raise `WeightsError` naming the first missing / misshapen / non-finite tensor of `names` (default: every
    tensor the config needs; a layer-streamed stage passes its own)."""
    shapes = expected_shapes(cfg)
    if names is not None:
        shapes = {n: shapes[n] for n in names}
    fix = ("the checkpoint and its config.json do not belong together: re-export the checkpoint, or use the config "
           "it was saved with")
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise WeightsError(f"{where}: checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}; "
                           f"{fix}")
    for name, shape in shapes.items():
        t = weights[name]
        if tuple(t.shape) != shape:
            raise WeightsError(f"{where}: tensor '{name}' has shape {tuple(t.shape)}, config expects {shape}; {fix}")
        if not _all_finite(t):
            raise WeightsError(f"{where}: tensor '{name}' holds NaN/Inf values; the checkpoint is corrupt")


def module_path(hf_name: str) -> str:
    """Map an HF weight name to the engine's module path (e.g. 'layers.3.attn.q_proj')."""
    name = hf_name.removeprefix("model.").removesuffix(".weight").removesuffix(".bias")
    return name.replace("self_attn", "attn")


def weight_site(hf_name: str) -> str | None:
    """The recipe site a weight is stored in, or None for tensors kept in fp32 (norms, biases).

    Routed experts -> ``moe.weight``; router and Qwen2-MoE shared-expert gate ->
    ``router`` (a compute precision: fp32 by default); shared experts are not
    routed and use ``linear.weight`` like any dense projection.
    """
    if hf_name.endswith("bias") or "norm" in hf_name:
        return None  # biases (incl. e_score_correction_bias) and norm weights stay fp32
    if hf_name == "model.embed_tokens.weight":
        return "embed"
    if hf_name == "lm_head.weight":
        return "lm_head"
    if hf_name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight")):
        return "router"
    if ROUTED_EXPERT.search(hf_name):
        return "moe.weight"
    return "linear.weight"
