"""Kernel options: the switches between kernel variants that compute the same bits, as one frozen value.

A backend holds one `KernelOptions` and hands it to every kernel wrapper it calls; a result records it
(`Engine.kernel_settings`, the result's `provenance.kernels`). Importable without Triton. No module global or
environment variable changes these: an A/B measurement builds a second backend with other options.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Which variant each kernel runs; every field changes when programs run or how a value is computed, never
    the bits (each variant is tested bit-identical against the other)."""

    pdl: bool = True  # programmatic dependent launch on sm_90+ (`engine.kernels.pdl`)
    fast_division: bool = True  # E4M3 quantizers divide by Markstein's reciprocal refinement on CUDA (`quant.py`)
    mx_row_scales: bool = True  # MX GEMM: a row's block scales loaded as one tile per 64 columns (`gemm_mx.py`)
    mx_fp4_ptx: bool = True  # MX GEMM: E2M1 decoded by PRMT table lookups in inline PTX (needs mx_row_scales)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"KernelOptions.{f.name} must be True or False, got {getattr(self, f.name)!r}")

    def summary(self) -> dict[str, bool]:
        """JSON-ready, for provenance."""
        return dataclasses.asdict(self)


DEFAULT_OPTIONS = KernelOptions()
