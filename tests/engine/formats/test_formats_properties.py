"""Hypothesis property tests: error bounds, saturation at the format max, block scales."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.formats import get_format, parse_spec, quantize, round_to_format

SETTINGS = settings(max_examples=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
EPS = 2.0 ** -21  # slack for the two float32 roundings in x / s and e * s

FLOAT_SCALED = ["e4m3:tensor", "e4m3:channel", "e4m3:1x128", "e4m3:128x128", "e4m3:2x8",
                "e5m2:tensor", "e5m2:token", "e4m3:1x32:pow2", "e2m1:1x16"]
INT_SCALED = ["int8:channel", "int8:token", "int8:tensor"]
MX = ["mxfp8", "mxfp8_e5m2", "mxfp4"]


@st.composite
def tensors(draw, max_rows=5, max_cols=200):
    """2-D float32 tensors: Gaussian or heavy-tailed, random exponent shift, zeros, edge values."""
    rows = draw(st.integers(1, max_rows))
    cols = draw(st.integers(1, max_cols))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    shift = draw(st.integers(-40, 40))
    kind = draw(st.sampled_from(["normal", "t3", "uniform", "list"]))
    g = torch.Generator().manual_seed(seed)
    if kind == "list":
        vals = draw(st.lists(st.floats(-1e6, 1e6, width=32, allow_subnormal=False),
                             min_size=rows * cols, max_size=rows * cols))
        x = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    elif kind == "normal":
        x = torch.randn(rows, cols, generator=g)
    elif kind == "uniform":
        x = torch.rand(rows, cols, generator=g) * 2 - 1
    else:
        z = torch.randn(rows, cols, generator=g)
        chi = torch.randn(3, rows, cols, generator=g).pow(2).sum(0) / 3
        x = z / chi.sqrt()
    x = x * 2.0 ** shift
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = 0.0  # an all-zero row
    return x


def _groups(x, spec):
    """Yield (row slice, col slice) of every group, computed independently of the library."""
    sp = parse_spec(spec)
    m, k = x.shape
    if sp.granularity == "tensor":
        yield slice(0, m), slice(0, k)
        return
    r, c = (1, k) if sp.is_rowwise else sp.tile
    for i in range(0, m, r):
        for j in range(0, k, c):
            yield slice(i, i + r), slice(j, j + c)


@SETTINGS
@given(x=tensors(), spec=st.sampled_from(FLOAT_SCALED))
def test_float_specs_error_bound(x, spec):
    """|deq - x| <= 2**-(m+1) |x| (+ half a subnormal step), i.e. e4m3 rel err <= 2**-4 for normals."""
    q = quantize(x, spec)
    f = get_format(parse_spec(spec).elem)
    s = q.expanded_scale()
    d = q.dequantize()
    err = (d.double() - x.double()).abs()
    rel = 2.0 ** -(f.mbits + 1)
    bound = torch.maximum(rel * x.double().abs(), s.double() * f.min_subnormal / 2) * (1 + EPS)
    assert torch.all(err <= bound + 1e-45)
    normal = (x / s).abs() >= f.min_normal
    rel_err = err[normal] / x.double().abs()[normal]
    assert torch.all(rel_err <= rel * (1 + EPS))
    assert q.stats()["saturation_frac"] == 0.0  # dynamic scales never clip their group


@SETTINGS
@given(x=tensors(), spec=st.sampled_from(INT_SCALED))
def test_int8_error_bound(x, spec):
    """INT8: |deq - x| <= scale / 2 and every code is within [-127, 127]."""
    q = quantize(x, spec)
    err = (q.dequantize().double() - x.double()).abs()
    assert torch.all(err <= q.expanded_scale().double() / 2 * (1 + EPS) + 1e-45)
    assert q.data.abs().max() <= 127


@SETTINGS
@given(x=tensors(), spec=st.sampled_from(FLOAT_SCALED + INT_SCALED))
def test_group_max_hits_format_max(x, spec):
    """Each nonzero group's largest |element| is exactly max_normal (pow2: in [max/2, max])."""
    sp = parse_spec(spec)
    f = get_format(sp.elem)
    q = quantize(x, spec)
    e = q.elements()
    for rs, cs in _groups(x, spec):
        if x[rs, cs].abs().max() == 0:
            assert e[rs, cs].abs().max() == 0
            continue
        top = e[rs, cs].abs().max().item()
        if sp.pow2:
            assert f.max_normal / 2 <= top <= f.max_normal
        else:
            assert top == f.max_normal


@SETTINGS
@given(x=tensors(max_cols=100), spec=st.sampled_from(MX))
def test_mx_scale_rule(x, spec):
    """MX: X = 2**(floor(log2 amax) - emax); block max element in [2**emax, max] (clipped per OCP)."""
    sp = parse_spec(spec)
    f = get_format(sp.elem)
    q = quantize(x, spec)
    e, d = q.elements(), q.dequantize()
    assert torch.isfinite(d).all()
    for b, (rs, cs) in enumerate(_groups(x, spec)):
        blk = x[rs, cs]
        amax = blk.abs().max().item()
        X = q.scale.reshape(-1)[b].item()
        if amax == 0:
            assert X == 2.0 ** -127 and e[rs, cs].abs().max() == 0
            continue
        shared = max(math.floor(math.log2(amax)) - f.emax, -127)
        assert X == 2.0 ** shared
        top = e[rs, cs].abs().max().item()
        assert top <= f.max_normal
        if shared > -127:
            assert top >= 2.0 ** f.emax
        # non-clipped elements obey the element error bound; clipped ones sit at +-max * X
        y = blk / X
        clipped = y.abs() > f.max_normal * (1 + 2.0 ** -(f.mbits + 1))
        assert torch.all(d[rs, cs][clipped].abs() == f.max_normal * X)
        err = (d[rs, cs] - blk).abs().double()
        bound = torch.maximum(2.0 ** -(f.mbits + 1) * blk.abs().double(),
                              torch.tensor(X * f.min_subnormal / 2, dtype=torch.float64))
        assert torch.all(err[~clipped] <= bound[~clipped] * (1 + EPS))


@SETTINGS
@given(x=tensors(max_cols=100))
def test_nvfp4_properties(x):
    """NVFP4: finite output, |elements| <= 6, E4M3 block scales; per-block error bounds.

    Blocks whose E4M3 scale underflows to 0 (amax_block / 6 / tensor_scale <= 2**-10, a
    real NVFP4 dynamic-range limit) dequantize to exactly 0.  Blocks with a normal E4M3
    scale (relative rounding <= 2**-4) satisfy |deq - x| <= max(|x|/4, s/4) + 0.375 s.
    """
    q = quantize(x, "nvfp4")
    d = q.dequantize()
    assert torch.isfinite(d).all()
    assert q.elements().abs().max() <= 6
    bs = q.scale
    assert torch.equal(round_to_format(bs, "e4m3"), bs) and (bs >= 0).all()
    amax = x.abs().max()
    if amax == 0:
        return
    ts = q.tensor_scale
    assert ts == amax / (448.0 * 6.0)
    k = x.shape[1]
    bs_full = bs.repeat_interleave(16, dim=1)[:, :k]
    s = bs_full * ts
    err = (d - x).abs()
    zero = bs_full == 0
    assert torch.all(d[zero] == 0)
    assert torch.all(x[zero].abs() / 6 / ts <= 2.0 ** -10 * (1 + EPS))
    normal = bs_full >= 2.0 ** -6
    bound = torch.maximum(0.25 * x.abs(), 0.25 * s) + 0.375 * s
    assert torch.all(err[normal] <= bound[normal] * (1 + EPS))
    assert torch.all(d.abs() <= 6 * s * (1 + EPS))


@SETTINGS
@given(x=tensors(), factor=st.floats(1.0, 16.0))
def test_static_scale_saturation(x, factor):
    """Static per-tensor scale: |x/s| > 464 (above the 448|480 midpoint) clamps to exactly
    +-448*s and is counted as saturated; nothing else is."""
    amax = x.abs().max().item()
    s_val = amax / 448.0 / factor
    if amax == 0 or not 1e-30 < s_val < 1e30:
        return
    s = torch.tensor(s_val, dtype=torch.float32)
    q = quantize(x, "e4m3:tensor", scale=s)
    clipped = (x / s).abs() > 464
    d = q.dequantize()
    assert torch.all(d.abs()[clipped] == 448 * s)
    assert torch.all(d.abs() <= 448 * s)
    assert q.stats()["saturation_frac"] == clipped.sum().item() / x.numel()


@SETTINGS
@given(x=tensors(max_rows=2, max_cols=64), name=st.sampled_from(["e4m3", "e5m2", "e2m1", "int8"]))
def test_rounding_idempotent_and_monotone(x, name):
    """round(round(x)) == round(x), and rounding is monotone non-decreasing."""
    r = round_to_format(x, name)
    assert torch.equal(round_to_format(r, name), r)
    xs = torch.sort(x.reshape(-1)).values
    rs = round_to_format(xs, name)
    assert torch.all(rs[1:] >= rs[:-1])
