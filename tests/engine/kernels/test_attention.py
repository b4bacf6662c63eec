"""Flash attention (engine/kernels/attention.py, prefill or any tq) vs the FP32 emulation (`Numerics.attention`).

Markers `gpu` + `interpreter`: on the GPU (skipped without CUDA) and on CPU tensors under TRITON_INTERPRET=1. The
paged KV cache's kernels (engine/kernels/paged_kv.py) are tested in test_paged_kv.py with the same tolerance.

Tolerance of the attention outputs: max |kernel - reference| <= 1.5e-2 * max |reference|. The kernels cast
P to bf16 and V to bf16 for the PV product (module docstring of engine.kernels.attention), a relative error
of a few 2^-9 per term (the interpreter run of these cases gave 0.1e-2 .. 0.5e-2); 1.5e-2 leaves headroom
for accumulation order and exp2 differences, and stays well below the difference between a correct and a
wrongly masked / wrongly scaled attention: the tests check that the reference itself moves by more than
DISCRIM = 0.1 where it matters (window, K scales, causal mask, context length). Quantized bits (FP8 output) must
match the formats library exactly.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.support.interpret import GPU_TEST_DEVICE

# skipped without CUDA; under TRITON_INTERPRET=1 they run on CPU tensors (tests/conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]

DEV = GPU_TEST_DEVICE  # "cpu" under TRITON_INTERPRET=1
TOL = 1.5e-2
DISCRIM = 0.1


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| over the finite reference entries."""
    ok = torch.isfinite(ref)
    return ((out.float() - ref).abs()[ok].max() / ref[ok].abs().max()).item()


def _rand(*shape, seed: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    """Seeded normal tensor on DEV in `dtype`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV).to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same FP8 bytes."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _scales_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same fp32 scale bits; NaN scales count as equal to NaN (payload and sign may differ)."""
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | both_nan).all())


# ------------------------------------------------------------------ prefill
PREFILL_CASES = {
    # name: (batch, heads, kv_heads, tq, tk, dq, dv, dtype, window, block_m, block_n)
    "mha_causal_d64_bn256": (2, 4, 4, 200, 200, 64, 64, torch.bfloat16, None, 64, 256),
    "gqa_offset_d128": (2, 8, 2, 150, 350, 128, 128, torch.bfloat16, None, 128, 64),
    "mqa_offset_d96": (1, 4, 1, 77, 301, 96, 96, torch.bfloat16, None, 64, 128),
    "window_offset_bm256": (1, 2, 1, 280, 420, 64, 64, torch.bfloat16, 100, 256, 64),
    "mla_dq192_dv128": (1, 4, 4, 130, 130, 192, 128, torch.bfloat16, None, 64, 64),
    "fp32_inputs": (1, 4, 2, 100, 160, 64, 64, torch.float32, None, 64, 64),
    "fp16_inputs_window": (1, 4, 2, 100, 160, 128, 128, torch.float16, 50, 64, 64),
    "decode_shaped_tq1": (3, 8, 2, 1, 333, 128, 128, torch.bfloat16, None, 128, 64),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_vs_reference(case):
    """Flash attention within TOL of the FP32 emulation: GQA/MQA, q positions after a cached prefix,
    sliding window, dq != dv, head dims 64/96/128/192, block sizes 64/128/256, fp32/bf16/fp16 inputs."""
    from engine.kernels.attention import flash_attention, flash_attention_reference

    b, h, hkv, tq, tk, dq, dv, dtype, window, bm, bn = PREFILL_CASES[case]
    q = _rand(b, h, tq, dq, seed=1, dtype=dtype)
    k = _rand(b, hkv, tk, dq, seed=2, dtype=dtype)
    v = _rand(b, hkv, tk, dv, seed=3, dtype=dtype)
    q_pos = torch.arange(tk - tq, tk, device=DEV)  # the queries follow a cached prefix of tk - tq tokens
    k_pos = torch.arange(tk, device=DEV)
    scale = 0.1 if dq != dv else None  # MLA passes its own softmax scale
    out = flash_attention(q, k, v, q_pos, k_pos, scale=scale, sliding_window=window, block_m=bm, block_n=bn)
    ref = flash_attention_reference(q, k, v, q_pos, k_pos, scale=scale, sliding_window=window)
    assert out.shape == (b, tq, h * dv) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    err = _rel_err(out, ref)
    assert err <= TOL, f"{case}: rel err {err:.2e}"
    if window is not None:  # the window matters at this tolerance: a kernel ignoring it would fail
        full = flash_attention_reference(q, k, v, q_pos, k_pos, scale=scale)
        assert _rel_err(full, ref) > DISCRIM


def test_prefill_unsorted_and_strided_inputs():
    """Keys in any order (k_pos permuted with K/V) and non-contiguous (batch, t, heads, d) views give the
    same result as the sorted contiguous layout, within TOL of the reference."""
    from engine.kernels.attention import flash_attention, flash_attention_reference

    b, h, hkv, t, d = 2, 4, 2, 120, 64
    q = _rand(b, t, h, d, seed=4).transpose(1, 2)  # (b, h, t, d) view, not contiguous
    k = _rand(b, t, hkv, d, seed=5).transpose(1, 2)
    v = _rand(b, t, hkv, d, seed=6).transpose(1, 2)
    pos = torch.arange(t, device=DEV)
    ref = flash_attention_reference(q, k, v, pos, pos, sliding_window=40)
    out = flash_attention(q, k, v, pos, pos, sliding_window=40)
    assert _rel_err(out, ref) <= TOL
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(0)).to(DEV)
    out_p = flash_attention(q, k[:, :, perm], v[:, :, perm], pos, pos[perm], sliding_window=40)
    assert _rel_err(out_p, ref) <= TOL


def _fp8_inputs(b, h, hkv, tq, tk, d, k_layout: str):
    """E4M3 q (per token per head), k (per head over the call, or per token), v (1x128) from the formats library."""
    from engine.formats import quantize

    q = _rand(b, h, tq, d, seed=7, scale=3.0, dtype=torch.float32)
    k = _rand(b, hkv, tk, d, seed=8, scale=2.0, dtype=torch.float32)
    v = _rand(b, hkv, tk, d, seed=9, dtype=torch.float32)
    qq = quantize(q, "e4m3:token")  # scale (b, h, tq, 1)
    if k_layout == "head":  # Numerics.kv_store e4m3:head: one scale per KV head over batch and tokens
        kq = quantize(k.transpose(0, 1).reshape(hkv, -1), "e4m3:token")
        kd = kq.data.reshape(hkv, b, tk, d).transpose(0, 1)
        ks = kq.scale.reshape(hkv)[None, :].expand(b, hkv)  # (batch, kv_heads)
    else:
        kq = quantize(k, "e4m3:token")
        kd, ks = kq.data, kq.scale[..., 0]  # (batch, kv_heads, tk)
    vq = quantize(v, "e4m3:1x128")
    return qq.data, qq.scale[..., 0], kd, ks, vq.data, vq.scale


@pytest.mark.parametrize("k_layout,d,bm,bn", [("head", 128, 128, 128), ("token", 64, 64, 64)])
def test_prefill_fp8_inputs(k_layout, d, bm, bn):
    """FP8 Q/K/V with their scales (q per token per head, K per head or per token, V 1x128) within TOL of
    the emulation on the dequantized values; a kernel that drops the K scales would fail."""
    from engine.kernels.attention import flash_attention, flash_attention_reference

    b, h, hkv, tq, tk = 2, 8, 2, 100, 260
    qd, qs, kd, ks, vd, vs = _fp8_inputs(b, h, hkv, tq, tk, d, k_layout)
    q_pos, k_pos = torch.arange(tk - tq, tk, device=DEV), torch.arange(tk, device=DEV)
    out = flash_attention(qd, kd, vd, q_pos, k_pos, q_scale=qs, k_scale=ks, v_scale=vs, block_m=bm, block_n=bn)
    ref = flash_attention_reference(qd, kd, vd, q_pos, k_pos, q_scale=qs, k_scale=ks, v_scale=vs)
    assert _rel_err(out, ref) <= TOL
    unscaled_k = flash_attention_reference(qd, kd, vd, q_pos, k_pos, q_scale=qs, v_scale=vs)
    assert _rel_err(unscaled_k, ref) > DISCRIM


@pytest.mark.parametrize("h,dv", [(2, 128), (2, 256), (4, 64), (4, 96)])
def test_prefill_fp8_output_bit_exact(h, dv):
    """out_quant='e4m3:1x128': FP8 data and scales equal engine.formats.quantize of the kernel's own fp32
    output, bit for bit (fused epilogue for dv 128/256, second pass for 64/96); output within TOL."""
    from engine.formats import quantize
    from engine.kernels.attention import flash_attention, flash_attention_reference

    tq = tk = 150
    q = _rand(1, h, tq, 128, seed=10)
    k = _rand(1, h, tk, 128, seed=11)
    v = _rand(1, h, tk, dv, seed=12, scale=7.0)
    v[0, 0, :, :5] = 0.0  # some exactly-zero outputs
    pos = torch.arange(tq, device=DEV)
    data, scales, hp = flash_attention(q, k, v, pos, pos, out_quant="e4m3:1x128", return_hp=True)
    ref_q = quantize(hp, "e4m3:1x128")
    assert data.dtype == torch.float8_e4m3fn and data.shape == (1, tq, h * dv)
    assert scales.shape == (1, tq, math.ceil(h * dv / 128))
    assert _bits_equal(data, ref_q.data) and _scales_equal(scales, ref_q.scale)
    assert _rel_err(hp, flash_attention_reference(q, k, v, pos, pos)) <= TOL
    if dv == 128:  # the production path (no fp32 copy) stores the same bits
        data2, scales2 = flash_attention(q, k, v, pos, pos, out_quant="e4m3:1x128")
        assert _bits_equal(data2, data) and _scales_equal(scales2, scales)


def test_prefill_extreme_scores_stay_finite():
    """Query rows scaled by 2**60 (scores near 2**66) and 2**-60: the tiles below the causal diagonal run
    without masks, and their softmax must still subtract the row maximum from the very rounded scores it was
    taken from (an FMA of the score scaling into that subtraction gives exp2(rounding error * huge) = inf,
    i.e. NaN outputs); output within TOL of the reference, which is one-hot / uniform attention."""
    from engine.kernels.attention import flash_attention, flash_attention_reference

    t = 300
    q, k, v = _rand(1, 4, t, 128, seed=16), _rand(1, 2, t, 128, seed=17), _rand(1, 2, t, 128, seed=18)
    q[0, :2] *= 2.0**60
    q[0, 2:] *= 2.0**-60
    pos = torch.arange(t, device=DEV)
    out = flash_attention(q, k, v, pos, pos, block_m=64, block_n=64)
    ref = flash_attention_reference(q, k, v, pos, pos)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert _rel_err(out, ref) <= TOL


def test_prefill_nan_in_v_propagates():
    """A NaN in one element V[p, c] reaches output column c of every query that sees key p, like in the
    emulation (the other columns stay finite), and the fused FP8 output gets a NaN scale for that group;
    the other batch entry stays finite."""
    from engine.kernels.attention import flash_attention, flash_attention_reference

    t, p, c, h = 200, 70, 3, 2
    q, k, v = _rand(2, h, t, 128, seed=13), _rand(2, 1, t, 128, seed=14), _rand(2, 1, t, 128, seed=15)
    v[0, 0, p, c] = float("nan")
    pos = torch.arange(t, device=DEV)
    out = flash_attention(q, k, v, pos, pos).reshape(2, t, h, 128)
    ref = flash_attention_reference(q, k, v, pos, pos).reshape(2, t, h, 128)
    assert torch.isnan(ref[0, p:, :, c]).all()
    assert torch.isnan(out[0, p:, :, c]).all(), "NaN in V dropped"
    others = torch.ones(128, dtype=torch.bool, device=DEV)
    others[c] = False
    assert torch.isfinite(out[0, :, :, others]).all() and torch.isfinite(out[1]).all()
    _, scales = flash_attention(q, k, v, pos, pos, out_quant="e4m3:1x128")  # (2, t, h): one group per head
    assert torch.isnan(scales[0, p:]).all() and torch.isfinite(scales[1]).all()


def test_bad_inputs_raise():
    """Clear errors for mismatched shapes, bad scale layouts and unsupported block sizes."""
    from engine.kernels.attention import flash_attention

    q, k, v = _rand(1, 4, 8, 64, seed=0), _rand(1, 3, 8, 64, seed=0), _rand(1, 3, 8, 64, seed=0)
    pos = torch.arange(8, device=DEV)
    with pytest.raises(ValueError, match="kv_heads 3 must divide heads 4"):
        flash_attention(q, k, v, pos, pos)
    k, v = k[:, :2], v[:, :2]
    with pytest.raises(ValueError, match="k_scale"):
        flash_attention(q, k, v, pos, pos, k_scale=torch.ones(5, device=DEV))
    with pytest.raises(ValueError, match="block_m"):
        flash_attention(q, k, v, pos, pos, block_m=48)
