"""datasets.yaml (evalharness/taskdata/registry.py): found through importlib.resources, validated with errors that
name the entry, looked up by HF dataset and config, built into DatasetDicts from a data dir."""

from __future__ import annotations

import json

import pytest

from evalharness.errors import DataError
from evalharness.taskdata.registry import local_dataset, parse_registry, registry


def test_package_registry_names_the_standard_datasets():
    """The shipped YAML parses and stands in for the datasets of lm-eval's standard tasks; every parser exists."""
    reg = registry()
    assert {"hellaswag", "arc", "piqa", "winogrande", "lambada", "gsm8k", "mmlu"} <= set(reg.lm_eval_folders)
    for path, name in [("Rowan/hellaswag", None), ("allenai/ai2_arc", "ARC-Easy"), ("allenai/ai2_arc", "ARC-Challenge"),
                       ("baber/piqa", None), ("allenai/winogrande", "winogrande_xl"), ("cimec/lambada", None),
                       ("openai/gsm8k", "main"), ("cais/mmlu", "anatomy")]:
        assert local_dataset(path, name) is not None, (path, name)


def test_lookup_matches_path_and_config():
    """A fixed config must match exactly; a templated one fills its files with the config name; other datasets,
    configs with path separators and other names give None."""
    mmlu = local_dataset("cais/mmlu", "college_physics")
    assert mmlu.splits["test"] == ("tasks/mmlu/test/college_physics_test.csv",) and mmlu.name == "college_physics"
    assert local_dataset("cais/mmlu", "../etc") is None
    assert local_dataset("allenai/ai2_arc", "ARC-Hard") is None
    assert local_dataset("allenai/winogrande", "winogrande_xs") is None
    assert local_dataset("EleutherAI/lambada_openai", "default") is None


@pytest.mark.parametrize("raw, match", [
    ({"datasets": []}, "exactly the keys"),
    ({"lm_eval_folders": "arc", "datasets": []}, "list of folder names"),
    ({"lm_eval_folders": [], "datasets": [{"path": "a", "name": None, "parser": "nope", "splits": {"t": "f"}}]},
     r"datasets\[0\]: unknown parser 'nope'"),
    ({"lm_eval_folders": [], "datasets": [{"path": "a", "name": None, "parser": "arc"}]},
     r"datasets\[0\]: needs path, name, parser, splits"),
    ({"lm_eval_folders": [], "datasets": [{"path": "a", "name": None, "parser": "arc", "splits": {"t": [1]}}]},
     "split 't' must be a file"),
    ({"lm_eval_folders": [], "datasets": [{"path": "a", "name": None, "parser": "arc", "splits": {"t": "f"},
                                           "empty": ["t"]}]}, "'empty' must list splits"),
])
def test_registry_errors_name_the_entry(raw, match):
    with pytest.raises(DataError, match=match):
        parse_registry(raw, "x.yaml")


def test_load_builds_every_split_and_the_empty_ones(tmp_path):
    """A dataset from a data dir: its splits from the files, the declared empty splits with the same features;
    a missing file is named; the same files give the same (memoized) object."""
    reg = parse_registry({"lm_eval_folders": [], "datasets": [
        {"path": "my/wg", "name": None, "parser": "winogrande", "splits": {"validation": "wg.jsonl"},
         "empty": ["train"]}]}, "test")
    ds = reg.lookup("my/wg", None)
    with pytest.raises(DataError, match="wg.jsonl is missing: my/wg \\(validation split\\)"):
        ds.load(tmp_path)
    (tmp_path / "wg.jsonl").write_text(json.dumps({"sentence": "A _.", "option1": "x", "option2": "y",
                                                   "answer": "1"}))
    built = ds.load(tmp_path)
    assert len(built["validation"]) == 1 and len(built["train"]) == 0
    assert built["train"].features == built["validation"].features
    assert ds.load(tmp_path) is built
    with pytest.raises(DataError, match="does not exist"):
        ds.load(tmp_path / "nowhere")
