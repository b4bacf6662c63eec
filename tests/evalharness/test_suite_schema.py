"""The suite schema (evalharness.suite_schema): every refused key is one message naming the file, the key path, what
it must be, the value given and, where there is one, what to do; defaults are recorded as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalharness.errors import SuiteError
from evalharness.evals import validate_eval_config
from evalharness.suite import load_suite

SMOKE = str(Path(__file__).resolve().parents[2] / "suites" / "smoke.yaml")


@pytest.mark.parametrize("sets, lines", [
    (["seed=x"], ["seed must be an integer, got 'x'"]),
    (["backend=cuda-nativ"],
     ["backend must be one of 'cpu-emulated', 'cuda-emulated' or 'cuda-native', got 'cuda-nativ'"]),
    (["backend=[cpu-emulated, cuda-native]"], ["mix devices"]),
    (["serving=[{name: x, attn_block: 96, kv_block_size: 48, cuda_graphs: 1, batch_size: 0}]"],
     ["serving[0].batch_size must be a positive integer, got 0",
      "serving[0].attn_block must be one of 64, 128 or 256, got 96",
      "serving[0].kv_block_size must be one of 16, 32, 64, 128 or 256, got 48",
      "serving[0].cuda_graphs must be true or false, got 1"]),
    (["serving=[{name: x, bs: 3}]"], ["serving[0]: unknown key(s) ['bs']; allowed: ['name', 'batch_size'"]),
    (["serving=[{name: x, tp: 0}]"], ["serving[0].tp must be a positive integer, got 0 (tensor parallel degree"]),
    (["models=[{name: a}]"], ["models[0]: required key 'path' is missing (a model source: an HF model folder"]),
    (["recipes=[]"], ["recipes must be a non-empty list of recipe names or YAML paths, got []"]),
    (["evals={foo: {}}"], ["evals: unknown key(s) ['foo']; allowed: ['layer_error', 'ppl_kld'"]),
    (["evals.tasks.limit=0", "evals.ppl_kld.bos=1"],
     ["evals.tasks.limit must be a positive integer or a mapping of task name -> integer, got 0",
      "evals.ppl_kld.bos must be true or false, got 1"]),
    (["reference_device=gpu"], ["reference_device must be one of 'auto', 'cpu' or 'cuda', got 'gpu' (cpu runs"]),
])
def test_refused_values_name_file_key_need_and_value(sets, lines):
    with pytest.raises(SuiteError) as ei:
        load_suite(SMOKE, sets=sets)
    got = str(ei.value).splitlines()
    assert len(got) == len(lines), got
    assert all(line.startswith(f"{SMOKE} (after --set): ") for line in got), got
    for want in lines:
        assert sum(want in line for line in got) == 1, (want, got)


def test_serving_records_only_non_default_knobs():
    suite = load_suite(SMOKE, sets=["serving=[{name: a, small_m: 32, prefill_chunk: 16, cuda_graphs: false}, "
                                    "{batch_size: 2, attn_block: 64}]"])
    servings = {r.serving["name"]: r.serving for r in suite.runs}
    assert servings == {"a": {"name": "a", "batch_size": 1, "prefill_chunk": 16, "small_m": 32, "cuda_graphs": False},
                        "serving1": {"name": "serving1", "batch_size": 2}}


def test_serving_entries_set_the_engines_serving_config():
    """The engine's ServingConfig is the one definition of the generation knobs: each of its fields (max_batch as
    batch_size; max_tokens sized per call) is a serving key of a suite, and a run's engine is served with what its
    entry set and the suite defaults for the rest (64-token pages, CUDA graphs only on CUDA)."""
    import dataclasses

    from engine.serving import ServingConfig
    from evalharness.runner import serving_config
    from evalharness.suite_schema import ServingEntry

    fields = {f.name for f in dataclasses.fields(ServingConfig)} - {"max_tokens", "max_batch"} | {"batch_size"}
    assert fields <= set(ServingEntry.model_fields)
    suite = load_suite(SMOKE, sets=["serving=[{name: a, batch_size: 3, prefix_cache: true, fp8_paged_max_tq: 8}, "
                                    "{name: b, kv_block_size: 16, prefill_chunk: 32}]"])
    served = {r.serving["name"]: (serving_config(r.serving, cuda=False), serving_config(r.serving, cuda=True))
              for r in suite.runs}
    assert served["a"][0] == ServingConfig(max_batch=3, kv_block_size=64, prefix_cache=True, fp8_paged_max_tq=8)
    assert served["a"][1].cuda_graphs and not served["a"][0].cuda_graphs
    assert served["b"][1] == ServingConfig(max_batch=1, kv_block_size=16, prefill_chunk=32, cuda_graphs=True)


def test_eval_settings_defaults_and_zero_fewshot():
    assert validate_eval_config("ppl_kld", {"seq_len": 64})["max_windows"] == 16
    assert validate_eval_config("tasks", {"num_fewshot": 0})["num_fewshot"] == 0
    with pytest.raises(ValueError, match=r"evals.layer_error.windows must be a positive integer, got 0"):
        validate_eval_config("layer_error", {"windows": 0})


def test_an_eval_runs_under_the_serving_configs_it_names():
    """`evals.<name>.serving`: the eval runs only under those serving configs (the others' runs leave it out, with
    the key itself never passed to the eval); unknown names, and a serving config left without any eval, are
    errors naming the key."""
    two = "serving=[{name: default, batch_size: 4}, {name: bs1, batch_size: 1}]"
    suite = load_suite(SMOKE, sets=[two, "evals.layer_error.serving=[default]"])
    by_serving = {}
    for run in suite.runs:
        by_serving.setdefault(run.serving["name"], set()).add(frozenset(run.evals))
    assert by_serving["default"] == {frozenset({"layer_error", "ppl_kld"})}
    assert by_serving["bs1"] == {frozenset({"ppl_kld"})}
    assert all("serving" not in cfg for run in suite.runs for cfg in run.evals.values())
    with pytest.raises(SuiteError, match=r"evals.layer_error.serving names \['bs2'\], not serving configs"):
        load_suite(SMOKE, sets=[two, "evals.layer_error.serving=[bs2]"])
    with pytest.raises(SuiteError, match="serving config 'bs1' runs no eval"):
        load_suite(SMOKE, sets=[two, "evals.layer_error.serving=[default]", "evals.ppl_kld.serving=[default]"])
    with pytest.raises(SuiteError, match="evals.ppl_kld.serving must be a list of serving configs, got 'default'"):
        load_suite(SMOKE, sets=["evals.ppl_kld.serving=default"])
