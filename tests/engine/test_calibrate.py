"""Static stage-wise scales: calibration, storage with the recipe, and their effect."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from engine.api import Engine
from engine.calibrate import calibrate_stage_scales
from engine.loading import load_model
from engine.model import Transformer
from engine.recipe import load_recipe
from evalharness.data import builtin_path

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def tiny():
    """The built-in tiny Llama and calibration / evaluation token batches from its corpus."""
    loaded = load_model(str(builtin_path("tiny-llama")))
    toks = json.loads((builtin_path("tiny-llama") / "corpus.json").read_text())["tokens"]
    batches = [torch.tensor([[1] + toks[i * 127:(i + 1) * 127] for i in range(j, j + 4)]) for j in (0, 4)]
    evalb = torch.tensor([[1] + toks[i * 127:(i + 1) * 127] for i in range(8, 16)])
    return Transformer(loaded.cfg, loaded.weights), batches, evalb


def _kld(model, recipe, tokens):
    """Mean token KL(fp32 || recipe)."""
    ref = torch.log_softmax(Engine(model, "fp32").logits(tokens).double(), -1)
    out = torch.log_softmax(Engine(model, recipe).logits(tokens).double(), -1)
    return float((ref.exp() * (ref - out)).sum(-1).mean())


@pytest.mark.slow
def test_stage_scales_shared_within_stages(tiny):
    """2 stages over 4 layers: layers 0-1 share one scale per module kind, 2-3 another."""
    model, batches, _ = tiny
    r = calibrate_stage_scales(model, load_recipe("fp8-tensor"), batches, n_stages=2)
    s = r.scales["linear.input"]
    for kind in ("attn.qkv", "mlp.gate_up", "mlp.down_proj", "attn.o_proj"):
        assert s[f"layers.0.{kind}"] == s[f"layers.1.{kind}"]
        assert s[f"layers.2.{kind}"] == s[f"layers.3.{kind}"]
    assert r.static_scale("linear.input", "layers.2.mlp.down_proj") == s["layers.2.mlp.down_proj"]
    assert r.static_scale("linear.weight", "layers.2.mlp.down_proj") is None
    per_layer = calibrate_stage_scales(model, load_recipe("fp8-tensor"), batches, n_stages=4).scales["linear.input"]
    # a stage scale is the max of its layers' scales
    assert s["layers.0.mlp.down_proj"] == max(per_layer["layers.0.mlp.down_proj"], per_layer["layers.1.mlp.down_proj"])


@pytest.mark.slow
def test_static_recipe_round_trips_through_yaml(tiny, tmp_path):
    """A calibrated recipe is plain data: written as YAML, loaded back identical."""
    model, batches, _ = tiny
    r = calibrate_stage_scales(model, load_recipe("fp8-tensor"), batches, n_stages=2, name="fp8-tensor-static2")
    p = tmp_path / "static.yaml"
    p.write_text(yaml.safe_dump(r.to_dict(), sort_keys=False))
    back = load_recipe(str(p))
    assert back.name == "fp8-tensor-static2" and dict(back.scales["linear.input"]) == dict(r.scales["linear.input"])


def test_static_scales_quality_and_too_small_scales_saturate(tiny):
    """Calibrated static scales stay close to dynamic per-tensor; scales 8x too small saturate and hurt."""
    model, batches, evalb = tiny
    base = load_recipe("fp8-tensor")
    static = calibrate_stage_scales(model, base, batches, n_stages=2, margin=1.25)
    dyn, sta = _kld(model, base, evalb), _kld(model, static, evalb)
    assert sta < 2.0 * dyn, (sta, dyn)
    tiny_scales = {site: {k: v / 8 for k, v in t.items()} for site, t in static.scales.items()}
    bad = base.with_scales("too-small", tiny_scales)
    sat = []
    eng = Engine(model, bad)
    eng.logits(evalb, observer=lambda m, s, q: sat.append(q.stats()["saturation_frac"]) if s == "linear.input" else None)
    assert max(sat) > 0.001
    assert _kld(model, bad, evalb) > 1.5 * sta


def test_static_scales_need_per_tensor_specs(tiny):
    """Block-scaled specs have no single static scale: a clear error."""
    model, batches, _ = tiny
    with pytest.raises(ValueError, match="per-tensor"):
        calibrate_stage_scales(model, load_recipe("fp8-block"), batches, n_stages=2)
