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
    with pytest.raises(memory_plan.MemoryPlanError, match=r"\['longctx'\] generate"):
        _tiny_plan(plan.streamed_bytes, evals={"ppl_kld": {}, "longctx": {"parts": ["degeneration", "passkey"]}})
    with pytest.raises(memory_plan.MemoryPlanError, match=r"\['invariance'\] generate or serve"):
        _tiny_plan(plan.streamed_bytes, evals={"ppl_kld": {}, "invariance": {}}, execution="streamed")
    with pytest.raises(memory_plan.MemoryPlanError, match="execution: resident"):
        _tiny_plan(plan.streamed_bytes, execution="resident")


def test_plan_streams_log_likelihood_tasks_and_longctx_kld():
    """A streamed group with the tasks eval and longctx is planned: longctx's KLD windows (the model's context by
    default) and one pass of lm-eval requests wait between stages; the pass holds what fits next to one layer, at
    most LM_PASS_TOKENS tokens, and falls back to the host when not even one batch fits on the device."""
    evals = {"tasks": {}, "longctx": {"kld_docs": 3}}
    big = _tiny_plan(evals=evals, execution="streamed")
    cfg = memory_plan.model_config(str(builtin_path("tiny-llama")))
    per_token = 12 * cfg.hidden_size
    assert big.mode == "streamed" and big.pass_tokens == memory_plan.LM_PASS_TOKENS
    assert big.streamed["windows_activations"] == per_token * memory_plan.LM_PASS_TOKENS
    assert "passes of up to 1048576 tokens" in big.describe()
    assert big.resident["kv_cache"] > 0 and "kv_cache" not in big.streamed  # generating parts: resident only
    longctx_only = _tiny_plan(evals={"longctx": {"kld_docs": 3, "parts": ["kld"]}}, execution="streamed")
    assert longctx_only.pass_tokens is None and longctx_only.resident["kv_cache"] == 0
    assert longctx_only.streamed["windows_activations"] == per_token * 3 * cfg.max_position  # kld_seq_len: context
    # a budget with room for 5000 tokens next to one layer: passes of 5000 tokens on the device
    rest = sum(v for k, v in big.streamed.items() if k != "windows_activations")
    small = _tiny_plan(rest + 5000 * per_token, evals=evals, execution="streamed")
    assert small.pass_tokens == 5000 and small.mode == "streamed" and not small.offload
    # room for fewer tokens than one batch of requests (2 x 512): the passes wait on the host
    tasks_only = _tiny_plan(evals={"tasks": {}}, execution="streamed")
    rest = sum(v for k, v in tasks_only.streamed.items() if k != "windows_activations")
    tight = _tiny_plan(rest + 500 * per_token, evals={"tasks": {}}, execution="streamed")
    assert tight.offload and tight.pass_tokens >= 2 * cfg.max_position


def test_execution_key_is_validated(tmp_path):
    (tmp_path / "s.yaml").write_text(SUITE + "execution: layered\n")
    with pytest.raises(SuiteError, match="execution must be one of .auto., .resident. or .streamed., got .layered."):
        load_suite(tmp_path / "s.yaml")
