"""Precision switching: the per-request high-precision path of sensitive modules recovers quality, exactly."""

from __future__ import annotations

import pytest
import torch

from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from evalharness.data import builtin_path
from evalharness.evals import EvalContext, run_eval
from evalharness.reference import ReferenceLM

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama master weights and reference."""
    loaded = load_model(str(builtin_path("tiny-llama")))
    return Transformer(loaded.cfg, loaded.weights), ReferenceLM(loaded)


def test_high_path_equals_a_recipe_with_those_modules_in_bf16(tiny):
    """Flagged requests run exactly the recipe with the modules overridden to bf16; others the base recipe."""
    model, _ = tiny
    eng = Engine(model, "fp8-block")
    cost = eng.enable_precision_switch(["layers.0.*"])
    assert cost["switched_tensors"] == 7  # q, k, v, o, gate, up, down of layer 0
    hp = Engine(model, eng.recipe.with_overrides("manual", {"layers.0.*": {
        "linear.weight": "bf16", "linear.input": "bf16"}}))
    x = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(eng.logits(x, high_precision=True), hp.logits(x))
    assert torch.equal(eng.logits(x), Engine(model, "fp8-block").logits(x))
    mixed = eng.logits(x, high_precision=[True, False, False, True])
    assert torch.equal(mixed[[0, 3]], hp.logits(x[[0, 3]])) and torch.equal(mixed[[1, 2]], eng.logits(x[[1, 2]]))


def test_switching_eval_recovers_quality(tiny):
    """Switching every layer to bf16 recovers most of fp8-block's KLD; rows of a mixed batch stay exact."""
    model, ref = tiny
    ctx = EvalContext(engine=Engine(model, "fp8-block"), reference=ref, tokenizer=None, corpus="builtin:tiny-llama",
                      vocab_size=512, batch_size=4, seed=0, cache={}, bos_id=1)
    m, s = run_eval("switching", ctx, {"modules": ["layers.*"], "windows": 4, "seq_len": 48, "reps": 1})
    assert m["low.kld_mean"] > 10 * m["high.kld_mean"] > 0
    assert 0.9 < m["recovered_frac"] <= 1.0 and m["recovered_lo"] <= m["recovered_frac"] <= m["recovered_hi"]
    assert m["mixed.rows_equal_frac"] == 1.0
    assert m["extra_weight_frac"] == pytest.approx(16 / 8.001953125, rel=1e-6)  # every GEMM weight doubled in bf16
    assert m["latency.low_s"] > 0 and m["switch_overhead"] > 0
    assert len(s["low.window_kld"]) == 4


def test_no_matching_module_is_a_clear_error(tiny):
    """A glob that matches nothing names the globs and shows what module paths look like."""
    model, _ = tiny
    with pytest.raises(ValueError, match="no weight matches.*layers.3.mlp.down_proj"):
        Engine(model, "fp8-block").enable_precision_switch(["decoder.*"])
    with pytest.raises(RuntimeError, match="enable_precision_switch"):
        Engine(model, "fp8-block").logits(torch.zeros(1, 4, dtype=torch.long), high_precision=True)
