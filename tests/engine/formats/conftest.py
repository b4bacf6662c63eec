"""Shared fixtures for the format-library tests.

Makes the repository root importable when pytest is run without an
installed package, and provides a brute-force rounding oracle that is
independent of the library's arithmetic rounding.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _finite_grid(fmt_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All non-negative finite values of a format (sorted) and their codes."""
    from engine.formats import decode_codes, get_format

    fmt = get_format(fmt_name)
    ncodes = 1 << (fmt.ebits + fmt.mbits)  # magnitudes only (no sign bit)
    codes = torch.arange(ncodes, dtype=torch.int32).to(torch.uint8)
    vals = decode_codes(codes, fmt)
    keep = torch.isfinite(vals)
    vals, codes = vals[keep].double(), codes[keep]
    order = torch.argsort(vals)
    return vals[order], codes[order]


def oracle_round(x: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """Nearest representable magnitude (ties -> even code), sign restored, saturating.

    Brute force over the format's value list, in float64: independent of the
    library's exponent-based rounding.
    """
    vals, codes = _finite_grid(fmt_name)
    xd = x.double()
    a = xd.abs().clamp(max=vals[-1].item())
    hi = torch.searchsorted(vals, a).clamp(max=len(vals) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi].int() % 2 == 0))
    mag = torch.where(pick_hi, vals[hi], vals[lo])
    return torch.where(torch.signbit(xd), -mag, mag).float()


@pytest.fixture
def oracle():
    """The brute-force rounding oracle function ``oracle(x, fmt_name)``."""
    return oracle_round
