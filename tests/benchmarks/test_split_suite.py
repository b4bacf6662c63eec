"""benchmarks/split_suite.py: the nightly split into one suite per model (or per shard of a model's recipes) keeps the
run keys and fingerprints of the whole suite's runs (so that results of the parts are what the whole suite's
--resume skips)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.split_suite import split
from evalharness.fingerprint import model_inputs, run_fingerprint
from evalharness.suite import load_suite

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def nightly(tmp_path) -> Path:
    """A copy of suites/nightly.yaml in a scratch tree where its ../zoo/<model> paths resolve."""
    (tmp_path / "suites").mkdir()
    suite = tmp_path / "suites" / "nightly.yaml"
    shutil.copy(REPO / "suites" / "nightly.yaml", suite)
    (tmp_path / "zoo").symlink_to(REPO / "zoo")
    return suite


def _check_parts(suite: Path, parts: list[Path], data_dir) -> list:
    """Every run of the whole suite in exactly one part, each part's runs with the whole suite's fingerprints (its
    first and last run checked); returns the parts' loaded suites."""
    whole = load_suite(str(suite), data_dir=str(data_dir))
    runs = {r.key: r for r in whole.runs}
    subs, got = [], []
    for part in parts:
        sub = load_suite(str(part), data_dir=str(data_dir))
        assert sub.runs, part
        got += [r.key for r in sub.runs]
        for r in (sub.runs[0], sub.runs[-1]):
            assert run_fingerprint(r, model_inputs(r.model), sub.reference_device) == \
                run_fingerprint(runs[r.key], model_inputs(runs[r.key].model), whole.reference_device)
        subs.append(sub)
    assert sorted(got) == sorted(runs)  # every run once, none twice
    return subs


def test_split_nightly_keeps_run_keys_and_fingerprints(nightly, data_dir):
    parts = split(nightly)
    assert [p.name for p in parts] == [".nightly-zoo-llama.yaml", ".nightly-zoo-moe.yaml",
                                       ".nightly-stories260k.yaml"]
    for part, sub in zip(parts, _check_parts(nightly, parts, data_dir)):
        assert {r.model["name"] for r in sub.runs} == {part.stem.split("-", 1)[1]}


def test_shards_deal_each_models_recipes_and_keep_the_fingerprints(nightly, data_dir):
    parts = split(nightly, shards=3)
    assert [p.name for p in parts[:3]] == [".nightly-zoo-llama-0.yaml", ".nightly-zoo-llama-1.yaml",
                                           ".nightly-zoo-llama-2.yaml"]
    assert len(parts) == 9
    _check_parts(nightly, parts, data_dir)
    with pytest.raises(SystemExit, match="--shards 11 needs a 'recipes' list of at least 11"):
        split(nightly, shards=11)
    parts = split(nightly, shards=2, shards_for={"zoo-moe": 10})
    assert [p.name for p in parts if "zoo-moe" in p.name] == [f".nightly-zoo-moe-{i}.yaml" for i in range(10)]
    assert len(parts) == 14
    _check_parts(nightly, parts, data_dir)
    with pytest.raises(SystemExit, match="names models the suite does not have: zoo-mo"):
        split(nightly, shards_for={"zoo-mo": 2})


def test_a_suite_without_named_models_is_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodels: [zoo/zoo-llama]\n")
    with pytest.raises(SystemExit, match="'models' must be a list of entries with a 'name'"):
        split(bad)
