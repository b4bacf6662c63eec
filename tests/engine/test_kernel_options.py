"""Kernel variants are backend options (`engine.kernels.options.KernelOptions`), not module switches: frozen,
validated, handed to the backend by `Engine(..., options=...)` and reported by `Engine.kernel_settings()` for a
result's provenance. No kernel module holds a switch that changes which variant runs."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from engine.api import Engine, make_numerics
from engine.kernels.options import DEFAULT_OPTIONS, KernelOptions
from engine.loading import load_model
from engine.model import Transformer
from evalharness.data import builtin_path


def test_options_are_frozen_validated_and_summarized():
    assert DEFAULT_OPTIONS.summary() == {"pdl": True, "fast_division": True, "mx_row_scales": True,
                                         "mx_fp4_ptx": True}
    off = KernelOptions(pdl=False, fast_division=False)
    assert off.summary()["pdl"] is False and off.summary()["mx_fp4_ptx"] is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        off.pdl = True
    with pytest.raises(TypeError, match="KernelOptions.pdl must be True or False"):
        KernelOptions(pdl="off")


def test_emulated_engine_reports_its_backend_only():
    loaded = load_model(str(builtin_path("tiny-llama")))
    eng = Engine(Transformer(loaded.cfg, loaded.weights), "fp8-block", backend="cpu-emulated",
                 options=KernelOptions(pdl=False))  # accepted; the emulation runs no kernel
    assert eng.kernel_settings() == {"backend": "cpu-emulated"}
    with pytest.raises(ValueError, match="unknown kernel options"):
        make_numerics(eng.recipe, "cpu-emulated", pdl=False)


def test_no_kernel_module_keeps_a_variant_switch():
    pytest.importorskip("triton")
    gone = {"engine.kernels.pdl": ("set_enabled", "enabled", "_ENABLED"), "engine.kernels.quant": ("FAST_DIVISION",),
            "engine.kernels.gemm_mx": ("MX_ROW_SCALES", "MX_FP4_PTX")}
    for mod, names in gone.items():
        m = importlib.import_module(mod)
        assert not [n for n in names if hasattr(m, n)], mod
    from engine.kernels import pdl

    assert pdl.launch_opts(torch.zeros(1), DEFAULT_OPTIONS.pdl) == {"PDL": False}  # CPU: never PDL
