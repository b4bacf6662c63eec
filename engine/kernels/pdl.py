"""Programmatic dependent launch (PDL) for the decode step's kernels (sm_90 and newer).

A decode step is a few hundred small dependent launches replayed from a CUDA graph. Between two of
them the GPU idles while the next grid launches and ramps up
(docs/design/performance.md#a-single-decode-call-has-a-fixed-cost), and the latency-bound kernels between the
GEMMs (norms, RoPE, cache write, attention: a few programs each) leave the HBM idle for microseconds at a time.

With PDL a kernel is launched with the attribute `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_
SERIALIZATION` (Triton's `launch_pdl=True`). Its programs may start once every program of the
previous kernel has executed `griddepcontrol.launch_dependents`, and `griddepcontrol.wait` blocks
until that kernel has completed with its writes visible. CUDA graphs keep such an edge when they
capture the launch.

The contract every kernel launched with PDL keeps, so that stream order is as strong as without it:

* every program executes `pdl_enter` before any access to memory that another kernel writes or
  reads (its `griddepcontrol.wait` comes first, then `launch_dependents`). A kernel therefore never
  completes before its predecessor has, and the guarantee chains through any run of PDL kernels;
* before `pdl_enter` a program may only read data no kernel of the step writes (weights): the decode
  GEMV prefetches its first weight bytes into L2 there (`l2_prefetch`), overlapping the tail of the
  previous, latency-bound kernel.

Kernels take a `PDL: tl.constexpr = False` argument, so the CPU interpreter, the emulation and every
caller that does not ask get unchanged code. `launch_opts(t)` returns the keyword arguments for a
launch on t's device. PDL changes when programs run, never what they compute: bits are identical.

Switch: `KernelOptions.pdl` (`engine.kernels.options`), a backend option each wrapper passes to `launch_opts`;
an A/B measurement (`benchmarks/bench_e2e.py --pdl`) builds a backend with it off. A result records the setting
(`Engine.kernel_settings`, the result's `provenance.kernels`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    """Programmatic dependent launch needs compute capability 9.0 or newer."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_opts(t: torch.Tensor, on: bool = True) -> dict:
    """Launch keyword arguments for a PDL-aware kernel working on t's device: the kernel's `PDL` constexpr,
    plus Triton's `launch_pdl` option when it is on (`on`: the backend's `KernelOptions.pdl`; CUDA, sm_90+)."""
    if on and t.is_cuda and _supported(t.device.index if t.device.index is not None else
                                             torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait until the previous kernel has completed (its writes visible), then let the next kernel's programs
    start launching. A no-op unless PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def l2_prefetch(addr, NBYTES: tl.constexpr):
    """One bulk L2 prefetch of NBYTES (a multiple of 16) at addr (a 16-byte aligned scalar pointer), issued by
    thread 0 of the program only (a hint: no registers are written, nothing waits for it)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr.to(tl.int64, bitcast=True), tl.full((), NBYTES, tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)
