"""The `cuda-native` backend's pieces for tensor / expert parallelism (`engine.parallel`).

The parallel layout, the exchange and the reductions are `engine.parallel`'s, the same for every backend;
what the native kernels need on top of it:

* **Weight shards** (`slice_native_weight`): a prepared `NativeWeight` (codes + scales of the whole tensor,
  quantized once) is cut along the sharding plan's dimension as codes + scales, so the shard is the same format
  holding exactly those values, and its GEMM stays native. A slice that cuts a scale group (a 128x128 tile, an MX
  block) has no such form: `slice_qtensor` refuses it and the backend keeps that shard's emulated fp32 values
  (its GEMM then runs emulated, counted as ``linear:fallback:unaligned-shard``).
* **Row-parallel GEMMs** (o_proj, down_proj): the native GEMM is asked for its fp32 sum without the bias and
  without the output rounding; `Numerics.gemm_output` all-reduces it, adds the bias and rounds, as the emulation
  does (`NativeNumerics.linear`).
* **Expert parallelism**: the FP8 rows a rank receives (E4M3 codes + 1x128 scales, as quantized once before
  dispatch) feed the grouped FP8 GEMMs of its experts without re-quantization (`run_dispatched_native`), and
  the outputs that come back are weighted and summed per token by the MoE combine kernel, in the
  single-process order (`combine_dispatched_native`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from engine.backends.native_weight import NativeWeight, dense_experts
from engine.formats import QTensor
from engine.formats.grouping import group_shape

__all__ = ["NativeParallel", "combine_dispatched_native", "run_dispatched_native", "slice_native_weight",
           "slice_qtensor"]


def slice_qtensor(q: QTensor, dim: int, start: int, length: int) -> Optional[QTensor]:
    """Rows (dim 0) or columns (dim 1) start:start+length of a 2-D QTensor as codes + scales: a QTensor whose
    `dequantize()` is exactly that slice of `q.dequantize()` (the same element * scale products). None when the
    slice cuts a scale group (it starts inside a group and does not end in it): the shard would need a
    tiling of its own, which the codes were not quantized with."""
    if len(q.shape) != 2 or dim not in (0, 1):
        raise ValueError(f"slice_qtensor: a 2-D weight and dim 0 or 1, got shape {tuple(q.shape)}, dim {dim}")
    m, k = q.shape
    data = q.data.narrow(dim, start, length).contiguous()
    scale = q.scale
    spec = q.spec
    if scale is not None and not spec.is_passthrough and spec.granularity != "tensor":
        if spec.is_rowwise:  # one scale per row (lead, 1)
            scale = scale.narrow(0, start, length) if dim == 0 else scale
        else:
            r, c = group_shape(spec, m, k)
            edge = (r, c)[dim]
            first, last = start // edge, (start + length - 1) // edge
            if start % edge and first != last:
                return None
            if r == 1 and dim == 0:  # (m, ceil(k/C)): row-local scales
                scale = scale.narrow(0, start, length)
            else:  # (ceil(m/R), ceil(k/C)) grid, or the column groups of row-local scales
                scale = scale.narrow(dim, first, last - first + 1)
        scale = scale.contiguous()
    return QTensor(data=data, scale=scale, spec=spec, shape=data.shape, orig_dtype=q.orig_dtype,
                   tensor_scale=q.tensor_scale)


def slice_native_weight(w, dim: int, start: int, length: int, prepare_kernel: Callable[[QTensor], object]):
    """This rank's slice of a `NativeWeight` as a `NativeWeight` of the same format (codes + scales cut by
    `slice_qtensor`, a float weight cut in its dtype), its kernel form rebuilt by `prepare_kernel` (the MX
    repack) when the whole one had one; None when the slice cuts a scale group."""
    if w.q is None:  # float weight held in its dtype
        kernel = w.kernel.narrow(dim, start, length).contiguous()
        return NativeWeight(w.spec, kernel.shape, kernel=kernel)
    q = slice_qtensor(w.q, dim, start, length)
    if q is None:
        return None
    return NativeWeight(w.spec, q.shape, q=q, kernel=prepare_kernel(q) if w.kernel is not None else None)


def run_dispatched_native(data: torch.Tensor, scales: torch.Tensor, counts: Sequence[int], held: Sequence[int],
                          stacks: tuple, out_dtype: torch.dtype) -> torch.Tensor:
    """This rank's routed experts on the rows dispatched to it, through the grouped FP8 GEMMs.

    data (rows, d) float8_e4m3fn and scales (rows, ceil(d/128)) fp32: the received E4M3 1x128 rows as the sender
    quantized them, expert-contiguous, counts[e] rows for expert e (all experts; zero for those held
    elsewhere); held: the experts held here, ascending, whose (gate, up, down) `ExpertWeights` are `stacks`.
    Each row goes to its expert with weight 1 (k = 1): the combine adds 0 + 1 * y, so the result is the
    expert's output y (rows, d), rounded to out_dtype, in fp32."""
    from engine.kernels import moe as moe_k

    if any(c for e, c in enumerate(counts) if e not in held):
        raise ValueError("run_dispatched_native: rows were dispatched to an expert this rank does not hold")
    dev, rows = data.device, data.shape[0]
    if rows == 0:
        return torch.zeros(0, data.shape[1], device=dev)
    seg = torch.tensor([counts[e] for e in held], device=dev)
    local = torch.repeat_interleave(torch.arange(len(held), device=dev), seg)[:, None]  # (rows, 1) local expert
    ones = torch.ones(rows, 1, device=dev)
    return moe_k.grouped_fp8_moe(data, scales, *stacks, ones, local, mode="block", out_dtype=out_dtype)


def combine_dispatched_native(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                              num_experts: int) -> torch.Tensor:
    """The dispatching rank's combine: expert outputs y (copies, d) fp32 in the expert-sorted order of `ids`
    (tokens, k) (`engine.routing.dispatch_plan`'s, which `sort_by_expert` reproduces), times `weights`
    (tokens, k), summed per token in ascending sorted position -> (tokens, d) fp32: the MoE combine kernel,
    deterministic and in the single-process order (an index_add on the GPU adds in any order)."""
    from engine.kernels import moe as moe_k

    return moe_k.combine(y, moe_k.sort_by_expert(ids, num_experts), weights)


class NativeParallel:
    """`NativeNumerics`' hooks of `engine.parallel` (a mixin before `Numerics` in its bases): weight shards,
    the receiving rank's experts and the dispatching rank's combine. Uses `NativeNumerics`' `_count`, `_mx_k`,
    `_moe_fallback` and `_expert_stacks`."""

    def slice_prepared(self, w, dim: int, start: int, length: int):
        """A rank's slice of a `NativeWeight` as codes + scales (`slice_native_weight`); a slice that cuts a scale
        group keeps the emulated values of the shard (its GEMM runs emulated)."""
        if not isinstance(w, NativeWeight):
            return super().slice_prepared(w, dim, start, length)
        nw = slice_native_weight(w, dim, start, length, self._mx_k.prepare_weight)
        self._count("shard", "native" if nw is not None else "fallback:unaligned")
        return nw if nw is not None else w.dequantize().narrow(dim, start, length).contiguous()

    def run_dispatched(self, xq: QTensor, data: torch.Tensor, scales: torch.Tensor | None, counts: Sequence[int],
                       experts: Sequence[tuple | None], module: str) -> torch.Tensor:
        """The received FP8 rows (codes + scales, no re-quantization) through this rank's grouped FP8 GEMMs
        (`run_dispatched_native`); the emulation where `moe` falls back."""
        if self._moe_fallback(xq, experts, module) is not None or not data.is_cuda:
            return super().run_dispatched(xq, data, scales, counts, dense_experts(experts), module)
        stacks, out_dtype = self._expert_stacks(experts, module)
        held = [e for e, ex in enumerate(experts) if ex is not None]
        self._count("moe", "native")
        return run_dispatched_native(data, scales, counts, held, stacks, out_dtype)

    def combine_dispatched(self, y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, plan) -> torch.Tensor:
        """The MoE combine kernel on the GPU (deterministic, in the single-process order), else the emulation's."""
        if not y.is_cuda:
            return super().combine_dispatched(y, weights, ids, plan)
        return combine_dispatched_native(y, weights, ids, len(plan.counts))
