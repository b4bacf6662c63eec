"""ppl_kld: the top-k reference cache (exact at k = vocab, a lower bound below it) and its on-disk reuse."""

from __future__ import annotations

import pytest

from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from evalharness.data import builtin_path
from evalharness.evals import EvalContext, run_eval
from evalharness.reference import ReferenceLM

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def parts():
    """tiny-llama engine (fp8-block) and its reference."""
    loaded = load_model(str(builtin_path("tiny-llama")))
    return Engine(Transformer(loaded.cfg, loaded.weights), "fp8-block"), ReferenceLM(loaded), loaded


def _ctx(parts, cache_dir=None):
    """A fresh EvalContext (fresh in-memory cache) over the built-in corpus."""
    engine, ref, loaded = parts
    return EvalContext(engine=engine, reference=ref, tokenizer=None, corpus="builtin:tiny-llama", vocab_size=512,
                       batch_size=4, seed=0, cache={}, bos_id=1, ref_cache_dir=cache_dir, model_sha=loaded.sha256)


CFG = {"seq_len": 64, "max_windows": 6}


def test_topk_full_vocab_equals_exact_and_small_k_is_a_lower_bound(parts):
    """k = vocab reproduces the exact KLD; k = 4 gives a lower bound (coarsened distributions)."""
    exact, _ = run_eval("ppl_kld", _ctx(parts), CFG)
    full, _ = run_eval("ppl_kld", _ctx(parts), dict(CFG, ref_topk=512))
    small, _ = run_eval("ppl_kld", _ctx(parts), dict(CFG, ref_topk=4))
    assert exact["ref_topk"] == 0 and full["ref_topk"] == 512
    assert full["kld_mean"] == pytest.approx(exact["kld_mean"], rel=1e-9)
    assert full["ppl_ref"] == pytest.approx(exact["ppl_ref"], rel=1e-12)
    assert full["top1_agree"] == exact["top1_agree"]
    assert small["kld_mean"] < exact["kld_mean"] and small["ref_tail_mass_mean"] > 0.01
    assert small["ppl_ref"] == pytest.approx(exact["ppl_ref"], rel=1e-12)  # target log-probs are stored exactly


@pytest.mark.slow
def test_disk_cache_is_reused_across_invocations(parts, tmp_path):
    """A second invocation (new in-memory cache) reads the reference from disk: zero reference passes."""
    c1 = _ctx(parts, str(tmp_path))
    m1, _ = run_eval("ppl_kld", c1, dict(CFG, ref_topk=16))
    assert c1.counters.get("reference_passes_topk") == 1 and len(list(tmp_path.glob("ppl_kld-*.safetensors"))) == 1
    c2 = _ctx(parts, str(tmp_path))
    m2, _ = run_eval("ppl_kld", c2, dict(CFG, ref_topk=16))
    assert c2.counters.get("reference_disk_hits") == 1 and "reference_passes_topk" not in c2.counters
    assert m1["kld_mean"] == m2["kld_mean"]
    next(tmp_path.glob("ppl_kld-*.safetensors")).write_bytes(b"corrupt")  # a corrupt cache is recomputed
    c3 = _ctx(parts, str(tmp_path))
    m3, _ = run_eval("ppl_kld", c3, dict(CFG, ref_topk=16))
    assert c3.counters.get("reference_passes_topk") == 1 and m3["kld_mean"] == m1["kld_mean"]


@pytest.mark.slow
def test_matrix_of_recipes_runs_the_reference_once(parts):
    """N recipes sharing one invocation's cache: one reference pass in total."""
    engine, ref, loaded = parts
    shared: dict = {}
    counters: dict = {}
    for recipe in ("fp32", "bf16", "fp8-tensor", "fp8-block"):
        ctx = EvalContext(engine=Engine(engine.model, recipe), reference=ref, tokenizer=None,
                          corpus="builtin:tiny-llama", vocab_size=512, batch_size=4, seed=0, cache=shared,
                          counters=counters, bos_id=1)
        run_eval("ppl_kld", ctx, CFG)
    assert counters["reference_passes"] == 1 and counters["reference_cache_hits"] == 3


def test_kl_from_logprobs_is_scipys_relative_entropy():
    """The harness's one token-KLD formula against scipy's relative entropy, row by row, and 0 for a row with itself."""
    import numpy as np
    import torch
    from scipy.stats import entropy

    from evalharness.evals.tokenstats import kl_from_logprobs

    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 5, 97, generator=g, dtype=torch.float64) * 3, -1)
    lq = torch.log_softmax(torch.randn(3, 5, 97, generator=g, dtype=torch.float64) * 3, -1)
    got = kl_from_logprobs(lp, lq)
    want = entropy(lp.exp().numpy(), lq.exp().numpy(), axis=-1)
    assert got.shape == (3, 5)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10)
    assert bool((got > 0).all())
    assert torch.equal(kl_from_logprobs(lp, lp), torch.zeros(3, 5, dtype=torch.float64))
