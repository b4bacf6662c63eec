"""Model configuration: a frozen dataclass built from an HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from engine.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ACTS = ("silu",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of a dense decoder-only transformer (Llama family).

    Built with `ModelConfig.from_hf(dict)`; keys follow HF transformers' names.
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
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], where: str = "config.json") -> "ModelConfig":
        """Translate an HF config mapping; unknown architectures fail with a clear message."""
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
            if key not in cfg:
                raise ConfigError(f"{where}: required key '{key}' is missing")
            return cfg[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 nests theta/scaling here
        if isinstance(rope_params, Mapping):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
            None, "default", "linear", "llama3"
        ):
            raise ConfigError(f"{where}: rope_scaling {dict(rope_scaling)} is not supported (default, linear, llama3)")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            model_type=mtype,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
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
