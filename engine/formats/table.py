"""The single table of element formats used by every quantization site.

Every numeric constant of a format (largest normal, smallest normal, smallest
subnormal, exponent range) is *derived* here from ``ebits``/``mbits``/``bias``
and the format's special-value rule; nothing else in the engine should
hard-code ``448`` or ``57344``.  ``tests/engine/formats/test_formats_table.py``
checks the derived numbers against hard-coded known values and against
``torch.finfo`` where torch has the dtype.

Special-value rules (``nan_rule``):

* ``"ieee"``    -- the all-ones exponent field is reserved: mantissa 0 is
  +-Inf, anything else NaN (E5M2).
* ``"all_ones"`` -- only the all-ones magnitude code (``S.1111.111`` for
  E4M3, ``0xFF`` for E8M0) is NaN, there is no Inf (the "fn" formats).
* ``"none"``    -- every code is a finite number (E2M1, INT8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "ElementFormat",
    "FORMATS",
    "HIGH_PRECISION_DTYPES",
    "get_format",
]


@dataclass(frozen=True)
class ElementFormat:
    """Description of one element (or scale) number format.

    Attributes:
        name: short canonical name (``"e4m3"``, ``"e5m2"``, ``"e8m0"``,
            ``"e2m1"``, ``"int8"``).
        ebits: number of exponent bits (0 for ``int8``).
        mbits: number of explicit mantissa (fraction) bits (7 for ``int8``:
            the magnitude bits).
        bias: exponent bias.
        signed: whether the code has a sign bit (E8M0 has none).
        has_inf: whether +-Inf is representable.
        has_nan: whether a NaN code exists.
        nan_rule: ``"ieee"``, ``"all_ones"`` or ``"none"`` (module docstring).
        has_zero: whether zero is representable (E8M0 has no zero).
        has_subnormals: whether exponent field 0 encodes subnormals.
        is_integer: True for ``int8``.
        nbits: total code width in bits.
        emin: exponent of the smallest normal (``1 - bias``; ``-bias`` for E8M0).
        emax: exponent of the largest normal (OCP MX calls it ``emax_elem``).
        max_normal: largest finite magnitude.
        min_normal: smallest positive normal magnitude.
        min_subnormal: smallest positive magnitude (== min_normal when there
            are no subnormals).
        torch_dtype: matching torch dtype when this torch build has one,
            else None.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    signed: bool
    has_inf: bool
    has_nan: bool
    nan_rule: str
    has_zero: bool
    has_subnormals: bool
    is_integer: bool
    nbits: int
    emin: int
    emax: int
    max_normal: float
    min_normal: float
    min_subnormal: float
    torch_dtype: Optional[torch.dtype]

    @property
    def sign_shift(self) -> int:
        """Bit position of the sign bit in the code (== ebits + mbits)."""
        return self.ebits + self.mbits

    @property
    def max_code(self) -> int:
        """Largest magnitude code (no sign bit) that encodes a finite value."""
        if self.nan_rule == "ieee":
            return (((1 << self.ebits) - 2) << self.mbits) | ((1 << self.mbits) - 1)
        if self.nan_rule == "all_ones":
            return (1 << (self.ebits + self.mbits)) - 2
        return (1 << (self.ebits + self.mbits)) - 1

    def __str__(self) -> str:
        """Return the canonical short name."""
        return self.name


def _torch_dtype(attr: str) -> Optional[torch.dtype]:
    """Return ``getattr(torch, attr)`` if this torch build has it, else None."""
    dt = getattr(torch, attr, None)
    return dt if isinstance(dt, torch.dtype) else None


def _make_float_format(name: str, ebits: int, mbits: int, bias: int, *,
                       nan_rule: str, signed: bool = True,
                       torch_attr: Optional[str] = None) -> ElementFormat:
    """Build an :class:`ElementFormat`, deriving all constants from the bit layout.

    Derivation (exact, in Python floats which hold these powers of two exactly):

    * ``emin = 1 - bias`` (smallest normal exponent); formats without a
      mantissa (E8M0) have no subnormals, so exponent field 0 is a normal
      value ``2**-bias`` and ``emin = -bias``.
    * ``min_subnormal = 2**(emin - mbits)``.
    * The largest finite magnitude code depends on the NaN rule
      (``ElementFormat.max_code``); its value is
      ``(1 + m / 2**mbits) * 2**(e - bias)`` for its exponent field ``e`` and
      mantissa field ``m``.
    """
    has_sub = mbits > 0
    emin = (1 - bias) if has_sub else -bias
    if nan_rule == "ieee":
        max_e_field = (1 << ebits) - 2
        max_m = (1 << mbits) - 1
    elif nan_rule == "all_ones":
        code = (1 << (ebits + mbits)) - 2
        max_e_field, max_m = code >> mbits, code & ((1 << mbits) - 1)
    elif nan_rule == "none":
        max_e_field = (1 << ebits) - 1
        max_m = (1 << mbits) - 1
    else:  # pragma: no cover - programming error
        raise ValueError(f"unknown nan_rule {nan_rule!r}")
    emax = max_e_field - bias
    max_normal = (1.0 + max_m / (1 << mbits)) * 2.0 ** emax
    min_normal = 2.0 ** emin
    min_sub = 2.0 ** (emin - mbits) if has_sub else min_normal
    return ElementFormat(
        name=name, ebits=ebits, mbits=mbits, bias=bias, signed=signed,
        has_inf=(nan_rule == "ieee"), has_nan=(nan_rule != "none"),
        nan_rule=nan_rule, has_zero=has_sub, has_subnormals=has_sub,
        is_integer=False, nbits=ebits + mbits + (1 if signed else 0),
        emin=emin, emax=emax, max_normal=max_normal, min_normal=min_normal,
        min_subnormal=min_sub,
        torch_dtype=_torch_dtype(torch_attr) if torch_attr else None,
    )


def _make_int_format(name: str, nbits: int) -> ElementFormat:
    """Build a symmetric signed integer format (range ``-(2**(nbits-1)-1) .. +``).

    The most negative two's complement code (-128 for int8) is never produced,
    so the grid is symmetric around zero.
    """
    qmax = float((1 << (nbits - 1)) - 1)
    return ElementFormat(
        name=name, ebits=0, mbits=nbits - 1, bias=0, signed=True,
        has_inf=False, has_nan=False, nan_rule="none", has_zero=True,
        has_subnormals=False, is_integer=True, nbits=nbits, emin=0, emax=0,
        max_normal=qmax, min_normal=1.0, min_subnormal=1.0,
        torch_dtype=torch.int8 if nbits == 8 else None,
    )


#: All element / scale formats, keyed by canonical name.
FORMATS: dict[str, ElementFormat] = {
    # FP8 E4M3 "fn": bias 7, max 448 (S.1111.110), NaN = S.1111.111, no Inf.
    "e4m3": _make_float_format("e4m3", 4, 3, 7, nan_rule="all_ones",
                               torch_attr="float8_e4m3fn"),
    # FP8 E5M2: IEEE-like, bias 15, max 57344, Inf and NaN.
    "e5m2": _make_float_format("e5m2", 5, 2, 15, nan_rule="ieee",
                               torch_attr="float8_e5m2"),
    # E8M0: unsigned power-of-two scale, bias 127, 0xFF = NaN, no zero.
    "e8m0": _make_float_format("e8m0", 8, 0, 127, nan_rule="all_ones",
                               signed=False, torch_attr="float8_e8m0fnu"),
    # FP4 E2M1: bias 1, values +-{0, .5, 1, 1.5, 2, 3, 4, 6}, no Inf/NaN.
    "e2m1": _make_float_format("e2m1", 2, 1, 1, nan_rule="none"),
    # Symmetric INT8, -127..127.
    "int8": _make_int_format("int8", 8),
}

#: High-precision passthrough "formats" (quantize == cast).
HIGH_PRECISION_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def get_format(name: str | ElementFormat) -> ElementFormat:
    """Look up an element format by name (case-insensitive); raise ValueError if unknown."""
    if isinstance(name, ElementFormat):
        return name
    key = str(name).strip().lower()
    if key not in FORMATS:
        raise ValueError(
            f"unknown element format {name!r}; valid: {sorted(FORMATS)}")
    return FORMATS[key]
