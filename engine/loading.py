"""Loading model weights: HF directories (safetensors, sharded or not), HF hub ids
(offline from the local cache), and llama2.c checkpoints.

Only safe formats are read: safetensors, or the raw fp32 llama2.c layout.

Memory: a checkpoint is read tensor by tensor through `safetensors.safe_open`
(one shard mapped at a time, never a whole-file dict), each tensor converted
to fp32 on its own (a bf16 / fp16 checkpoint never exists twice in memory),
so the host peak is one fp32 copy of the weights plus one tensor and the
mapped pages of the shard being read. Routed experts are written straight
into one fp32 stack per layer and projection, in transformers' in-memory
layout (``mlp.experts.gate_up_proj`` (experts, 2*inter, d), gate rows first;
``mlp.experts.down_proj`` (experts, d, inter)), so that the engine (which
takes per-expert views of the stacks, `engine.weights.canonical_weights`)
and the FP32 reference (which takes the stacks as its parameters) share the
same storage: one copy of the weights serves both.
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
from engine.weights import expected_shapes

HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


SOURCE_KINDS = ("builtin", "llama2c", "hf_dir", "hf_id")
SOURCE_GRAMMAR = ("builtin:NAME, llama2c:FILE (or a *.bin file), an HF model folder or an HF hub id (org/name), "
                  "outliers:<an HF model folder or hub id>")
OUTLIERS = "outliers:"  # the model with real-LLM activation structure planted (engine.outliers.add_outliers)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9_+.\-]+):")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, parsed (`parse_source`): the one reading of the model-source grammar.

    kind: `builtin` (a model folder shipped with the harness), `llama2c` (a llama2.c checkpoint file), `hf_dir`
    (an HF model folder, or a path that does not exist: the loader then says so) or `hf_id` (a hub id, from the
    local HF cache). path: the folder, file or hub id (for `builtin`, its folder when the folder of built-ins was
    given, else its NAME). text: the source as written. name: a `builtin`'s NAME. transform: `outliers` when the
    text is `outliers:<HF folder or hub id>`: the loader applies `engine.outliers.add_outliers` to the weights.
    """

    kind: str
    path: str
    text: str
    name: str = ""
    transform: str = ""

    def __str__(self) -> str:
        """What the loader reports as the model's source: the built-in's folder, else the text as written."""
        return self.path if self.kind == "builtin" else self.text

    @property
    def default_name(self) -> str:
        """A name for the model when none is given: the built-in's NAME, the file's stem, the folder's name, the
        hub id's last part."""
        if self.kind == "builtin":
            return self.name
        if self.kind == "llama2c":
            return Path(self.path.rstrip("/")).name.removesuffix(".bin")
        return Path(self.path.rstrip("/")).name + ("-outliers" if self.transform else "")

    def with_path(self, path: str) -> "ModelSource":
        """The same kind of source at another path (a resolved relative path); the text keeps the kind's prefix."""
        if self.kind == "builtin":
            return self
        text = f"llama2c:{path}" if self.text.startswith("llama2c:") else path
        return dataclasses.replace(self, path=path, text=OUTLIERS + text if self.transform else text)


def parse_source(text: "str | ModelSource", builtin_dir: Path | None = None) -> ModelSource:
    """Parse a model source (`SOURCE_GRAMMAR`): `builtin:NAME`, `llama2c:FILE` or a `*.bin` file, an HF model folder,
    or an HF hub id `org/name`. `builtin_dir`: the folder of built-in models (the harness's); given, `builtin:NAME`
    resolves to its sub-folder and an unknown NAME is an error listing the available ones. Nothing is read here
    but whether a path exists (a folder is `hf_dir`, a hub id only when no such path exists)."""
    if isinstance(text, ModelSource):
        return text
    if not isinstance(text, str) or not text.strip():
        raise WeightsError(f"model source {text!r}: empty; give {SOURCE_GRAMMAR}")
    if text.startswith("builtin:"):
        name = text.removeprefix("builtin:")
        if not name or "/" in name or name in (".", ".."):
            raise WeightsError(f"model source {text!r}: builtin: needs a NAME (e.g. builtin:tiny-llama)")
        if builtin_dir is None:
            return ModelSource("builtin", name, text, name)
        folder = Path(builtin_dir) / name
        if not folder.is_dir():
            avail = sorted(d.name for d in Path(builtin_dir).iterdir() if d.is_dir()) if Path(builtin_dir).is_dir() \
                else []
            raise WeightsError(f"model source {text!r}: unknown built-in '{name}'; available: {avail}")
        return ModelSource("builtin", str(folder), text, name)
    if text.startswith(OUTLIERS):
        inner = parse_source(text.removeprefix(OUTLIERS), builtin_dir)
        if inner.kind not in ("hf_dir", "hf_id") or inner.transform:
            raise WeightsError(f"model source {text!r}: outliers: takes an HF model folder or hub id "
                               f"(outliers:zoo/zoo-llama), not a {inner.kind} source")
        return dataclasses.replace(inner, text=text, transform="outliers")
    if text.startswith("llama2c:"):
        path = text.removeprefix("llama2c:")
        if not path:
            raise WeightsError(f"model source {text!r}: llama2c: needs the checkpoint file (llama2c:FILE)")
        return ModelSource("llama2c", path, text)
    if text.endswith(".bin"):
        return ModelSource("llama2c", text, text)
    scheme = _SCHEME.match(text)
    if scheme and not Path(text).expanduser().exists():
        raise WeightsError(f"model source {text!r}: unknown prefix '{scheme.group(1)}:'; give {SOURCE_GRAMMAR}")
    if not Path(text).expanduser().exists() and HF_ID.match(text):
        return ModelSource("hf_id", text, text)
    return ModelSource("hf_dir", text, text)


def resolved_source(source: "str | ModelSource") -> ModelSource:
    """`source` parsed; a `builtin:` that was not resolved to its folder is an error saying who resolves it."""
    src = parse_source(source)
    if src.kind == "builtin" and src.path == src.name:
        raise WeightsError(f"model source '{src.text}': built-in models ship with the harness; resolve it with "
                           "parse_source(text, builtin_dir=evalharness.data.BUILTIN_DIR)")
    return src


@dataclasses.dataclass
class LoadedModel:
    """A model's config, fp32 weights (HF names; routed experts stacked, see the module docstring) and
    where they came from. The engine's `Transformer` and the reference take these tensors without copying."""

    cfg: ModelConfig
    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    source: str
    directory: str | None
    sha256: str

    @property
    def weight_bytes(self) -> int:
        """Bytes of one copy of the weights (fp32), counting shared storage once."""
        seen: dict[int, int] = {}
        for t in self.weights.values():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def to(self, device: torch.device | str) -> "LoadedModel":
        """Move the weights to `device` one tensor at a time, in place; returns self.

        Each host tensor is released as soon as its device copy exists (when nothing else holds
        it), so the host never holds more than the not-yet-moved part. Done before building the
        engine and a reference on the same device, both then share the device copy.
        """
        for name in list(self.weights):
            self.weights[name] = self.weights[name].to(device)
        return self


def _hash_files(paths: list[Path]) -> str:
    """sha256 over the bytes of `paths` in order (identifies the checkpoint in provenance)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# Per-expert checkpoint tensors: DeepSeek / Qwen / OLMoE spelling and Mixtral's w1 (gate) / w3 (up) / w2 (down).
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")


class _ExpertStacks:
    """Fills one fp32 stack per MoE layer and projection from per-expert checkpoint tensors.

    ``model.layers.{i}.mlp.experts.gate_up_proj`` (experts, 2*inter, d): expert e's gate
    projection in rows [0, inter), its up projection in rows [inter, 2*inter);
    ``model.layers.{i}.mlp.experts.down_proj`` (experts, d, inter). A stack is allocated
    when its layer's first expert tensor is read (on `device`: the host by default); `missing` lists the slots
    never filled.
    """

    def __init__(self, cfg: ModelConfig, where: str, device: torch.device | str | None = None):
        self.cfg, self.where, self.device = cfg, where, device
        self.stacks: dict[str, torch.Tensor] = {}
        self.filled: dict[tuple[int, int, str], str] = {}  # (layer, expert, part) -> checkpoint name

    def slot(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, part) of a routed-expert tensor this config uses, else None."""
        m = _EXPERT.match(name)
        if m is None or self.cfg.moe is None:
            return None
        layer, expert = int(m.group(1)), int(m.group(2))
        if layer >= self.cfg.num_layers or not self.cfg.is_moe(layer) or expert >= self.cfg.moe.num_experts:
            return None
        return layer, expert, _PART[m.group(3)]

    def put(self, name: str, slot: tuple[int, int, str], t: torch.Tensor) -> None:
        """Copy checkpoint tensor `name` (any float dtype) into its fp32 slot."""
        layer, e, part = slot
        moe, d = self.cfg.moe, self.cfg.hidden_size
        inter = moe.intermediate_size
        shape = (d, inter) if part == "down" else (inter, d)
        if tuple(t.shape) != shape:
            raise WeightsError(f"{self.where}: tensor '{name}' has shape {tuple(t.shape)}, config expects {shape}")
        kind = "down_proj" if part == "down" else "gate_up_proj"
        key = f"model.layers.{layer}.mlp.experts.{kind}"
        if key not in self.stacks:
            full = (moe.num_experts, d, inter) if part == "down" else (moe.num_experts, 2 * inter, d)
            self.stacks[key] = torch.empty(full, dtype=torch.float32, device=self.device)
        dst = self.stacks[key][e]  # (d, inter) or (2*inter, d)
        if part == "gate":
            dst = dst[:inter]
        elif part == "up":
            dst = dst[inter:]
        dst.copy_(t)  # converts bf16 / fp16 to fp32 in place: no second full-size temporary
        self.filled[slot] = name

    def missing(self) -> list[str]:
        """Checkpoint-style names of the expert tensors a started stack still lacks."""
        out = []
        for key in self.stacks:
            layer = int(_STACKED.match(key).group(1))
            parts = ("down",) if key.endswith("down_proj") else ("gate", "up")
            for e in range(self.cfg.moe.num_experts):
                out += [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for p in parts
                        if (layer, e, p) not in self.filled]
        return out


def _wanted(cfg: ModelConfig, needed: set[str], name: str) -> str | None:
    """The name a non-expert checkpoint tensor is kept under, or None when the model does not use it.

    Mixtral's router moves to the ``mlp.gate`` spelling transformers uses in memory; already-stacked
    expert tensors (a transformers-5 state dict saved as is) pass through. Tensors of layers beyond
    the config (e.g. DeepSeek-V3's multi-token-prediction layer) and a tied ``lm_head`` are skipped,
    so they never take memory.
    """
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    m = _STACKED.match(name)
    if m is not None:
        layer = int(m.group(1))
        return name.removesuffix(".weight") if layer < cfg.num_layers and cfg.is_moe(layer) else None
    return name if name in needed else None


def _shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by its index, else every *.safetensors file."""
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
    return files


def _read_safetensors(directory: Path, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """Read the tensors `cfg` needs from a (possibly sharded) safetensors checkpoint as fp32, one at a time.

    Returns (weights by name, shard files). Routed experts come back stacked (see `_ExpertStacks`).
    """
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = _shard_files(directory)
    weights: dict[str, torch.Tensor] = {}
    experts = _ExpertStacks(cfg, str(directory))
    needed = set(expected_shapes(cfg))
    for f in files:
        if not f.exists():
            raise WeightsError(f"{f}: shard named in the index is missing")
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    slot = experts.slot(name)
                    if slot is not None:
                        experts.put(name, slot, st.get_tensor(name))
                        continue
                    keep = _wanted(cfg, needed, name)
                    if keep is not None:
                        weights[keep] = st.get_tensor(name).float()  # no copy when already fp32
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise WeightsError(f"{f}: corrupt or truncated safetensors file ({exc}); re-download or re-export it") from None
    missing = experts.missing()
    if missing:
        raise WeightsError(f"{directory}: checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}")
    weights.update(experts.stacks)
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


def checkpoint_files(source: "str | ModelSource") -> list[Path]:
    """The files whose bytes make up a model (what `load_model` reads and `LoadedModel.sha256` hashes, in order):
    a llama2.c file, or an HF folder's config.json and safetensors shards."""
    src = resolved_source(source)
    if src.kind == "llama2c":
        return [Path(src.path).expanduser()]
    directory = resolve_model_dir(src.path)
    if not (directory / "config.json").exists():
        raise WeightsError(f"{directory}: config.json is missing; this is not an HF model directory")
    return [directory / "config.json", *_shard_files(directory)]


def checkpoint_sha256(source: "str | ModelSource") -> str:
    """sha256 of a model's checkpoint files without loading it (equals `load_model(source).sha256`)."""
    files = checkpoint_files(source)
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise WeightsError(f"{missing[0]}: checkpoint file not found")
    return _transformed_sha(_hash_files(files), resolved_source(source))


def _transformed_sha(sha: str, src: ModelSource) -> str:
    """The checkpoint's sha256, or for an `outliers:` source the sha256 of it and the plan's tag (the transformed
    model is another model: its reference outputs are cached apart)."""
    if not src.transform:
        return sha
    from engine.outliers import DEFAULT_PLAN

    return hashlib.sha256(f"{sha}:{src.transform}:{DEFAULT_PLAN.tag()}".encode()).hexdigest()


def read_hf_config(directory: Path) -> tuple[Path, dict[str, Any], ModelConfig]:
    """(path, contents, ModelConfig) of an HF model folder's config.json; a WeightsError naming the file when it is
    missing or not JSON."""
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise WeightsError(f"{directory}: config.json is missing; this is not an HF model directory")
    try:
        hf_config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{cfg_path}: not valid JSON ({exc})") from None
    return cfg_path, hf_config, ModelConfig.from_hf(hf_config, where=str(cfg_path))


def load_model(source: "str | ModelSource") -> LoadedModel:
    """Load a model from a source (`parse_source`): an HF directory / hub id, a llama2.c checkpoint, a resolved
    built-in; an `outliers:` source with `engine.outliers.add_outliers` applied to the weights."""
    src = resolved_source(source)
    source = str(src)
    if src.kind == "llama2c":
        path = Path(src.path).expanduser()
        from engine.llama2c import read_llama2c

        hf_config, weights = read_llama2c(str(path))
        cfg = ModelConfig.from_hf(hf_config, where=str(path))
        return LoadedModel(cfg, hf_config, weights, source, None, _hash_files([path]))
    directory = resolve_model_dir(src.path)
    if not directory.is_dir():
        raise WeightsError(f"{directory}: expected a model directory (config.json + *.safetensors)")
    cfg_path, hf_config, cfg = read_hf_config(directory)
    weights, files = _read_safetensors(directory, cfg)
    if src.transform:
        from engine.outliers import add_outliers

        weights = add_outliers(cfg, weights, where=source)
    return LoadedModel(cfg, hf_config, weights, source, str(directory),
                       _transformed_sha(_hash_files([cfg_path, *files]), src))
