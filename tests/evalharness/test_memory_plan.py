"""Memory planning (evalharness.memory_plan) and the runner's choice of resident or layer-streamed execution."""

from __future__ import annotations

import pytest

import evalharness.memory_plan as memory_plan
import evalharness.runner as runner
from engine.recipe import load_recipe
from evalharness.data import builtin_path
from evalharness.errors import SuiteError
from evalharness.results import load_result
from evalharness.suite import load_suite

SUITE = ("name: t\nmodels: [{name: tiny, path: 'builtin:tiny-llama'}]\ncorpus: 'builtin:tiny-llama'\n"
         "recipes: [fp8-block]\nserving: [{name: default, batch_size: 2}]\n"
         "evals: {layer_error: {windows: 3, seq_len: 16}, ppl_kld: {seq_len: 16, max_windows: 3}}\n")


def _run(tmp_path, name: str, extra: str = ""):
    (tmp_path / f"{name}.yaml").write_text(SUITE + extra)
    lines: list[str] = []
    (outcome,) = runner.run_suite(load_suite(tmp_path / f"{name}.yaml"), tmp_path / name, log=lines.append)
    return outcome, load_result(outcome.path), lines


def _tiny_plan(budget=None, evals=None, execution="auto"):
    cfg = memory_plan.model_config(str(builtin_path("tiny-llama")))
    evals = evals or {"layer_error": {"windows": 3, "seq_len": 16}, "ppl_kld": {"seq_len": 16, "max_windows": 3}}
    return memory_plan.plan_model_group(cfg, [load_recipe("fp8-block")], evals, 2, "cpu", False, execution,
                                        budget=budget if budget is not None else 1 << 40)


def test_streamed_suite_equals_resident_and_auto_streams_when_resident_does_not_fit(tmp_path, monkeypatch):
    """`execution: streamed` gives the resident run's metrics and samples; `auto` picks streamed when only that
    fits (the plan is printed), and a model that fits neither way is an error result before anything loads."""
    _, res, res_log = _run(tmp_path, "resident", "execution: resident\n")
    _, st, st_log = _run(tmp_path, "streamed", "execution: streamed\n")
    assert res["status"] == st["status"] == "ok"
    assert res["metrics"] == st["metrics"] and res["samples"] == st["samples"]
    assert any("memory plan: resident" in s for s in res_log) and any("memory plan: streamed" in s for s in st_log)
    assert st["counters"]["streamed_bytes_read"] > 0

    full = _tiny_plan()
    between = (full.resident_bytes + full.streamed_bytes) / 2
    assert full.streamed_bytes < between < full.resident_bytes
    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: int(between / memory_plan.HEADROOM))
    _, auto, auto_log = _run(tmp_path, "auto")
    assert any("memory plan: streamed" in s for s in auto_log) and auto["metrics"] == res["metrics"]

    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: 1000)
    monkeypatch.setattr(runner, "load_model", lambda *a: pytest.fail("loaded a model that cannot fit"))
    outcome, err, _ = _run(tmp_path, "nofit")
    assert outcome.status == "error" and outcome.bad_input
    assert err["error"]["type"] == "MemoryPlanError" and "does not fit on cpu" in err["error"]["message"]
    assert "GiB" in err["error"]["message"]


def test_plan_numbers_and_choices():
    """The plan's components add up, streaming needs less than resident, generating evals cannot stream, and the
    offload plan is taken when the windows' activations do not fit next to a layer."""
    plan = _tiny_plan()
    assert plan.mode == "resident" and plan.resident_bytes == sum(plan.resident.values())
    assert plan.streamed["stage_fp32"] < plan.resident["weights_fp32"]
    # fp8-block on the emulated backend keeps dequantized fp32 weights: prepared ~ the quantized sites' fp32 bytes
    assert 0 < plan.resident["prepared"] <= plan.resident["weights_fp32"]
    assert _tiny_plan(plan.streamed_bytes).mode == "streamed"
    no_windows = plan.streamed_bytes - plan.streamed["windows_activations"]
    off = _tiny_plan(no_windows)
    assert off.mode == "streamed" and off.offload and "on the host" in off.describe()
    with pytest.raises(memory_plan.MemoryPlanError, match=r"longctx.*generate"):
        _tiny_plan(plan.streamed_bytes, evals={"ppl_kld": {}, "longctx": {}})
    with pytest.raises(memory_plan.MemoryPlanError, match="execution: resident"):
        _tiny_plan(plan.streamed_bytes, execution="resident")


def test_execution_key_is_validated(tmp_path):
    (tmp_path / "s.yaml").write_text(SUITE + "execution: layered\n")
    with pytest.raises(SuiteError, match="execution must be one of .auto., .resident. or .streamed., got .layered."):
        load_suite(tmp_path / "s.yaml")
