"""quantize/QTensor: scale formulas, MX/NVFP4 hand vectors, partial groups, stats."""

from __future__ import annotations

import math

import pytest
import torch

from engine.formats import (NVFP4_TENSOR_DENOM, QTensor, decode_codes, fake_quantize,
                            parse_spec, quantize)

ALL_SPECS = ["fp32", "bf16", "fp16", "e4m3:tensor", "e5m2:tensor", "e4m3:channel",
             "e4m3:token", "e5m2:token", "int8:channel", "int8:token", "e4m3:1x128",
             "e4m3:1x64:pow2", "e4m3:128x128", "e4m3:128x128:pow2", "e4m3:2x32", "e2m1:1x16",
             "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4"]


def _x(*shape, seed=0, scale=1.0):
    """Reproducible Gaussian test tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("shape", [(3, 172), (2, 3, 64), (1, 1), (5,), (0, 16)])
def test_shapes_dtypes_and_roundtrip(spec, shape):
    """Every spec returns a QTensor that dequantizes to the input shape; data dtype documented."""
    x = _x(*shape)
    qt = quantize(x, spec)
    assert isinstance(qt, QTensor) and qt.shape == x.shape
    y = qt.dequantize()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert qt.data.shape == x.shape
    sp = parse_spec(spec)
    want = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.uint8,
            "int8": torch.int8, "fp32": torch.float32, "bf16": torch.bfloat16,
            "fp16": torch.float16}[sp.elem]
    assert qt.data.dtype == want
    if x.numel():
        rel = ((y - x).norm() / x.norm()).item()
        assert rel < (0.2 if sp.elem == "e2m1" else 0.08), rel
    # fake_quantize keeps dtype
    xb = x.to(torch.bfloat16)
    assert fake_quantize(xb, spec).dtype == torch.bfloat16
    # idempotent: quantizing a dequantized tensor again changes nothing
    if x.numel() and sp.kind != "nvfp4":
        assert torch.equal(quantize(y, spec).dequantize(), y)


def test_scale_layouts():
    """Public scale shapes per granularity (module grouping docstring)."""
    x = _x(2, 3, 172)
    assert quantize(x, "e4m3:tensor").scale.shape == ()
    assert quantize(x, "e4m3:channel").scale.shape == (2, 3, 1)
    assert quantize(x, "e4m3:1x128").scale.shape == (2, 3, 2)
    assert quantize(x, "e4m3:128x128").scale.shape == (1, 2)
    assert quantize(x, "mxfp8").scale.shape == (2, 3, 6)
    q = quantize(x, "nvfp4")
    assert q.scale.shape == (2, 3, 11) and q.tensor_scale.shape == ()
    assert quantize(x, "bf16").scale is None


def test_dynamic_scale_formula_and_zero_group():
    """scale = amax / max_normal per group (fp32); an all-zero group gets scale 1."""
    x = _x(4, 256)
    x[1] = 0
    q = quantize(x, "e4m3:channel")
    amax = x.abs().amax(dim=1, keepdim=True)
    want = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    assert torch.equal(q.scale, want)
    assert torch.equal(q.dequantize()[1], torch.zeros(256))
    qi = quantize(x, "int8:token")
    assert torch.equal(qi.scale, torch.where(amax == 0, torch.ones_like(amax), amax / 127.0))
    # the max element of each nonzero row hits the format max exactly
    assert torch.equal(qi.data.abs().amax(dim=1).float(), torch.tensor([127.0, 0, 127, 127]))
    assert torch.equal(decode_codes(q.data, "e4m3").abs().amax(dim=1), torch.tensor([448.0, 0, 448, 448]))


def test_scale_division_correctly_rounded():
    """Scales are the correctly rounded fp32 quotient amax / max (checked via float64:
    double rounding is innocuous for division since 53 >= 2 * 24 + 2)."""
    from engine.formats import float_scale_from_amax

    g = torch.Generator().manual_seed(11)
    amax = torch.rand(200_000, generator=g) * 2.0 ** torch.randint(-60, 60, (200_000,), generator=g)
    for mx in (448.0, 57344.0, 127.0, 6.0, 2688.0):
        assert torch.equal(float_scale_from_amax(amax, mx), (amax.double() / mx).float())


def test_pow2_scales_round_up():
    """':pow2' scales are 2**ceil(log2(amax/max)); exact powers are kept."""
    x = torch.zeros(3, 128)
    x[0, 0], x[1, 5], x[2, 9] = 448.0 * 0.25, 300.0, 1e-3
    q = quantize(x, "e4m3:1x128:pow2")
    assert q.scale.reshape(-1).tolist() == [0.25, 1.0, 2.0 ** math.ceil(math.log2(1e-3 / 448))]
    assert q.stats()["saturation_frac"] == 0.0


def test_partial_groups_use_their_own_amax():
    """(3, 172): 1x128, 128x128 and mxfp8 edge groups take the amax of the elements they hold."""
    x = _x(3, 172, seed=5) * 0.01
    x[0, 3], x[1, 140], x[2, 171], x[1, 60] = 10.0, 3.0, -5.0, -2.0
    # 1x128: row r, block b covers columns [128b, min(128b+128, 172))
    q = quantize(x, "e4m3:1x128")
    for r in range(3):
        for b, (c0, c1) in enumerate([(0, 128), (128, 172)]):
            assert q.scale[r, b] == x[r, c0:c1].abs().amax() / 448.0
    # 128x128: a single tile row (3 < 128 rows), columns as above
    q2 = quantize(x, "e4m3:128x128")
    assert q2.scale.shape == (1, 2)
    assert q2.scale[0, 0] == x[:, :128].abs().amax() / 448 and q2.scale[0, 1] == 5.0 / 448
    # mxfp8: 172 = 5 * 32 + 12; the last block holds 12 elements
    q3 = quantize(x, "mxfp8")
    for r in range(3):
        for b in range(6):
            blk = x[r, 32 * b: min(32 * b + 32, 172)]
            e = math.floor(math.log2(blk.abs().amax().item())) - 8
            assert q3.scale[r, b].item() == 2.0 ** e
    # changing one group leaves every other group's output unchanged
    for spec in ["e4m3:1x128", "e4m3:128x128", "mxfp8", "nvfp4"]:
        x2 = x.clone()
        x2[0, 150] = 1000.0 if spec != "nvfp4" else 5.0  # nvfp4: keep global amax
        a, b = fake_quantize(x, spec), fake_quantize(x2, spec)
        diff = (a != b)
        if spec == "e4m3:128x128":
            assert not diff[:, :128].any()
        elif spec == "mxfp8" or spec == "nvfp4":
            blk = 32 if spec == "mxfp8" else 16
            c0 = (150 // blk) * blk
            diff[0, c0:c0 + blk] = False
            assert not diff.any()
        else:
            assert not diff[1:].any() and not diff[0, :128].any()


def test_leading_dims_equal_2d_view():
    """(B, T, K) quantizes exactly like its (-1, K) view, for every spec."""
    x = _x(2, 5, 100, seed=3)
    for spec in ALL_SPECS:
        a = quantize(x, spec).dequantize()
        b = quantize(x.reshape(10, 100), spec).dequantize().reshape(2, 5, 100)
        assert torch.equal(a, b), spec


def test_mxfp4_hand_vector():
    """OCP MX v1.0 rule, worked by hand.

    Block 0 (32 elements) amax = 3.5:
      floor(log2 3.5) = 1, emax(E2M1) = 2  ->  shared_exp = 1 - 2 = -1, X = 0.5
      x / X:  3.5/0.5 = 7.0  -> above max 6 -> clamped to 6  (OCP saturation) -> 3.0
              3.0/0.5 = 6.0  -> 6                                       -> 3.0
             -1.2/0.5 = -2.4 -> nearest of {2, 3} is 2                  -> -1.0
              0.3/0.5 = 0.6  -> nearest of {0.5, 1} is 0.5              -> 0.25
              0.1/0.5 = 0.2  -> nearest of {0, 0.5} is 0                -> 0.0
             1.25/0.5 = 2.5  -> tie 2 (code 0100) / 3 (0101): even      -> 1.0
            0.125/0.5 = 0.25 -> tie 0 (code 0000) / 0.5 (0001): even    -> 0.0
              2.2/0.5 = 4.4  -> nearest of {4, 6} is 4                  -> 2.0
    Block 1 is all zero: shared_exp clamps to -127, X = 2**-127 (code 0), elements 0.
    """
    x = torch.zeros(1, 64)
    x[0, :8] = torch.tensor([3.5, 3.0, -1.2, 0.3, 0.1, 1.25, 0.125, 2.2])
    q = quantize(x, "mxfp4")
    assert q.scale.tolist() == [[0.5, 2.0 ** -127]]
    assert q.scale_codes().tolist() == [[126, 0]]  # E8M0: 127 - 1, and 0
    assert q.data[0, :8].tolist() == [0b0111, 0b0111, 0b1100, 0b0001, 0, 0b0100, 0, 0b0110]
    assert q.dequantize()[0, :8].tolist() == [3.0, 3.0, -1.0, 0.25, 0.0, 1.0, 0.0, 2.0]
    assert torch.equal(q.dequantize()[0, 8:], torch.zeros(56))
    st = q.stats()
    assert st["saturation_frac"] == 1 / 64  # only 3.5 was clipped
    assert st["underflow_frac"] == 2 / 64   # 0.1 and 0.125 became 0
    assert st["subnormal_frac"] == 1 / 64   # 0.5 is E2M1's subnormal
    assert st["scale_exp_hist"] == {-1: 1, -127: 1}


def test_mxfp8_hand_vector():
    """amax 1000: floor(log2 1000) = 9, emax(E4M3) = 8 -> X = 2**1 = 2.

      1000/2 = 500   -> > 448, clamped to 448          -> 896
       300/2 = 150   -> E4M3 step 16 in [128, 256): 144 -> 288
      0.01/2 = 0.005 -> subnormal, 0.005 / 2**-9 = 2.56 -> 3 * 2**-9 -> 0.01171875
    """
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([1000.0, 300.0, 0.01])
    q = quantize(x, "mxfp8")
    assert q.scale.tolist() == [[2.0]] and q.scale_codes().tolist() == [[128]]
    assert q.dequantize()[0, :3].tolist() == [896.0, 288.0, 3 * 2.0 ** -9 * 2]
    assert q.stats()["saturation_frac"] == 1 / 32
    assert q.stats()["subnormal_frac"] == 1 / 32


def test_nvfp4_hand_vector():
    """tensor_scale = 6/2688; block 0: amax 6 -> (6/6)/ts = 448 -> E4M3 448.

    block 1: amax 0.3 -> (0.3/6)/ts = 0.05 * 448 = 22.4 -> E4M3 (step 2 in [16,32)) 22.
    elements = round_e2m1(x / (block_scale * tensor_scale)):
      block 0: 6/(448 ts) = 6 -> 6;  -2.9 -> -2.9 -> -3;  1.0 -> 1
      block 1: denom = 22 * 6/2688 = 0.049107...; 0.3/denom = 6.109 -> 6; 0.1/denom = 2.036 -> 2
    block 2 is all zero: its E4M3 scale is 0 and its elements are 0.
    """
    x = torch.zeros(1, 48)
    x[0, :3] = torch.tensor([6.0, -2.9, 1.0])
    x[0, 16:18] = torch.tensor([0.3, 0.1])
    q = quantize(x, "nvfp4")
    ts = torch.tensor(6.0) / NVFP4_TENSOR_DENOM
    assert q.tensor_scale == ts
    assert q.scale.tolist() == [[448.0, 22.0, 0.0]]
    e = q.elements()[0]
    assert e[:3].tolist() == [6.0, -3.0, 1.0] and e[16:18].tolist() == [6.0, 2.0]
    assert torch.equal(q.dequantize()[0, 32:], torch.zeros(16))
    d = q.dequantize()[0]
    assert d[16].item() == pytest.approx(6 * 22 * 6 / 2688, rel=1e-6)
    assert q.scale_codes().tolist() == [[0x7E, 0x5B, 0x00]]  # 448, 22 = 1.375*2**4, 0


def test_nvfp4_static_tensor_scale():
    """nvfp4 accepts a static per-tensor scale; block scales stay dynamic."""
    x = _x(2, 32)
    q = quantize(x, "nvfp4", scale=0.01)
    assert q.tensor_scale.item() == pytest.approx(0.01)


def test_static_scale_saturates_and_is_reported():
    """Values beyond scale * max saturate to exactly +-max * scale and count as saturated."""
    x = torch.tensor([[1.0, -100.0, 224.0, 300.0, -1000.0, 0.0, 2.0, 3.0]])
    q = quantize(x, "e4m3:tensor", scale=0.5)
    assert q.scale.item() == 0.5
    assert q.dequantize().tolist() == [[1.0, -96.0, 224.0, 224.0, -224.0, 0.0, 2.0, 3.0]]
    assert q.stats()["saturation_frac"] == 2 / 8
    # per-row static scales broadcast to the (rows, 1) layout
    x2 = torch.tensor([[10.0, 20.0], [10.0, 20.0]])
    q2 = quantize(x2, "int8:channel", scale=torch.tensor([[1.0], [0.1]]))
    assert torch.allclose(q2.dequantize(), torch.tensor([[10.0, 20.0], [10.0, 12.7]]))
    assert q2.stats()["saturation_frac"] == 1 / 4
    # non-saturating E4M3 with a static scale: NaN on overflow
    q3 = quantize(x, "e4m3:tensor", scale=0.5, saturate=False)
    assert torch.isnan(q3.dequantize()[0, 3:5]).all()
    with pytest.raises(ValueError, match="broadcast"):
        quantize(torch.ones(4, 8), "e4m3:channel", scale=torch.ones(3))
    with pytest.raises(ValueError):
        quantize(torch.ones(4, 32), "mxfp8", scale=1.0)
    with pytest.raises(ValueError):
        quantize(torch.ones(4, 32), "bf16", scale=1.0)


def test_stats_exact_fractions():
    """Stats on a constructed tensor (static scale 1): 2 saturated, 1 underflow, 1 subnormal."""
    x = torch.tensor([1000.0, -500.0, 1e-4, 0.0, 0.005, 1.0, 448.0, 460.0])
    st = quantize(x, "e4m3:tensor", scale=1.0).stats()
    assert st["n"] == 8
    assert st["saturation_frac"] == 2 / 8   # 1000, -500 (460 rounds to 448 by RNE)
    assert st["underflow_frac"] == 1 / 8    # 1e-4 < 2**-10
    assert st["subnormal_frac"] == 1 / 8    # 0.005 -> 3 * 2**-9
    assert st["amax"] == 1000.0 and st["nan_frac"] == 0.0
    assert st["scale_min"] == st["scale_max"] == 1.0 and st["scale_exp_hist"] == {0: 1}


def test_stats_scale_histogram_and_nan():
    """scale_exp_hist counts floor(log2 scale); NaN inputs are counted and poison their group."""
    x = torch.zeros(4, 8)
    x[0, 0], x[1, 0], x[2, 0], x[3, 0] = 448.0 * 4, 448.0 * 4, 448.0 / 8, 448.0
    st = quantize(x, "e4m3:channel").stats()
    assert st["scale_exp_hist"] == {2: 2, -3: 1, 0: 1}
    assert st["scale_min"] == 0.125 and st["scale_max"] == 4.0
    x[3, 1] = float("nan")
    q = quantize(x, "e4m3:channel")
    assert q.stats()["nan_frac"] == 1 / 32
    assert torch.isnan(q.dequantize()[3]).all() and not torch.isnan(q.dequantize()[:3]).any()
    assert torch.isnan(quantize(x, "mxfp4").dequantize()[3]).all()


def test_passthrough_stats():
    """fp16 cast: overflow to Inf counts as saturation; underflow and subnormals counted."""
    x = torch.tensor([1e5, 1e-8, 1e-6, 1.0])
    q = quantize(x, "fp16")
    st = q.stats()
    assert (st["saturation_frac"], st["underflow_frac"], st["subnormal_frac"]) == (0.25, 0.25, 0.25)
    assert st["scale_min"] is None and st["scale_exp_hist"] == {}
    assert quantize(x, "fp32").stats()["saturation_frac"] == 0.0
    assert torch.equal(quantize(x, "fp32").dequantize(), x)
    assert quantize(x, "bf16").dequantize().dtype == torch.float32


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_counts_off_keeps_data_and_scales_and_stats_says_why(spec):
    """quantize(..., counts=False) skips the count reductions only: the same data, scales and tensor scale; stats()
    of such a QTensor is an error naming the flag, not zeros."""
    x = _x(4, 256, scale=300.0)
    x[0, 0] = 1e-30  # something to count (underflow) under every format
    on, off = quantize(x, spec), quantize(x, spec, counts=False)
    assert on.counts and not off.counts
    assert torch.equal(on.data, off.data)
    assert (on.scale is None and off.scale is None) or torch.equal(on.scale, off.scale)
    assert (on.tensor_scale is None and off.tensor_scale is None) or torch.equal(on.tensor_scale, off.tensor_scale)
    assert on.stats()["n"] == x.numel()
    with pytest.raises(ValueError, match="quantized without its counts: quantize it with counts=True"):
        off.stats()


def test_numerics_gathers_counts_for_its_observer_only():
    """`Numerics.quant` gathers a quantization's counts while an observer is installed (what layer_error and
    calibration read), and skips them otherwise; the values are the same."""
    from engine.numerics import Numerics
    from engine.recipe import load_recipe

    nx = Numerics(load_recipe("fp8-block"))
    x = _x(8, 256)
    bare = nx.quant(x, "linear.input", "layers.0.mlp.down_proj")
    seen = []
    nx.observer = lambda module, site, q: seen.append(q.stats()["n"])
    watched = nx.quant(x, "linear.input", "layers.0.mlp.down_proj")
    assert not bare.counts and seen == [x.numel()]
    assert torch.equal(bare.dequantize(), watched.dequantize())


def test_stochastic_quantize_unbiased():
    """Stochastic rounding through quantize is unbiased on average."""
    x = _x(64, 128, seed=9)
    g = torch.Generator().manual_seed(0)
    acc = torch.zeros_like(x)
    n = 200
    for _ in range(n):
        acc += quantize(x, "e4m3:1x128", rounding="stochastic", generator=g).dequantize()
    rne_err = (fake_quantize(x, "e4m3:1x128") - x).abs().mean()
    sr_bias = (acc / n - x).abs().mean()
    assert sr_bias < rne_err / 3


def test_non_float_input_rejected():
    """Integer tensors are rejected."""
    with pytest.raises(TypeError):
        quantize(torch.ones(3, dtype=torch.int32), "e4m3:tensor")
