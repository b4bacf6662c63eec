"""Scale-group geometry: per-group amax, scale layouts and broadcasting.

Every scaled spec views the input as the 2-D matrix ``X2 = x.reshape(-1, K)``
(``M`` rows, ``K = x.shape[-1]``; a 0-d/1-D input is one row) and partitions
it into ``R x C`` groups:

=================  ==========  ==========================================
granularity        group       public ``scale`` shape (broadcast-ready)
=================  ==========  ==========================================
tensor             M x K       ``()`` (0-d)
channel / token    1 x K       ``x.shape[:-1] + (1,)`` (broadcasts vs x)
tile 1xC, mx,      1 x C       ``x.shape[:-1] + (ceil(K/C),)``; use
nvfp4                          ``QTensor.expanded_scale()`` to broadcast
tile RxC (R > 1)   R x C       ``(ceil(M/R), ceil(K/C))`` over the 2-D view
=================  ==========  ==========================================

Internally every layout is the "grid" ``(ceil(M/R), ceil(K/C))``.  Groups at
the bottom/right edges may be partial: their amax is taken over the elements
they actually hold (the zero padding used for the reshape cannot change an
amax of absolute values, and it is sliced away again), so no padding leaks
into scales or outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .spec import QuantSpec

__all__ = ["as_2d", "group_shape", "grid_shape", "public_scale_shape",
           "group_amax", "expand_grid", "grid_to_public", "public_to_grid"]


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """Return the ``(M, K)`` view of ``x`` (K = last dim; 0-d -> (1, 1))."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])


def group_shape(spec: QuantSpec, m: int, k: int) -> tuple[int, int]:
    """Group size ``(R, C)`` of ``spec`` for a ``(m, k)`` 2-D view."""
    if spec.granularity == "tensor":
        return max(m, 1), max(k, 1)
    if spec.is_rowwise:
        return 1, max(k, 1)
    assert spec.tile is not None, spec
    return spec.tile


def grid_shape(spec: QuantSpec, m: int, k: int) -> tuple[int, int]:
    """Number of groups ``(ceil(m/R), ceil(k/C))`` along each axis of the 2-D view.

    Per-tensor specs always have the single group ``(1, 1)``, even when empty.
    """
    if spec.granularity == "tensor":
        return 1, 1
    r, c = group_shape(spec, m, k)
    return math.ceil(m / r), math.ceil(k / c)


def public_scale_shape(spec: QuantSpec, shape: torch.Size) -> tuple[int, ...]:
    """Shape of ``QTensor.scale`` for an input of ``shape`` (see module table)."""
    lead = tuple(shape[:-1]) if len(shape) > 0 else ()
    k = shape[-1] if len(shape) > 0 else 1
    m = math.prod(lead) if lead else 1
    if spec.granularity == "tensor":
        return ()
    if spec.is_rowwise:
        return lead + (1,)
    r, c = group_shape(spec, m, k)
    if r == 1:
        return lead + (math.ceil(k / c),)
    return grid_shape(spec, m, k)


def group_amax(x2: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-group ``max |x|`` on the grid ``(ceil(M/R), ceil(K/C))``, float32.

    NaN in a group propagates to its amax (``torch.amax`` propagates NaN on
    CPU and CUDA).  Empty inputs give an all-zero (possibly empty) grid.
    """
    m, k = x2.shape
    r, c = group_shape(spec, m, k)
    gm, gk = grid_shape(spec, m, k)
    a = x2.abs().to(torch.float32)
    if m == 0 or k == 0:
        return torch.zeros((gm, gk), dtype=torch.float32, device=x2.device)
    if spec.granularity == "tensor":
        return a.amax().reshape(1, 1)
    if r == 1 and c == k:
        return a.amax(dim=1, keepdim=True)
    pm, pk = gm * r - m, gk * c - k
    if pm or pk:
        a = F.pad(a, (0, pk, 0, pm))  # zeros never raise an amax of |x|
    return a.reshape(gm, r, gk, c).amax(dim=(1, 3))


def expand_grid(g: torch.Tensor, spec: QuantSpec, m: int, k: int) -> torch.Tensor:
    """Broadcast a grid tensor ``(gm, gk)`` to the full ``(m, k)`` view (partial edges sliced)."""
    r, c = group_shape(spec, m, k)
    if spec.granularity == "tensor":
        return g.reshape(1, 1).expand(m, k)
    if r == 1 and c == k:
        return g.expand(m, k)
    out = g
    if r > 1:
        out = out.repeat_interleave(r, dim=0)[:m]
    if c > 1:
        out = out.repeat_interleave(c, dim=1)[:, :k]
    return out


def grid_to_public(g: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """Reshape a grid tensor to the public scale layout for an input of ``shape``."""
    return g.reshape(public_scale_shape(spec, shape))


def public_to_grid(s: torch.Tensor, spec: QuantSpec, shape: torch.Size) -> torch.Tensor:
    """Broadcast a user scale to the public layout, then reshape it to the grid.

    Raises:
        ValueError: if ``s`` does not broadcast to the public scale shape.
    """
    pub = public_scale_shape(spec, shape)
    try:
        sb = torch.broadcast_to(s, pub)
    except RuntimeError as exc:
        raise ValueError(
            f"static scale of shape {tuple(s.shape)} does not broadcast to the "
            f"scale shape {pub} of spec {spec} for input shape {tuple(shape)}") from exc
    m = math.prod(shape[:-1]) if len(shape) > 0 else 1
    k = shape[-1] if len(shape) > 0 else 1
    return sb.reshape(grid_shape(spec, m, k))
