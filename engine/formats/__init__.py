"""Bit-exact number-format library (pure torch; identical on CPU and CUDA).

Every quantization site of the engine goes through this package::

    from engine.formats import parse_spec, quantize, fake_quantize

    spec = parse_spec("e4m3:1x128")          # QuantSpec; str(spec) is canonical
    qt = quantize(x, spec)                    # QTensor(data, scale, spec, shape, ...)
    y = qt.dequantize()                       # float32, x.shape
    qt.stats()                                # saturation/underflow/subnormal/scales

Modules: :mod:`.table` (formats), :mod:`.elements` (element rounding and
codes), :mod:`.spec` (spec strings), :mod:`.grouping` (scale groups),
:mod:`.qtensor` (quantize/QTensor), :mod:`.calibration` (static and
stage-wise scales), :mod:`.accumulate` (tensor-core accumulation emulation).
"""

from .accumulate import AccumSpec, matmul_accum, parse_accumulate
from .calibration import (AmaxObserver, scales_from_jsonable, scales_to_jsonable,
                          stage_boundaries, stage_scales)
from .elements import (ROUNDING_MODES, codes_to_torch, decode_codes, encode_codes,
                       round_to_format, round_with_overflow, torch_to_codes, values_to_codes)
from .qtensor import (NVFP4_TENSOR_DENOM, QTensor, fake_quantize, float_scale_from_amax,
                      mx_scale_from_amax, quantize)
from .spec import VALID_FORMS, QuantSpec, parse_spec
from .table import FORMATS, HIGH_PRECISION_DTYPES, ElementFormat, get_format

__all__ = [
    "AccumSpec", "AmaxObserver", "ElementFormat", "FORMATS", "HIGH_PRECISION_DTYPES",
    "NVFP4_TENSOR_DENOM", "QTensor", "QuantSpec", "ROUNDING_MODES", "VALID_FORMS",
    "codes_to_torch", "decode_codes", "encode_codes", "fake_quantize", "float_scale_from_amax",
    "get_format", "matmul_accum", "mx_scale_from_amax", "parse_accumulate", "parse_spec",
    "quantize", "round_to_format", "round_with_overflow", "scales_from_jsonable",
    "scales_to_jsonable", "stage_boundaries", "stage_scales", "torch_to_codes",
    "values_to_codes",
]
