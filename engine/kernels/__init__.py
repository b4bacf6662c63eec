"""GPU kernels (Triton). Each file holds `@triton.jit` kernels plus thin wrappers that
assert shapes and allocate outputs; a pure-torch reference sits beside every wrapper.
The kernel modules need Triton and a CUDA GPU (or the CPU interpreter); this package's
own namespace and `paged_cache` import with torch alone (the CPU runtime uses them)."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, queried once per device; 4 elsewhere (the CPU
    interpreter: enough programs to exercise split-K and multi-program paths)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel_device_ok(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on t's device: CUDA, or CPU tensors under Triton's own interpreter switch
    (`TRITON_INTERPRET=1`, read by Triton at import; this is the engine's one read of it). It never changes what
    a kernel computes."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
