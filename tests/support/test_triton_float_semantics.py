"""The float semantics the kernels rely on, as Triton implements them: fp32 -> bf16 / E4M3 / E5M2 casts, their
widening back to fp32, and `tl.dot` on bf16 and FP8 tiles, against torch on adversarial values.

On the GPU this pins what sm_90 does (cvt.rn.bf16.f32: nearest even, overflow to inf; cvt.rn.satfinite.{e4m3,
e5m2}x2.f32: nearest even, finite values and infinities past the format's range saturate to its largest finite
value, NaN of either sign becomes 0x7F). Under TRITON_INTERPRET=1 the same tests check that the interpreter patched by
tests/support/interpret.py (`faithful_floats`) does the same, which is what lets the other GPU tests marked
`interpreter` compare kernel bits with the formats library on the CPU. Unpatched, the Triton 3.6 interpreter fails
8 of these 9 tests (all but the E5M2 dot): it truncates to bf16, widens bf16 subnormals wrongly, does not saturate
when it rounds to FP8 (inf and NaN come out where the GPU gives the largest finite value), reads E4M3's NaN code as
480, and multiplies bf16 tiles as 16-bit integers.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.interpret import GPU_TEST_DEVICE

# skipped without CUDA; under TRITON_INTERPRET=1 they run on the CPU (tests/conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]
DEV = GPU_TEST_DEVICE  # "cpu" under TRITON_INTERPRET=1

FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@pytest.fixture(scope="module")
def kernels():
    """(cast kernel, dot kernel), defined once Triton imports."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=ok).to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))

    return cast, dot


def _cast(kernels, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = x.to(DEV).contiguous()
    y = torch.empty(x.shape, dtype=dtype, device=DEV)
    kernels[0][(-(-x.numel() // 256),)](x, y, x.numel(), BLOCK=256)
    return y.cpu()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_values(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Same bits where ref is not NaN (signed zeros and infinities included); NaN exactly where ref is NaN (its sign
    and payload are the hardware's)."""
    nan = torch.isnan(ref.float())
    assert torch.equal(torch.isnan(out.float()), nan), f"{what}: NaN positions differ"
    bad = (_bits(out) != _bits(ref)) & ~nan
    where = bad.nonzero()[:5].flatten().tolist()
    assert not bad.any(), f"{what}: {int(bad.sum())} values differ, e.g. inputs at {where}"


def _adversarial_fp32() -> torch.Tensor:
    """fp32 values where the roundings differ: ties to even, carries into the exponent, the formats' edges, fp32 and
    target subnormals, signed zeros, infinities, NaN of both signs, and every 2**-13 step of [1, 2) plus random
    values over 2**-30 .. 2**20."""
    special = [0.0, -0.0, 1.0, -1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -20, 2.0 - 2 ** -9,
               2.0 - 2 ** -24, 1.0625, 1.1875, 3.25, 3.75, 240.0, 208.0, 17.0, 0.0234375, 0.0029296875,
               448.0, 449.0, 464.0, 464.0001, 480.0, 500.0, 1e6, 57344.0, 61439.0, 61440.0, 65536.0, 1e30,
               3.3e38, 3.4028235e38, 2 ** -6, 2 ** -7, 2 ** -9, 2 ** -10, 3 * 2 ** -11, 2 ** -14, 2 ** -16, 2 ** -17,
               3 * 2 ** -18, 2 ** -126, 2 ** -127, 2 ** -133, 2 ** -149, 1e-45,
               float("inf"), -float("inf"), float("nan"), -float("nan")]
    x = torch.tensor(special, dtype=torch.float32)
    grid = 1.0 + torch.arange(2 ** 13, dtype=torch.float32) * 2 ** -13
    g = torch.Generator().manual_seed(0)
    rnd = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-30, 21, (4000,), generator=g).float())
    body = torch.cat([x, grid, rnd])
    return torch.cat([body, -body])


def test_fp32_to_bf16_rounds_to_nearest_even(kernels):
    x = _adversarial_fp32()
    _assert_same_values(_cast(kernels, x, torch.bfloat16), x.to(torch.bfloat16), "fp32 -> bf16")


@pytest.mark.parametrize("dtype", list(FP8), ids=lambda d: str(d).split("_")[-1])
def test_fp32_to_fp8_rounds_to_nearest_even_and_saturates(kernels, dtype):
    x = _adversarial_fp32()
    top = FP8[dtype]
    ref = torch.where(torch.isnan(x), x, x.clamp(-top, top)).to(dtype)
    out = _cast(kernels, x, dtype)
    _assert_same_values(out, ref, f"fp32 -> {dtype}")
    big = x.abs() > top
    assert big.any() and (out[big].float().abs() == top).all()  # infinities included: no NaN, no inf
    assert (out[torch.isnan(x)].view(torch.uint8) == 0x7F).all()  # NaN of either sign: the one code 0x7F


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FP8], ids=lambda d: str(d).split("_")[-1].replace("torch.", ""))
def test_every_code_widens_exactly_to_fp32(kernels, dtype):
    width = torch.finfo(dtype).bits
    codes = torch.arange(2 ** width, dtype=torch.int32)
    x = (codes - 2 ** 16 * (codes >= 2 ** 15)).to(torch.int16) if width == 16 else codes.to(torch.uint8)
    x = x.view(dtype)
    _assert_same_values(_cast(kernels, x, torch.float32), x.float(), f"{dtype} -> fp32")


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FP8], ids=lambda d: str(d).split("_")[-1].replace("torch.", ""))
def test_dot_multiplies_values_not_bit_patterns(kernels, dtype):
    """Small integers times 1 / 2 / 4: every product and partial sum is an integer below 2**13, exact even in the FP8
    tensor core's reduced-precision accumulation, so any correct dot gives torch's fp64 result to the bit; one NaN
    operand poisons exactly its row."""
    g = torch.Generator().manual_seed(1)
    m, n, k = 16, 16, 32
    a = (torch.randint(-8, 9, (m, k), generator=g) * torch.exp2(torch.randint(0, 3, (m, 1), generator=g))).float()
    b = torch.randint(-8, 9, (k, n), generator=g).float()
    a[3, 5] = float("nan")
    ref = (a.double() @ b.double()).float()
    c = torch.empty((m, n), dtype=torch.float32, device=DEV)
    kernels[1][(1,)](a.to(dtype).to(DEV), b.to(dtype).to(DEV), c, M=m, N=n, K=k)
    _assert_same_values(c.cpu(), ref, f"dot {dtype}")
    assert torch.isnan(c[3]).all() and not torch.isnan(c[:3]).any()
