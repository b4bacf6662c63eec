"""The paged serving runtime on the CPU: same numerics as Engine.generate where the recipe is batch-invariant."""

from __future__ import annotations

import pytest
import torch

from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from engine.runtime import PagedRuntime
from engine.serving import ServingConfig
from evalharness.data import builtin_path

pytestmark = pytest.mark.numerics

PROMPTS = [[1, 5, 9, 33, 2, 7], [1, 100, 3], [1, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 8], [1, 17]]


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama master weights (synthetic outlier channels)."""
    loaded = load_model(str(builtin_path("tiny-llama")))
    return Transformer(loaded.cfg, loaded.weights)


def _serve(model, recipe, n_new=6, **cfg):
    """(runtime outputs + step logits, Engine.generate outputs + step logits) for PROMPTS."""
    eng = Engine(model, recipe)
    rt = PagedRuntime(eng, ServingConfig(**{"max_tokens": 64, **cfg}))
    got = rt.generate(PROMPTS, n_new, return_logits=True)
    want = [eng.generate(p, n_new, return_logits=True) for p in PROMPTS]
    return got, want


@pytest.mark.parametrize("block,batch,chunk", [(16, 4, None), (16, 4, 4), (64, 2, 5), (256, 1, 3)])
def test_fp32_runtime_equals_engine_generate(tiny, block, batch, chunk):
    """Under fp32 paging, batching and chunking change nothing but GEMM order: same tokens, logits within 1e-4."""
    (outs, logits), want = _serve(tiny, "fp32", kv_block_size=block, max_batch=batch, prefill_chunk=chunk)
    assert outs == [w[0] for w in want]
    assert max((a - w[1]).abs().max().item() for a, w in zip(logits, want)) <= 1e-4


def test_fp8_kv_pages_hold_the_emulation_bits(tiny):
    """One request at a time, whole-prompt prefill: the FP8 pages reproduce the emulated KV cache exactly."""
    (outs, logits), want = _serve(tiny, "fp8-kv", kv_block_size=16, max_batch=1)
    assert outs == [w[0] for w in want]
    assert all(torch.equal(a, w[1]) for a, w in zip(logits, want))


def test_fp8_kv_dynamic_head_scales_depend_on_batch_composition(tiny):
    """Batched decode: the per-head K scale of a decode step spans every request in the batch, so a
    request's logits move when it is decoded next to others (what the invariance eval measures)."""
    (outs, logits), want = _serve(tiny, "fp8-kv", kv_block_size=16, max_batch=4)
    gap = max((a - w[1]).abs().max().item() for a, w in zip(logits, want))
    assert gap > 0.1, gap
    (_, logits_b), _ = _serve(tiny, "fp8-block", kv_block_size=16, max_batch=4)  # bf16 KV: no such coupling
    assert max((a - w[1]).abs().max().item() for a, w in zip(logits_b, want)) < gap


def test_kv_block_size_does_not_change_numerics(tiny):
    """Page size is layout only: identical logits for block 16 and 128 under the same batching."""
    eng = Engine(tiny, "fp8-kv")
    a = PagedRuntime(eng, ServingConfig(kv_block_size=16, max_batch=4, max_tokens=64)).generate(
        PROMPTS, 5, return_logits=True)[1]
    b = PagedRuntime(eng, ServingConfig(kv_block_size=128, max_batch=4, max_tokens=128)).generate(
        PROMPTS, 5, return_logits=True)[1]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_decode_split_count_policy(tiny, monkeypatch):
    """Off CUDA there are no splits (None); an explicit `num_splits` wins; on CUDA (the policy evaluated for a
    132-SM device) the count is fixed per batch size, eager and CUDA graphs alike: about two programs per SM
    over the batch's KV heads, at most one split per attention tile of the capacity."""
    import engine.runtime as R

    rt = PagedRuntime(Engine(tiny, "fp32"), ServingConfig(kv_block_size=16, max_batch=4, max_tokens=1024))
    assert rt.splits_for(1) is None
    rt.num_splits = 5
    assert rt.splits_for(1) == 5 and rt.splits_for(64) == 5
    rt.num_splits = None
    monkeypatch.setattr(rt, "device", torch.device("cuda"))
    monkeypatch.setattr(R, "sm_count", lambda device: 132)
    hkv, tiles = rt.kv.kv_heads, 1024 // rt.attn_block
    for b in (1, 2, 4, 64, 10_000):
        assert rt.splits_for(b) == max(1, min(64, tiles, 264 // (b * hkv)))
    assert rt.splits_for(10_000) == 1 and rt.splits_for(1) == min(64, tiles, 264 // hkv) > 1


def test_score_is_the_prefill_logits(tiny):
    """`score` (paged prefill of whole rows) equals the engine's full-sequence logits under fp32."""
    eng = Engine(tiny, "fp32")
    x = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(0))
    rt = PagedRuntime(eng, ServingConfig(kv_block_size=16, max_batch=4, max_tokens=64, prefill_chunk=16))
    assert (rt.score(x) - eng.logits(x)).abs().max().item() <= 1e-4


def test_bad_serving_configs_are_clear_errors(tiny):
    """Validation names the field; CUDA graphs need a CUDA backend; MLA models are refused."""
    with pytest.raises(ValueError, match="kv_block_size 48"):
        ServingConfig(kv_block_size=48)
    with pytest.raises(ValueError, match="prefill_chunk"):
        ServingConfig(prefill_chunk=0)
    with pytest.raises(ValueError, match="cuda_graphs"):
        PagedRuntime(Engine(tiny, "fp32"), ServingConfig(cuda_graphs=True))
    rt = PagedRuntime(Engine(tiny, "fp32"), ServingConfig(max_tokens=16))
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        rt.generate([[1] * 12], 8)


def test_prefix_cache_hit_reuses_pages(tiny):
    """A prompt sharing whole pages with a live sequence reuses them: fp32 hit == miss (1e-4); under fp8-kv
    the reused pages keep the earlier call's per-head K scales, so the hit's logits differ from a miss."""
    prompt = list(range(1, 41))  # 40 tokens: 2 whole 16-token pages can be reused, 8 tokens prefilled
    for recipe, same in (("fp32", True), ("fp8-kv", False)):
        rt = PagedRuntime(Engine(tiny, recipe), ServingConfig(kv_block_size=16, max_batch=2, max_tokens=64,
                                                              prefix_cache=True))
        miss = rt.prefill(0, prompt)
        assert rt.last_prefix_hit == 0 and miss.shape[0] == 40
        rt.prefill(1, prompt[:20])  # an earlier, shorter request: it also holds the first page
        assert rt.last_prefix_hit == 16  # ... which it reused from slot 0
        hit = rt.prefill(0, prompt)  # slot 0 recycled: its prefix now comes from slot 1 (one whole page)
        assert rt.last_prefix_hit == 16 and hit.shape[0] == 24
        gap = (hit - miss[16:]).abs().max().item()
        assert (gap <= 1e-4) if same else (gap > 1e-3), (recipe, gap)


def test_fp8_paged_max_tq_is_a_serving_option():
    """fp8_paged_max_tq: None (no limit) by default, a positive token count, anything else an error naming the
    option."""
    from engine.serving import ServingConfig

    assert ServingConfig().fp8_paged_max_tq is None
    assert ServingConfig(fp8_paged_max_tq=16).fp8_paged_max_tq == 16
    for bad in (0, -4, "16", True):
        with pytest.raises(ValueError, match="fp8_paged_max_tq"):
            ServingConfig(fp8_paged_max_tq=bad)


@pytest.mark.parametrize("recipe", ["fp32", "fp8-kv"])
def test_gather_rows_reads_each_rows_pages_through_the_block_table(tiny, recipe):
    """`PagedKVCache.gather_rows` (device block table, no host read) holds each sequence's gathered K/V first:
    the values `gather` reads, bit for bit (FP8 pages dequantized with their scales)."""
    eng = Engine(tiny, recipe)
    rt = PagedRuntime(eng, ServingConfig(max_tokens=64, kv_block_size=16, max_batch=3))
    assert rt.kv.fp8 == (recipe == "fp8-kv")
    rt.generate(PROMPTS[:3], 5)
    ids = torch.tensor([2, 0, 1])
    k, v = rt.kv.gather_rows(0, ids, rt.kv.max_blocks_per_seq)
    assert k.shape == (3, rt.kv.kv_heads, 64, rt.kv.head_dim) and v.dtype == torch.float32
    for row, sid in enumerate(ids.tolist()):
        n = rt.kv.length(sid)
        kg, vg = rt.kv.gather(0, sid, n)
        assert n > 5 and torch.equal(k[row:row + 1, :, :n], kg) and torch.equal(v[row:row + 1, :, :n], vg)
    with pytest.raises(ValueError, match="num_blocks"):
        rt.kv.gather_rows(0, ids, rt.kv.max_blocks_per_seq + 1)


def test_rows_paged_attention_serves_as_the_gathered_rows(tiny, monkeypatch):
    """`Numerics.paged_attention_rows` (every row over the cache's capacity at once, causally masked: the native
    backend's attention on fp32 pages, which a CUDA graph can hold) against the per-row gathered attention, under
    continuous batching: the same tokens, logits within fp32 summation-order noise, not bit-identical by contract."""
    eng = Engine(tiny, "fp32")
    cfg = ServingConfig(max_tokens=64, kv_block_size=16, max_batch=3, prefill_chunk=4)
    want_out, want_logits = PagedRuntime(eng, cfg).generate(PROMPTS, 8, return_logits=True)
    calls = []

    def rows(*args, **kwargs):
        calls.append(1)
        return eng.nx.paged_attention_rows(*args, **kwargs)

    monkeypatch.setattr(eng.nx, "paged_attention", rows)
    got_out, got_logits = PagedRuntime(eng, cfg).generate(PROMPTS, 8, return_logits=True)
    assert calls and got_out == want_out
    assert max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits)) <= 1e-4
    assert not eng.nx.paged_graphs(torch.float32)  # the emulation's own paged attention reads lengths on the host


@pytest.mark.parametrize("every", [1, 3, 8])
def test_stop_ids_read_back_every_few_steps_end_where_one_at_a_time_does(tiny, every):
    """Stop ids are matched on the device and read back every `stop_check_every` steps: a request past its stop id
    decodes on until then, and its output (tokens, step logits) still ends at the stop id, as Engine.generate's
    one request at a time. The rows decoded past their stop ids are the price: more rows the rarer the read-back."""
    from engine.generation import GenerationRequest

    eng = Engine(tiny, "fp32")
    free_run = [eng.generate(p, 12) for p in PROMPTS]
    # each request its own stop ids: a token of its free-running output (at output positions 1, 4, 6 and never)
    stops = [(free_run[0][1],), (free_run[1][4], 99999), (free_run[2][6],), ()]
    reqs = [GenerationRequest(tuple(p), 12, s) for p, s in zip(PROMPTS, stops)]
    want = [eng.generate(list(r.prompt), 12, stop_ids=r.stop_ids, return_logits=True) for r in reqs]
    assert [len(w[0]) for w in want][:3] == [free_run[0].index(stops[0][0]) + 1, free_run[1].index(stops[1][0]) + 1,
                                              free_run[2].index(stops[2][0]) + 1]
    rt = PagedRuntime(eng, ServingConfig(max_tokens=64, max_batch=4, stop_check_every=every))
    before = eng.work["decode_rows"]
    got = rt.serve(reqs, keep_logits=True)
    rows = eng.work["decode_rows"] - before
    assert [g.tokens for g in got] == [w[0] for w in want]
    for g, w in zip(got, want):
        assert g.logits.shape == w[1].shape and (g.logits - w[1]).abs().max().item() <= 1e-4
    exact = sum(len(w[0]) - 1 for w in want)  # each request's decode steps (its first token is the prefill's)
    assert rows == exact if every == 1 else rows > exact
    with pytest.raises(ValueError, match="stop_check_every"):
        ServingConfig(stop_check_every=0)
