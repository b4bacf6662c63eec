"""layer_error's per-site quantization statistics (`quant.<site>.saturation_frac` / `.underflow_frac`): the
element-weighted fractions over every quantization of the engine's pass, summed on the device from each QTensor's
counts, equal to what `QTensor.stats()` reports of the same quantizations."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from evalharness.data import builtin_path
from evalharness.evals import EvalContext, run_eval
from evalharness.reference import ReferenceLM

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("recipe", ["fp8-tensor", "nvfp4-experts"])
def test_quant_fractions_equal_the_qtensor_stats(recipe):
    loaded = load_model(str(builtin_path("tiny-llama")))
    model = Transformer(loaded.cfg, loaded.weights)
    engine = Engine(model, recipe)
    ctx = EvalContext(engine=engine, reference=ReferenceLM(loaded), tokenizer=None, corpus="builtin:tiny-llama",
                      vocab_size=loaded.cfg.vocab_size, batch_size=2, seed=0, cache={}, bos_id=1)
    cfg = {"windows": 4, "seq_len": 48}
    metrics, _ = run_eval("layer_error", ctx, cfg)
    # the same windows and batches through an observer that asks each QTensor for its stats
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])

    def observe(module: str, site: str, q) -> None:
        st = q.stats()
        n = float(q.data.numel())
        for k, key in ((0, "saturation_frac"), (1, "underflow_frac")):
            sums[site][k] += st[key] * n
        sums[site][2] += n

    win = ctx.windows(48, None, 4, max(4 * 48 * 2, 4096), True)
    for _, inputs, _ in win.batches(2):
        engine.logits(inputs, observer=observe)
    assert sums and any(s[1] > 0 for s in sums.values())  # some site underflows: the comparison can fail
    for site, (sat, under, n) in sums.items():
        assert metrics[f"quant.{site}.saturation_frac"] == pytest.approx(sat / n, rel=1e-12, abs=0)
        assert metrics[f"quant.{site}.underflow_frac"] == pytest.approx(under / n, rel=1e-12, abs=0)
