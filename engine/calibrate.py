"""Static, stage-wise scales (the seed article's "unified scale flow").

Calibration runs the model under a recipe on calibration batches, records
the amax every quantization site sees, and then shares one scale per *stage*
of consecutive layers (a scale switch only at stage boundaries):
``scale = max(amax over the stage's layers) * margin / max_normal``. The
scales are stored with the recipe (its ``scales:`` key), so a calibrated
recipe is plain data like any other.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable

import torch

from engine.formats import parse_spec, stage_scales
from engine.model import Transformer
from engine.numerics import Numerics
from engine.recipe import HIGH_PRECISION, Recipe

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


@torch.no_grad()
def observe_amax(model: Transformer, recipe: Recipe, batches: Iterable[torch.Tensor],
                 sites: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """Max |x| seen by every (site, module) quantization over the calibration batches."""
    nx = Numerics(recipe)
    weights = model.prepare(nx)
    amax: dict[tuple[str, str], float] = defaultdict(float)

    def observer(module: str, site: str, q) -> None:
        if site in sites:
            a = q.stats()["amax"]
            amax[(site, module)] = max(amax[(site, module)], float(a))

    nx.observer = observer
    for tokens in batches:
        model.forward(nx, weights, tokens.to(model.device))
    return dict(amax)


def calibrate_stage_scales(model: Transformer, recipe: Recipe, batches: Iterable[torch.Tensor],
                           n_stages: int, sites: tuple[str, ...] = ("linear.input",), margin: float = 1.0,
                           name: str | None = None) -> Recipe:
    """A copy of `recipe` with static per-stage scales for `sites` (per-tensor specs only).

    Each module kind (e.g. ``attn.qkv``, ``mlp.down_proj``) gets one scale per
    stage; modules outside the layer stack (``lm_head``) get their own scale.
    """
    for site in sites:
        spec = recipe.spec(site)
        if spec in HIGH_PRECISION or parse_spec(spec).granularity != "tensor":
            raise ValueError(f"static scales need a per-tensor spec at site '{site}', the recipe has '{spec}'")
    amax = observe_amax(model, recipe, batches, sites)
    n_layers = model.cfg.num_layers
    scales: dict[str, dict[str, float]] = defaultdict(dict)
    per_kind: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for (site, module), a in amax.items():
        m = _LAYER.match(module)
        fmt = parse_spec(recipe.spec(site, module)).elem
        if m is None:
            scales[site][module] = stage_scales({0: a}, 1, 1, fmt=fmt, margin=margin)[0]
        else:
            per_kind[(site, m.group(2))][int(m.group(1))] = a
    for (site, kind), by_layer in per_kind.items():
        fmt = parse_spec(recipe.spec(site, f"layers.0.{kind}")).elem
        shared = stage_scales(by_layer, n_layers, n_stages, fmt=fmt, margin=margin)
        for layer, s in shared.items():
            scales[site][f"layers.{layer}.{kind}"] = float(s)
    return recipe.with_scales(name or f"{recipe.name}-static{n_stages}", scales)
