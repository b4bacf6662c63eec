"""Tensor-core accumulation emulation (tcN, tcN:promoteK)."""

from __future__ import annotations

import pytest
import torch

from engine.formats import fake_quantize, matmul_accum, parse_accumulate
from engine.formats.accumulate import truncate_mantissa


def _inputs(m, n, k, seed=0, positive=False):
    """FP8-valued inputs (e4m3 1x128 activations, 128x128 weights)."""
    g = torch.Generator().manual_seed(seed)
    f = torch.rand if positive else torch.randn
    a = fake_quantize(f(m, k, generator=g), "e4m3:1x128")
    b = fake_quantize(f(n, k, generator=g), "e4m3:128x128")
    return a, b


def _rel(c, ref):
    """Frobenius relative error."""
    return ((c.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("s,canon", [
    ("fp32", "fp32"), ("tc14", "tc14"), ("TC14:promote128", "tc14:promote128"),
    ("tc14:inner32", "tc14:inner32"), ("tc13:inner8:promote64", "tc13:promote64:inner8"),
])
def test_parse_accumulate(s, canon):
    """Accepted strings and their canonical forms."""
    assert str(parse_accumulate(s)) == canon


@pytest.mark.parametrize("bad", ["fp16", "tc", "tc0", "tc24", "tc14:promote102", "tc14:promote0",
                                 "tc14:foo", "tc14:promote128:promote128", "tc14promote128"])
def test_parse_accumulate_errors(bad):
    """Invalid strings raise ValueError naming the string and the valid forms."""
    with pytest.raises(ValueError) as ei:
        parse_accumulate(bad)
    assert repr(bad) in str(ei.value) and "tcN" in str(ei.value)


def test_truncate_mantissa():
    """Truncation toward zero keeps N fraction bits."""
    v = torch.tensor([1.0 + 2.0 ** -14 + 2.0 ** -15, -(1.0 + 2.0 ** -14 + 2.0 ** -15), 3.0],
                     dtype=torch.float64)
    assert truncate_mantissa(v, 14).tolist() == [1.0 + 2.0 ** -14, -(1.0 + 2.0 ** -14), 3.0]


def test_fp32_mode_and_exact_small_case():
    """fp32 is a plain matmul; tc with enough bits is exact on small integer inputs."""
    a, b = _inputs(8, 6, 64)
    assert torch.equal(matmul_accum(a, b, "fp32"), a @ b.T)
    ai = torch.randint(-4, 5, (5, 40)).float()
    bi = torch.randint(-4, 5, (3, 40)).float()
    assert torch.equal(matmul_accum(ai, bi, "tc14"), ai @ bi.T)
    assert torch.equal(matmul_accum(ai, bi, "tc14:promote8"), ai @ bi.T)


def test_truncation_is_biased_toward_zero():
    """With positive inputs, truncation only ever loses magnitude."""
    a, b = _inputs(16, 16, 1024, positive=True)
    ref = a.double() @ b.double().T
    c = matmul_accum(a, b, "tc10").double()
    assert torch.all(c <= ref)


def test_tc14_error_and_promotion_gain_k4096():
    """K=4096: tc14 relative error is ~1e-2 (DeepSeek-V3: ~2% max); promote128 is far smaller."""
    a, b = _inputs(32, 32, 4096, seed=1)
    ref = a.double() @ b.double().T
    e32 = _rel(matmul_accum(a, b, "fp32"), ref)
    e14 = _rel(matmul_accum(a, b, "tc14"), ref)
    ep = _rel(matmul_accum(a, b, "tc14:promote128"), ref)
    assert 2e-3 < e14 < 5e-2, e14
    assert ep < e14 / 5, (ep, e14)
    assert e32 < ep
    # positive inputs (no cancellation): max elementwise relative error in the 1% range
    ap, bp = _inputs(16, 16, 4096, seed=2, positive=True)
    refp = ap.double() @ bp.double().T
    mx = ((matmul_accum(ap, bp, "tc14").double() - refp).abs() / refp).max().item()
    assert 3e-3 < mx < 3e-2, mx


def test_more_bits_less_error_and_chunk_batch_invariance():
    """Error falls with N; the chunk_batch knob does not change results; shapes checked."""
    a, b = _inputs(8, 8, 1000, seed=3)
    ref = a.double() @ b.double().T
    errs = [_rel(matmul_accum(a, b, f"tc{n}"), ref) for n in (8, 12, 16, 20)]
    assert errs == sorted(errs, reverse=True)
    assert torch.equal(matmul_accum(a, b, "tc14:promote128", chunk_batch=7),
                       matmul_accum(a, b, "tc14:promote128"))
    with pytest.raises(ValueError):
        matmul_accum(a, b[:, :10], "tc14")
