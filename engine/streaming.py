"""Layer-streamed execution: a checkpoint read one decoder layer at a time, and the engine advanced stage by stage.

A model bigger than the device is evaluated layer-major: the weights of one stage (the embedding, one decoder
layer, the head) are read from the checkpoint's safetensors shards (memory-mapped through
`safetensors.safe_open`, only that stage's tensors touched), upcast to fp32 on the device, quantized into the
recipe's formats, run over every batch of windows, and dropped before the next stage. The activations of all
batches stay between stages (on the device, or on the host with ``offload``).

The stages are `Transformer.forward`'s own three parts (`forward_start`, `forward_layer`, `forward_end`), so a
batch gets the same bits as the resident forward on the same device.

* `LayerStore`: which checkpoint tensors each stage needs, and reading them (fp32, on a device). Routed experts
  come back stacked as transformers holds them (``mlp.experts.gate_up_proj`` / ``down_proj``), so one read serves
  the FP32 reference and the engine (which takes per-expert views, `engine.weights.canonical_weights`). FP8
  checkpoints with block scales (``<name>_scale_inv``, DeepSeek-V3's layout) are dequantized on the device.
* `StreamedEngine`: the engine's side of a streamed pass (`load` a stage's prepared weights, `run` a stage on one
  batch), plus `logits` for one batch; it does not generate (`StreamedGenerationError`).
* `stream_logits`: the engine alone over many batches, layer-major.
"""

from __future__ import annotations

import collections
import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from engine.config import ModelConfig
from engine.errors import WeightsError
from engine.model import LayerState, Transformer, prepare_weight
from engine.numerics import LocalProbe, QuantObserver
from engine.recipe import Recipe, load_recipe
from engine.rope import mla_softmax_scale, rope_attention_factor, rope_inv_freq
from engine.weights import canonical_weights, check_weights, expected_shapes

if TYPE_CHECKING:
    from engine.loading import ModelSource

Stage = Any  # "embed", a layer index (int) or "head"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class StreamedGenerationError(RuntimeError):
    """Generation asked of a layer-streamed model: every decode step reads every layer."""


def stages(cfg: ModelConfig) -> list[Stage]:
    """The stages of one streamed pass, in order: 'embed', 0 .. num_layers-1, 'head'."""
    return ["embed", *range(cfg.num_layers), "head"]


def stage_names(cfg: ModelConfig, stage: Stage) -> list[str]:
    """The engine names (canonical, per-expert) a stage's step reads, in `expected_shapes` order.

    Each stage also holds the RMSNorm weight that reads its output (`Transformer.norm_after`): the embedding stage
    layer 0's input norm, layer i layer i+1's (the last layer the final norm)."""
    shapes = expected_shapes(cfg)
    n = cfg.num_layers
    if stage == "embed":
        names = ["model.embed_tokens.weight"]
        names.append("model.layers.0.input_layernorm.weight" if n else "model.norm.weight")
    elif stage == "head":
        names = ["model.norm.weight", "lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"]
    else:
        prefix = f"model.layers.{stage}."
        names = [k for k in shapes if k.startswith(prefix)]
        names.append(f"model.layers.{stage + 1}.input_layernorm.weight" if stage + 1 < n else "model.norm.weight")
    return names


def fp8_block_size(hf_config: Mapping[str, Any], where: str) -> tuple[int, int]:
    """The (rows, columns) of an FP8 checkpoint's scale blocks: config.json's
    ``quantization_config.weight_block_size`` (DeepSeek-V3 writes [128, 128]), else 128 x 128."""
    q = hf_config.get("quantization_config") or {}
    size = q.get("weight_block_size", [128, 128]) if isinstance(q, Mapping) else [128, 128]
    if (not isinstance(size, (list, tuple)) or len(size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
        raise WeightsError(f"{where}: config.json quantization_config.weight_block_size must be two positive "
                           f"integers (rows, columns), got {size!r}")
    return int(size[0]), int(size[1])


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """An FP8 weight (out, in) with one scale per `block` (rows, columns; partial blocks at the edges), shape
    (ceil(out/rows), ceil(in/cols)), as fp32 on w's device."""
    out, inn = w.shape
    bo, bi = block
    if tuple(scale_inv.shape) != (-(-out // bo), -(-inn // bi)):
        raise WeightsError(f"tensor '{name}': scale_inv shape {tuple(scale_inv.shape)} is not one scale per "
                           f"{bo}x{bi} block of the weight {tuple(w.shape)} (expected {(-(-out // bo), -(-inn // bi))}; "
                           "config.json quantization_config.weight_block_size gives the block); re-export the "
                           "checkpoint")
    s = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inn]  # (out, in)
    return w.float() * s


class LayerStore:
    """A checkpoint read stage by stage (`stages`): each call reads only that stage's tensors, as fp32 on `device`.

    `open(source)`: an HF folder (its safetensors shards, memory-mapped; the index or the shards' headers say
    which shard holds which tensor) or a llama2.c file (read whole: small by nature). `bytes_read` counts the
    checkpoint bytes read so far (stored dtype); `stage_bytes(stage)` the fp32 bytes a stage takes on the device.
    """

    def __init__(self, cfg: ModelConfig, where: str, files: dict[str, Path] | None = None,
                 weights: Mapping[str, torch.Tensor] | None = None, hf_config: dict | None = None,
                 directory: str | None = None):
        self.cfg, self.where = cfg, where
        self.hf_config = hf_config or {}  # the config.json contents (transformers builds the reference from them)
        self.directory = directory  # the HF folder, None for a llama2.c file
        self.files = files or {}  # checkpoint name -> shard
        self.weights = dict(weights or {})  # in-memory checkpoints (llama2.c)
        self.bytes_read = 0
        self.reads: collections.Counter = collections.Counter()  # stage -> times read
        self._by_stage = self._index()

    @classmethod
    def open(cls, source: "str | ModelSource") -> "LayerStore":
        """The store of a model source (`engine.loading.parse_source`), reading only headers now."""
        from engine.loading import _shard_files, read_hf_config, resolve_model_dir, resolved_source

        src = resolved_source(source)
        if src.transform:
            raise WeightsError(f"model source '{src.text}': a transformed model ({src.transform}:) is built from the "
                               "whole checkpoint when loaded; layer streaming reads the files as they are: run it "
                               "resident (execution: resident)")
        if src.kind == "llama2c":
            from engine.llama2c import read_llama2c

            path = src.path
            hf_config, weights = read_llama2c(str(Path(path).expanduser()))
            return cls(ModelConfig.from_hf(hf_config, where=path), path, weights=weights, hf_config=hf_config)
        directory = resolve_model_dir(src.path)
        _, hf_config, cfg = read_hf_config(directory)
        from safetensors import SafetensorError, safe_open

        files: dict[str, Path] = {}
        for f in _shard_files(directory):
            if not f.exists():
                raise WeightsError(f"{f}: shard named in the index is missing")
            try:
                with safe_open(str(f), framework="pt") as st:
                    files.update({name: f for name in st.keys()})
            except (SafetensorError, OSError) as exc:
                raise WeightsError(f"{f}: corrupt or truncated safetensors file ({exc}); re-export it") from None
        return cls(cfg, str(directory), files=files, hf_config=hf_config, directory=str(directory))

    def _names(self) -> Iterable[str]:
        return self.files if self.files else self.weights

    def _index(self) -> dict[Stage, list[str]]:
        """Checkpoint names per stage (a layer's tensors under their layer; embedding, final norm and head under
        their stages; tensors the config does not use are left out, as the resident loader leaves them)."""
        from engine.loading import _ExpertStacks, _wanted

        cfg = self.cfg
        needed = set(expected_shapes(cfg))
        slots = _ExpertStacks(cfg, self.where)
        by: dict[Stage, list[str]] = collections.defaultdict(list)
        names = set(self._names())
        for name in names:
            if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in names:
                continue  # read together with its weight
            if slots.slot(name) is None and _wanted(cfg, needed, name) is None:
                continue
            m = _LAYER.match(name)
            if m:
                by[int(m.group(1))].append(name)
            elif name == "model.embed_tokens.weight":
                by["embed"].append(name)
                if cfg.tie_word_embeddings:
                    by["head"].append(name)
            else:
                by["head"].append(name)
        return by

    def _read(self, name: str, device: torch.device, shard: Callable[[Path], Any]) -> torch.Tensor:
        """One checkpoint tensor on `device` in its stored dtype (FP8 with block scales: dequantized, fp32).
        `shard(file)`: that file's open safetensors handle (each file is opened once per stage)."""
        from safetensors import SafetensorError

        def get(key: str) -> torch.Tensor | None:
            if not self.files:
                t = self.weights.get(key)
            else:
                f = self.files.get(key)
                t = None if f is None else shard(f).get_tensor(key)
            if t is not None:
                self.bytes_read += t.numel() * t.element_size()
            return t

        try:
            t = get(name).to(device)
            scale = get(name + "_scale_inv")
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise WeightsError(f"{self.files.get(name, self.where)}: corrupt or truncated safetensors file reading "
                               f"'{name}' ({exc}); re-export it") from None
        if t.dtype in _FP8:
            if scale is None:
                raise WeightsError(f"{self.where}: FP8 tensor '{name}' has no '{name}_scale_inv'; only FP8 "
                                   "checkpoints with block scales (DeepSeek-V3's layout) are read")
            return _dequant_fp8(t, scale.to(device), fp8_block_size(self.hf_config, self.where), name)
        return t

    def load(self, stage: Stage, device: torch.device | str) -> dict[str, torch.Tensor]:
        """A stage's tensors (`stage_names`; routed experts stacked as transformers holds them), fp32 on `device`,
        checked against the config (name, shape, finite values: the first bad one is named)."""
        from engine.loading import _ExpertStacks, _wanted

        device = torch.device(device)
        cfg = self.cfg
        needed = set(expected_shapes(cfg))
        experts = _ExpertStacks(cfg, self.where, device=device)
        out: dict[str, torch.Tensor] = {}
        wanted_names = list(self._by_stage.get(stage, []))
        # the norm after this stage lives in the next layer (or the head)
        extra = stage_names(cfg, stage)[-1] if stage != "head" else None
        if extra is not None and extra not in wanted_names:
            owner = _LAYER.match(extra)
            pool = self._by_stage.get(int(owner.group(1)) if owner else "head", [])
            wanted_names += [n for n in pool if _wanted(cfg, needed, n) == extra]
        with contextlib.ExitStack() as stack:
            handles: dict[Path, Any] = {}

            def shard(f: Path):
                if f not in handles:
                    from safetensors import safe_open

                    handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
                return handles[f]

            for name in wanted_names:
                slot = experts.slot(name)
                if slot is not None:
                    experts.put(name, slot, self._read(name, device, shard))
                    continue
                keep = _wanted(cfg, needed, name)
                if keep is not None:
                    out[keep] = self._read(name, device, shard).float()
        missing = experts.missing()
        if missing:
            raise WeightsError(f"{self.where}: checkpoint lacks {len(missing)} tensor(s) the config needs, "
                               f"e.g. {missing[:3]}")
        out.update(experts.stacks)
        self._check(stage, out)
        self.reads[stage] += 1
        return out

    def _check(self, stage: Stage, weights: Mapping[str, torch.Tensor]) -> None:
        """Raise `WeightsError` naming the first missing / misshapen / non-finite tensor of the stage."""
        check_weights(self.cfg, canonical_weights(weights), self.where, stage_names(self.cfg, stage))

    def stage_bytes(self, stage: Stage) -> int:
        """fp32 bytes of a stage's tensors on the device (from the config)."""
        shapes = expected_shapes(self.cfg)
        return 4 * sum(int(torch.Size(shapes[n]).numel()) for n in stage_names(self.cfg, stage))


class _Shell(Transformer):
    """A `Transformer` without master weights: its config and RoPE tables, for stage-by-stage forwards."""

    def __init__(self, cfg: ModelConfig, device: torch.device):  # no super().__init__(): it would need every weight
        self.cfg = cfg
        self.weights = {}
        self.inv_freq = rope_inv_freq(cfg).to(device)
        self.rope_factor = rope_attention_factor(cfg)
        self.softmax_scale = mla_softmax_scale(cfg) if cfg.mla is not None else None


class StreamedEngine:
    """An engine whose weights are never all resident: `load` prepares one stage's weights, `run` runs one stage.

    The same recipe, backend and dispatch as `engine.api.Engine` (its `make_numerics`); `logits` runs one batch
    through every stage (reading the whole checkpoint once per call). `resident_bytes` (when the caller knows
    it) goes into the message of the generation error.
    """

    streamed = True

    def __init__(self, store: LayerStore, recipe: Recipe | str, backend: str = "cpu-emulated",
                 resident_bytes: int | None = None, **kernel_options):
        from engine.api import BACKENDS, make_numerics
        from engine.serving import ServingConfig

        if backend not in BACKENDS:
            raise ValueError(f"unknown backend '{backend}'; available: {BACKENDS}")
        if backend.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"backend '{backend}' needs a CUDA GPU; none is visible (use cpu-emulated)")
        self.store = store
        self.cfg = store.cfg
        self.backend = backend
        self.device = torch.device("cuda" if backend.startswith("cuda") else "cpu")
        self.recipe = load_recipe(recipe)
        self.nx = make_numerics(self.recipe, backend, **kernel_options)
        self.model = _Shell(self.cfg, self.device)
        self.work: collections.Counter = collections.Counter()
        self.default_prefill_chunk: int | None = None
        self.serving = ServingConfig()
        self.resident_bytes = resident_bytes

    def kernel_settings(self) -> dict:
        """What chose the kernels, for a result's provenance (`engine.api.Engine.kernel_settings`)."""
        from engine.api import Engine

        return Engine.kernel_settings(self)

    @property
    def vocab_size(self) -> int:
        """Size of the output distribution."""
        return self.cfg.vocab_size

    @property
    def max_seq_len(self) -> int:
        """Longest context the model was configured for."""
        return self.cfg.max_position

    def prepare(self, master: Mapping[str, torch.Tensor], stage: Stage) -> dict[str, torch.Tensor]:
        """A stage's weights in the recipe's formats (`engine.model.prepare_weight`) from its fp32 master tensors
        (`LayerStore.load`; stacked experts become per-expert views first). With tied embeddings the head stage's
        table is prepared as `lm_head.weight`, as the resident engine prepares it."""
        canon = canonical_weights(master)
        if stage == "head" and "lm_head.weight" not in canon:
            canon["lm_head.weight"] = canon.pop("model.embed_tokens.weight")
        return {n: prepare_weight(self.nx, n, t.to(self.device)) for n, t in canon.items()}

    def load(self, stage: Stage) -> dict[str, torch.Tensor]:
        """Read a stage from the store and prepare it."""
        return self.prepare(self.store.load(stage, self.device), stage)

    @torch.no_grad()
    def run(self, stage: Stage, w: Mapping[str, torch.Tensor], inp, tap: Optional[Callable] = None,
            observer: Optional[QuantObserver] = None, local: Optional[LocalProbe] = None):
        """One stage on one batch: tokens -> state ('embed'), state -> state (layer i), state -> logits ('head')."""
        nx = self.nx
        nx.tap, nx.observer, nx.local = tap, observer, local
        try:
            if stage == "embed":
                tokens = inp.to(self.device)
                self.work["forward_tokens"] += tokens.numel()
                return self.model.forward_start(nx, w, tokens)
            if stage == "head":
                return self.model.forward_end(nx, w, inp)
            return self.model.forward_layer(nx, w, stage, inp)
        finally:
            nx.tap, nx.observer, nx.local = None, None, None

    def local_step(self, w: Mapping[str, torch.Tensor], i: int, x: torch.Tensor, like: LayerState) -> torch.Tensor:
        """Layer i fed `x`, another model's input of that layer (`layer_fed`)."""
        return layer_fed(self.model, self.nx, w, i, x, like)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, tap: Optional[Callable[[str, torch.Tensor], None]] = None,
               observer: Optional[QuantObserver] = None, prefill_chunk: int | None = None,
               high_precision: bool = False, local: Optional[LocalProbe] = None) -> torch.Tensor:
        """Logits (batch, t, vocab) of one batch, every stage read and run in turn (`Engine.logits`'s signature;
        no chunked prefill and no precision switching: they need the model resident)."""
        if prefill_chunk is not None and prefill_chunk < tokens.shape[1]:
            raise StreamedGenerationError("chunked prefill needs every layer's KV cache at once; a layer-streamed "
                                          "engine runs whole windows (drop prefill_chunk, or run resident)")
        if high_precision:
            raise StreamedGenerationError("precision switching needs the whole model resident")
        return stream_logits(self, [tokens], tap=lambda b: tap, observer=observer, local=local)[0]

    def generation_error(self, what: str) -> StreamedGenerationError:
        """The error for generation asked of this engine (`what`: who asked), naming the memory and the routes."""
        need = self.resident_bytes or sum(self.store.stage_bytes(s) for s in stages(self.cfg))
        return StreamedGenerationError(
            f"{what}: model '{self.store.where}' runs layer-streamed (it does not fit on {self.device.type}), and "
            f"generation reads every layer at each decode step: it needs the whole model resident, about "
            f"{need / 2**30:.1f} GiB plus the KV cache. Run the generating evals (longctx, passkey, lm-eval "
            "generate_until tasks) on more GPUs with tensor / expert parallelism (serving tp / ep under torchrun, "
            "docs/guide/multi-gpu.md), or with `execution: resident` on a machine that holds it; what runs "
            "layer-streamed: layer_error, ppl_kld, the log-likelihood tasks and longctx's KLD by position "
            "(docs/guide/big-models.md)")

    def generate_batch(self, requests: Sequence, serving=None, step_stats: bool = False, keep_logits: bool = False,
                       max_batch: int | None = None):
        """Not available when streamed: raises `StreamedGenerationError` naming the memory and the routes."""
        raise self.generation_error("generate_batch")

    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                 return_logits: bool = False, high_precision: bool = False):
        """Not available when streamed: raises `StreamedGenerationError`."""
        raise self.generation_error("generate")


def stream_logits(engine: StreamedEngine, batches: Sequence[torch.Tensor],
                  tap: Callable[[int], Optional[Callable]] = lambda b: None,
                  observer: Optional[QuantObserver] = None, local: Optional[LocalProbe] = None,
                  consume: Callable[[int, torch.Tensor], Any] = lambda b, logits: logits,
                  offload: bool = False) -> list:
    """The engine alone over `batches` (each (batch, t) tokens), layer-major: `consume(b, logits)` of each batch,
    in order. `tap(b)` gives batch b's tap callback; `offload` keeps the activations on the host between stages."""
    states: list = list(batches)
    out: list = [None] * len(states)
    for stage in stages(engine.cfg):
        w = engine.load(stage)
        for b in range(len(states)):
            res = engine.run(stage, w, _to(states[b], engine.device), tap(b), observer, local)
            if stage == "head":
                out[b] = consume(b, res)
                states[b] = None
            else:
                states[b] = _to(res, "cpu") if offload else res
        del w
    return out


@torch.no_grad()
def layer_fed(model: Transformer, nx, w: Mapping[str, torch.Tensor], i: int, x: torch.Tensor,
              like: LayerState) -> torch.Tensor:
    """Layer i of the engine fed `x` (batch, t, d), e.g. the reference's input of that layer: the engine's own
    attn_norm of x, the layer, the residual add (the layer's *local* error, without what earlier layers
    propagate). Returns the layer's output residual stream (batch, t, d); no taps, observer or probe. `like`
    gives the positions and RoPE tables of the batch."""
    tap, observer, local = nx.tap, nx.observer, nx.local
    nx.tap, nx.observer, nx.local = None, None, None
    try:
        hn, hq = nx.rmsnorm_quant(x, w[f"model.layers.{i}.input_layernorm.weight"], model.cfg.rms_norm_eps,
                                  f"layers.{i}.attn_norm")
        return model.forward_layer(nx, w, i, LayerState(x, hn, like.pos, like.cos, like.sin, hq)).x
    finally:
        nx.tap, nx.observer, nx.local = tap, observer, local


def _to(state, device):
    """A batch's activations (tokens, a `LayerState`) on `device` (x and hn moved; positions are shared)."""
    if isinstance(state, LayerState):
        if state.x.device == torch.device(device):
            return state
        return LayerState(state.x.to(device), state.hn.to(device), state.pos, state.cos, state.sin)
    return state
