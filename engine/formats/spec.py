"""Quantization spec strings: parsing, validation and canonical form.

Vocabulary (case-insensitive, whitespace ignored; ``str(spec)`` is canonical):

=====================  =====================================================
``fp32`` ``bf16``      high-precision passthrough (quantize == cast); aliases
``fp16``               ``float32``, ``bfloat16``, ``float16``, ``half``
``ELEM:tensor``        one fp32 scale for the whole tensor
``ELEM:channel``       one scale per row of the ``(-1, K)`` view (weights)
``ELEM:token``         same grouping as ``channel`` (activations)
``ELEM:RxC``           R x C tiles over the ``(-1, K)`` view; ``1xC`` are 1-D
                       blocks along the last dim (``e4m3:1x128``), ``128x128``
                       2-D weight tiles (DeepSeek-V3)
``...:pow2``           suffix: scales rounded *up* to a power of two
``...:shiftN``         suffix (signed integer N, e.g. ``:shift-1``): every
                       dynamically computed scale is multiplied by ``2**N``
                       (after ``:pow2`` rounding).  ``shift-1`` makes scales
                       one exponent too small, so the top half of each
                       group's range saturates at the element max: a
                       deliberate, bit-exact fault for the gate's selftest.
                       Static (calibrated) scales are used as given.
``mxfp8``              OCP MX: E4M3 elements, 32-blocks, E8M0 scale
``mxfp8_e5m2``         OCP MX: E5M2 elements, 32-blocks, E8M0 scale
``mxfp4``              OCP MX: E2M1 elements, 32-blocks, E8M0 scale
``nvfp4``              E2M1 elements, 16-blocks, E4M3 block scale, fp32
                       per-tensor scale
=====================  =====================================================

``ELEM`` is one of ``e4m3``, ``e5m2``, ``e2m1``, ``int8``.  Full grammar of
the scaled forms: ``ELEM:GRANULARITY[:pow2][:shiftN]`` (suffixes in that
canonical order; either order is accepted on input; ``shift0`` is dropped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

from .table import HIGH_PRECISION_DTYPES, ElementFormat, get_format

__all__ = ["QuantSpec", "parse_spec", "VALID_FORMS", "SpecLike"]

#: Human-readable list of accepted forms, used in error messages.
VALID_FORMS = (
    "fp32 | bf16 | fp16",
    "ELEM:tensor | ELEM:channel | ELEM:token | ELEM:RxC (e.g. e4m3:1x128, e4m3:128x128)"
    " with ELEM in {e4m3, e5m2, e2m1, int8}",
    "optional ':pow2' suffix on the ELEM forms (power-of-two scales)",
    "optional ':shiftN' suffix on the ELEM forms (scales times 2**N, e.g. ':shift-1')",
    "mxfp8 | mxfp8_e5m2 | mxfp4 | nvfp4",
)

_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_SCALED_ELEMS = ("e4m3", "e5m2", "e2m1", "int8")
_MX = {"mxfp8": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}
_TILE_RE = re.compile(r"^(\d+)x(\d+)$")
_SHIFT_RE = re.compile(r"^shift([+-]?\d+)$")
#: Largest |N| of ``:shiftN`` (the fp32 scale exponent range).
MAX_SCALE_SHIFT = 64


@dataclass(frozen=True)
class QuantSpec:
    """A parsed quantization spec (frozen, hashable).

    Attributes:
        kind: ``"passthrough"``, ``"scaled"`` (fp32 scales), ``"mx"`` or
            ``"nvfp4"``.
        elem: element format name (``"e4m3"`` ...) or the passthrough dtype
            name (``"fp32"``, ``"bf16"``, ``"fp16"``).
        granularity: ``"none"`` (passthrough), ``"tensor"``, ``"channel"``,
            ``"token"``, ``"tile"`` (RxC), ``"mx"`` or ``"nvfp4"``.
        tile: ``(R, C)`` group shape over the ``(-1, K)`` view for ``tile``,
            ``mx`` (1, 32) and ``nvfp4`` (1, 16); None otherwise.
        scale_fmt: ``"fp32"``, ``"e8m0"`` (MX) or ``"e4m3"`` (NVFP4 block
            scale); None for passthrough.
        pow2: scales rounded up to powers of two (``:pow2`` suffix).
        scale_shift: ``N`` of a ``:shiftN`` suffix: dynamic scales are
            multiplied by ``2**N`` (0: no shift).
        name: the named-format string for ``mx``/``nvfp4`` specs.
    """

    kind: str
    elem: str
    granularity: str
    tile: Optional[tuple[int, int]] = None
    scale_fmt: Optional[str] = None
    pow2: bool = False
    name: Optional[str] = None
    scale_shift: int = 0

    @property
    def is_passthrough(self) -> bool:
        """True for fp32/bf16/fp16 specs (quantize is a cast)."""
        return self.kind == "passthrough"

    @property
    def element_format(self) -> Optional[ElementFormat]:
        """The :class:`ElementFormat` of the elements (None for passthrough)."""
        return None if self.is_passthrough else get_format(self.elem)

    @property
    def is_rowwise(self) -> bool:
        """True for ``channel``/``token`` (one scale per row of the (-1, K) view)."""
        return self.granularity in ("channel", "token")

    def __str__(self) -> str:
        """Canonical spec string; ``parse_spec(str(s)) == s``."""
        if self.is_passthrough:
            return self.elem
        if self.kind in ("mx", "nvfp4"):
            return str(self.name)
        g = f"{self.tile[0]}x{self.tile[1]}" if self.granularity == "tile" else self.granularity
        shift = f":shift{self.scale_shift:+d}" if self.scale_shift > 0 else (
            f":shift{self.scale_shift}" if self.scale_shift else "")
        return f"{self.elem}:{g}" + (":pow2" if self.pow2 else "") + shift


SpecLike = Union[str, QuantSpec]


def _err(s: str, why: str) -> ValueError:
    """Build the ValueError for a bad spec string, listing valid forms."""
    forms = "; ".join(VALID_FORMS)
    return ValueError(f"invalid quant spec {s!r}: {why}. Valid forms: {forms}")


def parse_spec(s: SpecLike) -> QuantSpec:
    """Parse a spec string (or pass a :class:`QuantSpec` through).

    Raises:
        ValueError: naming the bad string and listing the valid forms.
    """
    if isinstance(s, QuantSpec):
        return s
    if not isinstance(s, str):
        raise _err(repr(s), f"expected a string, got {type(s).__name__}")
    raw = s
    t = "".join(s.split()).lower()
    t = _ALIASES.get(t, t)
    if t in HIGH_PRECISION_DTYPES:
        return QuantSpec(kind="passthrough", elem=t, granularity="none")
    if t in _MX:
        return QuantSpec(kind="mx", elem=_MX[t], granularity="mx", tile=(1, 32),
                         scale_fmt="e8m0", name=t)
    if t == "nvfp4":
        return QuantSpec(kind="nvfp4", elem="e2m1", granularity="nvfp4", tile=(1, 16),
                         scale_fmt="e4m3", name=t)
    parts = t.split(":")
    if len(parts) not in (2, 3, 4):
        raise _err(raw, "expected ELEM:GRANULARITY[:pow2][:shiftN] or a named format")
    elem, gran = parts[0], parts[1]
    pow2, shift, seen = False, 0, set()
    for suffix in parts[2:]:
        m_shift = _SHIFT_RE.match(suffix)
        kind = "pow2" if suffix == "pow2" else "shift" if m_shift else None
        if kind is None:
            raise _err(raw, f"unknown suffix {suffix!r} (only 'pow2' and 'shiftN', e.g. 'shift-1')")
        if kind in seen:
            raise _err(raw, f"suffix '{kind}' given twice")
        seen.add(kind)
        if kind == "pow2":
            pow2 = True
        else:
            shift = int(m_shift.group(1))
            if abs(shift) > MAX_SCALE_SHIFT:
                raise _err(raw, f"shift {shift} out of range (|N| <= {MAX_SCALE_SHIFT})")
    if elem not in _SCALED_ELEMS:
        raise _err(raw, f"unknown element format {elem!r}")
    if gran in ("tensor", "channel", "token"):
        return QuantSpec(kind="scaled", elem=elem, granularity=gran, scale_fmt="fp32", pow2=pow2,
                         scale_shift=shift)
    m = _TILE_RE.match(gran)
    if not m:
        raise _err(raw, f"unknown granularity {gran!r}")
    r, c = int(m.group(1)), int(m.group(2))
    if r <= 0 or c <= 0:
        raise _err(raw, "tile sizes must be positive")
    return QuantSpec(kind="scaled", elem=elem, granularity="tile", tile=(r, c),
                     scale_fmt="fp32", pow2=pow2, scale_shift=shift)
