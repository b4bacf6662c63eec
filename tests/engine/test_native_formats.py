"""The cuda-native backend's one capability table (`engine.backends.native.NATIVE_FORMATS`) against the kernels' own
lists of what they take: a format added to a kernel without the table (or the reverse) fails here."""

from __future__ import annotations

import pytest
import torch

from engine.formats import parse_spec
from engine.backends.native import NATIVE_FORMATS


def test_table_names_the_formats_the_kernels_take():
    pytest.importorskip("triton")
    from engine.kernels import attention, quant

    assert NATIVE_FORMATS.quant == quant.QUANT_FORMATS
    assert NATIVE_FORMATS.paged_out_quant in attention.OUT_QUANT_SPECS
    assert NATIVE_FORMATS.moe[1] in NATIVE_FORMATS.quant and NATIVE_FORMATS.moe[0] in NATIVE_FORMATS.gemm
    with pytest.raises(ValueError, match="quant kernels write one of"):
        quant.act_quant(torch.zeros(1, 128), fmt="mxfp4")


def test_table_is_consistent_and_frozen():
    for w, xs in NATIVE_FORMATS.gemm.items():  # every entry a valid spec
        parse_spec(w)
        for x in xs:
            parse_spec(x)
    assert set(NATIVE_FORMATS.float_weights) <= set(NATIVE_FORMATS.float_input_gemm)
    assert set(NATIVE_FORMATS.half) <= set(NATIVE_FORMATS.float_weights)
    assert torch.float32 not in NATIVE_FORMATS.paged_pages  # the kernels' P.V products are half precision
    with pytest.raises(TypeError):
        NATIVE_FORMATS.gemm["e5m2:tensor"] = ("e5m2:tensor",)
