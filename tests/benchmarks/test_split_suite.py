"""benchmarks/split_suite.py: the nightly split into one suite per model (or per shard of a model's recipes) keeps the
run keys and fingerprints of the whole suite's runs (so that results of the parts are what the whole suite's
--resume skips)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.split_suite import split
from evalharness.fingerprint import model_inputs, run_fingerprint
from evalharness.results import SCHEMA_VERSION
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


def test_serving_apart_gives_one_run_a_part_with_the_whole_suites_fingerprints(nightly, data_dir):
    parts = split(nightly, shards=10, serving_apart=True)
    assert len(parts) == 60
    assert parts[:2] == [nightly.parent / ".nightly-zoo-llama-0-default.yaml",
                         nightly.parent / ".nightly-zoo-llama-0-bs1.yaml"]
    for part, sub in zip(parts, _check_parts(nightly, parts, data_dir)):
        assert len(sub.runs) == 1
        assert sub.runs[0].serving["name"] == part.stem.rsplit("-", 1)[1]
        # the tasks run under `default` only (evals.tasks.serving): a bs1 part leaves them out, as the suite does
        assert ("tasks" in sub.runs[0].evals) == part.stem.endswith("default")
    with pytest.raises(SystemExit, match="--only-serving bs2 needs --serving-apart and a serving config"):
        split(nightly, serving_apart=True, only_serving="bs2")
    with pytest.raises(SystemExit, match="--only-serving bs1 needs --serving-apart"):
        split(nightly, only_serving="bs1")


def _result(path: Path, spec, fingerprint: dict, status: str = "ok") -> None:
    doc = {"schema_version": SCHEMA_VERSION, "run_key": spec.key, "status": status, "metrics": {},
           "fingerprint": fingerprint}
    path.write_text(json.dumps(doc))


def test_pending_keeps_the_parts_that_resume_would_run(nightly, data_dir, tmp_path):
    """--pending asks the runner's own resume check: a finished result of the run's fingerprint is done; an error
    result or one of another fingerprint (another harness, recipe, model ...) is to run again."""
    whole = load_suite(str(nightly), data_dir=str(data_dir))
    results = tmp_path / "results"
    results.mkdir()
    stale = None
    for r in whole.runs:
        fp = run_fingerprint(r, model_inputs(r.model), whole.reference_device)
        if r.model["name"] != "zoo-moe":
            _result(results / f"{r.key}.json", r, fp)
        elif r.recipe.name == "fp32":
            _result(results / f"{r.key}.json", r, fp, status="error")
        elif r.recipe.name == "bf16" and r.serving["name"] == "bs1":
            stale = r.key
            _result(results / f"{r.key}.json", r, {**fp, "sha256": "0" * 64})
        elif r.serving["name"] == "bs1":
            _result(results / f"{r.key}.json", r, fp)
    parts = split(nightly, shards=10, serving_apart=True, pending=results, data_dir=str(data_dir))
    left = sorted(r.key for p in parts for r in load_suite(str(p), data_dir=str(data_dir)).runs)
    expected = sorted([r.key for r in whole.runs if r.model["name"] == "zoo-moe" and r.serving["name"] == "default"]
                      + [f"zoo-moe__fp32__bs1__{whole.runs[0].backend}", stale])
    assert left == expected
    assert sorted(nightly.parent.glob(".nightly-*.yaml")) == sorted(parts)  # the finished parts' files are gone
    bs1 = split(nightly, shards=10, serving_apart=True, pending=results, data_dir=str(data_dir), only_serving="bs1")
    assert [p.name for p in bs1] == [".nightly-zoo-moe-0-bs1.yaml", ".nightly-zoo-moe-1-bs1.yaml"]
    first = split(nightly, shards=10, serving_apart=True, pending=results, data_dir=str(data_dir), max_parts=3)
    assert first == parts[:3]
    assert sorted(nightly.parent.glob(".nightly-*.yaml")) == sorted(first)
