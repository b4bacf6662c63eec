"""The FP32 reference's batched generation (left-padded transformers batches with its KV cache) against one
request at a time, and `generate_many`'s one-at-a-time path for engines that only offer `generate`."""

from __future__ import annotations

import random

import pytest
import torch

from engine.generation import GenerationRequest, step_statistics
from engine.loading import load_model
from evalharness.generation import generate_many
from evalharness.reference import ReferenceLM
from tests.conftest import REPO


def _requests(seed: int) -> list[GenerationRequest]:
    """Eight requests of 2-40 prompt tokens and budgets 1-12; stop ids on every third."""
    rnd = random.Random(seed)
    out = []
    for i in range(8):
        prompt = [1] + [rnd.randrange(3, 4000) for _ in range(rnd.choice([1, 6, 6, 21, 39]))]
        out.append(GenerationRequest(tuple(prompt), rnd.randint(1, 12),
                                     tuple(rnd.sample(range(3, 4000), 400)) if i % 3 == 0 else ()))
    return out


@pytest.mark.parametrize("model", ["zoo-llama", "zoo-moe"])
def test_padded_batches_equal_one_at_a_time(model):
    """Left padding, chunked prefill and finished rows leaving the batch change nothing but fp32 rounding: the
    same tokens as `generate` alone, step logits within 1e-4, statistics from those logits."""
    ref = ReferenceLM(load_model(str(REPO / "zoo" / model)))
    reqs = _requests(seed=2)
    done: list[int] = []  # the progress callback: every request, as it finishes
    gens = ref.generate_batch(reqs, max_batch=3, step_stats=True, keep_logits=True, on_done=done.append)
    assert sum(done) == len(reqs) and len(done) >= 3, done
    for r, g in zip(reqs, gens):
        tokens, logits = ref.generate(list(r.prompt), r.max_new_tokens, stop_ids=r.stop_ids, return_logits=True)
        assert g.tokens == tokens
        assert (g.logits - logits).abs().max().item() <= 1e-4
        ent, margin = step_statistics(g.logits)
        assert g.entropy == pytest.approx(ent.tolist(), abs=1e-9) and g.margin == pytest.approx(margin.tolist())
    assert any(len(g.tokens) < r.max_new_tokens for r, g in zip(reqs, gens))  # a stop id ended one early


class OneAtATime:
    """An engine with only the narrow interface's `generate`: counts its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def generate(self, prompt, max_new_tokens, stop_ids=(), return_logits=False):
        self.calls += 1
        return self.inner.generate(prompt, max_new_tokens, stop_ids=stop_ids, return_logits=return_logits)


def test_generate_many_drives_a_one_request_engine():
    """Without `generate_batch`, each request goes through `generate` (with logits when statistics are asked
    for), giving what the batched path gives."""
    ref = ReferenceLM(load_model(str(REPO / "zoo" / "zoo-llama")))
    reqs = _requests(seed=5)
    single = OneAtATime(ref)
    done: list[int] = []
    got = generate_many(single, reqs, max_batch=4, step_stats=True, on_done=done.append)
    want = generate_many(ref, reqs, max_batch=4, step_stats=True)
    assert single.calls == len(reqs) and done == [1] * len(reqs)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert torch.allclose(torch.tensor(sum((g.entropy for g in got), [])),
                          torch.tensor(sum((w.entropy for w in want), [])), atol=1e-5)


def test_long_batches_split_to_bound_attention_memory(monkeypatch):
    """`logits` over a batch whose eager attention would pass the budget runs in sub-batches (same bits), and a
    sequence too long alone in query chunks through the KV cache (fp32 rounding only)."""
    import evalharness.reference as R

    ref = ReferenceLM(load_model(str(REPO / "zoo" / "zoo-llama")))
    heads = ref.model.config.num_attention_heads
    x = torch.randint(0, 4000, (5, 300), generator=torch.Generator().manual_seed(0))
    full = ref.logits(x)
    monkeypatch.setattr(R, "_ATTN_BYTES", 3 * heads * 300 * 300 * 4 * 2)  # two sequences per call
    assert torch.equal(ref.logits(x), full)
    monkeypatch.setattr(R, "_ATTN_BYTES", 3 * heads * 300 * 70 * 4)  # one sequence, 70 queries at a time
    assert (ref.logits(x) - full).abs().max().item() <= 1e-4
