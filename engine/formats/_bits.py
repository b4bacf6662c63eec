"""Exact float32 bit helpers shared by the format library.

Division by a Python scalar must go through :func:`div_scalar`: on CUDA,
``tensor / python_float`` (and ``/ cpu_0d_tensor``) is computed as
``tensor * (1 / b)``, which is not correctly rounded and differs from the
CPU's true division in the last bit (seen on an H200 with torch 2.11).
Tensor / same-device-tensor division is IEEE correctly rounded on both.

All helpers are vectorized torch integer/bit operations on the IEEE-754
binary32 encoding (via ``Tensor.view(torch.int32)``), so they give identical
results on CPU and CUDA: no ``log2``/``pow``/``exp2`` transcendental calls,
whose last-bit behaviour may differ between devices.
"""

from __future__ import annotations

import torch

__all__ = ["f32_bits", "bits_f32", "exp2i", "floor_log2", "pow2_ceil", "abs_and_sign", "div_scalar"]

_EXP_MASK = 0xFF
_MANT_MASK = (1 << 23) - 1


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret a float32 tensor as its int32 bit patterns (no copy)."""
    assert x.dtype == torch.float32, x.dtype
    return x.contiguous().view(torch.int32)


def bits_f32(b: torch.Tensor) -> torch.Tensor:
    """Reinterpret an int32 tensor of bit patterns as float32 values."""
    return b.to(torch.int32).contiguous().view(torch.float32)


def exp2i(k: torch.Tensor) -> torch.Tensor:
    """Return the float32 value ``2**k`` for an integer tensor ``k`` in [-149, 127].

    Built directly from the bit pattern: normal powers ``k >= -126`` are
    ``(k + 127) << 23``; subnormal powers ``-149 <= k < -126`` have the single
    mantissa bit ``1 << (k + 149)``.  Callers must keep ``k`` in range
    (values outside are clamped, which callers never rely on).
    """
    k = k.to(torch.int32).clamp(-149, 127)
    normal = (k + 127) << 23
    sub = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return bits_f32(torch.where(k >= -126, normal, sub))


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact ``floor(log2(a))`` (int32) for positive finite float32 ``a``.

    Normal values read the biased exponent field.  For float32 subnormals the
    exponent field is 0 and the value is ``m * 2**-149`` with ``m`` the integer
    mantissa field; ``m < 2**23`` converts exactly to float32, whose exponent
    field then gives ``floor(log2(m))``.  Zero returns -150 (below every
    subnormal); Inf/NaN return 128.  The caller masks those cases.
    """
    b = f32_bits(a.abs())
    e_field = (b >> 23) & _EXP_MASK
    m = b & _MANT_MASK
    normal_e = e_field - 127
    m_as_f = m.to(torch.float32)  # exact: m < 2**23
    sub_e = ((f32_bits(m_as_f) >> 23) & _EXP_MASK) - 127 - 149
    out = torch.where(e_field > 0, normal_e, sub_e)
    return torch.where(b == 0, torch.full_like(out, -150), out)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Round positive finite float32 values up to the next power of two (exact).

    ``s`` that is already a power of two is returned unchanged; otherwise
    ``2**(floor(log2 s) + 1)``.  Zero, Inf and NaN pass through unchanged.
    Results are capped at ``2**127``.
    """
    e = floor_log2(s)
    p = exp2i(e)
    is_pow2 = p == s
    up = exp2i((e + 1).clamp(max=127))
    out = torch.where(is_pow2, p, up)
    special = (s == 0) | ~torch.isfinite(s)
    return torch.where(special, s, out)


def abs_and_sign(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split float32 ``x`` into ``|x|`` and a bool tensor of its sign bits.

    The sign comes from the bit pattern, so ``-0.0`` reports negative.
    """
    b = f32_bits(x)
    return bits_f32(b & 0x7FFFFFFF), b < 0


def div_scalar(a: torch.Tensor, b: float) -> torch.Tensor:
    """Correctly rounded ``a / b`` for a Python scalar ``b`` on every device.

    Builds ``b`` as a same-device tensor so CUDA uses true division instead of
    multiplying by a rounded reciprocal (see module docstring).
    """
    return a / torch.full_like(a, b)
