"""Format table constants and exhaustive code enumeration (decode/encode)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.formats import (FORMATS, codes_to_torch, decode_codes, get_format, torch_to_codes,
                            values_to_codes)

# Hard-coded known values (OCP FP8 / MX v1.0 specs, NVIDIA docs).
KNOWN = {
    #        max_normal        min_normal   min_subnormal  emax  has_inf has_nan
    "e4m3": (448.0, 2.0 ** -6, 2.0 ** -9, 8, False, True),
    "e5m2": (57344.0, 2.0 ** -14, 2.0 ** -16, 15, True, True),
    "e8m0": (2.0 ** 127, 2.0 ** -127, 2.0 ** -127, 127, False, True),
    "e2m1": (6.0, 1.0, 0.5, 2, False, False),
    "int8": (127.0, 1.0, 1.0, 0, False, False),
}

TORCH_DTYPES = {
    "e4m3": getattr(torch, "float8_e4m3fn", None),
    "e5m2": getattr(torch, "float8_e5m2", None),
    "e8m0": getattr(torch, "float8_e8m0fnu", None),
}

CODED = ["e4m3", "e5m2", "e8m0", "e2m1"]


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_constants_match_known_values(name):
    """Derived constants equal hard-coded spec values."""
    f = get_format(name)
    mx, mn, ms, emax, inf, nan = KNOWN[name]
    assert (f.max_normal, f.min_normal, f.min_subnormal) == (mx, mn, ms)
    assert f.emax == emax
    assert (f.has_inf, f.has_nan) == (inf, nan)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e8m0"])
def test_constants_match_torch_finfo(name):
    """Derived constants agree with torch.finfo for the dtypes torch has."""
    dt = TORCH_DTYPES[name]
    if dt is None:
        pytest.skip(f"torch has no dtype for {name}")
    fi = torch.finfo(dt)
    f = get_format(name)
    assert f.torch_dtype == dt
    assert f.max_normal == fi.max
    assert f.min_normal == fi.smallest_normal
    assert f.nbits == fi.bits


def test_e2m1_value_set_and_int8_range():
    """E2M1 encodes exactly +-{0, .5, 1, 1.5, 2, 3, 4, 6}; INT8 is symmetric -127..127."""
    v = decode_codes(torch.arange(16, dtype=torch.uint8), "e2m1")
    assert v[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert v[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(v[8])  # code 0b1000 is -0.0
    f = get_format("int8")
    assert f.is_integer and f.max_normal == 127 and f.torch_dtype == torch.int8


def test_unknown_format_raises():
    """Unknown format names raise ValueError listing the valid ones."""
    with pytest.raises(ValueError, match="e4m3"):
        get_format("e3m4")


def _all_codes(name):
    """Every code of a format as uint8 (4-bit formats: 0..15)."""
    n = 1 << get_format(name).nbits
    return torch.arange(n, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("name", CODED)
def test_decode_encode_identity_on_finite_codes(name):
    """decode -> encode is the identity on every finite code (incl. -0)."""
    c = _all_codes(name)
    v = decode_codes(c, name)
    fin = ~torch.isnan(v) & ~torch.isinf(v)
    assert torch.equal(values_to_codes(v[fin], name), c[fin])


@pytest.mark.parametrize("name", CODED)
def test_nan_and_inf_codes_follow_table(name):
    """NaN/Inf codes are exactly those implied by the format's nan_rule."""
    f = get_format(name)
    c = _all_codes(name).int()
    v = decode_codes(c.to(torch.uint8), name)
    mag = c & ((1 << (f.ebits + f.mbits)) - 1)
    ef, m = mag >> f.mbits, mag & ((1 << f.mbits) - 1)
    if f.nan_rule == "ieee":
        top = ef == (1 << f.ebits) - 1
        exp_nan, exp_inf = top & (m != 0), top & (m == 0)
    elif f.nan_rule == "all_ones":
        exp_nan, exp_inf = mag == (1 << (f.ebits + f.mbits)) - 1, torch.zeros_like(mag, dtype=torch.bool)
    else:
        exp_nan = exp_inf = torch.zeros_like(mag, dtype=torch.bool)
    assert torch.equal(torch.isnan(v), exp_nan)
    assert torch.equal(torch.isinf(v), exp_inf)
    counts = {"e4m3": 2, "e5m2": 6, "e8m0": 1, "e2m1": 0}
    assert int(exp_nan.sum()) == counts[name]
    # NaN values encode to the positive canonical NaN code.
    if f.has_nan:
        nan_code = values_to_codes(torch.tensor([float("nan"), -float("nan")]), name)
        assert torch.isnan(decode_codes(nan_code, name)).all()
        assert nan_code.tolist() == [nan_code[0].item()] * 2


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e8m0"])
def test_decode_matches_torch_dtype_bit_views(name):
    """Decoded values equal torch's own float8 -> float32 conversion for all 256 codes."""
    dt = TORCH_DTYPES[name]
    if dt is None:
        pytest.skip(f"torch has no dtype for {name}")
    c = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = c.view(dt).float()
    mine = decode_codes(c, name)
    assert torch.equal(torch.isnan(ref), torch.isnan(mine))
    fin = ~torch.isnan(ref)
    assert torch.equal(ref[fin].view(torch.int32), mine[fin].view(torch.int32))  # -0 too
    # also decoding the float8 tensor itself (a bit view) works
    assert torch.equal(torch.nan_to_num(decode_codes(c.view(dt), name), nan=1.5),
                       torch.nan_to_num(mine, nan=1.5))


def test_codes_to_torch_roundtrip_and_errors():
    """codes_to_torch/torch_to_codes are bit views; non-byte dtypes are rejected."""
    c = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    t = codes_to_torch(c, "e4m3")
    assert t.dtype == torch.float8_e4m3fn and torch.equal(torch_to_codes(t), c)
    assert codes_to_torch(c[:16], "e2m1").dtype == torch.uint8
    with pytest.raises(TypeError):
        torch_to_codes(torch.zeros(3))


def test_int8_codes_roundtrip():
    """INT8 codes are two's complement bytes of -127..127."""
    v = torch.arange(-127, 128, dtype=torch.float32)
    c = values_to_codes(v, "int8")
    assert torch.equal(decode_codes(c, "int8"), v)
    assert torch.equal(c.view(torch.int8).float(), v)


def test_e8m0_extremes():
    """E8M0: code 0 is 2**-127 (no zero), 254 is 2**127, 255 NaN, unsigned."""
    v = decode_codes(torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8), "e8m0")
    assert v[:4].tolist() == [2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127]
    assert math.isnan(v[4].item())
    assert FORMATS["e8m0"].signed is False
