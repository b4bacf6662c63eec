"""Static calibration scales and the stage-wise ("unified scale flow") scales.

Workflow::

    obs = AmaxObserver()                        # per-tensor running amax
    for batch in calib:                         # engine hooks call observe()
        obs.observe(("attn_in", layer), x)
    table = stage_scales(obs.layer_amax("attn_in"), n_layers=32, n_stages=4,
                         fmt="e4m3", margin=1.0)
    scales_to_jsonable(table)                   # -> store with the recipe
    quantize(x, "e4m3:tensor", scale=table[layer])   # static; saturates beyond

Stage scales change only at stage boundaries: every layer of a stage shares
``scale = max(amax over the stage's layers) * margin / max_normal``.
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Mapping, Optional, Sequence, Union

import torch

from .qtensor import float_scale_from_amax
from .spec import parse_spec
from .table import ElementFormat, get_format

__all__ = ["AmaxObserver", "stage_boundaries", "stage_scales", "scales_to_jsonable",
           "scales_from_jsonable"]

AmaxLike = Union[float, torch.Tensor]


class AmaxObserver:
    """Accumulate the running ``max |x|`` per key over calibration batches.

    Args:
        granularity: ``"tensor"`` (one amax per key, the main use) or
            ``"row"`` (one amax per row of the ``(-1, K)`` view; the row
            count must stay the same across batches of a key).

    Amax tensors stay on the input's device (no host sync while observing).
    ``torch.maximum`` propagates NaN, so a NaN seen in calibration shows up
    as a NaN amax instead of being silently skipped.
    """

    def __init__(self, granularity: str = "tensor") -> None:
        """Create an empty observer with the given granularity."""
        if granularity not in ("tensor", "row"):
            raise ValueError(f"granularity must be 'tensor' or 'row', got {granularity!r}")
        self.granularity = granularity
        self._amax: dict[Hashable, torch.Tensor] = {}

    def observe(self, key: Hashable, x: torch.Tensor) -> None:
        """Fold ``max |x|`` of one batch into the running amax of ``key``."""
        a = x.detach().to(torch.float32).abs()
        if self.granularity == "tensor":
            cur = a.amax() if a.numel() else torch.zeros((), device=a.device)
        else:
            cur = a.reshape(-1, a.shape[-1] if a.dim() else 1).amax(dim=1)
        prev = self._amax.get(key)
        if prev is not None:
            if prev.shape != cur.shape:
                raise ValueError(f"key {key!r}: amax shape changed {tuple(prev.shape)} -> "
                                 f"{tuple(cur.shape)}")
            cur = torch.maximum(prev, cur.to(prev.device))
        self._amax[key] = cur

    def amax(self, key: Hashable) -> torch.Tensor:
        """Running amax of ``key`` (0-d tensor, or (rows,) for ``row``)."""
        return self._amax[key]

    def keys(self) -> list[Hashable]:
        """All observed keys, in first-seen order."""
        return list(self._amax)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` has been observed."""
        return key in self._amax

    def __len__(self) -> int:
        """Number of observed keys."""
        return len(self._amax)

    def reset(self) -> None:
        """Forget every observation."""
        self._amax.clear()

    def layer_amax(self, site: Hashable) -> dict[int, AmaxLike]:
        """``{layer: amax}`` for keys of the form ``(site, layer)``.

        Per-tensor amax values are returned as Python floats, per-row ones as
        CPU tensors, ready for :func:`stage_scales`.
        """
        out: dict[int, AmaxLike] = {}
        for key, v in self._amax.items():
            if isinstance(key, tuple) and len(key) == 2 and key[0] == site:
                out[int(key[1])] = float(v.item()) if v.dim() == 0 else v.detach().cpu()
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form: ``{"granularity", "entries": [{"key", "amax"}]}``.

        Tuple keys become lists; amax values floats or lists of floats.
        """
        entries = []
        for key, v in self._amax.items():
            k = list(key) if isinstance(key, tuple) else key
            entries.append({"key": k, "amax": v.item() if v.dim() == 0 else v.cpu().tolist()})
        return {"granularity": self.granularity, "entries": entries}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AmaxObserver":
        """Inverse of :meth:`to_dict` (list keys become tuples)."""
        obs = cls(d.get("granularity", "tensor"))
        for e in d["entries"]:
            k = tuple(e["key"]) if isinstance(e["key"], list) else e["key"]
            obs._amax[k] = torch.tensor(e["amax"], dtype=torch.float32)
        return obs


def stage_boundaries(n_layers: int, n_stages: int) -> list[int]:
    """Start layer of each of ``n_stages`` contiguous, near-equal stages.

    ``stage_boundaries(10, 3) == [0, 3, 6]`` (stages 0-2, 3-5, 6-9).
    """
    if n_layers <= 0 or n_stages <= 0 or n_stages > n_layers:
        raise ValueError(f"need 0 < n_stages <= n_layers, got n_stages={n_stages}, "
                         f"n_layers={n_layers}")
    return [(i * n_layers) // n_stages for i in range(n_stages)]


def _validate_boundaries(b: Sequence[int], n_layers: int) -> list[int]:
    """Check stage start indices: start at 0, strictly increasing, < n_layers."""
    b = [int(v) for v in b]
    if not b or b[0] != 0 or any(y <= x for x, y in zip(b, b[1:])) or b[-1] >= n_layers:
        raise ValueError(f"stage boundaries must be strictly increasing start layers beginning "
                         f"at 0 and < n_layers={n_layers}, got {b}")
    return b


def _elem_format(fmt: Union[str, ElementFormat]) -> ElementFormat:
    """Accept an element-format name or a scaled spec string (``"e4m3:tensor"``)."""
    if isinstance(fmt, ElementFormat):
        return fmt
    if ":" in fmt:
        ef = parse_spec(fmt).element_format
        if ef is None:
            raise ValueError(f"{fmt!r} has no element format")
        return ef
    return get_format(fmt)


def stage_scales(amax: Mapping[int, AmaxLike], n_layers: int, n_stages: Optional[int] = None,
                 *, boundaries: Optional[Sequence[int]] = None,
                 fmt: Union[str, ElementFormat] = "e4m3",
                 margin: float = 1.0) -> dict[int, AmaxLike]:
    """One shared static scale per stage of consecutive layers.

    Args:
        amax: ``{layer: amax}`` (floats or same-shaped tensors); layers may
            be missing as long as every stage has at least one.
        n_layers: number of layers; every layer ``0..n_layers-1`` gets a scale.
        n_stages: number of near-equal stages (see :func:`stage_boundaries`),
            or
        boundaries: explicit stage start layers (``[0, 8, 20]``).
        fmt: element format (``"e4m3"``) or a scaled spec string.
        margin: multiplier on the stage amax (> 1 leaves headroom).

    Returns:
        ``{layer: scale}`` with ``scale = max(amax over the stage) * margin /
        max_normal`` computed in float32 (``1.0`` when the stage amax is 0,
        like dynamic scales).  Floats for scalar amax, tensors for tensors.
    """
    if (n_stages is None) == (boundaries is None):
        raise ValueError("pass exactly one of n_stages or boundaries")
    b = stage_boundaries(n_layers, n_stages) if boundaries is None else \
        _validate_boundaries(boundaries, n_layers)
    ef = _elem_format(fmt)
    if not (margin > 0 and math.isfinite(margin)):
        raise ValueError(f"margin must be positive and finite, got {margin}")
    bad = [k for k in amax if not 0 <= int(k) < n_layers]
    if bad:
        raise ValueError(f"amax has layers outside 0..{n_layers - 1}: {bad}")
    ends = b[1:] + [n_layers]
    out: dict[int, AmaxLike] = {}
    for start, end in zip(b, ends):
        vals = [torch.as_tensor(amax[i], dtype=torch.float32).cpu()
                for i in range(start, end) if i in amax]
        if not vals:
            raise ValueError(f"stage of layers {start}..{end - 1} has no amax observation")
        stage_amax = torch.stack(torch.broadcast_tensors(*vals)).amax(dim=0)
        s = float_scale_from_amax(stage_amax * torch.tensor(margin, dtype=torch.float32),
                                  ef.max_normal)
        val: AmaxLike = float(s.item()) if s.dim() == 0 else s
        for i in range(start, end):
            out[i] = val
    return out


def scales_to_jsonable(scales: Mapping[int, AmaxLike]) -> dict[str, Any]:
    """``{layer: scale}`` -> ``{"layer": float | list}`` (JSON/YAML-safe)."""
    return {str(k): (float(v) if not isinstance(v, torch.Tensor) or v.dim() == 0
                     else v.cpu().tolist())
            for k, v in scales.items()}


def scales_from_jsonable(d: Mapping[Any, Any]) -> dict[int, AmaxLike]:
    """Inverse of :func:`scales_to_jsonable` (lists become float32 tensors)."""
    out: dict[int, AmaxLike] = {}
    for k, v in d.items():
        out[int(k)] = torch.tensor(v, dtype=torch.float32) if isinstance(v, (list, tuple)) \
            else float(v)
    return dict(sorted(out.items()))

