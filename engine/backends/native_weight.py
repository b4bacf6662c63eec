"""`NativeWeight`: a weight as the `cuda-native` backend holds it (codes + scales in its format, or a float weight
in its dtype), and the fp32 values its fallbacks read."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from engine.formats import QTensor

__all__ = ["NativeWeight", "dense_experts", "dense_values"]


@dataclasses.dataclass
class NativeWeight:
    """A weight prepared once for the native kernels.

    `q` is the recipe-format QTensor (None for a plain float weight, then held
    in `kernel` in its dtype); `kernel` holds whatever the GEMM wrapper wants
    (e.g. repacked MX data); `dense` is a lazily built fp32 dequantized copy
    used only by fallbacks.
    """

    spec: str
    shape: torch.Size
    q: Optional[QTensor] = None
    dense: Optional[torch.Tensor] = None
    kernel: Optional[object] = None

    def dequantize(self) -> torch.Tensor:
        """fp32 (N, K) values of the weight (built on first use and kept: fallbacks only)."""
        if self.dense is None:
            self.dense = self.q.dequantize() if self.q is not None else self.kernel.float()
        return self.dense

    def storage_bytes(self) -> int:
        """Bytes the weight occupies in its kernel format (data + scales; no fallback copy)."""
        if self.q is None:
            return self.kernel.numel() * self.kernel.element_size()
        n = self.q.data.numel() * self.q.data.element_size()
        return n + (0 if self.q.scale is None else self.q.scale.numel() * self.q.scale.element_size())

    @property
    def device(self) -> torch.device:
        """Device of the stored weight."""
        return (self.q.data if self.q is not None else self.kernel).device


def dense_values(w: torch.Tensor | NativeWeight) -> torch.Tensor:
    """The fp32 values of a prepared weight, native or not."""
    return w.dequantize() if isinstance(w, NativeWeight) else w


def dense_experts(experts: Sequence[tuple | None]) -> list[tuple | None]:
    """(gate, up, down) of each expert as fp32 values (None for an expert held by another rank)."""
    return [None if ex is None else tuple(dense_values(t) for t in ex) for ex in experts]
