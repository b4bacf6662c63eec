"""Element rounding, encoding and decoding, implemented arithmetically.

Rounding never calls torch's float8 casts: it extracts the float32 exponent
from the bit pattern (``_bits.floor_log2``), computes the quantum
``q = 2**(max(e, emin) - mbits)`` of the target format at that binade, and
rounds ``|x| / q`` to an integer (``torch.round`` is round-half-to-even on
CPU and CUDA).  Division by a power of two is exact, so the only rounding is
the one we ask for.  Tests compare the result bit-exactly against torch's
casts where the semantics match.

Observed torch cast semantics (documented in the tests as well):

* ``x.to(torch.float8_e4m3fn)`` rounds RNE.  On overflow, torch 2.13 (CPU)
  **saturates** every overflow, including ``+-Inf``, to ``+-448`` (== our
  ``saturate=True``), while torch 2.11 (CPU and CUDA, seen on an H200) gives
  NaN for ``|x| > 464`` and for ``+-Inf`` (== our ``saturate=False``).  The
  library's own behaviour is fixed by the ``saturate`` argument, not by the
  torch version.  NaN stays NaN (torch keeps the sign bit).
* ``x.to(torch.float8_e5m2)`` rounds RNE and overflows to ``+-Inf``
  (``|x| >= 61440``, the midpoint above 57344 that ties to the even
  ``2**16``).  == our ``saturate=False``.
* ``x.to(torch.float8_e8m0fnu)`` ignores the sign, rounds the linear mantissa
  half-up (which is RNE here since ``mbits == 0``), maps values below
  ``2**-127`` (zero included) to code 0 (``2**-127``) and overflow/Inf/NaN to
  ``0xFF`` (NaN).  == our ``saturate=False``.

NaN encoding: NaN values always get the *positive* canonical code
(``0x7F`` for E4M3/E5M2, ``0xFF`` for E8M0).  The sign of a NaN produced by
arithmetic differs between x86 (``0xFFC00000``) and CUDA (``0x7FFFFFFF``), so
taking it from the data would break CPU/CUDA bit-exactness.  Formats with
no NaN code (E2M1, INT8) encode NaN as 0; quantize() reports NaN counts in
its statistics.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._bits import abs_and_sign, bits_f32, exp2i, f32_bits, floor_log2
from .table import ElementFormat, get_format

__all__ = [
    "round_to_format",
    "round_with_overflow",
    "values_to_codes",
    "encode_codes",
    "decode_codes",
    "codes_to_torch",
    "torch_to_codes",
    "ROUNDING_MODES",
]

ROUNDING_MODES = ("rne", "stochastic")


def _check_rounding(rounding: str) -> None:
    """Validate the rounding mode argument."""
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")


def _uniform_like(y: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Uniform [0, 1) float32 noise shaped like ``y`` from ``generator``.

    The noise is drawn on the generator's device when one is given (torch
    requires that) and moved to ``y``'s device.  CPU and CUDA generators give
    different streams, so stochastic rounding is bit-reproducible per device
    and seed, not across devices.
    """
    dev = generator.device if generator is not None else y.device
    u = torch.rand(y.shape, generator=generator, device=dev, dtype=torch.float32)
    return u.to(y.device)


def round_with_overflow(x: torch.Tensor, fmt: str | ElementFormat, *,
                        rounding: str = "rne",
                        generator: Optional[torch.Generator] = None,
                        saturate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``x`` to ``fmt``'s representable values; also return the overflow mask.

    Args:
        x: tensor of any float dtype; converted to float32 first (exact for
            bf16/fp16).
        fmt: element format (name or :class:`ElementFormat`).
        rounding: ``"rne"`` (round to nearest, ties to even) or
            ``"stochastic"`` (round up with probability equal to the
            fractional position between the two neighbouring values).
        generator: torch.Generator for stochastic rounding.
        saturate: overflow behaviour.  True clamps to ``+-max_normal`` (Inf
            inputs too).  False maps overflow to ``+-Inf`` when the format has
            Inf (E5M2), else to NaN (E4M3, E8M0).  E2M1 and INT8 have neither,
            so they always saturate.

    Returns:
        ``(values, overflow)``: float32 rounded values (shape of ``x``) and a
        bool mask of finite-or-infinite inputs whose rounded magnitude would
        exceed ``max_normal`` (the elements that were clipped or became
        Inf/NaN).  NaN inputs give NaN values and are not counted as overflow.
    """
    fmt = get_format(fmt)
    _check_rounding(rounding)
    xf = x.to(torch.float32)
    if fmt.is_integer:
        return _round_integer(xf, fmt, rounding, generator)
    a, neg = abs_and_sign(xf)
    isnan = torch.isnan(xf)
    # Clamp so that the exponent stays small; 2**(emax+1) > max_normal, so any
    # clamped value still rounds to an overflow.  (E8M0: 2**128 is not a
    # float32, clamp Inf to the largest float32, which still rounds to 2**128.)
    big = float(2.0 ** (fmt.emax + 1)) if fmt.emax < 127 else torch.finfo(torch.float32).max
    ac = torch.clamp(a, max=big)
    ac = torch.where(isnan, torch.zeros_like(ac), ac)
    e = torch.clamp(floor_log2(ac), min=fmt.emin)
    # Quantum at this binade: q = 2**(max(e, emin) - mbits).  Subnormals of the
    # target format share the quantum of the smallest normal binade.
    q = exp2i(e - fmt.mbits)
    t = ac / q  # exact (division by a power of two, result normal)
    if rounding == "rne":
        r = torch.round(t)  # half-to-even on every device
    else:
        fl = torch.floor(t)
        frac = t - fl  # exact
        r = fl + (_uniform_like(t, generator) < frac).to(torch.float32)
    mag = r * q  # exact: r has at most mbits+1 significant bits
    overflow = (mag > fmt.max_normal) & ~isnan
    if not fmt.has_zero:
        # E8M0: no zero and no subnormals; values below 2**emin become 2**emin.
        mag = torch.clamp(mag, min=fmt.min_normal)
    if saturate or not fmt.has_nan:
        mag = torch.where(overflow, torch.full_like(mag, fmt.max_normal), mag)
    elif fmt.has_inf:
        mag = torch.where(overflow, torch.full_like(mag, float("inf")), mag)
    else:
        mag = torch.where(overflow, torch.full_like(mag, float("nan")), mag)
    if fmt.signed:
        out = torch.where(neg, -mag, mag)
    else:
        out = mag  # E8M0 has no sign bit; the sign is ignored (as torch does)
    out = torch.where(isnan, torch.full_like(out, float("nan")), out)
    return out, overflow


def _round_integer(xf: torch.Tensor, fmt: ElementFormat, rounding: str,
                   generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float32 ``xf`` to the symmetric integer grid, clamping at ``+-max``.

    NaN inputs stay NaN in the returned values (they encode to 0).
    """
    if rounding == "rne":
        r = torch.round(xf)
    else:
        fl = torch.floor(xf)
        r = fl + (_uniform_like(xf, generator) < (xf - fl)).to(torch.float32)
    overflow = r.abs() > fmt.max_normal
    return torch.clamp(r, -fmt.max_normal, fmt.max_normal), overflow


def round_to_format(x: torch.Tensor, fmt: str | ElementFormat, *,
                    rounding: str = "rne",
                    generator: Optional[torch.Generator] = None,
                    saturate: bool = True) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and return float32 values (see :func:`round_with_overflow`)."""
    return round_with_overflow(x, fmt, rounding=rounding, generator=generator,
                               saturate=saturate)[0]


def values_to_codes(v: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Encode float32 values that are *already representable* in ``fmt`` as codes.

    Returns a uint8 tensor of bit patterns (E2M1: the 4-bit code in the low
    nibble; INT8: the two's complement byte, as uint8).  Values that are not
    representable give unspecified codes; use :func:`encode_codes` to round
    first.  NaN gets the positive canonical NaN code (or 0 without one).
    """
    fmt = get_format(fmt)
    vf = v.to(torch.float32)
    if fmt.is_integer:
        q = torch.nan_to_num(vf, nan=0.0).to(torch.int32)
        return (q & 0xFF).to(torch.uint8)
    a, neg = abs_and_sign(vf)
    isnan = torch.isnan(vf)
    isinf = torch.isinf(vf)
    a_safe = torch.where(isnan | isinf, torch.zeros_like(a), a)
    e = floor_log2(a_safe)
    subnormal = a_safe < fmt.min_normal
    ef = (e + fmt.bias).clamp(min=0)
    # Normal: the top mbits of the float32 fraction field are the mantissa.
    mant_n = (f32_bits(a_safe) >> (23 - fmt.mbits)) & ((1 << fmt.mbits) - 1)
    if fmt.has_subnormals:
        # Subnormal: value = m * min_subnormal exactly (m < 2**mbits).
        mant_s = (a_safe / fmt.min_subnormal).to(torch.int32)
        ef = torch.where(subnormal, torch.zeros_like(ef), ef)
        mant = torch.where(subnormal, mant_s, mant_n)
    else:
        mant = mant_n
    code = (ef << fmt.mbits) | mant
    if fmt.has_inf:
        inf_code = ((1 << fmt.ebits) - 1) << fmt.mbits
        code = torch.where(isinf, torch.full_like(code, inf_code), code)
    if fmt.signed:
        code = code | (neg.to(torch.int32) << fmt.sign_shift)
    if fmt.has_nan:
        nan_code = (1 << (fmt.ebits + fmt.mbits)) - 1
        if fmt.nan_rule == "ieee":
            nan_code = (((1 << fmt.ebits) - 1) << fmt.mbits) | ((1 << fmt.mbits) - 1)
        code = torch.where(isnan, torch.full_like(code, nan_code), code)
    else:
        code = torch.where(isnan, torch.zeros_like(code), code)
    return code.to(torch.uint8)


def encode_codes(x: torch.Tensor, fmt: str | ElementFormat, *,
                 rounding: str = "rne",
                 generator: Optional[torch.Generator] = None,
                 saturate: bool = True) -> torch.Tensor:
    """Round ``x`` to ``fmt`` (see :func:`round_with_overflow`) and return uint8 codes."""
    v = round_to_format(x, fmt, rounding=rounding, generator=generator, saturate=saturate)
    return values_to_codes(v, fmt)


def decode_codes(codes: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Decode uint8 codes (or torch float8/int8 tensors) of ``fmt`` to float32.

    Float formats: exponent field ``ef``, mantissa ``m``; normal values are
    built bit-exactly as float32 ``(ef - bias + 127) << 23 | m << (23 - mbits)``,
    subnormals as ``m * min_subnormal``.  E8M0 code ``c`` is ``2**(c - 127)``
    (code 0 is the float32 subnormal ``2**-127``), 0xFF is NaN.  NaN/Inf follow
    the format's ``nan_rule``.  INT8 codes are two's complement bytes.
    """
    fmt = get_format(fmt)
    c = torch_to_codes(codes).to(torch.int32)
    if fmt.is_integer:
        return torch.where(c >= 128, c - 256, c).to(torch.float32)
    nb = fmt.ebits + fmt.mbits
    mag_code = c & ((1 << nb) - 1)
    ef = mag_code >> fmt.mbits
    m = mag_code & ((1 << fmt.mbits) - 1)
    if fmt.has_subnormals:
        normal_bits = ((ef - fmt.bias + 127) << 23) | (m << (23 - fmt.mbits))
        normal = bits_f32(torch.where(ef > 0, normal_bits, torch.zeros_like(normal_bits)))
        sub = m.to(torch.float32) * fmt.min_subnormal
        val = torch.where(ef > 0, normal, sub)
    else:
        val = exp2i(ef - fmt.bias)  # exact, including the subnormal 2**-127
    if fmt.nan_rule == "ieee":
        top = ef == (1 << fmt.ebits) - 1
        val = torch.where(top & (m == 0), torch.full_like(val, float("inf")), val)
        val = torch.where(top & (m != 0), torch.full_like(val, float("nan")), val)
    elif fmt.nan_rule == "all_ones":
        val = torch.where(mag_code == (1 << nb) - 1, torch.full_like(val, float("nan")), val)
    if fmt.signed:
        neg = ((c >> fmt.sign_shift) & 1) == 1
        val = torch.where(neg, -val, val)
    return val


def codes_to_torch(codes: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Reinterpret uint8 codes as the format's torch dtype (bit view, no cast).

    Returns the codes unchanged when torch has no dtype for the format
    (E2M1 stays uint8); INT8 codes become ``torch.int8``.
    """
    fmt = get_format(fmt)
    if fmt.torch_dtype is None:
        return codes
    return codes.contiguous().view(fmt.torch_dtype)


def torch_to_codes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a float8/int8/uint8 tensor as its uint8 bit patterns (no cast)."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype (codes), got {t.dtype}")
    return t.contiguous().view(torch.uint8)
