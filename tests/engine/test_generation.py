"""Batched generation (`Engine.generate_batch`): the paged runtime's continuous batching (GQA pages, and MLA's
latent pages) against one request at a time, with per-request budgets and stop ids."""

from __future__ import annotations

import random

import pytest
import torch

from engine.api import Engine
from engine.generation import GenerationRequest, step_statistics
from engine.loading import load_model
from engine.model import Transformer
from engine.serving import ServingConfig
from tests.conftest import REPO
from tests.support.batch_invariance import parted_within_invariance

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def zoo() -> dict[str, Transformer]:
    """zoo-llama (GQA) and zoo-moe (MLA + MoE)."""
    out = {}
    for name in ("zoo-llama", "zoo-moe"):
        loaded = load_model(str(REPO / "zoo" / name))
        out[name] = Transformer(loaded.cfg, loaded.weights)
    return out


def _requests(seed: int = 0, stops: bool = False) -> list[GenerationRequest]:
    """Nine requests: prompts of 3-40 tokens (some of equal length), budgets 1-14, stop ids on some."""
    rnd = random.Random(seed)
    out = []
    for i in range(9):
        n = rnd.choice([3, 9, 9, 24, 40])
        prompt = [1] + [rnd.randrange(3, 4000) for _ in range(n - 1)]
        stop = tuple(rnd.sample(range(3, 4000), 300)) if stops and i % 2 else ()
        out.append(GenerationRequest(tuple(prompt), rnd.randint(1, 14), stop))
    return out


@pytest.mark.parametrize("model", ["zoo-llama", "zoo-moe"])
@pytest.mark.parametrize("batch,chunk", [(4, None), (3, 7), (16, None)])
def test_fp32_batched_equals_one_at_a_time(zoo, model, batch, chunk):
    """Under fp32, continuous batching on the paged runtime (GQA pages; MLA's key + latent pages) gives every
    request the tokens of `Engine.generate` alone, budgets and stop ids included; step statistics match its
    logits. `on_done` hears of every request as it finishes (a progress bar that moves during the decode, not once
    at the end)."""
    eng = Engine(zoo[model], "fp32")
    reqs = _requests(stops=True)
    done: list[int] = []
    gens = eng.generate_batch(reqs, ServingConfig(max_batch=batch, prefill_chunk=chunk), step_stats=True,
                              on_done=done.append)
    assert sum(done) == len(reqs) and len(done) >= 3, done
    stopped = 0
    for r, g in zip(reqs, gens):
        tokens, logits = eng.generate(list(r.prompt), r.max_new_tokens, stop_ids=r.stop_ids, return_logits=True)
        assert g.tokens == tokens
        stopped += len(tokens) < r.max_new_tokens
        ent, margin = step_statistics(logits)
        assert g.entropy == pytest.approx(ent.tolist(), abs=1e-4) and g.margin == pytest.approx(margin.tolist(),
                                                                                                 abs=1e-3)
    assert stopped >= 1  # some request ended on a stop id before its budget


def test_mla_pages_hold_the_cache_format_and_serve_in_batches(zoo):
    """zoo-moe (MLA) on the paged runtime under fp8-kv: the pages are FP8 (the RoPE'd key as one K head with its
    per-head scales, the latent as V in 1x128 groups), a sequence's pages give back the values the contiguous cache
    holds (`Numerics.kv_store`) for the same single request, and the decode ran batched (more rows than steps)."""
    eng = Engine(zoo["zoo-moe"], "fp8-kv")
    m = eng.cfg.mla
    reqs = [GenerationRequest(r.prompt, 6) for r in _requests(seed=4)[:5]]
    eng.work.clear()
    eng.generate_batch(reqs, ServingConfig(max_batch=4))
    rt = eng._runtime
    assert rt.kv.fp8 and (rt.kv.kv_heads, rt.kv.head_dim, rt.kv.head_dim_v) == (1, m.qk_rope_head_dim,
                                                                                m.kv_lora_rank)
    assert eng.work["decode_rows"] > eng.work["decode_steps"]
    # one request alone: its pages against the contiguous cache of Engine.generate's prefill
    from engine.attention import KVCache

    prompt = list(reqs[0].prompt)
    eng.generate_batch([GenerationRequest(tuple(prompt), 1)], ServingConfig(max_batch=1))
    cache = KVCache.empty(eng.cfg, 1, len(prompt), eng.device)
    eng.model.forward(eng.nx, eng.weights, torch.tensor([prompt]), cache)
    for layer in (0, eng.cfg.num_layers - 1):
        k, v = eng._runtime.kv.gather(layer, 0, len(prompt))
        assert torch.equal(k, cache.k[layer]) and torch.equal(v, cache.v[layer]), layer


@pytest.mark.parametrize("recipe", ["fp32", "fp8-kv"])
def test_paged_latent_reads_every_row_at_once_zero_past_its_length(zoo, recipe):
    """`Numerics.paged_latent` returns the whole batch's cached keys and latents padded to the longest row: each
    row's positions up to its start + t are the values its pages hold (`PagedKVCache.gather`, bit for bit), the
    positions past them zeros."""
    from engine.runtime import PagedRuntime, _PagedView

    eng = Engine(zoo["zoo-moe"], recipe)
    m = eng.cfg.mla
    rt = PagedRuntime(eng, ServingConfig(max_batch=3, max_tokens=64, kv_block_size=16))
    gen = torch.Generator().manual_seed(0)

    def call(ids: list[int], starts: list[int], t: int):
        for sid, st in zip(ids, starts):
            rt.kv.allocate(sid, st + t)
        view = _PagedView(rt, torch.tensor(ids), torch.tensor(starts))
        k_pe = torch.randn(len(ids), 1, t, m.qk_rope_head_dim, generator=gen)
        c_kv = torch.randn(len(ids), 1, t, m.kv_lora_rank, generator=gen)
        return eng.nx.paged_latent(view, 0, k_pe, c_kv, "layers.0.attn")

    for sid, t in ((0, 20), (1, 2), (2, 17)):  # prompts of different lengths (one or two pages), one call each
        call([sid], [0], t)
    k, v = call([2, 0, 1], [17, 20, 2], 1)  # a decode step of all three
    assert k.shape == (3, 1, 21, m.qk_rope_head_dim) and v.shape == (3, 1, 21, m.kv_lora_rank)
    for row, (sid, n) in enumerate(((2, 18), (0, 21), (1, 3))):
        kg, vg = rt.kv.gather(0, sid, n)
        assert torch.equal(k[row:row + 1, :, :n], kg) and torch.equal(v[row:row + 1, :, :n], vg), row
        assert not k[row, :, n:].any() and not v[row, :, n:].any(), row
    assert v[:, :, :3].abs().min() > 0  # the stored latents themselves are not zeros


def test_a_request_that_stops_at_once_frees_its_slot(zoo):
    """A request whose first token is a stop id (or whose budget is 1) ends at prefill; the next waiting request
    takes its slot, and everything still matches one request at a time."""
    eng = Engine(zoo["zoo-llama"], "fp32")
    base = _requests(seed=3)
    first = eng.generate_batch(base, ServingConfig(max_batch=2))
    reqs = [GenerationRequest(r.prompt, 10, (g.tokens[0],) if i % 3 == 0 else ()) for i, (r, g) in
            enumerate(zip(base, first))]
    got = eng.generate_batch(reqs, ServingConfig(max_batch=2))
    assert [len(g.tokens) for g in got[::3]] == [1] * len(got[::3])
    assert [g.tokens for g in got] == [eng.generate(list(r.prompt), 10, stop_ids=r.stop_ids) for r in reqs]


@pytest.mark.parametrize("model,recipe", [("zoo-llama", "fp8-block"), ("zoo-llama", "fp8-tensor"),
                                          ("zoo-moe", "fp8-block")])
def test_fp8_batched_within_measured_batch_invariance(zoo, model, recipe):
    """Under FP8, decoding next to other requests moves each step's logits by at most delta, measured on the
    steps before the two decodes part; where they part, the one-at-a-time decode's top-1/top-2 margin is within
    2 * delta (a near-tie that the batch composition may flip), never a real error."""
    eng = Engine(zoo[model], recipe)
    reqs = [GenerationRequest(r.prompt, 16) for r in _requests(seed=1)[:6]]
    assert parted_within_invariance(eng, reqs, ServingConfig(max_batch=4)) < len(reqs)


def test_runtime_pages_are_sized_to_the_requests_and_reused(zoo):
    """The runtime behind `generate_batch` is rebuilt only when the serving config changes or longer requests need
    more pages, and a prompt that fills the context is an error naming its length."""
    eng = Engine(zoo["zoo-llama"], "fp32")
    eng.generate_batch([GenerationRequest((1, 2, 3), 4)])
    rt = eng._runtime
    assert rt.config.max_tokens == 256
    eng.generate_batch([GenerationRequest((1, 2, 3, 4), 8)])
    assert eng._runtime is rt
    eng.generate_batch([GenerationRequest((1,) * 250, 8)])
    assert eng._runtime is not rt and eng._runtime.config.max_tokens == 512
    with pytest.raises(ValueError, match=f"prompt of {eng.cfg.max_position} tokens leaves no room"):
        eng.generate_batch([GenerationRequest((1,) * eng.cfg.max_position, 1)])
