"""Spec-string parsing, canonical forms and error messages."""

from __future__ import annotations

import pytest

from engine.formats import QuantSpec, parse_spec

CANONICAL = [
    "fp32", "bf16", "fp16",
    "e4m3:tensor", "e5m2:tensor", "e4m3:channel", "e4m3:token", "e5m2:token", "e5m2:channel",
    "int8:channel", "int8:token", "e4m3:1x128", "e4m3:1x64", "e4m3:128x128", "e4m3:64x32",
    "e4m3:1x128:pow2", "e4m3:128x128:pow2", "e2m1:1x16", "int8:tensor",
    "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4",
]


@pytest.mark.parametrize("s", CANONICAL)
def test_canonical_roundtrip(s):
    """str(parse_spec(s)) == s for canonical strings; parsing is idempotent and hashable."""
    sp = parse_spec(s)
    assert isinstance(sp, QuantSpec)
    assert str(sp) == s
    assert parse_spec(str(sp)) == sp
    assert parse_spec(sp) is sp
    assert hash(sp) == hash(parse_spec(s))


@pytest.mark.parametrize("raw,canon", [
    ("E4M3:1X128", "e4m3:1x128"), (" e4m3 : tensor ", "e4m3:tensor"),
    ("float32", "fp32"), ("bfloat16", "bf16"), ("half", "fp16"), ("MXFP4", "mxfp4"),
    ("e4m3:1x128:POW2", "e4m3:1x128:pow2"),
])
def test_aliases_and_case(raw, canon):
    """Case, whitespace and dtype aliases normalize to the canonical string."""
    assert str(parse_spec(raw)) == canon


def test_fields():
    """Parsed fields describe the grouping."""
    sp = parse_spec("e4m3:128x128")
    assert (sp.kind, sp.elem, sp.granularity, sp.tile, sp.scale_fmt) == \
        ("scaled", "e4m3", "tile", (128, 128), "fp32")
    assert parse_spec("mxfp4").tile == (1, 32) and parse_spec("mxfp4").scale_fmt == "e8m0"
    assert parse_spec("nvfp4").tile == (1, 16) and parse_spec("nvfp4").scale_fmt == "e4m3"
    assert parse_spec("bf16").is_passthrough and parse_spec("bf16").element_format is None
    assert parse_spec("e4m3:token").is_rowwise and parse_spec("int8:channel").is_rowwise
    assert parse_spec("e4m3:1x128:pow2").pow2


@pytest.mark.parametrize("bad", [
    "e4m3", "e4m3:", "e4m3:row", "e3m4:tensor", "e4m3:0x128", "e4m3:1x", "e4m3:1x128:pow3",
    "fp64", "", "mxfp6", "e4m3:tensor:pow2:x", "nvfp4:1x16",
])
def test_bad_specs_raise_with_string_and_forms(bad):
    """Bad strings raise ValueError that names the string and lists the valid forms."""
    with pytest.raises(ValueError) as ei:
        parse_spec(bad)
    msg = str(ei.value)
    assert repr(bad) in msg
    assert "mxfp8" in msg and "ELEM:tensor" in msg


def test_non_string_raises():
    """Non-string, non-QuantSpec input raises ValueError."""
    with pytest.raises(ValueError):
        parse_spec(3)  # type: ignore[arg-type]
