"""Op-local conformance probe (`Numerics.local`): each op's own error vs float64 on the same inputs.

These are the measurements that let the smoke gate catch a BF16 softmax, a 14-bit accumulator and a
shared K-cache scale, which end-to-end KLD cannot resolve on small models (docs/guide/gate.md, "The gate selftest").
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.numerics import Numerics
from engine.recipe import load_recipe
from evalharness.evals.layer_error import LocalSums

SELFTEST = "suites/selftest"


def _nx(recipe: str) -> tuple[Numerics, LocalSums]:
    nx = Numerics(load_recipe(recipe))
    sink = LocalSums()
    nx.local = sink
    return nx, sink


def test_local_sums_aggregate_rel_l2_and_mean():
    """rel_l2 = sqrt(sum num / sum den) over calls and modules; headroom = sum / count; worst module named."""
    s = LocalSums()
    t = torch.tensor
    s("a", "linear.accum", "rel_l2", t(1.0), t(100.0))
    s("a", "linear.accum", "rel_l2", t(3.0), t(100.0))  # module a: sqrt(4 / 200)
    s("b", "linear.accum", "rel_l2", t(0.0), t(50.0))
    s("a", "kv.k", "headroom_bits", t(3.0), t(2.0))
    s("b", "kv.k", "headroom_bits", t(0.0), t(2.0))
    m, worst = s.result()
    assert m["local.linear.accum.rel_l2"] == pytest.approx(math.sqrt(4 / 250))
    assert m["local.linear.accum.rel_l2_max"] == pytest.approx(math.sqrt(4 / 200))
    assert m["local.kv.k.headroom_bits"] == pytest.approx(0.75)
    assert m["local.kv.k.headroom_bits_max"] == pytest.approx(1.5)
    assert worst == ["kv.k.headroom_bits: a", "linear.accum.rel_l2: a"]


def test_gemm_accumulation_error_isolated():
    """fp32 accumulation: ~1e-7 relative to float64; tc14 without promotion: >= 100x more, on the same
    FP8 inputs, and equal to a hand computation of the same quantity."""
    torch.manual_seed(0)
    x = torch.randn(16, 1024)
    w = torch.randn(64, 1024) / 32
    vals = {}
    for recipe in ("fp8-block", f"{SELFTEST}/accum-tc14-no-promotion.yaml"):
        nx, sink = _nx(recipe)
        wq = nx.prepare_weight(w, "linear.weight", "m")
        xq = nx.quant(x, "linear.input", "m")
        nx.linear(xq, wq, None, "m")
        vals[recipe] = sink.result()[0]["local.linear.accum.rel_l2"]
        if recipe == "fp8-block":  # fp32 accumulation, before the (bf16) output rounding: by hand
            acc = torch.nn.functional.linear(xq.dequantize(), wq).double()
            ideal = xq.dequantize().double() @ wq.double().T
            assert vals[recipe] == pytest.approx(float((acc - ideal).norm() / ideal.norm()), rel=1e-6)
    assert vals["fp8-block"] < 1e-6
    assert vals[f"{SELFTEST}/accum-tc14-no-promotion.yaml"] > 100 * vals["fp8-block"]


def test_softmax_precision_isolated():
    """The attention probabilities' local error: fp32 softmax ~1e-7, bf16 softmax ~2^-9."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    pos = torch.arange(32)
    out = {}
    for recipe in ("fp8-block", f"{SELFTEST}/softmax-bf16.yaml"):
        nx, sink = _nx(recipe)
        nx.attention(q, k, v, pos, pos, "attn")
        out[recipe] = sink.result()[0]["local.attn.softmax.rel_l2"]
    assert out["fp8-block"] < 1e-6
    assert 2 ** -12 < out[f"{SELFTEST}/softmax-bf16.yaml"] < 2 ** -6


def test_kv_headroom_per_head_vs_per_tensor():
    """Head 1's keys are exactly 4x smaller than head 0's: per-head scales waste 0 bits; one shared scale
    leaves head 1 log2(4) = 2 bits of headroom, 1 bit averaged over the two heads. V (1x128 blocks): 0."""
    torch.manual_seed(2)
    k = torch.randn(2, 2, 8, 64)
    k[:, 1] = k[:, 0] / 4
    got = {}
    for recipe in ("fp8-kv", f"{SELFTEST}/kv-k-per-tensor.yaml"):
        nx, sink = _nx(recipe)
        kd = nx.kv_store(k, "kv.k", "attn")
        nx.kv_store(k, "kv.v", "attn")
        assert kd.shape == k.shape and (kd - k).abs().max() < 0.1 * k.abs().max()
        got[recipe] = sink.result()[0]
    assert got["fp8-kv"]["local.kv.k.headroom_bits"] == 0.0
    assert got[f"{SELFTEST}/kv-k-per-tensor.yaml"]["local.kv.k.headroom_bits"] == pytest.approx(1.0)
    assert got[f"{SELFTEST}/kv-k-per-tensor.yaml"]["local.kv.k.headroom_bits_max"] == pytest.approx(1.0)
    assert got["fp8-kv"]["local.kv.v.headroom_bits"] == 0.0


def test_probe_changes_no_bits():
    """Installing the probe measures only: the engine's logits are bit-identical with and without it."""
    from engine.api import Engine
    from engine.loading import load_model
    from engine.model import Transformer
    from evalharness.data import builtin_path

    loaded = load_model(str(builtin_path("tiny-llama")))
    eng = Engine(Transformer(loaded.cfg, loaded.weights), "fp8-kv")
    toks = torch.randint(0, eng.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    sink = LocalSums()
    assert torch.equal(eng.logits(toks), eng.logits(toks, local=sink))
    m, _ = sink.result()
    assert {"local.linear.accum.rel_l2", "local.attn.softmax.rel_l2", "local.kv.k.headroom_bits"} <= set(m)


def test_router_precision_isolated():
    """The router's own error: an FP32 router ~1e-7 relative to float64 logits, an E4M3 router >= 1e-3
    (the planted `router-e4m3` bug), on the same high-precision input and weight."""
    torch.manual_seed(4)
    x, w = torch.randn(64, 256), torch.randn(16, 256) / 16
    got = {}
    for recipe in ("fp8-block", f"{SELFTEST}/router-e4m3.yaml"):
        nx, sink = _nx(recipe)
        nx.router(x, nx.prepare_weight(w, "router", "layers.1.mlp.gate"), "layers.1.mlp.gate")
        got[recipe] = sink.result()[0]["local.router.rel_l2"]
    assert got["fp8-block"] < 1e-6
    assert got[f"{SELFTEST}/router-e4m3.yaml"] > 1e-3
