"""Sensitivity analysis and automatic bisection of precision recipes.

Sensitivity (the seed article's method): with a low-precision recipe L and a
high-precision recipe H, switch one *unit* (a site, a layer, or a module kind)
at a time

* ``only-low``: H everywhere, the unit in L  -> delta KLD the unit costs alone;
* ``only-high``: L everywhere, the unit in H  -> KLD the unit's fallback recovers;

rank units by their effect with intervals (windows are the paired unit), and
recommend a mixed recipe under a budget ("at most N units in high precision").

Bisection: given a failing candidate recipe and a good recipe (the baseline),
find the smallest set of units whose fallback to the good recipe's formats
brings the metric back under the threshold: rank single-unit recoveries,
add greedily, then prune; report each step's metric and the modeled bytes the
fix moves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from engine.api import Engine
from engine.model import Transformer
from engine.recipe import SITES, Recipe
from evalharness import stats
from evalharness.evals.tokenstats import kl_from_logprobs

# Module kinds: the module-path globs a kind covers (fused quant points + their GEMMs).
MODULE_KINDS: dict[str, tuple[str, ...]] = {
    "attn.qkv": ("layers.*.attn.qkv", "layers.*.attn.q_proj", "layers.*.attn.k_proj", "layers.*.attn.v_proj"),
    "attn.core": ("layers.*.attn",),
    "attn.o_proj": ("layers.*.attn.o_proj",),
    "mlp.gate_up": ("layers.*.mlp.gate_up", "layers.*.mlp.gate_proj", "layers.*.mlp.up_proj"),
    "mlp.down_proj": ("layers.*.mlp.down_proj",),
    "residual": ("layers.*.resid_mid", "layers.*.resid_out", "embed"),
    "lm_head": ("lm_head",),
}


@dataclasses.dataclass(frozen=True)
class Unit:
    """A switchable part of the model: a site (all modules), or module globs (all sites)."""

    name: str
    site: str | None = None
    globs: tuple[str, ...] = ()

    def apply(self, base: Recipe, donor: Recipe, name: str) -> Recipe:
        """`base` with this unit's formats taken from `donor`."""
        if self.site is not None:
            return base.derive(name, **{self.site.replace(".", "_"): donor.spec(self.site)})
        # Every site of the matched modules takes the donor's (module-independent) format; appended
        # overrides win over earlier ones, so a planted per-module override in `base` is replaced too.
        donor_sites = {s: donor.spec(s) for s in SITES}
        return base.with_overrides(name, {g: donor_sites for g in self.globs})


def differing_sites(a: Recipe, b: Recipe) -> list[str]:
    """Sites whose format differs between two recipes."""
    return [s for s in SITES if a.spec(s) != b.spec(s)]


def make_units(by: str, low: Recipe, high: Recipe, n_layers: int) -> list[Unit]:
    """The units of an analysis: `site`, `layer` or `module`."""
    if by == "site":  # `inherit` sites follow their parent site: not a unit of their own
        return [Unit(f"site:{s}", site=s) for s in differing_sites(low, high)
                if not (low.sites[s] == "inherit" and high.sites[s] == "inherit")]
    if by == "layer":
        return [Unit(f"layer:{i}", globs=(f"layers.{i}.*",)) for i in range(n_layers)]
    if by == "module":
        return [Unit(f"module:{k}", globs=g) for k, g in MODULE_KINDS.items()]
    raise ValueError(f"--by must be site, layer or module, got '{by}'")


class RecipeScorer:
    """KLD(reference || engine) per window for any recipe, with the reference computed once."""

    def __init__(self, model: Transformer, reference_logprobs: torch.Tensor, inputs: torch.Tensor,
                 targets: torch.Tensor, backend: str = "cpu-emulated", batch_size: int = 8):
        self.model, self.ref, self.inputs, self.targets = model, reference_logprobs, inputs, targets
        self.backend, self.batch_size = backend, batch_size
        self.calls = 0

    def window_kld(self, recipe: Recipe) -> list[float]:
        """Mean KLD of each window under `recipe` (scored positions only)."""
        self.calls += 1
        engine = Engine(self.model, recipe, backend=self.backend)
        out = []
        for s in range(0, self.inputs.shape[0], self.batch_size):
            x, y = self.inputs[s:s + self.batch_size], self.targets[s:s + self.batch_size]
            le = torch.log_softmax(engine.logits(x).double().cpu(), -1)  # (batch, t, vocab)
            lr = self.ref[s:s + x.shape[0]]
            k = kl_from_logprobs(lr, le)  # (batch, t)
            mask = y >= 0
            k = torch.where(torch.isfinite(k), k, torch.full_like(k, math.inf))
            out += ((k * mask).sum(-1) / mask.sum(-1).clamp_min(1)).tolist()
        return out


def _summary(values: list[float], lower: float | None = 0.0) -> dict[str, float]:
    """Mean with a t-interval over windows (inf if any window is non-finite); `lower`: the least the mean can be
    (0 for the windows' KL divergences, None for a difference of them)."""
    if any(not math.isfinite(v) for v in values):
        return {"mean": math.inf, "lo": math.inf, "hi": math.inf}
    ci = stats.mean_ci(values, lower=lower)
    return {"mean": ci["mean"], "lo": ci["lo"], "hi": ci["hi"]}


def _delta(a: list[float], b: list[float]) -> dict[str, float]:
    """Paired delta mean(b - a) with its interval."""
    d = [y - x for x, y in zip(a, b)]
    return _summary(d, lower=None)


def sensitivity(scorer: RecipeScorer, low: Recipe, high: Recipe, units: list[Unit], budget: int | None = None,
                log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Rank units by only-low cost and only-high recovery; recommend a mixed recipe under `budget`."""
    k_high, k_low = scorer.window_kld(high), scorer.window_kld(low)
    rows = []
    for u in units:
        only_low = scorer.window_kld(u.apply(high, low, f"{high.name}+{u.name}=low"))
        only_high = scorer.window_kld(u.apply(low, high, f"{low.name}+{u.name}=high"))
        row = {"unit": u.name, "only_low_kld": _summary(only_low), "only_low_cost": _delta(k_high, only_low),
               "only_high_kld": _summary(only_high), "only_high_gain": _delta(only_high, k_low)}
        rows.append(row)
        log(f"  {u.name:28} only-low dKLD={row['only_low_cost']['mean']:.4g}  "
            f"only-high gain={row['only_high_gain']['mean']:.4g}")
    rows.sort(key=lambda r: -r["only_high_gain"]["mean"])
    result: dict[str, Any] = {"all_high_kld": _summary(k_high), "all_low_kld": _summary(k_low), "ranking": rows}
    if budget:
        chosen = [r["unit"] for r in rows[:budget]]
        mixed = low
        by_name = {u.name: u for u in units}
        for name in chosen:
            mixed = by_name[name].apply(mixed, high, f"{low.name}-mixed{budget}")
        k_mixed = scorer.window_kld(mixed)
        result["recommended"] = {"budget": budget, "units": chosen, "kld": _summary(k_mixed),
                                 "recipe": mixed.to_dict()}
    return result


def modeled_bytes(recipe: Recipe, model: Transformer) -> dict[str, float]:
    """Bytes per decoded token under `recipe`: weights read once, KV appended, GEMM inputs (no batching)."""
    from engine.recipe import storage_bits as bits

    from engine.model import _module_path

    w = sum(t.numel() * bits(recipe.spec("linear.weight", _module_path(n))) / 8
            for n, t in model.weights.items() if n.endswith("proj.weight"))
    cfg = model.cfg
    kv = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (bits(recipe.spec("kv.k")) + bits(recipe.spec("kv.v"))) / 8
    return {"weight_bytes": w, "kv_bytes_per_token": kv}


def bisect(scorer: RecipeScorer, candidate: Recipe, good: Recipe, units: list[Unit], threshold: float,
           log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Smallest set of units whose fallback to `good` brings mean KLD under `threshold` (greedy + prune)."""
    k_cand = scorer.window_kld(candidate)
    base = _summary(k_cand)
    steps = [{"units": [], "kld": base}]
    if base["mean"] <= threshold:
        return {"threshold": threshold, "candidate_kld": base, "already_passing": True, "units": [], "steps": steps}
    single = []
    for u in units:
        k = _summary(scorer.window_kld(u.apply(candidate, good, f"{candidate.name}-fix-{u.name}")))
        single.append((k["mean"], u))
        log(f"  fallback {u.name:28} -> KLD {k['mean']:.4g}")
    single.sort(key=lambda x: x[0])
    chosen: list[Unit] = []
    current = candidate
    kld = base
    for _, u in single:
        chosen.append(u)
        current = u.apply(current, good, f"{candidate.name}-fix")
        kld = _summary(scorer.window_kld(current))
        steps.append({"units": [c.name for c in chosen], "kld": kld})
        if kld["mean"] <= threshold:
            break
    if kld["mean"] > threshold:
        return {"threshold": threshold, "candidate_kld": base, "found": False, "units": [c.name for c in chosen],
                "steps": steps}
    for u in list(chosen):  # backward pruning: drop units that are not needed
        if len(chosen) == 1:
            break
        trial = [c for c in chosen if c is not u]
        r = candidate
        for c in trial:
            r = c.apply(r, good, f"{candidate.name}-fix")
        k = _summary(scorer.window_kld(r))
        if k["mean"] <= threshold:
            chosen, current, kld = trial, r, k
            steps.append({"units": [c.name for c in chosen], "kld": kld, "pruned": u.name})
    fixed = current
    cost_c, cost_f = modeled_bytes(candidate, scorer.model), modeled_bytes(fixed, scorer.model)
    return {"threshold": threshold, "candidate_kld": base, "found": True, "units": [c.name for c in chosen],
            "fixed_kld": kld, "fixed_recipe": fixed.to_dict(), "steps": steps,
            "cost": {"candidate": cost_c, "fixed": cost_f,
                     "delta_weight_bytes": cost_f["weight_bytes"] - cost_c["weight_bytes"],
                     "delta_kv_bytes_per_token": cost_f["kv_bytes_per_token"] - cost_c["kv_bytes_per_token"]},
            "evaluations": scorer.calls}


def prepare_scorer(suite_path: str, sets: list[str], data_dir: str | None, model_name: str | None,
                   windows: int, seq_len: int, device: str | None = None):
    """Load one model of a suite, its reference log-probs on `windows` windows, and a `RecipeScorer`."""
    from engine.loading import load_model
    from evalharness.evals import EvalContext
    from evalharness.fingerprint import model_source
    from evalharness.reference import ReferenceLM
    from evalharness.runner import _load_tokenizer, resolve_backend
    from evalharness.suite import load_suite

    suite = load_suite(suite_path, sets=sets, data_dir=data_dir)
    models = {r.model["name"]: r for r in suite.runs}
    if model_name is None:
        model_name = next(iter(models))
    if model_name not in models:
        from evalharness.errors import SuiteError

        raise SuiteError(f"{suite_path}: no model named '{model_name}' in the suite (have {sorted(models)})")
    spec = models[model_name]
    backend = resolve_backend(spec.backend, device)
    dev = "cuda" if backend.startswith("cuda") else "cpu"
    loaded = load_model(model_source(spec.model))
    tok = _load_tokenizer(spec.model, loaded)
    reference = ReferenceLM(loaded, device=dev)
    model = Transformer(loaded.cfg, loaded.weights).to(dev)
    bos = getattr(tok, "bos_id", None) if tok is not None else loaded.cfg.bos_token_id
    ctx = EvalContext(engine=None, reference=reference, tokenizer=tok, corpus=spec.model["corpus"],
                      vocab_size=loaded.cfg.vocab_size, batch_size=spec.serving["batch_size"], seed=spec.seed,
                      cache={}, bos_id=bos)
    win = ctx.windows(seq_len, None, windows, max(windows * seq_len * 2, 4096), True)
    ref = torch.cat([torch.log_softmax(reference.logits(x).double().cpu(), -1)
                     for _, x, _ in win.batches(spec.serving["batch_size"])])
    scorer = RecipeScorer(model, ref, win.inputs, win.targets, backend=backend,
                          batch_size=spec.serving["batch_size"])
    info = {"suite": suite.name, "model": spec.model, "backend": backend, "windows": win.n, "seq_len": seq_len,
            "data_sha256": win.sha256, "model_sha256": loaded.sha256}
    return scorer, info


def analysis_doc(kind: str, key: str, info: dict[str, Any], body: dict[str, Any], device: str) -> dict[str, Any]:
    """A result-like document (schema v1 envelope) for a sensitivity or bisection analysis."""
    from evalharness import provenance
    from evalharness.results import SCHEMA_VERSION

    return {"schema_version": SCHEMA_VERSION, "kind": kind, "run_key": key, "status": "ok", "spec": info,
            "provenance": {"git_sha": provenance.git_sha(), "created_at": provenance.now_iso(),
                           "packages": provenance.package_versions(),
                           "hardware": provenance.hardware_fingerprint(device)},
            "metrics": {}, kind: body}
