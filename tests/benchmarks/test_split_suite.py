"""benchmarks/split_suite.py: the nightly split into one suite per model keeps the run keys and fingerprints of the
whole suite's runs (so that results of the parts are what the whole suite's --resume skips)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.split_suite import split
from evalharness.fingerprint import model_inputs, run_fingerprint
from evalharness.suite import load_suite

REPO = Path(__file__).resolve().parents[2]


def test_split_nightly_keeps_run_keys_and_fingerprints(tmp_path, data_dir):
    (tmp_path / "suites").mkdir()
    suite = tmp_path / "suites" / "nightly.yaml"
    shutil.copy(REPO / "suites" / "nightly.yaml", suite)
    (tmp_path / "zoo").symlink_to(REPO / "zoo")  # the suite's ../zoo/<model> paths
    parts = split(suite)
    assert [p.name for p in parts] == [".nightly-zoo-llama.yaml", ".nightly-zoo-moe.yaml",
                                       ".nightly-stories260k.yaml"]
    whole = load_suite(str(suite), data_dir=str(data_dir))
    runs = {r.key: r for r in whole.runs}
    got = []
    for part in parts:
        sub = load_suite(str(part), data_dir=str(data_dir))
        assert {r.model["name"] for r in sub.runs} == {part.stem.split("-", 1)[1]}
        got += [r.key for r in sub.runs]
        r = sub.runs[0]
        assert run_fingerprint(r, model_inputs(r.model), sub.reference_device) == \
            run_fingerprint(runs[r.key], model_inputs(runs[r.key].model), whole.reference_device)
    assert sorted(got) == sorted(runs)


def test_shards_deal_each_models_recipes_and_keep_the_fingerprints(tmp_path, data_dir):
    (tmp_path / "suites").mkdir()
    suite = tmp_path / "suites" / "nightly.yaml"
    shutil.copy(REPO / "suites" / "nightly.yaml", suite)
    (tmp_path / "zoo").symlink_to(REPO / "zoo")
    parts = split(suite, shards=3)
    assert [p.name for p in parts[:3]] == [".nightly-zoo-llama-0.yaml", ".nightly-zoo-llama-1.yaml",
                                           ".nightly-zoo-llama-2.yaml"]
    assert len(parts) == 9
    whole = load_suite(str(suite), data_dir=str(data_dir))
    runs = {r.key: r for r in whole.runs}
    got = []
    for part in parts:
        sub = load_suite(str(part), data_dir=str(data_dir))
        assert sub.runs, part
        got += [r.key for r in sub.runs]
        r = sub.runs[-1]
        assert run_fingerprint(r, model_inputs(r.model), sub.reference_device) == \
            run_fingerprint(runs[r.key], model_inputs(runs[r.key].model), whole.reference_device)
    assert sorted(got) == sorted(runs)  # every run once, none twice
    with pytest.raises(SystemExit, match="--shards 11 needs a 'recipes' list of at least 11"):
        split(suite, shards=11)
    parts = split(suite, shards=2, shards_for={"zoo-moe": 10})
    assert [p.name for p in parts if "zoo-moe" in p.name] == [f".nightly-zoo-moe-{i}.yaml" for i in range(10)]
    assert len(parts) == 14
    assert sorted(k for p in parts for k in (r.key for r in load_suite(str(p), data_dir=str(data_dir)).runs)) == \
        sorted(runs)
    with pytest.raises(SystemExit, match="names models the suite does not have: zoo-mo"):
        split(suite, shards_for={"zoo-mo": 2})


def test_a_suite_without_named_models_is_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodels: [zoo/zoo-llama]\n")
    with pytest.raises(SystemExit, match="'models' must be a list of entries with a 'name'"):
        split(bad)
