"""Memory planning: the bytes a model group needs, resident or layer-streamed, computed before anything is loaded.

From the model's config (config.json, or a llama2.c header), the recipes, the serving batch sizes and the evals'
settings, `plan_model_group` estimates (all in bytes, on the engine's device):

* weights: one fp32 copy (W; the resident reference shares it on the same device), the largest recipe's prepared
  weights (the emulated backends keep dequantized fp32 values of every quantized site, `cuda-native` the stored
  format: `engine.recipe.storage_bits`), and per stage (embedding, one decoder layer, head) the same for streaming;
* activations of one batch through the forward (residual stream and norms, q/k/v, the MLP's or active experts'
  intermediates, eager attention scores x3, logits x2);
* what the evals keep: the reference taps of one batch (`layer_error`: every layer resident, one layer streamed),
  the reference's logits of ppl_kld's or longctx's KLD windows (full, or the top-k cache above 512 MiB), and
  streamed, the residual streams between stages (reference and engine) of every window of the fixed-window evals
  (layer_error, ppl_kld, longctx's kld part) or of one pass of the tasks eval's log-likelihood requests: lm-eval
  requests are planned at min(context, `TASK_SEQ`) tokens, and a pass holds what fits next to one layer (else on
  the host), at most `LM_PASS_TOKENS` tokens (`MemoryPlan.pass_tokens`; each pass reads the checkpoint once);
* the KV cache of the evals that may generate (tasks, longctx's degeneration and passkey parts, invariance,
  switching, threeway), resident only: streamed, generating tasks and parts are not run (a `PartlyRunError`
  names them), and an eval with nothing that streams (invariance, switching, threeway, longctx without kld) is a
  `MemoryPlanError`.

`execution` (a suite key: auto | resident | streamed) picks the plan: `auto` runs resident when it fits, else
streamed (activations kept on the host between stages when they do not fit next to a layer), else the model group
fails before loading with the numbers (`MemoryPlanError`, an error result per run). These are estimates with a
stated headroom (`HEADROOM` of the free memory is planned for), not measurements.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from engine.config import ModelConfig
from engine.recipe import Recipe, storage_bits
from engine.weights import expected_shapes, module_path, weight_site
from evalharness.errors import HarnessError

if TYPE_CHECKING:
    from engine.loading import ModelSource

EXECUTIONS = ("auto", "resident", "streamed")
# the evals that run layer-major (evalharness.streamed): tasks' log-likelihood tasks and longctx's kld part only
STREAMED_EVALS = ("layer_error", "ppl_kld", "tasks", "longctx")
TASK_SEQ = 2048  # the longest lm-eval request planned for (min(the model's context, this))
LM_PASS_TOKENS = 2**20  # at most this many request tokens wait between stages in one pass of the tasks eval
HEADROOM = 0.9  # the fraction of the free memory a plan may use
_PPL_FULL_LIMIT = 512 * 2**20  # ppl_kld keeps full reference logits below this (evals/ppl_kld._CACHE_LIMIT_BYTES)
GiB = 2**30


class MemoryPlanError(HarnessError):
    """The model group does not fit in the way asked (or at all): raised before anything is loaded."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The plan of one model group: its mode, the memory it may use, and the estimates behind the choice."""

    mode: str  # resident | streamed
    device: str
    budget: int  # bytes the plan may use (HEADROOM x free memory)
    resident: dict[str, int]  # component -> bytes, resident execution
    streamed: dict[str, int]  # component -> bytes, streamed execution
    offload: bool = False  # streamed: activations on the host between stages
    pass_tokens: int | None = None  # streamed: the most input tokens one map_logits pass keeps between stages

    @property
    def resident_bytes(self) -> int:
        """Total bytes of the resident plan."""
        return sum(self.resident.values())

    @property
    def streamed_bytes(self) -> int:
        """Total bytes of the streamed plan (on the device)."""
        return sum(v for k, v in self.streamed.items() if not (self.offload and k == "windows_activations"))

    def describe(self) -> str:
        """One line: the mode chosen and the numbers it was chosen on."""
        def fmt(parts: dict[str, int]) -> str:
            return ", ".join(f"{k} {v / GiB:.3g}" for k, v in parts.items())

        extra = " (activations on the host between stages)" if self.offload else ""
        if self.mode == "streamed" and self.pass_tokens:
            extra += f" (log-likelihood passes of up to {self.pass_tokens} tokens)"
        return (f"memory plan: {self.mode}{extra} on {self.device}, budget {self.budget / GiB:.3g} GiB; "
                f"resident {self.resident_bytes / GiB:.3g} GiB [{fmt(self.resident)}]; "
                f"streamed {self.streamed_bytes / GiB:.3g} GiB [{fmt(self.streamed)}]")


def model_config(source: "str | ModelSource") -> ModelConfig:
    """The model's config without its weights: config.json of an HF folder, a llama2.c file's header."""
    from engine.loading import parse_source, resolve_model_dir

    src = parse_source(source)
    if src.kind == "llama2c":
        from engine.llama2c import read_llama2c

        return ModelConfig.from_hf(read_llama2c(str(Path(src.path).expanduser()))[0], where=str(src))
    path = resolve_model_dir(src.path) / "config.json"
    if not path.exists():
        from engine.errors import WeightsError

        raise WeightsError(f"{path.parent}: config.json is missing; this is not an HF model directory")
    return ModelConfig.from_hf(json.loads(path.read_text()), where=str(path))


def available_bytes(device: str) -> int:
    """Free memory of `device`: the GPU's free bytes, or the host's MemAvailable."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _prepared_bytes(numel: int, spec: str, native: bool) -> int:
    """Extra bytes of one weight prepared in `spec` next to its fp32 master (0 where the master serves)."""
    if spec == "fp32":
        return 0
    return int(numel * storage_bits(spec) / 8) if native else 4 * numel


def weight_bytes(cfg: ModelConfig, recipes: list[Recipe], native: bool) -> dict[Any, tuple[int, int]]:
    """Per stage ('embed', layer i, 'head'): (fp32 bytes, largest recipe's prepared bytes)."""
    from engine.streaming import stage_names, stages

    shapes = expected_shapes(cfg)
    out: dict[Any, tuple[int, int]] = {}
    for stage in stages(cfg):
        fp32 = prep = 0
        names = stage_names(cfg, stage)
        for name in names:
            numel = int(torch.Size(shapes[name]).numel())
            fp32 += 4 * numel
        for recipe in recipes:
            total = 0
            for name in names:
                site = weight_site(name if not (stage == "head" and name.endswith("embed_tokens.weight"))
                                   else "lm_head.weight")
                if site is None:
                    continue
                mod = site if site in ("embed", "lm_head") else module_path(name)
                total += _prepared_bytes(int(torch.Size(shapes[name]).numel()), recipe.spec(site, mod), native)
            prep = max(prep, total)
        out[stage] = (fp32, prep)
    return out


def _batch_activations(cfg: ModelConfig, b: int, t: int) -> int:
    """Peak bytes of one batch's forward (fp32): residual stream and norms, projections, MLP / expert
    intermediates, eager attention scores (scores, probabilities, a temporary), logits and a log-softmax."""
    d, tokens = cfg.hidden_size, b * t
    heads = cfg.num_heads
    qkv = heads * (cfg.mla.qk_head_dim if cfg.mla is not None else cfg.head_dim) * 3
    inter = cfg.intermediate_size
    if cfg.moe is not None:
        inter = max(inter, cfg.moe.intermediate_size * cfg.moe.top_k + (cfg.moe.shared_intermediate_size or 0))
    per_token = 4 * (6 * d + qkv + 3 * inter)
    scores = 3 * 4 * b * heads * t * t
    logits = 2 * 4 * tokens * cfg.vocab_size
    return tokens * per_token + scores + logits


def _tap_bytes_per_layer(cfg: ModelConfig, tokens: int) -> int:
    """Reference tap bytes of one layer for `tokens` tokens (what layer_error keeps until the engine's taps)."""
    d = cfg.hidden_size
    qkv = cfg.num_heads * (cfg.mla.qk_head_dim if cfg.mla is not None else cfg.head_dim) * 4
    inter = cfg.intermediate_size if cfg.moe is None else (cfg.moe.shared_intermediate_size or 0) + cfg.moe.num_experts
    return 4 * tokens * (8 * d + qkv + inter)


def _window_sets(cfg: ModelConfig, settings: dict[str, dict]) -> list[tuple[int, int]]:
    """(windows, seq_len) of each fixed-window eval: layer_error, ppl_kld, longctx's KLD by position."""
    out = []
    for name in ("layer_error", "ppl_kld"):
        if name in settings:
            s = settings[name]
            out.append((s.get("windows") or s.get("max_windows") or 1, s["seq_len"]))
    lc = settings.get("longctx")
    if lc is not None and "kld" in (lc.get("parts") or ("kld",)):
        out.append((lc["kld_docs"], min(lc.get("kld_seq_len") or cfg.max_position, cfg.max_position)))
    return out


def _reference_logits(cfg: ModelConfig, settings: dict[str, dict]) -> list[tuple[str, int, int, Any]]:
    """(eval, windows, seq_len, ref_topk) of each eval that keeps the reference's logits of all its windows."""
    out = []
    if "ppl_kld" in settings:
        s = settings["ppl_kld"]
        out.append(("ppl_kld", s["max_windows"], s["seq_len"], s["ref_topk"]))
    lc = settings.get("longctx")
    if lc is not None and "kld" in (lc.get("parts") or ("kld",)):
        out.append(("longctx", lc["kld_docs"], min(lc.get("kld_seq_len") or cfg.max_position, cfg.max_position),
                    lc.get("ref_topk")))
    return out


def plan_model_group(cfg: ModelConfig, recipes: list[Recipe], evals: dict[str, dict[str, Any]], batch_size: int,
                     device: str, native: bool, execution: str = "auto", budget: int | None = None) -> MemoryPlan:
    """The memory plan of one model (all its recipes), or `MemoryPlanError` with the numbers when none fits.

    `budget`: bytes to plan for (default: HEADROOM x the free memory of `device`)."""
    from evalharness.evals import validate_eval_config

    if execution not in EXECUTIONS:
        raise MemoryPlanError(f"execution must be one of {list(EXECUTIONS)}, got {execution!r}")
    budget = int(HEADROOM * available_bytes(device)) if budget is None else int(budget)
    stage_w = weight_bytes(cfg, recipes, native)
    settings = {name: validate_eval_config(name, dict(c or {})) for name, c in evals.items()}
    windows = _window_sets(cfg, settings)  # (windows, seq_len) of each fixed-window eval
    lm_batch = (settings["tasks"].get("batch_size") or batch_size) if "tasks" in settings else 0
    task_seq = min(cfg.max_position, TASK_SEQ) if "tasks" in settings else 0
    seq = max([t for _, t in windows] + [task_seq]) or 128
    b = max([min(batch_size, n) for n, _ in windows] + [lm_batch, 1])
    act = _batch_activations(cfg, b, seq)
    d = cfg.hidden_size
    vocab = cfg.vocab_size
    taps_one = _tap_bytes_per_layer(cfg, b * seq) if "layer_error" in settings else 0
    ppl = 0
    for _, n, t, topk in _reference_logits(cfg, settings):
        full = n * t * vocab * 4
        ppl = max(ppl, full if full <= _PPL_FULL_LIMIT and not topk else n * t * 64 * 16)
    longctx_parts = ()
    if "longctx" in settings:
        longctx_parts = tuple(settings["longctx"].get("parts") or ("degeneration", "passkey", "kld"))
    generating = [n for n in settings if n not in STREAMED_EVALS or n == "tasks"] + \
        (["longctx"] if set(longctx_parts) - {"kld"} else [])
    # evals with nothing to run layer-streamed: they serve, or (longctx without kld) only generate
    unstreamable = [n for n in settings if n not in STREAMED_EVALS] + \
        (["longctx"] if longctx_parts and "kld" not in longctx_parts else [])
    kv = 0
    if generating:
        ctx_len = min(cfg.max_position, 8192)
        kv_width = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) if cfg.mla is not None else \
            2 * cfg.num_kv_heads * cfg.head_dim
        kv = 2 * 4 * cfg.num_layers * batch_size * ctx_len * kv_width  # reference and engine caches, fp32
    resident = {"weights_fp32": sum(w for w, _ in stage_w.values()) - (stage_w["head"][0] if cfg.tie_word_embeddings
                                                                       else 0),
                "prepared": sum(p for _, p in stage_w.values()), "activations": act,
                "taps": taps_one * cfg.num_layers, "ppl_reference": ppl, "kv_cache": kv}
    biggest = max(stage_w.values(), key=lambda wp: wp[0] + wp[1])
    per_token = 3 * 4 * d  # between stages: the reference's residual stream, the engine's and its norm (fp32)
    win_tokens = max([n * t for n, t in windows] + [seq])
    streamed = {"stage_fp32": biggest[0], "stage_prepared": biggest[1], "activations": act, "taps": taps_one,
                "ppl_reference": ppl}
    pass_tokens = None
    if "tasks" in settings:  # lm-eval's requests, in passes of what fits next to one layer (else on the host)
        floor = lm_batch * task_seq
        room = (budget - sum(streamed.values())) // per_token
        if room < max(floor, win_tokens):
            room = int(HEADROOM * available_bytes("cpu")) // per_token
        pass_tokens = max(floor, min(LM_PASS_TOKENS, room))
        win_tokens = max(win_tokens, pass_tokens)
    streamed["windows_activations"] = per_token * win_tokens
    plan = MemoryPlan("resident", device, budget, resident, streamed, pass_tokens=pass_tokens)
    fits_resident = plan.resident_bytes <= budget
    offload_plan = dataclasses.replace(plan, mode="streamed", offload=True)
    fits_streamed = plan.streamed_bytes <= budget
    fits_offload = offload_plan.streamed_bytes <= budget
    why = ""
    if execution in ("auto", "resident") and fits_resident:
        return plan
    if execution == "resident":
        why = "execution: resident, but the resident plan does not fit"
    elif unstreamable:
        why = (f"the evals {unstreamable} generate or serve, which needs the whole model resident (layer-streamed: "
               "layer_error, ppl_kld, the log-likelihood tasks, longctx's kld part); run them on more GPUs (tensor / "
               "expert parallelism, docs/guide/multi-gpu.md)")
        if execution == "streamed":
            why = f"execution: streamed, but {why}"
    elif fits_streamed:
        return dataclasses.replace(plan, mode="streamed")
    elif fits_offload:
        return offload_plan
    else:
        why = "even one layer streamed (activations on the host between stages) does not fit"
    raise MemoryPlanError(f"model does not fit on {device} ({why}): {plan.describe().split(': ', 1)[1]}. "
                          "Use a larger device, fewer windows or a smaller batch_size, or reference_device: cpu")


def plan_for_runs(suite, runs: list, device: str, log: Callable[[str], None]) -> MemoryPlan:
    """`plan_model_group` for the RunSpecs of one model in a suite (its `execution` key), logged."""
    spec = runs[0]
    from evalharness.fingerprint import model_source

    cfg = model_config(model_source(spec.model))
    plan = plan_model_group(cfg, [r.recipe for r in runs], spec.evals, max(r.serving["batch_size"] for r in runs),
                            device, any(r.backend == "cuda-native" for r in runs),
                            execution=suite.raw.get("execution", "auto"))
    log(f"model '{spec.model['name']}': {plan.describe()}")
    return plan
