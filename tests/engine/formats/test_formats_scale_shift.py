"""The ``:shiftN`` spec suffix (scales times 2**N): parsing and exact bit patterns.

``e4m3:...:shift-1`` is the gate selftest's planted "block scales one exponent
too small" fault: the top half of every group's range saturates at 448.
"""

from __future__ import annotations

import pytest
import torch

from engine.formats import parse_spec, quantize
from engine.recipe import Recipe, load_recipe


@pytest.mark.parametrize("raw,canon,shift", [
    ("e4m3:1x128:shift-1", "e4m3:1x128:shift-1", -1),
    ("e4m3:128x128:SHIFT-1", "e4m3:128x128:shift-1", -1),
    ("e4m3:tensor:shift2", "e4m3:tensor:shift+2", 2),
    ("e4m3:tensor:shift+2", "e4m3:tensor:shift+2", 2),
    ("e4m3:1x4:shift-3:pow2", "e4m3:1x4:pow2:shift-3", -3),
    ("e5m2:token:pow2:shift-1", "e5m2:token:pow2:shift-1", -1),
    ("e4m3:tensor:shift0", "e4m3:tensor", 0),
])
def test_parse_and_canonical(raw, canon, shift):
    """Either suffix order parses; the canonical string puts pow2 first and signs the shift."""
    sp = parse_spec(raw)
    assert sp.scale_shift == shift and str(sp) == canon and parse_spec(str(sp)) == sp


@pytest.mark.parametrize("bad", ["e4m3:tensor:shift", "e4m3:tensor:shift-1:shift-2", "e4m3:tensor:shiftx",
                                 "e4m3:tensor:shift-100", "e4m3:tensor:pow2:pow2", "e4m3:tensor:pow2:shift-1:x"])
def test_bad_shift_specs(bad):
    """Malformed shift suffixes raise naming the string and the valid forms (incl. ':shiftN')."""
    with pytest.raises(ValueError) as ei:
        parse_spec(bad)
    assert repr(bad) in str(ei.value) and "shiftN" in str(ei.value)


def test_shift_minus_one_bit_patterns():
    """1x4 groups, amax 448 and 7: scales 0.5 and 7/896; elements above half the range saturate to 0x7E."""
    x = torch.tensor([[448.0, 300.0, 224.0, -100.0, 7.0, 3.5, 1.75, -7.0]])
    q = quantize(x, "e4m3:1x4:shift-1")
    assert q.scale.tolist() == [[0.5, 7.0 / 448.0 / 2.0]]  # exactly amax / 448 * 2**-1
    assert q.scale.dtype == torch.float32
    codes = q.data.view(torch.uint8).tolist()
    # 448/0.5 = 896 -> 448 (0x7E, saturated); 300/0.5 = 600 -> 448 (0x7E); 224/0.5 = 448 (0x7E, exact);
    # -100/0.5 = -200: a tie between 192 and 208 -> -192 (even mantissa, 0xF4); 7/(7/896) = 896 -> 448;
    # 3.5 -> 448 (exact); 1.75 -> 224 (0x76); -7 -> -448 (0xFE).
    assert codes == [[0x7E, 0x7E, 0x7E, 0xF4, 0x7E, 0x7E, 0x76, 0xFE]]
    assert q.dequantize().tolist() == [[224.0, 224.0, 224.0, -96.0, 3.5, 3.5, 1.75, -3.5]]
    st = q.stats()
    assert st["saturation_frac"] == pytest.approx(4 / 8)  # 448, 300, 7, -7 clipped (224 and 3.5 are exact)


def test_shift_is_exact_power_of_two_of_the_unshifted_scale():
    """For random data, shift-N scales are the plain scales times 2**N bit for bit (also with pow2)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 256)[None, :]
    for base in ("e4m3:1x128", "e4m3:128x128", "e4m3:token", "e5m2:tensor", "e4m3:1x32:pow2"):
        plain = quantize(x, base).scale
        for n in (-1, -3, 2):
            shifted = quantize(x, f"{base}:shift{n:+d}").scale
            assert torch.equal(shifted, plain * (2.0 ** n)), (base, n)


def test_shift_ignores_static_scales():
    """A static scale is used as given: the suffix shifts only computed scales."""
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert torch.equal(quantize(x, "e4m3:tensor:shift-1", scale=0.25).dequantize(),
                       quantize(x, "e4m3:tensor", scale=0.25).dequantize())


def test_recipe_sites_accept_shift(tmp_path):
    """Recipes carry the suffix (canonical form) through validation."""
    r = Recipe(name="x", sites={**dict(load_recipe("fp8-block").sites), "linear.input": "e4m3:1x128:SHIFT-1"})
    assert r.spec("linear.input") == "e4m3:1x128:shift-1"
    planted = load_recipe(str(__import__("pathlib").Path(__file__).resolve().parents[3] / "suites" / "selftest"
                              / "block-scale-shift-1.yaml"))
    assert planted.spec("linear.weight") == "e4m3:128x128:shift-1"
