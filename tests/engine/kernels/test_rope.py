"""The fused q/k RoPE kernel (engine.kernels.rope.rope_qk) against `engine.rope.apply_rope`: bit-identical.

* GPU tests (marker `gpu`, skipped without CUDA): Llama-3-8B-like shapes (32 / 8 heads, d = 128) on the
  model's strided q/k views, both cos/sin layouts, inf / NaN / signed-zero inputs.
* Interpreter tests (marker `interpreter` alone): on CPU tensors under TRITON_INTERPRET=1 only
  (``TRITON_INTERPRET=1 python3 -m pytest -q -m interpreter tests/engine/kernels/test_rope.py``); small shapes,
  4 heads: every layout, head dims 24 / 64 / 96 / 128 (masked halves), head blocks 1 / 2 / 4.
* Input validation: needs only an importable triton (no launch).

"Bit-identical" means equal fp32 bit patterns, signed zeros included; NaN positions must agree but
NaN payloads may differ (the module docstring of engine.kernels.rope).
"""

from __future__ import annotations

import pytest
import torch


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """(equal fp32 bits where either is not NaN and NaN in the same places, a short mismatch report)."""
    if a.shape != b.shape:
        return False, f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    ai, bi = a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    bad = (ai != bi) & ~(nan_a & nan_b)
    n = int(bad.sum())
    if n == 0:
        return True, ""
    idx = bad.nonzero()[0].tolist()
    return False, f"{n} of {a.numel()} differ; first at {idx}: {a[tuple(idx)].item()!r} vs {b[tuple(idx)].item()!r}"


def _inputs(b: int, t: int, h: int, hkv: int, d: int, layout: str, dev: str, seed: int = 0):
    """Model-like q, k views (batch, heads, t, d) of contiguous (batch, t, heads*d) fp32 GEMM outputs, cos/sin tables.

    layout "flat": (t, d) tables for positions start .. start+t-1 (contiguous KV cache); "paged":
    (batch, 1, t, d) with each sequence at its own position; "paged1": (1, 1, t, d)."""
    from engine.rope import rope_tables

    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, t, h * d, generator=g) * 3).to(dev)  # (batch, t, heads*d)
    k = (torch.randn(b, t, hkv * d, generator=g) * 3).to(dev)  # (batch, t, kv_heads*d)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (d/2,)
    if layout == "flat":
        pos = torch.arange(37, 37 + t)  # (t,)
        cos, sin = rope_tables(inv_freq, pos)  # (t, d)
    else:
        start = torch.randint(0, 9000, (b, 1), generator=g)
        if layout == "paged1":
            start = start[:1]
        start[0, 0] = 0  # position 0: sin = 0, cos = 1 (inf * 0 below)
        cos, sin = rope_tables(inv_freq, start + torch.arange(t))  # (batch | 1, t, d)
        cos, sin = cos[:, None], sin[:, None]  # (batch | 1, 1, t, d)
    qv = q.view(b, t, h, d).transpose(1, 2)  # (batch, heads, t, d), strided like the model's
    kv = k.view(b, t, hkv, d).transpose(1, 2)  # (batch, kv_heads, t, d)
    return qv, kv, cos.to(dev), sin.to(dev)


def _special(q: torch.Tensor, k: torch.Tensor) -> None:
    """Write inf, -inf, NaN, signed zeros, tiny and huge values into q and k (in place, through the views)."""
    d = q.shape[-1]
    half = d // 2
    q[0, 0, 0, 3] = float("inf")  # at position 0 of a paged layout: inf * sin(0) = NaN
    q[0, -1, -1, half + 1] = -float("inf")
    q[-1, 0, 0, 5] = float("nan")
    k[0, 0, 0, 7] = float("nan")
    k[-1, -1, -1, half + 2] = float("inf")
    # +0 rows away from position 0 (where cos < 0 < sin for some pairs): torch's -(+0) is -0, and
    # -0 + -0 = -0 there; a kernel computing the negation as 0 - x would give +0
    q[-1, 1 % q.shape[1], -1, :] = 0.0
    k[-1, 0, -1, :] = 0.0
    q[-1, 0, -1, :half] = -0.0
    k[0, 0, -1, :] = -0.0
    q[-1, -1, 0, 9] = 3e38  # products overflow to inf
    k[-1, 0, 0, half + 9] = 1e-42  # denormal


def _check(q, k, cos, sin, **knobs) -> None:
    """rope_qk vs apply_rope: contiguous outputs with the same bits."""
    from engine.kernels.rope import rope_qk, rope_qk_reference

    qo, ko = rope_qk(q, k, cos, sin, **knobs)
    qr, kr = rope_qk_reference(q, k, cos, sin)
    assert qo.is_contiguous() and ko.is_contiguous()
    assert qo.dtype == torch.float32 and ko.dtype == torch.float32
    for name, out, ref in (("q", qo, qr), ("k", ko, kr)):
        ok, why = _same_bits(out, ref)
        assert ok, f"{name}: {why}"
    # q_bf16: the same launch also writes q rounded to bf16 (the paged attention's query carrier)
    qo2, ko2, q16 = rope_qk(q, k, cos, sin, q_bf16=True, **knobs)
    assert q16.dtype == torch.bfloat16 and q16.shape == qr.shape and q16.is_contiguous()
    assert _same_bits(qo2, qr)[0] and _same_bits(ko2, kr)[0]
    want = qr.to(torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(q16), nan)
    assert torch.equal(q16.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), "q bf16 copy"


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["flat", "paged"])
@pytest.mark.parametrize("b,t", [(1, 1), (8, 1), (64, 1), (1, 16), (8, 16), (64, 16)])
def test_rope_qk_llama3_8b_bitexact(b, t, layout):
    """Llama-3-8B heads (32 q, 8 kv, d = 128), decode and short prefill: every output bit equals apply_rope's."""
    pytest.importorskip("triton")
    q, k, cos, sin = _inputs(b, t, 32, 8, 128, layout, "cuda", seed=b * 100 + t)
    _check(q, k, cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["flat", "paged", "paged1"])
def test_rope_qk_nonfinite_and_zeros(layout):
    """inf / NaN propagate where apply_rope's do (NaN from inf * sin(0) included); signed zeros keep their sign."""
    pytest.importorskip("triton")
    from engine.kernels.rope import rope_qk
    from engine.rope import apply_rope

    q, k, cos, sin = _inputs(4, 3, 32, 8, 128, layout, "cuda", seed=7)
    _special(q, k)
    _check(q, k, cos, sin)
    qo, _ = rope_qk(q, k, cos, sin)
    qr = apply_rope(q, cos, sin)
    assert torch.isnan(qr).any() and torch.isinf(qr).any()  # the inputs exercise both
    assert torch.equal(torch.isnan(qo), torch.isnan(qr)) and torch.equal(torch.isinf(qo), torch.isinf(qr))


@pytest.mark.gpu
@pytest.mark.parametrize("block_h", [1, 4, 32])
@pytest.mark.parametrize("d", [64, 96, 256])
def test_rope_qk_knobs_and_head_dims(block_h, d):
    """Other head dims (96: masked halves) and head blocks give the same bits as apply_rope."""
    pytest.importorskip("triton")
    q, k, cos, sin = _inputs(3, 5, 12, 4, d, "paged", "cuda", seed=d + block_h)
    _check(q, k, cos, sin, block_h=block_h)


# ------------------------------------------------------------------ interpreter (CPU)
@pytest.mark.interpreter
@pytest.mark.parametrize("layout", ["flat", "paged", "paged1"])
@pytest.mark.parametrize("b,t,hkv,d", [(1, 1, 1, 64), (3, 5, 2, 128), (3, 1, 2, 64), (1, 5, 1, 128)])
def test_rope_qk_interpreter_bitexact(b, t, hkv, d, layout):
    """CPU interpreter: h = 4 heads, strided model views, every bit equal to apply_rope on CPU."""
    pytest.importorskip("triton")
    q, k, cos, sin = _inputs(b, t, 4, hkv, d, layout, "cpu", seed=b * 31 + t * 7 + d)
    _check(q, k, cos, sin)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf * 0
@pytest.mark.parametrize("d,block_h", [(64, 1), (96, 2), (24, 4)])
def test_rope_qk_interpreter_special_values(d, block_h):
    """CPU interpreter: inf / NaN / signed zeros / overflow / denormals, a non-power-of-two half (96, 24)."""
    pytest.importorskip("triton")
    q, k, cos, sin = _inputs(2, 3, 4, 2, d, "paged", "cpu", seed=d)
    _special(q, k)
    _check(q, k, cos, sin, block_h=block_h)


@pytest.mark.interpreter
def test_rope_qk_interpreter_contiguous_and_expanded_inputs():
    """Contiguous q/k and an expanded (stride-0 batch) table give apply_rope's bits too."""
    pytest.importorskip("triton")
    q, k, cos, sin = _inputs(3, 2, 4, 2, 64, "paged1", "cpu", seed=5)
    _check(q.contiguous(), k.contiguous(), cos.expand(3, 1, 2, 64), sin.expand(3, 1, 2, 64))


# ------------------------------------------------------------------ validation (no launch)
def _valid(dev: str = "cpu"):
    """A small valid (q, k, cos, sin)."""
    return _inputs(2, 3, 4, 2, 64, "flat", dev, seed=1)


@pytest.mark.parametrize("case,match", [
    ("q_stride", "q: needs unit stride"),
    ("k_stride", "k: needs unit stride"),
    ("q_dtype", "q: expected float32"),
    ("k_3d", r"k: expected \(batch, heads, t, d\)"),
    ("k_shape", "k: shape"),
    ("odd_d", "must be even"),
    ("cos_shape", "cos: expected"),
    ("sin_heads", "sin: expected"),
    ("cos_dtype", "cos: expected float32"),
])
def test_rope_qk_rejects_bad_inputs(case, match, monkeypatch):
    """Bad inputs raise ValueError naming the tensor before any launch."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # let CPU tensors through the device check
    from engine.kernels.rope import rope_qk

    q, k, cos, sin = _valid()
    if case == "q_stride":
        q = torch.randn(2, 4, 3, 128)[..., ::2]
    elif case == "k_stride":
        k = torch.randn(2, 2, 64, 3).transpose(2, 3)  # (2, 2, 3, 64) with d stride 3
    elif case == "q_dtype":
        q = q.double()
    elif case == "k_3d":
        k = k[0]
    elif case == "k_shape":
        k = torch.randn(2, 2, 4, 64)
    elif case == "odd_d":
        q, k = torch.randn(2, 4, 3, 63), torch.randn(2, 2, 3, 63)
        cos, sin = torch.randn(3, 63), torch.randn(3, 63)
    elif case == "cos_shape":
        cos = cos[:2]
    elif case == "sin_heads":
        sin = sin.expand(2, 4, 3, 64)
    elif case == "cos_dtype":
        cos = cos.double()
    with pytest.raises(ValueError, match=match):
        rope_qk(q, k, cos, sin)


def test_rope_qk_rejects_cpu_without_interpreter(monkeypatch):
    """CPU tensors without TRITON_INTERPRET=1: a ValueError pointing at apply_rope."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from engine.kernels.rope import rope_qk

    with pytest.raises(ValueError, match="q: the Triton RoPE kernel needs CUDA"):
        rope_qk(*_valid())
