"""CPU vs CUDA bit-exactness of every spec (skipped without a CUDA GPU).

Run on a GPU machine with ``python3 -m pytest tests/engine/formats -m gpu -q``.
Bit-exact means identical bit patterns, except that any two NaNs compare
equal (NaN payload/sign bits legitimately differ between x86 and CUDA).
"""

from __future__ import annotations

import pytest
import torch

from engine.formats import encode_codes, matmul_accum, quantize, round_to_format

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPECS = ["fp32", "bf16", "fp16", "e4m3:tensor", "e5m2:tensor", "e4m3:channel", "e4m3:token",
         "e5m2:token", "e5m2:channel", "int8:channel", "int8:token", "int8:tensor",
         "e4m3:1x128", "e4m3:1x64", "e4m3:1x128:pow2", "e4m3:128x128", "e4m3:128x128:pow2",
         "e2m1:1x16", "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bits (on CPU)."""
    t = t.detach().cpu().contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equality where any NaN equals any NaN (float tensors only)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.is_floating_point() and a.element_size() >= 2:
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb), f"{what}: NaN positions differ"
        same = _bits(a) == _bits(b)
        assert torch.all(same | na), f"{what}: {int((~same & ~na).sum())} bit mismatches"
    else:
        assert torch.equal(_bits(a), _bits(b)), f"{what}: bit mismatch"


def _inputs() -> dict[str, torch.Tensor]:
    """Random and adversarial CPU inputs."""
    g = torch.Generator().manual_seed(0)
    out = {
        "normal": torch.randn(3, 172, generator=g),
        "wide": torch.randn(8, 256, generator=g) * torch.logspace(-30, 30, 256),
        "heavy": torch.randn(130, 300, generator=g) / torch.rand(130, 300, generator=g).clamp(1e-3),
        "zeros": torch.zeros(4, 64),
        "denormals": torch.randn(4, 96, generator=g) * 1e-39,
        "mixed_denormal": torch.cat([torch.randn(2, 40, generator=g),
                                     torch.randn(2, 40, generator=g) * 1e-40], dim=1),
        "at_e4m3_max": torch.tensor([[448.0, -448.0, 1.0, 0.5] * 8]),
        "at_e5m2_max": torch.tensor([[57344.0, -1.0, 2.0, 3.0] * 8]),
        "at_e2m1_max": torch.tensor([[6.0, -3.0, 0.25, 0.75] * 8]),
        "at_int8_max": torch.tensor([[127.0, -63.5, 0.5, 1.5] * 8]),
        "ties": (torch.arange(-64, 64).float() + 0.5).reshape(2, 64),
        "nan": torch.randn(3, 64, generator=g).index_fill_(1, torch.tensor([5]), float("nan")),
        "inf": torch.randn(3, 64, generator=g).index_fill_(1, torch.tensor([7]), float("inf")),
        "rank3": torch.randn(2, 3, 172, generator=g),
        "bf16": torch.randn(5, 200, generator=g).to(torch.bfloat16),
    }
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_quantize_cpu_vs_cuda_bit_exact(spec):
    """data, scales, tensor_scale, dequantized values and stats agree bit-for-bit."""
    for name, x in _inputs().items():
        qc = quantize(x, spec)
        qg = quantize(x.cuda(), spec)
        what = f"{spec}/{name}"
        assert_bit_equal(qc.data, qg.data, what + " data")
        if qc.scale is not None:
            assert_bit_equal(qc.scale, qg.scale, what + " scale")
        if qc.tensor_scale is not None:
            assert_bit_equal(qc.tensor_scale, qg.tensor_scale, what + " tensor_scale")
        assert_bit_equal(qc.dequantize(), qg.dequantize(), what + " dequantize")
        sc, sg = qc.stats(), qg.stats()
        for key in ("saturation_frac", "underflow_frac", "subnormal_frac", "nan_frac",
                    "scale_exp_hist"):
            assert sc[key] == sg[key], (what, key)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e8m0", "e2m1", "int8"])
def test_element_rounding_cpu_vs_cuda(name):
    """Element rounding/encoding on random float32 bit patterns agrees across devices."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1_000_000,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x, x * 2.0 ** -100, torch.randn(100_000, generator=g) * 100])
    for sat in (True, False):
        assert_bit_equal(round_to_format(x, name, saturate=sat),
                         round_to_format(x.cuda(), name, saturate=sat), f"{name} round sat={sat}")
        assert_bit_equal(encode_codes(x, name, saturate=sat),
                         encode_codes(x.cuda(), name, saturate=sat), f"{name} codes sat={sat}")


@pytest.mark.parametrize("acc", ["fp32", "tc14", "tc14:promote128", "tc10:inner32"])
def test_accumulation_cpu_vs_cuda(acc):
    """Accumulation emulation on FP8-valued inputs agrees across devices (fp32: allclose)."""
    g = torch.Generator().manual_seed(2)
    a = quantize(torch.randn(16, 1024, generator=g), "e4m3:1x128").dequantize()
    b = quantize(torch.randn(24, 1024, generator=g), "e4m3:128x128").dequantize()
    c, d = matmul_accum(a, b, acc), matmul_accum(a.cuda(), b.cuda(), acc)
    if acc == "fp32":  # cuBLAS vs CPU BLAS summation order differs: not a bit-exact mode
        rel = ((c - d.cpu()).norm() / c.norm()).item()
        assert rel < 1e-3, rel
    else:
        assert_bit_equal(c, d, acc)


def test_scale_divisions_are_correctly_rounded_on_cuda():
    """amax / max_normal on CUDA equals the correctly rounded quotient (CUDA turns
    tensor / python_scalar into a reciprocal multiply; the library must avoid that)."""
    from engine.formats import float_scale_from_amax

    g = torch.Generator().manual_seed(3)
    amax = torch.rand(100_000, generator=g) * 1000 + 1e-3
    want = (amax.double() / 448.0).float()
    got = float_scale_from_amax(amax.cuda(), 448.0).cpu()
    assert torch.equal(got, want)


def test_stochastic_rounding_on_cuda_is_unbiased():
    """Stochastic rounding with a CUDA generator works and is unbiased."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.full((200_000,), 1.03, device="cuda")
    r = round_to_format(x, "e4m3", rounding="stochastic", generator=g)
    assert set(r.unique().tolist()) <= {1.0, 1.125}
    assert abs(r.double().mean().item() - 1.03) < 5 * 0.0625 / 200_000 ** 0.5
