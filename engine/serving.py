"""How requests are served: the frozen serving configuration shared by the engine's runtime and the harness."""

from __future__ import annotations

import dataclasses
from typing import Optional

KV_BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """How requests are served (validated at construction).

    kv_block_size: tokens per KV page; max_batch: sequence slots (requests decoded together);
    max_tokens: longest sequence (prompt + generation); prefill_chunk: prompt tokens per prefill
    call (None: whole prompt); cuda_graphs: capture and replay the decode step (CUDA only);
    prefix_cache: a prompt that starts with whole pages another live sequence already holds reuses
    them (a hit) and prefills only the rest -- with FP8 KV the reused pages carry the scales of the
    call that wrote them, so a hit can differ from a miss (the invariance eval measures it);
    fp8_paged_max_tq: on the native backend, calls of more tokens than this on FP8 pages write through the
    formats library and attend emulated instead of on the paged kernels (None: no limit, the default; a bound
    to bisect a paged-kernel fault with); stop_check_every: decode steps between read-backs of the stop ids matched
    on the device (1: every step; more: fewer host synchronizations, a request past its stop id decoding on until
    the next read-back, its extra tokens cut off).
    """

    kv_block_size: int = 16
    max_batch: int = 8
    max_tokens: int = 1024
    prefill_chunk: Optional[int] = None
    cuda_graphs: bool = False
    prefix_cache: bool = False
    fp8_paged_max_tq: Optional[int] = None
    stop_check_every: int = 8

    def __post_init__(self) -> None:
        if self.kv_block_size not in KV_BLOCK_SIZES:
            raise ValueError(f"kv_block_size {self.kv_block_size}: use one of {KV_BLOCK_SIZES}")
        for key in ("max_batch", "max_tokens", "stop_check_every"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive integer or None, got {self.prefill_chunk!r}")
        if self.fp8_paged_max_tq is not None and (not isinstance(self.fp8_paged_max_tq, int)
                                                  or isinstance(self.fp8_paged_max_tq, bool)
                                                  or self.fp8_paged_max_tq < 1):
            raise ValueError(f"fp8_paged_max_tq must be a positive number of tokens or None (no limit), got "
                             f"{self.fp8_paged_max_tq!r}")
