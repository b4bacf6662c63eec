"""Loading model weights: HF directories (safetensors, sharded or not), HF hub ids
(offline from the local cache), and llama2.c checkpoints.

Only safe formats are read: safetensors, or the raw fp32 llama2.c layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.errors import WeightsError

HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclasses.dataclass
class LoadedModel:
    """A model's config, fp32 weights (HF names) and where they came from."""

    cfg: ModelConfig
    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    source: str
    directory: str | None
    sha256: str


def _hash_files(paths: list[Path]) -> str:
    """sha256 over the bytes of `paths` in order (identifies the checkpoint in provenance)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _read_safetensors(directory: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """Read every tensor of a (possibly sharded) safetensors checkpoint as fp32."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise WeightsError(f"{index}: not a valid safetensors index ({exc}); re-export the checkpoint") from None
        files = sorted({directory / f for f in wmap.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(
            f"{directory}: no *.safetensors files (only safetensors checkpoints are loaded; "
            "convert .bin/.pt checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.exists():
            raise WeightsError(f"{f}: shard named in the index is missing")
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    weights[name] = st.get_tensor(name).float()
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise WeightsError(f"{f}: corrupt or truncated safetensors file ({exc}); re-download or re-export it") from None
    return weights, files


def resolve_model_dir(source: str) -> Path:
    """A local directory for `source`: a path, or an HF hub id resolved from the local cache.

    Downloads only when the hub is reachable and `HF_HUB_OFFLINE` is not set;
    otherwise the id must already be in the HF cache.
    """
    p = Path(source).expanduser()
    if p.exists():
        return p
    if HF_ID.match(source):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
            raise WeightsError(f"model '{source}': huggingface_hub is not installed; give a local directory") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        try:
            return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"],
                                          local_files_only=offline))
        except Exception as exc:  # the hub raises many types; report them uniformly
            raise WeightsError(
                f"model '{source}': not a local path and not resolvable as an HF hub id "
                f"({type(exc).__name__}: {exc}). Download it first (huggingface-cli download {source}) "
                "or give a local directory."
            ) from None
    raise WeightsError(f"model not found: '{source}' is neither an existing path nor an HF hub id (org/name)")


def load_model(source: str) -> LoadedModel:
    """Load a model from an HF directory / hub id, or a llama2.c checkpoint (`llama2c:PATH` or `*.bin`)."""
    if source.startswith("llama2c:") or source.endswith(".bin"):
        path = Path(source.removeprefix("llama2c:")).expanduser()
        from engine.llama2c import read_llama2c

        hf_config, weights = read_llama2c(str(path))
        cfg = ModelConfig.from_hf(hf_config, where=str(path))
        return LoadedModel(cfg, hf_config, weights, source, None, _hash_files([path]))
    directory = resolve_model_dir(source)
    if not directory.is_dir():
        raise WeightsError(f"{directory}: expected a model directory (config.json + *.safetensors)")
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise WeightsError(f"{directory}: config.json is missing; this is not an HF model directory")
    try:
        hf_config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{cfg_path}: not valid JSON ({exc})") from None
    cfg = ModelConfig.from_hf(hf_config, where=str(cfg_path))
    weights, files = _read_safetensors(directory)
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return LoadedModel(cfg, hf_config, weights, source, str(directory), _hash_files([cfg_path, *files]))
