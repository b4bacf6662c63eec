"""Layer-streamed evaluation (engine.streaming, evalharness.streamed): the same metrics and samples, bit for bit, as
the resident path, on the zoo models (dense Llama; DeepSeek-V3 MoE with MLA) and stories260K (llama2.c)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from engine.streaming import LayerStore, StreamedEngine, StreamedGenerationError
from evalharness.evals import EvalContext, run_eval
from evalharness.reference import ReferenceLM
from evalharness.streamed_reference import StreamedReference

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "data" / "models" / "stories260k" / "stories260K.bin"


def _ctx(engine, reference, loaded, corpus, bos):
    return EvalContext(engine=engine, reference=reference, tokenizer=None, corpus=corpus,
                       vocab_size=loaded.cfg.vocab_size, batch_size=2, seed=0, cache={}, bos_id=bos,
                       model_sha=loaded.sha256)


def _same(a: dict, b: dict) -> None:
    """Equal key sets and bit-equal values (NaN equal to NaN)."""
    assert sorted(a) == sorted(b)
    diff = [k for k in a if not (a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])))]
    assert not diff, f"differ: {[(k, a[k], b[k]) for k in diff[:5]]}"


def _tokens_corpus(tmp_path, vocab: int) -> str:
    """A token-JSON corpus of pseudo-random ids (llama2.c models have no tokenizer here)."""
    import json

    g = torch.Generator().manual_seed(0)
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"vocab_size": vocab, "tokens": torch.randint(3, vocab, (600,), generator=g).tolist()}))
    return str(path)


# the zoo models take 5-10 s each on one core: the slow step; stories260K (needs the shared data) in the quick loop
CASES = [pytest.param("zoo/zoo-llama", "fp8-block", id="zoo-llama", marks=pytest.mark.slow),
         pytest.param("zoo/zoo-moe", "fp8-block", id="zoo-moe", marks=pytest.mark.slow),
         pytest.param("stories", "fp8-tensor", id="stories260k")]


@pytest.mark.parametrize("model,recipe", CASES)
def test_streamed_equals_resident(model, recipe, tmp_path):
    """layer_error (taps, quantization statistics, op-local sums, per-layer local error) and ppl_kld (full logits
    and the top-k cache) of a layer-streamed run equal the resident run's, bit for bit."""
    if model == "stories":
        if not STORIES.exists():
            pytest.skip("shared data folder with stories260K not present")
        source = f"llama2c:{STORIES}"
    else:
        source = str(REPO / model)
    loaded = load_model(source)
    if model == "stories":
        corpus, bos = _tokens_corpus(tmp_path, loaded.cfg.vocab_size), 1
    else:
        corpus, bos = str(REPO / model / "heldout_sample.json"), None
    resident = _ctx(Engine(Transformer(loaded.cfg, loaded.weights), recipe), ReferenceLM(loaded), loaded, corpus, bos)
    store = LayerStore.open(source)
    streamed = _ctx(StreamedEngine(store, recipe), StreamedReference(store), loaded, corpus, bos)
    le = {"windows": 3, "seq_len": 24, "layer_local": True}
    pk = {"seq_len": 24, "max_windows": 3}
    for name, cfg in (("layer_error", le), ("ppl_kld", pk), ("ppl_kld", dict(pk, ref_topk=8))):
        m_res, s_res = run_eval(name, resident, cfg)
        m_str, s_str = run_eval(name, streamed, cfg)
        _same(m_res, m_str)
        assert s_res == s_str
    assert m_res["kld_mean"] > 0  # the recipe really differs from the reference
    assert streamed.counters["streamed_bytes_read"] > 0 and "streamed_bytes_read" not in resident.counters
    m, _ = run_eval("layer_error", resident, le)
    n = loaded.cfg.num_layers
    assert {f"layers.{i}.layer_local.rel_l2" for i in range(n)} <= set(m)
    # the local error of the last layer is not larger than what reaches it from all layers before
    assert 0 < m[f"layers.{n - 1}.layer_local.rel_l2"] <= m[f"layers.{n - 1}.resid_out.rel_l2"]


def test_streamed_engine_does_not_generate():
    """Generation asked of a streamed engine names the memory it needs and the multi-GPU route."""
    from evalharness.data import builtin_path

    store = LayerStore.open(str(builtin_path("tiny-llama")))
    eng = StreamedEngine(store, "fp8-block", resident_bytes=3 * 2**30)
    with pytest.raises(StreamedGenerationError, match=r"3\.0 GiB.*tensor / expert parallelism"):
        eng.generate_batch([])
    with pytest.raises(StreamedGenerationError, match="generation"):
        StreamedReference(store).generate([1, 2], 4)


def test_bench_streamed_tiny_self_check(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_streamed.py on CPU with the tiny shape: writes the checkpoint, runs both evals streamed,
    reports one read of the checkpoint for layer_error and two (reference, engine) for ppl_kld."""
    import importlib.util
    import json
    import sys

    spec = importlib.util.spec_from_file_location("bench_streamed", REPO / "benchmarks" / "bench_streamed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "fig.json"
    monkeypatch.setattr(sys, "argv", ["bench_streamed.py", "--device", "cpu", "--tiny", "--out", str(tmp_path / "ck"),
                                      "--windows", "2", "--seq-len", "16", "--batch-size", "2", "--json", str(out)])
    bench.main()
    fig = json.loads(out.read_text())
    assert fig["layers"] == 3 and fig["layer_error"]["passes"] == 1.0 and fig["ppl_kld"]["passes"] == 2.0
    # the whole checkpoint once, plus each RMSNorm weight read a second time by the stage before its own
    assert 0 <= fig["layer_error"]["bytes_streamed"] - fig["checkpoint_bf16_bytes"] <= 4 * 2 * 64
    assert 0 < fig["layer_error"]["metrics"]["max_rel_l2"] < 1 and fig["ppl_kld"]["projected_dsv3_s"] > 0
    assert not (tmp_path / "ck").exists()
