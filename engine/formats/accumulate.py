"""Emulation of limited-precision tensor-core accumulation.

``matmul_accum(a, b, accumulate)`` returns ``a @ b.T`` for ``a (M, K)``,
``b (N, K)`` (already-dequantized float32 values) under an accumulation
model selected by a string:

``fp32``
    plain float32 ``torch.matmul``.
``tcN`` (e.g. ``tc14``)
    Hopper-style FP8 tensor-core accumulation that keeps only ``N`` explicit
    mantissa (fraction) bits (DeepSeek-V3 measured ~14 on H800; ``tc23``
    has float32's mantissa width).
``tcN:promoteK`` (e.g. ``tc14:promote128``)
    as ``tcN``, but every ``K`` products the limited-precision partial sum
    is added into a full float32 accumulator (correctly rounded fp32 add)
    and reset to zero: DeepSeek-V3's FP32 promotion on CUDA cores.
``...:innerC``
    optional: products per tensor-core step (default 4, see below).

Model (documented, deliberately simple):

1. The reduction dim is split into consecutive chunks of ``C`` products
   (``inner``, default 4).  Each chunk's products are summed exactly-ish in
   float64 (products of FP8/BF16 values are exact in float64 and a handful
   of them sum exactly), standing in for the tensor core's wide internal
   adder tree for one step.
2. The chunk sum is added to the running accumulator (float64 add) and the
   result is **truncated toward zero** to ``N`` fraction bits (masking the
   low mantissa bits of the float64 pattern), modelling the alignment
   shifter that drops low bits of the narrower operand.
3. With ``promoteK`` the truncated accumulator is flushed every ``K``
   products (``K`` must be a multiple of ``C``) into a float32 accumulator.

Loops run only over K-chunks; every step is vectorized over M and N.  All
steps are exact or correctly-rounded IEEE operations, so results agree on
CPU and CUDA for FP8/BF16-valued inputs.  The float64 accumulator does not
model float32 overflow (irrelevant for realistic magnitudes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = ["AccumSpec", "parse_accumulate", "matmul_accum", "truncate_mantissa"]

_VALID = "fp32 | tcN | tcN:promoteK | tcN[:promoteK]:innerC  (1 <= N <= 23, e.g. tc14:promote128)"
_TC_RE = re.compile(r"^tc(\d+)((?::(?:promote|inner)\d+)*)$")
_OPT_RE = re.compile(r":(promote|inner)(\d+)")


@dataclass(frozen=True)
class AccumSpec:
    """Parsed accumulation mode.

    Attributes:
        mode: ``"fp32"`` or ``"tc"``.
        mant_bits: retained fraction bits ``N`` (tc only).
        promote: promotion interval ``K`` in products, or None.
        inner: products per tensor-core step ``C``.
    """

    mode: str
    mant_bits: Optional[int] = None
    promote: Optional[int] = None
    inner: int = 4

    def __str__(self) -> str:
        """Canonical string (``inner`` shown only when not the default 4)."""
        if self.mode == "fp32":
            return "fp32"
        s = f"tc{self.mant_bits}"
        if self.promote:
            s += f":promote{self.promote}"
        if self.inner != 4:
            s += f":inner{self.inner}"
        return s


def parse_accumulate(s: Union[str, AccumSpec]) -> AccumSpec:
    """Parse an accumulation string; raise ValueError naming it and the valid forms."""
    if isinstance(s, AccumSpec):
        return s
    t = "".join(str(s).split()).lower()
    if t == "fp32":
        return AccumSpec("fp32")
    m = _TC_RE.match(t)
    if not m:
        raise ValueError(f"invalid accumulate spec {s!r}; valid forms: {_VALID}")
    n = int(m.group(1))
    opts: dict[str, int] = {}
    for name, val in _OPT_RE.findall(m.group(2)):
        if name in opts:
            raise ValueError(f"invalid accumulate spec {s!r}: {name} given twice; "
                             f"valid forms: {_VALID}")
        opts[name] = int(val)
    if not 1 <= n <= 23:
        raise ValueError(f"invalid accumulate spec {s!r}: N must be in 1..23; valid: {_VALID}")
    inner = opts.get("inner", 4)
    promote = opts.get("promote")
    if inner <= 0 or (promote is not None and (promote <= 0 or promote % inner)):
        raise ValueError(f"invalid accumulate spec {s!r}: promote must be a positive multiple "
                         f"of inner ({inner}); valid: {_VALID}")
    return AccumSpec("tc", n, promote, inner)


def truncate_mantissa(v: torch.Tensor, n: int) -> torch.Tensor:
    """Truncate float64 ``v`` toward zero to ``n`` fraction bits (bit mask, exact)."""
    assert v.dtype == torch.float64
    mask = ~((1 << (52 - n)) - 1)
    return (v.contiguous().view(torch.int64) & mask).view(torch.float64)


def matmul_accum(a: torch.Tensor, b: torch.Tensor, accumulate: Union[str, AccumSpec] = "fp32",
                 *, chunk_batch: int = 256) -> torch.Tensor:
    """``a @ b.T`` (``a (M, K)``, ``b (N, K)``) under an accumulation model.

    Args:
        a, b: float tensors (any float dtype; converted to float32 values).
        accumulate: ``fp32``, ``tcN``, ``tcN:promoteK`` (module docstring).
        chunk_batch: how many K-chunks' partial products are formed per
            batched einsum (memory/speed knob only; does not change results).

    Returns:
        float32 tensor ``(M, N)``.
    """
    spec = parse_accumulate(accumulate)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"expected a (M, K) and b (N, K), got {tuple(a.shape)}, {tuple(b.shape)}")
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    if spec.mode == "fp32":
        return a32 @ b32.T
    m, k = a32.shape
    n = b32.shape[0]
    c = spec.inner
    nk = -(-k // c)
    pad = nk * c - k
    a64 = torch.nn.functional.pad(a32.double(), (0, pad)).reshape(m, nk, c)
    b64 = torch.nn.functional.pad(b32.double(), (0, pad)).reshape(n, nk, c)
    acc = torch.zeros((m, n), dtype=torch.float64, device=a.device)
    main = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    steps_per_promote = (spec.promote // c) if spec.promote else None
    for j0 in range(0, nk, chunk_batch):
        j1 = min(nk, j0 + chunk_batch)
        # Step 1: exact-ish float64 sum of the C products of each chunk.
        sums = torch.einsum("mjc,njc->jmn", a64[:, j0:j1], b64[:, j0:j1])
        for j in range(j0, j1):
            # Step 2: add, then truncate to N fraction bits.
            acc = truncate_mantissa(acc + sums[j - j0], spec.mant_bits)
            # Step 3: FP32 promotion every `promote` products.
            if steps_per_promote and (j + 1) % steps_per_promote == 0:
                main = main + acc.to(torch.float32)
                acc = torch.zeros_like(acc)
    if steps_per_promote:
        return main + acc.to(torch.float32)
    return acc.to(torch.float32)
