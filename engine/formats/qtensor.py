"""``quantize`` / ``QTensor`` / ``fake_quantize``: the public quantization API.

Storage of ``QTensor.data`` (always the input's shape):

* ``e4m3`` / ``e5m2`` elements (scaled specs and ``mxfp8``/``mxfp8_e5m2``):
  a ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensor whose *bits* come
  from this library's arithmetic encoder (a bit view, never a torch cast).
* ``e2m1`` elements (``mxfp4``, ``nvfp4``, ``e2m1:*``): ``torch.uint8`` with
  the 4-bit E2M1 code in the low nibble (one element per byte, unpacked).
* ``int8``: ``torch.int8`` in [-127, 127].
* passthrough (``fp32``/``bf16``/``fp16``): the input cast to that dtype.

``QTensor.scale`` is float32 in the layout of :mod:`engine.formats.grouping`
(MX: the powers of two ``2**shared_exp``; NVFP4: the E4M3-representable block
scales, with the fp32 per-tensor scale in ``QTensor.tensor_scale``).

All arithmetic is float32, element-wise, vectorized torch ops that behave
identically on CPU and CUDA.  Element values are ``x / scale`` (a true
division, correctly rounded on both devices); dequantization is
``element * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from . import grouping as G
from ._bits import div_scalar, exp2i, floor_log2, pow2_ceil
from .elements import (codes_to_torch, decode_codes, round_to_format, round_with_overflow,
                       values_to_codes)
from .spec import QuantSpec, SpecLike, parse_spec
from .table import HIGH_PRECISION_DTYPES, get_format

__all__ = ["QTensor", "quantize", "fake_quantize", "float_scale_from_amax", "mx_scale_from_amax",
           "NVFP4_TENSOR_DENOM"]

ScaleLike = Union[float, int, torch.Tensor]

#: NVFP4 per-tensor scale denominator: max E4M3 (448) * max E2M1 (6).
NVFP4_TENSOR_DENOM = 448.0 * 6.0


def float_scale_from_amax(amax: torch.Tensor, max_normal: float, pow2: bool = False) -> torch.Tensor:
    """Dynamic fp32 scale of a group: ``scale = amax / max_normal``.

    * ``amax == 0`` (all-zero group) -> ``scale = 1`` so elements encode as 0
      and no division by zero happens.
    * ``pow2=True`` -> ``scale = 2**ceil(log2(amax / max_normal))``: rounded
      *up* so that ``amax / scale <= max_normal`` still holds (no clipping);
      computed exactly from the float32 bits.
    * NaN/Inf amax give a NaN/Inf scale, which poisons the group's output
      (NaN after dequantization) rather than hiding non-finite inputs.
    """
    s = div_scalar(amax.to(torch.float32), max_normal)
    if pow2:
        s = pow2_ceil(s)
    return torch.where(amax == 0, torch.ones_like(s), s)


def mx_scale_from_amax(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """OCP MX v1.0 shared scale ``X = 2**shared_exp`` of a block (float32).

    ``shared_exp = floor(log2(amax)) - emax_elem`` clamped to the E8M0 range
    ``[-127, 127]``; ``emax_elem`` is the exponent of the element format's
    largest normal (8 for E4M3, 15 for E5M2, 2 for E2M1).  ``floor(log2)`` is
    read exactly from the float32 bits.  An all-zero block (and any block
    with amax < 2**(emax_elem - 127)) gets the smallest E8M0 value
    ``2**-127`` (code 0x00); its elements encode as zeros.  A block with a
    NaN or Inf gets the NaN scale (code 0xFF), so the whole block decodes to
    NaN.  With this floor rule ``amax / X`` lies in ``[2**emax, 2**(emax+1))``
    and can exceed the element max (e.g. 7.5 for E2M1); such elements are
    clamped to ``max_normal`` as the OCP spec prescribes.
    """
    e = (floor_log2(amax) - emax_elem).clamp(-127, 127)
    x = exp2i(e)
    return torch.where(torch.isfinite(amax), x, torch.full_like(x, float("nan")))


@dataclass
class QTensor:
    """A quantized tensor (plain container, not a tensor subclass).

    Attributes:
        data: encoded elements, same shape as the input (module docstring).
        scale: float32 scales (layout per granularity) or None (passthrough).
        spec: the :class:`QuantSpec` used.
        shape: the original input shape.
        orig_dtype: the input dtype (``fake_quantize`` casts back to it).
        tensor_scale: NVFP4 per-tensor fp32 scale (0-d), else None.
        counts: 0-d tensors gathered at quantize time for :meth:`stats`
            (kept as tensors so quantize never synchronizes a GPU); empty
            when quantized with ``counts=False``.
    """

    data: torch.Tensor
    scale: Optional[torch.Tensor]
    spec: QuantSpec
    shape: torch.Size
    orig_dtype: torch.dtype
    tensor_scale: Optional[torch.Tensor] = None
    counts: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ views
    def _mk(self) -> tuple[int, int]:
        """Rows and columns of the (-1, K) view of the original shape."""
        k = self.shape[-1] if len(self.shape) else 1
        m = self.data.numel() // k if k else 0
        return m, k

    def elements(self) -> torch.Tensor:
        """Decoded element values (unscaled), float32, original shape."""
        if self.spec.is_passthrough:
            return self.data.to(torch.float32)
        return decode_codes(self.data, self.spec.elem).reshape(self.shape)

    def group_scale_grid(self) -> torch.Tensor:
        """Effective per-group scale on the grid (NVFP4: block_scale * tensor_scale)."""
        assert self.scale is not None
        s = self.scale
        if self.spec.kind == "nvfp4":
            s = s * self.tensor_scale
        m, k = self._mk()
        return s.reshape(G.grid_shape(self.spec, m, k))

    def expanded_scale(self) -> torch.Tensor:
        """Effective float32 scale of every element, broadcast to the original shape."""
        m, k = self._mk()
        g = self.group_scale_grid()
        return G.expand_grid(g, self.spec, m, k).reshape(self.shape)

    def scale_codes(self) -> torch.Tensor:
        """Scales as uint8 codes of the spec's scale format (E8M0 for MX, E4M3 for NVFP4)."""
        if self.spec.scale_fmt not in ("e8m0", "e4m3") or self.scale is None:
            raise ValueError(f"spec {self.spec} has float32 scales, not coded ones")
        return values_to_codes(self.scale, self.spec.scale_fmt)

    # ------------------------------------------------------------ dequantize
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return ``element * scale`` in ``dtype`` with the original shape.

        Passthrough specs cast ``data`` back; NVFP4 multiplies by the fp32
        product ``block_scale * tensor_scale`` (the same product quantize
        divided by).
        """
        if self.spec.is_passthrough:
            return self.data.to(torch.float32).to(dtype)
        out = self.elements() * self.expanded_scale()
        return out.to(dtype)

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Format statistics (Python numbers; synchronizes once on GPU).

        Keys: ``n`` (elements), ``saturation_frac`` (elements clipped at the
        format max or turned Inf/NaN by overflow, static-scale saturation
        included), ``underflow_frac`` (non-zero finite inputs that encoded to
        zero), ``subnormal_frac`` (non-zero encoded elements below the
        element format's min normal), ``nan_frac`` (NaN inputs), ``amax``
        (input max |x|, NaN if the input has NaN), ``scale_min``,
        ``scale_max`` (over finite effective scales; None for passthrough)
        and ``scale_exp_hist`` ({floor(log2 scale): count} over positive
        finite effective scales; {} for passthrough).  Fractions are over
        all ``n`` elements (0.0 for empty tensors).
        """
        if not self.counts:
            raise ValueError(f"stats() of a {self.spec} QTensor quantized without its counts: quantize it with "
                             "counts=True (engine.numerics.Numerics gathers them while an observer is installed)")
        c = {k: v.item() for k, v in self.counts.items()}
        n = int(c.get("n", 0))

        def frac(key: str) -> float:
            """Count of ``key`` as a fraction of all elements."""
            return float(c.get(key, 0)) / n if n else 0.0

        out: dict[str, Any] = {
            "n": n,
            "saturation_frac": frac("saturated"),
            "underflow_frac": frac("underflow"),
            "subnormal_frac": frac("subnormal"),
            "nan_frac": frac("nan"),
            "amax": float(c.get("amax", 0.0)),
            "scale_min": None, "scale_max": None, "scale_exp_hist": {},
        }
        if self.scale is not None and self.scale.numel():
            s = self.group_scale_grid().reshape(-1)
            fin = s[torch.isfinite(s)]
            if fin.numel():
                out["scale_min"] = float(fin.min().item())
                out["scale_max"] = float(fin.max().item())
            pos = fin[fin > 0]
            if pos.numel():
                exps, cnt = torch.unique(floor_log2(pos), return_counts=True)
                out["scale_exp_hist"] = {int(e): int(n_) for e, n_ in zip(exps.tolist(), cnt.tolist())}
        if self.tensor_scale is not None:
            out["tensor_scale"] = float(self.tensor_scale.item())
        return out


# ---------------------------------------------------------------- quantize
def _counts(x2: torch.Tensor, vals: torch.Tensor, overflow: torch.Tensor,
            min_normal: Optional[float]) -> dict[str, torch.Tensor]:
    """0-d count tensors for :meth:`QTensor.stats` (no host sync)."""
    finite_nz = torch.isfinite(x2) & (x2 != 0)
    c = {
        "n": torch.full((), x2.numel(), dtype=torch.int64, device=x2.device),
        "saturated": overflow.sum(),
        "underflow": (finite_nz & (vals == 0)).sum(),
        "nan": torch.isnan(x2).sum(),
        "amax": x2.abs().amax() if x2.numel() else torch.zeros((), device=x2.device),
    }
    if min_normal is not None:
        sub = (vals != 0) & (vals.abs() < min_normal)
        c["subnormal"] = sub.sum()
    else:
        c["subnormal"] = torch.zeros((), dtype=torch.int64, device=x2.device)
    return c


def _encode_data(vals: torch.Tensor, elem: str, shape: torch.Size) -> torch.Tensor:
    """Store rounded element values in the documented ``data`` dtype."""
    fmt = get_format(elem)
    if fmt.is_integer:
        return torch.nan_to_num(vals, nan=0.0).to(torch.int8).reshape(shape)
    return codes_to_torch(values_to_codes(vals, fmt), fmt).reshape(shape)


def _quantize_passthrough(xf: torch.Tensor, spec: QuantSpec, orig_dtype: torch.dtype, counts: bool) -> QTensor:
    """Cast to fp32/bf16/fp16; counts overflow-to-Inf, underflow and subnormals (when `counts`)."""
    dt = HIGH_PRECISION_DTYPES[spec.elem]
    data = xf.to(dt)
    if not counts:
        return QTensor(data=data, scale=None, spec=spec, shape=xf.shape, orig_dtype=orig_dtype)
    back = data.to(torch.float32)
    x2, v2 = xf.reshape(-1), back.reshape(-1)
    overflow = torch.isfinite(x2) & torch.isinf(v2)
    counts = _counts(x2, v2, overflow, torch.finfo(dt).tiny)
    return QTensor(data=data, scale=None, spec=spec, shape=xf.shape, orig_dtype=orig_dtype,
                   counts=counts)


def quantize(x: torch.Tensor, spec: SpecLike, *, scale: Optional[ScaleLike] = None,
             rounding: str = "rne", generator: Optional[torch.Generator] = None,
             saturate: bool = True, counts: bool = True) -> QTensor:
    """Quantize ``x`` according to ``spec`` (string or :class:`QuantSpec`).

    Args:
        x: float tensor of any shape (fp32/bf16/fp16; converted to fp32).
        spec: quant spec (see :mod:`engine.formats.spec`).
        scale: optional static scale instead of the dynamic amax scale.
            Scaled specs: anything broadcastable to the public scale shape
            (a float for per-tensor); values beyond ``scale * max_normal``
            saturate and are counted in ``stats()['saturation_frac']``.
            NVFP4: the static fp32 per-tensor scale (block scales stay
            dynamic).  Not accepted for MX (scales are defined by the block)
            or passthrough.  Used as given (``:pow2`` does not re-round it,
            ``:shiftN`` does not shift it).
        rounding: ``"rne"`` or ``"stochastic"`` (element rounding only;
            scales are always computed deterministically).
        generator: torch.Generator for stochastic rounding.
        saturate: overflow behaviour of E4M3/E5M2 elements for scaled specs
            (False: E4M3 -> NaN, E5M2 -> Inf).  MX and NVFP4 always saturate
            (OCP MX rule; E2M1 has no Inf/NaN).
        counts: gather the 0-d count tensors that :meth:`QTensor.stats`
            reads (a dozen reductions over the input); False skips them
            (the data and scales are the same either way).

    Returns:
        :class:`QTensor`.
    """
    sp = parse_spec(spec)
    orig_dtype = x.dtype
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    if sp.is_passthrough:
        if scale is not None:
            raise ValueError(f"spec {sp} is a passthrough cast and takes no scale")
        return _quantize_passthrough(xf, sp, orig_dtype, counts)
    fmt = get_format(sp.elem)
    x2 = G.as_2d(xf)
    m, k = x2.shape
    tensor_scale = None
    if sp.kind == "scaled":
        if scale is not None:
            st = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
            grid = G.public_to_grid(st, sp, xf.shape).contiguous()
        else:
            # Dynamic scale per group: scale = amax / max_normal (1 if amax == 0).
            grid = float_scale_from_amax(G.group_amax(x2, sp), fmt.max_normal, sp.pow2)
            if sp.scale_shift:
                # `:shiftN`: every computed scale times 2**N (exact: a power-of-two product).
                grid = grid * (2.0 ** sp.scale_shift)
        y = x2 / G.expand_grid(grid, sp, m, k)
        vals, overflow = round_with_overflow(y, fmt, rounding=rounding, generator=generator,
                                             saturate=saturate)
        public = G.grid_to_public(grid, sp, xf.shape)
    elif sp.kind == "mx":
        if scale is not None:
            raise ValueError(f"spec {sp}: MX scales are defined by each block; no static scale")
        # OCP MX: X = 2**(floor(log2(amax_block)) - emax_elem), E8M0-clamped.
        grid = mx_scale_from_amax(G.group_amax(x2, sp), fmt.emax)
        y = x2 / G.expand_grid(grid, sp, m, k)  # exact: division by a power of two
        vals, overflow = round_with_overflow(y, fmt, rounding=rounding, generator=generator,
                                             saturate=True)
        public = G.grid_to_public(grid, sp, xf.shape)
    elif sp.kind == "nvfp4":
        if scale is not None:
            ts = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
        else:
            # tensor_scale = amax(x) / (448 * 6); an all-zero tensor gets 1.
            amax_t = x2.abs().amax() if x2.numel() else torch.zeros((), device=x.device)
            ts = div_scalar(amax_t, NVFP4_TENSOR_DENOM)
            ts = torch.where(amax_t == 0, torch.ones_like(ts), ts)
        # block_scale = e4m3_round(amax_block / 6 / tensor_scale)  (RNE, saturating;
        # evaluated left to right in fp32).  Tiny blocks may round to 0.
        grid = round_to_format(div_scalar(G.group_amax(x2, sp), 6.0) / ts, "e4m3", saturate=True)
        # elements = round_e2m1(x / (block_scale * tensor_scale)); a block whose
        # scale is 0 (all-zero block, or E4M3 underflow) encodes as zeros.
        denom = G.expand_grid(grid * ts, sp, m, k)
        y = torch.where(denom == 0, torch.zeros_like(x2), x2 / denom)
        y = torch.where(torch.isnan(x2), x2, y)
        vals, overflow = round_with_overflow(y, fmt, rounding=rounding, generator=generator,
                                             saturate=True)
        public = G.grid_to_public(grid, sp, xf.shape)
        tensor_scale = ts
    else:  # pragma: no cover - parse_spec never produces this
        raise ValueError(f"unsupported spec kind {sp.kind!r}")
    data = _encode_data(vals, sp.elem, xf.shape)
    return QTensor(data=data, scale=public, spec=sp, shape=xf.shape, orig_dtype=orig_dtype, tensor_scale=tensor_scale,
                   counts=_counts(x2, vals, overflow, None if fmt.is_integer else fmt.min_normal) if counts else {})


def fake_quantize(x: torch.Tensor, spec: SpecLike, **kw: Any) -> torch.Tensor:
    """``quantize(x, spec, **kw).dequantize().to(x.dtype)`` (quantize-dequantize)."""
    return quantize(x, spec, **kw).dequantize().to(x.dtype)
