"""The project's numerics gate, written with its own pytest plugin (evalharness/pytest_plugin.py).

The suite, baselines and overrides come from `[tool.pytest.ini_options]` in pyproject.toml
(`numerics_suite`, `numerics_baselines`, `numerics_set`): the smoke suite's tiny-llama under fp32 and
fp8-block at the suite's full settings, gated against the committed `baselines/smoke/`. Widen it with
`pytest -m numerics --numerics-set recipe=fp32,bf16,fp8-tensor,fp8-block`; refresh the baselines with
`pytest -m numerics --numerics-update-baselines` (review the printed diff, then commit).
"""

from __future__ import annotations

import pytest

from evalharness.pytest_plugin import assert_gate_passes, assert_metric

pytestmark = pytest.mark.numerics

FP32 = "tiny-llama__fp32__default__cpu-emulated"
FP8 = "tiny-llama__fp8-block__default__cpu-emulated"


def test_smoke_gate_against_committed_baselines(numerics_results):
    """Every gate rule of the smoke suite passes against baselines/smoke (evidence printed on failure)."""
    assert set(numerics_results) >= {FP32, FP8}
    assert_gate_passes(numerics_results)


def test_fp32_recipe_is_bit_identical_to_the_reference(numerics_results):
    """fp32 through the engine equals the transformers FP32 reference exactly on CPU."""
    r = numerics_results[FP32]
    assert_metric(r, "ppl_kld.kld_mean", max=0.0)
    assert_metric(r, "layer_error.max_rel_l2", max=0.0)
    assert_metric(r, "ppl_kld.top1_agree", min=1.0)


def test_fp8_block_within_baseline(numerics_results):
    """fp8-block: KLD and top-1 agreement no worse than the committed baseline beyond the tolerance."""
    r = numerics_results[FP8]
    assert_metric(r, "ppl_kld.nonfinite_frac", max=0.0)
    assert_metric(r, "ppl_kld.kld_mean", max=0.1, rel_to_baseline=0.25, abs_tol=1e-6)
    assert_metric(r, "ppl_kld.top1_agree", min=0.8, rel_to_baseline=0.0, abs_tol=0.01, direction="higher")
    assert_metric(r, "layer_error.logits.rel_l2", max=0.2, rel_to_baseline=0.25, abs_tol=1e-5)
