"""benchmarks/bench_harness.py's suite: the nightly's evals on the benchmark checkpoint, for the serving configs asked
for; an eval limited to named serving configs (the nightly's tasks: `serving: [default]`) keeps the chosen ones and
is left out when none of them is chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks.bench_harness import write_suite
from evalharness.suite import load_suite

NIGHTLY = Path(__file__).resolve().parents[2] / "suites" / "nightly.yaml"


@pytest.mark.parametrize("serving, want", [
    (None, {"default": {"layer_error", "ppl_kld", "tasks", "longctx"}, "bs1": {"layer_error", "ppl_kld", "longctx"}}),
    (["bs1"], {"bs1": {"layer_error", "ppl_kld", "longctx"}}),
    (["default"], {"default": {"layer_error", "ppl_kld", "tasks", "longctx"}}),
])
def test_bench_suite_keeps_the_nightlys_evals_per_serving_config(tmp_path, serving, want):
    base = yaml.safe_load(NIGHTLY.read_text())
    path = tmp_path / "bench.yaml"
    write_suite(path, base, tmp_path / "ckpt", "Llama-3-8B", ["fp8-block"], "cuda-native", serving)
    suite = load_suite(str(path), data_dir=str(tmp_path))
    assert {r.serving["name"]: set(r.evals) for r in suite.runs} == want
