"""benchmarks/bench_harness.py's generation throughput: the evaluations' batched generation (every prompt at once
through `generate_many`, served with the given paging) against the runtime's decode step, with its arithmetic
checked on the CPU emulation."""

from __future__ import annotations

import pytest

from benchmarks.bench_harness import generation_throughput
from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from evalharness.data import builtin_path


def test_generation_throughput_counts_every_new_token_against_the_runtimes_step():
    loaded = load_model(str(builtin_path("tiny-llama")))
    eng = Engine(Transformer(loaded.cfg, loaded.weights), "fp8-block")
    prompts = [[1] + [3 + (7 * i + j) % 200 for j in range(20 + 5 * i)] for i in range(3)]
    g = generation_throughput(eng, prompts, 6, forward_s_per_token=1e-5, decode_s=0.01, cuda=False)
    assert (g["batch"], g["new_tokens"]) == (3, 18)  # no stop ids: every request its 6 tokens
    assert eng.serving.max_batch == 3 and eng.serving.kv_block_size == 64 and not eng.serving.cuda_graphs
    assert g["prefill_floor_s"] == pytest.approx(sum(map(len, prompts)) * 1e-5)
    assert g["runtime_tokens_per_s"] == pytest.approx(300.0)
    assert g["tokens_per_s"] == pytest.approx(18 / g["s"]) and g["ratio"] == pytest.approx(g["tokens_per_s"] / 300.0)
    assert g["ratio_decode"] == pytest.approx(18 / (g["s"] - g["prefill_floor_s"]) / 300.0)
    slow = generation_throughput(eng, prompts, 6, forward_s_per_token=1.0, decode_s=0.01, cuda=False)
    assert slow["ratio_decode"] is None  # a prefill floor above the measured time: no decode-only ratio
