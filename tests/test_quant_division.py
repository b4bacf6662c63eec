"""The quant kernels' fast division (`engine.kernels.quant._div_by_scale`), checked on the CPU.

On the GPU the E4M3 quantizers divide each element by its group scale with Markstein's refinement
(q = x * r, r = RN(1/s); nr = fma(q, s, -x); q' = fma(nr, -r, q)) instead of the IEEE division, for
tiles whose group amaxes are finite and >= 2^-80. The kernels run only on CUDA (the interpreter's fma
rounds twice), so this file replays the same operations with an exactly rounded fma built from float64
(product exact, TwoSum error, round-to-odd, then one rounding to float32) and compares against torch's
IEEE division: bit-identical E4M3 codes everywhere in that domain, bit-identical fp32 quotients wherever
E4M3 does not flush them to zero. The GPU kernel tests (tests/test_kernels_gpu.py) check the kernels.
"""

from __future__ import annotations

import pytest
import torch

E4M3_MAX = 448.0
BOUND = 2.0 ** -80  # the kernels' smallest amax for the fast path


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Exactly rounded float32 fma(a, b, c) (round to nearest even), elementwise."""
    p = a.double() * b.double()  # exact: 24 + 24 significant bits
    cd = c.double()
    s = p + cd
    bb = s - p  # TwoSum: e is the exact rounding error of s = RN64(p + c)
    e = (p - (s - bb)) + (cd - bb)
    # round to odd in 53 bits (inexact and even last bit -> the neighbour towards the exact value), after which
    # one rounding to 24 bits is the correct rounding of p + c (53 >= 24 + 2)
    even = (s.view(torch.int64) & 1) == 0
    fix = (e != 0) & even & torch.isfinite(s)
    s = torch.where(fix, torch.nextafter(s, torch.where(e > 0, torch.inf, -torch.inf).double()), s)
    return s.float()


def div_by_scale(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The kernels' `_div_by_scale(x, s, RN(1/s))` with exact fmas."""
    r = torch.ones_like(s) / s
    q = x * r
    return fma32(fma32(q, s, -x), -r, q)


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float8_e4m3fn).view(torch.uint8)


def _groups(n: int, seed: int) -> torch.Tensor:
    """(n, 128) float32 groups with amax over 2^-80 .. 2^127 and the hard cases inside them: elements down to
    float32 subnormals, signed zeros, E4M3 midpoints, values near powers of two, the amax itself."""
    g = torch.Generator().manual_seed(seed)
    mant = 1.0 + torch.rand(n, 128, generator=g)
    spread = torch.randint(0, 180, (n, 128), generator=g)  # how far below the group amax each element sits
    spread[:, :64] = torch.randint(0, 12, (n, 64), generator=g)  # most within E4M3's range
    e_amax = torch.randint(-79, 127, (n, 1), generator=g)
    x = torch.ldexp(mant, (e_amax - spread).float()).float()
    x = torch.where(torch.rand(n, 128, generator=g) < 0.5, -x, x)
    x[:, 0] = torch.ldexp(torch.ones(n), e_amax[:, 0].float()) * 1.75  # the amax element
    x[: n // 4, 1:4] = torch.tensor([0.0, -0.0, -0.0])
    # E4M3 midpoints after the division: amax = 448 * s and element = midpoint * s exactly, for scales s with
    # 16-bit significands (1/s is inexact, so a product with RN(1/s) can land beside the midpoint)
    s_exact = torch.ldexp(1.0 + torch.randint(1, 2 ** 16, (n // 4,), generator=g) / 2.0 ** 16,
                          e_amax[: n // 4, 0].float() - 9)
    x[: n // 4, 0] = 448.0 * s_exact
    mids = torch.tensor([1.0625, 1.1875, 3.25, 3.75, 0.0234375, 240.0, 208.0, 17.0, 0.001953125 * 1.5])
    x[: n // 4, 4:13] = mids[None, :] * s_exact[:, None]
    return x


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=1, keepdim=True) / E4M3_MAX


def test_fma32_is_exactly_rounded():
    """The reference fma itself: exact on cases where a naive float32 multiply-add is not."""
    a = torch.tensor([1.0 + 2 ** -12, 3.0, -0.0, 1.0 + 2 ** -23], dtype=torch.float32)
    b = torch.tensor([1.0 + 2 ** -12, 1.0 / 3.0, 5.0, 1.0 - 2 ** -23], dtype=torch.float32)
    c = torch.tensor([-1.0, -1.0, 0.0, -1.0], dtype=torch.float32)
    got = fma32(a, b, c)
    exact = [2 ** -11 + 2 ** -24, float(torch.tensor(1.0 / 3.0).float().double() * 3 - 1), 0.0, -(2.0 ** -46)]
    assert got.tolist() == [float(torch.tensor(v).float()) for v in exact]
    assert (a * b + c)[0].item() != got[0].item()  # the double rounding the interpreter has
    assert torch.signbit(fma32(torch.tensor([-0.0]), torch.tensor([2.0]), torch.tensor([-0.0])))[0]


def test_fast_division_gives_the_ieee_e4m3_bits():
    """Across 4096 groups of wide dynamic range: the same E4M3 codes as x / s, and the same fp32 quotient
    wherever it is at least 2^-12 (below that E4M3 rounds both to a signed zero)."""
    x = _groups(4096, 0)
    s = _scale(x)
    assert (s >= BOUND / E4M3_MAX).all()
    ref = x / s
    got = div_by_scale(x, s)
    assert torch.equal(_e4m3(got), _e4m3(ref))
    big = ref.abs() >= 2.0 ** -12
    assert torch.equal(got[big].view(torch.int32), ref[big].view(torch.int32))
    zeros = x == 0
    assert torch.equal(torch.signbit(got[zeros]), torch.signbit(x[zeros]))  # -0 stays -0 (E4M3 0x80)


def test_the_refinement_step_is_what_makes_it_exact():
    """Negative control: the first product alone (x * RN(1/s)) misses the IEEE quotient on these inputs, and
    flips E4M3 codes, so the test above can fail."""
    x = _groups(4096, 1)
    s = _scale(x)
    ref = x / s
    naive = x * (torch.ones_like(s) / s)
    assert (naive.view(torch.int32) != ref.view(torch.int32)).sum().item() > 1000
    assert (_e4m3(naive) != _e4m3(ref)).any()


def _scale_by_constant(amax: torch.Tensor) -> torch.Tensor:
    """The kernels' group scale: `_div_by_scale(amax, 448, RCP_448)` with exact fmas."""
    from engine.kernels.quant import RCP_448

    r = torch.full_like(amax, RCP_448.value)
    s = torch.full_like(amax, E4M3_MAX)
    q = amax * r
    return fma32(fma32(q, s, -amax), -r, q)


def test_scale_constant_is_rn_of_one_over_448():
    from engine.kernels.quant import RCP_448

    r = torch.tensor([RCP_448.value], dtype=torch.float32)
    assert r.item() == RCP_448.value  # exactly representable: the kernel's constant has no rounding of its own
    assert torch.equal(r, torch.ones(1) / E4M3_MAX)  # IEEE RN(1 / 448)


def test_scale_division_by_the_constant_is_exact_over_the_fast_domain():
    """The group scale amax / 448 by refinement with RN(1/448) equals IEEE division for every float32 significand
    (the whole binade [1, 2): 2^23 values) and at every exponent of the fast domain (amax in [2^-80, 2^128),
    where the quotients and residuals are normal, so the binade's result scales exactly)."""
    one_binade = (torch.arange(2 ** 23, dtype=torch.int32) + (127 << 23)).view(torch.float32)
    for e in (0, -80, -79, -40, 1, 60, 126, 127):
        amax = torch.ldexp(one_binade, torch.tensor(float(e)))
        assert torch.equal(_scale_by_constant(amax).view(torch.int32), (amax / E4M3_MAX).view(torch.int32)), e
    g = torch.Generator().manual_seed(3)
    amax = torch.ldexp(1.0 + torch.rand(1 << 16, generator=g), torch.randint(-80, 128, (1 << 16,), generator=g).float())
    assert torch.equal(_scale_by_constant(amax).view(torch.int32), (amax / E4M3_MAX).view(torch.int32))


def test_scale_needs_the_refinement():
    """Negative control: amax * RN(1/448) alone misses the IEEE quotient for part of the binade."""
    from engine.kernels.quant import RCP_448

    amax = (torch.arange(2 ** 23, dtype=torch.int32) + (127 << 23)).view(torch.float32)
    naive = amax * RCP_448.value
    assert (naive.view(torch.int32) != (amax / E4M3_MAX).view(torch.int32)).sum().item() > 1000


@pytest.mark.parametrize("amax", [2.0 ** -140, 2.0 ** -147])
def test_tiny_amax_is_outside_the_fast_domain(amax):
    """Why the kernels fall back to IEEE division below 2^-80: for a subnormal amax, RN(1/s) overflows or
    loses precision and the refinement returns wrong codes."""
    x = torch.tensor([[amax, amax / 3, -amax / 7, amax / 2]], dtype=torch.float32)
    s = _scale(x)
    assert not torch.equal(_e4m3(div_by_scale(x, s)), _e4m3(x / s))


def test_fast_division_is_never_used_off_cuda(monkeypatch):
    """The kernels take the fast division only on NVIDIA CUDA (the interpreter's fma rounds twice; the fast path
    is inline PTX), and ENGINE_FAST_QDIV=0 (`FAST_DIVISION`) turns it off there too."""
    from engine.kernels import quant

    cpu = torch.zeros(1)
    assert quant.fast_division(cpu) is False
    monkeypatch.setattr(quant, "FAST_DIVISION", False)

    class FakeCuda:
        is_cuda = True

    assert quant.fast_division(FakeCuda()) is False
    monkeypatch.setattr(quant, "FAST_DIVISION", True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert quant.fast_division(FakeCuda()) is True
    monkeypatch.setattr(torch.version, "hip", "6.2")  # a ROCm build: the fast path's inline PTX cannot compile
    assert quant.fast_division(FakeCuda()) is False
