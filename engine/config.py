"""Model configuration: a frozen dataclass built from an HF `config.json`.

One `ModelConfig` describes every architecture the engine runs; the
architecture-specific parts are optional nested frozen dataclasses:

* `MlaConfig` -- DeepSeek-V2/V3 multi-head latent attention (q / kv LoRA ranks,
  decoupled RoPE dims);
* `MoeConfig` -- the routed-expert MLP (scoring, group-limited top-k,
  normalisation, routed scaling, shared expert).

`ModelConfig.from_hf` translates HF keys (transformers 5.x names, with the
4.x spellings where they differ) and raises `ConfigError` naming the key for
anything the engine does not implement, instead of silently computing
something else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from engine.errors import ConfigError

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")
SUPPORTED_MODEL_TYPES = DENSE_TYPES + MOE_TYPES
SUPPORTED_ACTS = ("silu",)
ROPE_TYPES = (None, "default", "linear", "llama3", "yarn")
# config.json keys that must be JSON integers / numbers when present (null = absent): a quoted "256" is an error
# naming the key, not a silently converted value
INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "bos_token_id",
            "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
            "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size", "decoder_sparse_step", "moe_layer_freq", "n_group", "topk_group",
            "n_shared_experts", "first_k_dense_replace")
FLOAT_KEYS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "clip_qkv")
# o_proj carries a bias iff attention_bias is set (HF); qwen2 / mistral families never have one
_O_PROJ_BIAS_TYPES = ("llama", "qwen3", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """DeepSeek multi-head latent attention dimensions.

    q = q_b(norm(q_a(x))) (or q_proj(x) when `q_lora_rank` is None), per head
    [nope | rope]; the joint latent [c_kv | k_pe] = kv_a_proj_with_mqa(x),
    per head [k_nope | v] = kv_b(norm(c_kv)); k_pe is one RoPE key shared by
    all heads. `rope_interleave`: RoPE pairs are (x0, x1), (x2, x3)... (DeepSeek's
    layout) instead of rotate-half (x_i, x_{i+d/2}).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    latent_norm_eps: float = 1e-6  # q_a / kv_a RMSNorms use DeepSeek's default eps, not rms_norm_eps

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: nope + rope parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The routed-expert MLP of MoE layers (see `engine.routing` for the formulas).

    scoring: ``softmax`` (over all experts) or ``sigmoid`` (per expert).
    correction_bias: a per-expert bias added to the scores for *selection only*
    (DeepSeek-V3 ``e_score_correction_bias``). Group-limited top-k: experts
    form `n_group` groups; only the `topk_group` best groups (group score
    ``max`` of its scores, or ``top2sum`` = sum of its two best biased scores)
    are eligible. The top-k weights are the (unbiased) scores of the chosen
    experts, optionally renormalised to sum 1 (`norm_topk_prob`), then
    multiplied by `routed_scaling_factor`. `shared_intermediate_size` > 0 adds
    a shared expert run on every token (`shared_gate`: Qwen2-MoE's sigmoid gate).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    correction_bias: bool = False
    shared_intermediate_size: int = 0
    shared_gate: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"model config: MoE scoring '{self.scoring}' is not supported (softmax, sigmoid)")
        if self.group_score not in ("max", "top2sum"):
            raise ConfigError(f"model config: MoE group score '{self.group_score}' is not supported (max, top2sum)")
        if not 0 < self.top_k <= self.num_experts:
            raise ConfigError(f"model config: num_experts_per_tok ({self.top_k}) must be in 1..{self.num_experts}")
        if self.num_experts % self.n_group:
            raise ConfigError(f"model config: n_routed_experts ({self.num_experts}) must be a multiple of "
                              f"n_group ({self.n_group})")
        per_group = self.num_experts // self.n_group
        if not 0 < self.topk_group <= self.n_group or self.topk_group * per_group < self.top_k:
            raise ConfigError(f"model config: topk_group ({self.topk_group}) groups of {per_group} experts cannot "
                              f"supply num_experts_per_tok ({self.top_k}) experts (n_group {self.n_group})")
        if self.group_score == "top2sum" and self.n_group > 1 and per_group < 2:
            raise ConfigError(f"model config: group score 'top2sum' needs >= 2 experts per group, got {per_group}")

    @property
    def group_limited(self) -> bool:
        """True when the group restriction can exclude experts."""
        return self.n_group > 1 and self.topk_group < self.n_group


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only transformer (dense or MoE, GQA or MLA).

    Built with `ModelConfig.from_hf(dict)`; keys follow HF transformers' names.
    `head_dim` is the per-head q/k width (MLA: nope + rope). `layer_types`
    (None = every layer ``full_attention`` or, with `sliding_window`, all sliding)
    says which layers use the sliding window. `moe_layers` lists the layer
    indices whose MLP is the `moe` block; the others are dense SwiGLU MLPs
    of `intermediate_size`.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    o_proj_bias: bool = False
    qk_norm: str | None = None  # None | "head" (Qwen3: per head over head_dim) | "full" (OLMoE: whole projection)
    clip_qkv: float | None = None
    layer_types: tuple[str, ...] | None = None
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position"):
            if int(getattr(self, f)) <= 0:
                raise ConfigError(f"model config: '{f}' must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope_dim % 2:
            raise ConfigError(f"model config: the RoPE dimension must be even, got {self.rope_dim}")
        if self.qk_norm not in (None, "head", "full"):
            raise ConfigError(f"model config: qk_norm '{self.qk_norm}' is not supported (head, full)")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"model config: layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_layers} layers")
        if self.moe_layers and self.moe is None:
            raise ConfigError("model config: moe_layers given without a MoE configuration")
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"model config: MoE layer indices {bad} out of range 0..{self.num_layers - 1}")

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of q/k (MLA: qk_rope_head_dim; else head_dim)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding-window size of `layer`, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def is_moe(self, layer: int) -> bool:
        """True when `layer`'s MLP is the routed-expert block."""
        return layer in self.moe_layers

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], where: str = "config.json") -> "ModelConfig":
        """Translate an HF config mapping; unknown architectures and settings fail with the key named."""
        _check_types(cfg, where)
        mtype = cfg.get("model_type", "llama")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{where}: model_type '{mtype}' is not supported by the engine yet "
                f"(supported: {SUPPORTED_MODEL_TYPES})"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTS:
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported (supported: {SUPPORTED_ACTS})")

        def need(key: str) -> Any:
            """A required key, or a ConfigError naming it."""
            if key not in cfg:
                raise ConfigError(f"{where}: required key '{key}' is missing")
            return cfg[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        layers = int(need("num_hidden_layers"))
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope_settings(cfg, where)
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        layer_types = cfg.get("layer_types")
        if layer_types is not None:
            layer_types = tuple(str(x) for x in layer_types)
            unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
            if unknown:
                raise ConfigError(f"{where}: layer_types {unknown} are not supported (full_attention, sliding_attention)")
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        attention_bias = bool(cfg.get("attention_bias", mtype == "qwen2"))
        if mtype == "qwen2_moe":
            attention_bias = bool(cfg.get("qkv_bias", True))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        mla = _mla_config(cfg, mtype, where)
        if mla is not None:
            if kv_heads != heads:
                raise ConfigError(f"{where}: MLA expands the latent to every head; num_key_value_heads ({kv_heads}) "
                                  f"must equal num_attention_heads ({heads})")
            head_dim = mla.qk_head_dim
        moe, moe_layers = _moe_config(cfg, mtype, layers, where)
        clip = cfg.get("clip_qkv") if mtype == "olmoe" else None
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ConfigError(f"{where}: partial_rotary_factor {partial} is not supported (only 1.0)")
        return cls(
            model_type=mtype,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            o_proj_bias=attention_bias and mtype in _O_PROJ_BIAS_TYPES,
            qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}.get(mtype),
            clip_qkv=float(clip) if clip is not None else None,
            layer_types=layer_types,
            mla=mla,
            moe=moe,
            moe_layers=moe_layers,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` (a file or a model directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"model config not found: {path} (a model directory needs config.json)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_hf(cfg, where=str(path))


def _check_types(cfg: Mapping[str, Any], where: str) -> None:
    """Integer and number keys hold JSON numbers (`INT_KEYS`, `FLOAT_KEYS`); a ConfigError names the first that
    does not (a string such as "256" is a broken export: transformers refuses it too)."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{where}: expected a JSON object of config keys, got {type(cfg).__name__}")

    def bad(key: str, kind: str) -> ConfigError:
        return ConfigError(f"{where}: '{key}' must be {kind}, got {cfg[key]!r} ({type(cfg[key]).__name__}); "
                           "fix the value in config.json (write it without quotes)")

    for key in INT_KEYS:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise bad(key, "an integer")
    eos = cfg.get("eos_token_id")
    if eos is not None and not (isinstance(eos, int) and not isinstance(eos, bool) or isinstance(eos, list) and all(
            isinstance(e, int) and not isinstance(e, bool) for e in eos)):
        raise bad("eos_token_id", "an integer or a list of integers")
    for key in FLOAT_KEYS:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise bad(key, "a number")


def _rope_settings(cfg: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from `rope_theta`/`rope_scaling` or transformers-5 `rope_parameters`."""
    rope_scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters")  # transformers >= 5 nests theta/scaling here
    if isinstance(rope_params, Mapping):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
            rope_scaling = dict(rope_params)
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in ROPE_TYPES:
            raise ConfigError(f"{where}: rope_scaling {dict(rope_scaling)} is not supported "
                              f"(default, linear, llama3, yarn)")
        if kind == "yarn" and "original_max_position_embeddings" not in rope_scaling:
            raise ConfigError(f"{where}: yarn rope scaling needs 'original_max_position_embeddings'")
    return float(rope_theta if rope_theta is not None else 10000.0), dict(rope_scaling) if rope_scaling else None


def _mla_config(cfg: Mapping[str, Any], mtype: str, where: str) -> MlaConfig | None:
    """The MLA dimensions of a DeepSeek-V2/V3 config (None for other architectures)."""
    if mtype not in ("deepseek_v2", "deepseek_v3"):
        return None
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise ConfigError(f"{where}: MLA needs a positive '{key}', got {cfg.get(key)!r}")
    q_lora = cfg.get("q_lora_rank")
    # DeepSeek-V2 always lays RoPE pairs out interleaved (complex multiply); V3 has a switch
    interleave = True if mtype == "deepseek_v2" else bool(cfg.get("rope_interleave", True))
    return MlaConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]), rope_interleave=interleave)


def _moe_config(cfg: Mapping[str, Any], mtype: str, layers: int,
                where: str) -> tuple[MoeConfig | None, tuple[int, ...]]:
    """The routed-expert configuration and the indices of MoE layers, per architecture."""
    if mtype not in MOE_TYPES:
        return None, ()

    def get(key: str, default: Any = None) -> Any:
        """A key with a default (None values count as absent)."""
        v = cfg.get(key)
        return default if v is None else v

    def n_experts(*keys: str) -> int:
        """The routed-expert count under its first present spelling (configs alias num_experts /
        num_local_experts / n_routed_experts across transformers versions)."""
        for key in keys:
            if cfg.get(key) is not None:
                return int(cfg[key])
        raise ConfigError(f"{where}: required key '{keys[0]}' is missing")

    k = int(get("num_experts_per_tok", 2))
    if mtype == "mixtral":
        moe = MoeConfig(num_experts=n_experts("num_local_experts", "num_experts"), top_k=k,
                        intermediate_size=int(cfg["intermediate_size"]), scoring="softmax", norm_topk_prob=True)
        return moe, tuple(range(layers))
    if mtype == "olmoe":
        moe = MoeConfig(num_experts=n_experts("num_experts", "num_local_experts"), top_k=k, intermediate_size=int(cfg["intermediate_size"]),
                        norm_topk_prob=bool(get("norm_topk_prob", False)))
        return moe, tuple(range(layers))
    if mtype in ("qwen2_moe", "qwen3_moe"):
        n = n_experts("num_experts", "num_local_experts")
        step = int(get("decoder_sparse_step", 1))
        dense = set(get("mlp_only_layers", []))
        shared = int(get("shared_expert_intermediate_size", 0)) if mtype == "qwen2_moe" else 0
        moe_layers = tuple(i for i in range(layers) if i not in dense and n > 0 and (i + 1) % step == 0)
        if not moe_layers:
            return None, ()
        moe = MoeConfig(num_experts=n, top_k=k, intermediate_size=int(need_key(cfg, "moe_intermediate_size", where)),
                        norm_topk_prob=bool(get("norm_topk_prob", False)), shared_intermediate_size=shared,
                        shared_gate=shared > 0)
        return moe, moe_layers
    # DeepSeek-V2 / V3
    if int(get("moe_layer_freq", 1)) != 1:
        raise ConfigError(f"{where}: moe_layer_freq {cfg['moe_layer_freq']} is not supported (only 1)")
    n = n_experts("n_routed_experts", "num_local_experts", "num_experts")
    n_group, topk_group = int(get("n_group", 1)), int(get("topk_group", 1))
    shared = int(get("n_shared_experts", 0)) * int(need_key(cfg, "moe_intermediate_size", where))
    common = dict(num_experts=n, top_k=k, intermediate_size=int(cfg["moe_intermediate_size"]),
                  routed_scaling_factor=float(get("routed_scaling_factor", 1.0)), shared_intermediate_size=shared)
    if mtype == "deepseek_v2":
        method = get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"{where}: topk_method '{method}' is not supported for deepseek_v2 "
                              "(greedy, group_limited_greedy)")
        if get("norm_topk_prob", False):
            raise ConfigError(f"{where}: norm_topk_prob true is not supported for deepseek_v2 (transformers ignores "
                              "it, DeepSeek's code renormalises); set it false")
        if method == "greedy":
            n_group, topk_group = 1, 1
        moe = MoeConfig(scoring="softmax", n_group=n_group, topk_group=topk_group, group_score="max", **common)
    else:
        method = get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ConfigError(f"{where}: topk_method '{method}' is not supported for deepseek_v3 (noaux_tc)")
        scoring = get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"{where}: scoring_func '{scoring}' is not supported for deepseek_v3 (sigmoid)")
        moe = MoeConfig(scoring="sigmoid", norm_topk_prob=bool(get("norm_topk_prob", True)), n_group=n_group,
                        topk_group=topk_group, group_score="top2sum", correction_bias=True, **common)
    first_dense = int(get("first_k_dense_replace", 0))
    return moe, tuple(range(first_dense, layers))


def need_key(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    """`cfg[key]`, or a ConfigError naming the missing key."""
    if cfg.get(key) is None:
        raise ConfigError(f"{where}: required key '{key}' is missing")
    return cfg[key]
