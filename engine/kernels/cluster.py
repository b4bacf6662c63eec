"""Thread-block clusters for Triton kernels on sm_90: a split-K reduce through distributed shared memory.

Triton 3.6 exposes clusters only through `num_ctas` layouts, which split one program's tensors over several
CTAs. The split-K decode GEMM wants the opposite: S independent programs (the K splits of one output tile)
that exchange their fp32 partials on chip instead of through global memory and an arrival counter (about
2 us of dependent round trips per call, 2026-11-29). This module gives
a kernel compiled with `num_ctas=1`:

* `launch`: compiles (or finds) the kernel, then launches it with the cluster attribute of Triton's own
  launcher (`CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION` = (S, 1, 1), grid x multiplied by S) and `region` bytes
  of dynamic shared memory beyond what the kernel allocates itself. Program ids along axis 0 run over
  `grid[0] * S`; the S consecutive programs `p // S` share a cluster and `p % S` is the rank inside it;
* `arrive` / `wait`: the cluster barrier (`barrier.cluster.arrive` / `.wait`), split so that the first
  phase (every CTA has started, so its shared memory exists) costs nothing: arrive at the kernel's start,
  wait just before the first remote store;
* `store_remote`: each element stored into the reduce region of the CTA of a given rank (`mapa` +
  `st.shared::cluster`); `load_local`: elements read back from this CTA's own region.

The region is the last `region` bytes of the dynamic shared memory (`%dynamic_smem_size`), so the kernel
needs no argument for it and it never overlaps Triton's own buffers. Every helper is inline PTX executed
once per element (scalars: once per thread); none is pure, so the compiler keeps their order. Nothing here
runs on the CPU or under the interpreter: callers pick another path there (`supported`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import triton
import triton.language as tl


@triton.jit
def arrive(dep, RELEASE: tl.constexpr):
    """This thread arrives at the cluster barrier (release: its earlier shared-memory stores, remote ones
    included, are visible to the threads that wait after it). Returns a dummy to chain on."""
    if RELEASE:
        return tl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; mov.u32 $0, 0;", "=r,r", [dep],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed.aligned; mov.u32 $0, 0;", "=r,r", [dep],
                                         dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait(dep):
    """This thread waits until every thread of every CTA of the cluster has arrived (acquire)."""
    return tl.inline_asm_elementwise("barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;", "=r,r", [dep],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_remote(val, byte_off, rank, REGION: tl.constexpr):
    """Store each fp32 element of val at byte_off in the reduce region of the cluster CTA `rank` (tensors of
    one shape). Returns a dummy."""
    # address = end of the dynamic shared memory + (byte_off - REGION), in this CTA's window, then mapped to rank's
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .u32 d; mov.u32 a, global_smem; mov.u32 d, %dynamic_smem_size; add.u32 a, a, d; "
        "add.u32 a, a, $2; mapa.shared::cluster.u32 a, a, $3; st.shared::cluster.f32 [a], $1; mov.u32 $0, 0; }",
        "=r,f,r,r", [val, byte_off - REGION, rank], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_local(byte_off, REGION: tl.constexpr):
    """fp32 elements at byte_off in this CTA's reduce region."""
    return tl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .u32 d; mov.u32 a, global_smem; mov.u32 d, %dynamic_smem_size; add.u32 a, a, d; "
        "add.u32 a, a, $1; ld.shared.f32 $0, [a]; }",
        "=f,r", [byte_off - REGION], dtype=tl.float32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def supported(index: int) -> bool:
    """Thread-block clusters (and this module's PTX) need compute capability 9.0 or newer."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def _occupancy(function: int, shared: int, size: int) -> int:
    """How many clusters of `size` CTAs with `shared` bytes each the device holds at once (Triton's driver
    utility, which also raises the kernel's dynamic shared-memory limit to `shared`: needed above 48 KB)."""
    return int(triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(function, shared, size))


def _prepare(compiled: Any, size: int, region: int) -> None:
    """Make Triton's launcher start `compiled` in clusters of `size` with `region` extra shared bytes (its packed
    metadata is (num_warps, num_ctas, shared)); raises RuntimeError when no such cluster fits on the device."""
    want = (size, region)
    if getattr(compiled, "_engine_cluster", None) == want:
        return
    compiled._init_handles()
    shared = -(-int(compiled.metadata.shared) // 16) * 16 + region
    fits = _occupancy(compiled.function, shared, size)
    if fits < 1:
        raise RuntimeError(f"engine.kernels.cluster: a cluster of {size} CTAs of {compiled.name} with {shared} B of "
                           "shared memory each does not fit on this device")
    compiled.packed_metadata = (compiled.metadata.num_warps, size, shared)
    compiled._engine_cluster = want
    compiled._engine_max_clusters = fits


def launch(kernel: Callable, grid: tuple[int, ...], size: int, region: int, args: dict[str, Any],
           **options: Any) -> Any:
    """Launch the @triton.jit `kernel` on `grid` (in clusters: axis 0 becomes grid[0] * size programs) with
    `region` bytes of reduce region per CTA. `args`: every kernel argument by name (constexprs included);
    `options`: num_warps, num_stages, launch_pdl. Returns the compiled kernel (`_engine_max_clusters`: how
    many clusters the device holds at once)."""
    compiled = kernel.warmup(grid=grid, **args, **options)
    if hasattr(compiled, "result"):
        compiled = compiled.result()
    _prepare(compiled, size, region)
    compiled[tuple(grid) + (1,) * (3 - len(grid))](*(args[name] for name in kernel.arg_names))
    return compiled
