"""Triton quant kernels vs the formats library: bit-exact quantization (GPU only; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.interpret_util import GPU_TEST_DEVICE, INTERPRET

# skipped without CUDA; under TRITON_INTERPRET=1 the tests marked `interpreter` run on the CPU (tests/conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]  # every test also runs interpreted on the CPU
DEV = GPU_TEST_DEVICE  # "cpu" under TRITON_INTERPRET=1


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of an FP8 tensor."""
    return t.view(torch.uint8)


def _library_scales(s: torch.Tensor, rs: torch.Tensor) -> bool:
    """Kernel scales s have the library's bits rs. On the GPU strictly, NaN payloads included (the library runs on
    the same GPU, whose fp32 arithmetic returns its one canonical NaN). Under the interpreter a NaN
    scale need only be NaN: numpy keeps an input NaN's payload (torch's bf16 NaN is 0xFFFF), the CPU library's
    torch ops do not."""
    same = s.view(torch.int32) == rs.view(torch.int32)
    return bool((same | (torch.isnan(s) & torch.isnan(rs)) if INTERPRET else same).all())


def _inputs(rows: int, k: int, kind: str) -> torch.Tensor:
    """Random and adversarial inputs (zeros, signed zeros, denormals, exact E4M3 max, NaN, inf, huge, ties)."""
    g = torch.Generator(device=DEV).manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, device=DEV, generator=g)
    if kind == "heavy":
        x = x / torch.rand(rows, k, device=DEV, generator=g).clamp_min(1e-3)
    elif kind == "zeros":
        x[:, : k // 2] = 0.0
        x[0] = 0.0
    elif kind == "denormal":
        x = x * 1e-39
    elif kind == "at_max":
        x[:, 0] = 448.0  # group amax exactly at the format max: scale 1
        x[:, 1] = -448.0
    elif kind == "nan":
        x[1, 5] = float("nan")
    elif kind == "signed_zero":  # -0 keeps its sign through the division (E4M3 0x80); an all -0 group
        x[:, ::3] = -0.0
        x[0] = -0.0
    elif kind == "inf":  # an infinite amax: scale inf, finite elements 0, the infinite ones NaN
        x[1 % rows, 3] = float("inf")
        x[0, min(130, k - 1)] = float("-inf")
    elif kind == "signed_zero_fast":  # -0 and +0 inside groups with a normal amax: the fast division's tiles
        x[:, 1::3] = -0.0
        x[:, 2::5] = 0.0
    elif kind == "wide":  # group amaxes ~2^-77 .. 2^120 (fast division), elements down to float32 subnormals
        x = torch.ldexp(x, torch.randint(-75, 118, (rows, 1), device=DEV, generator=g).float())
        x[:, 1::7] *= 2.0 ** -100
        x[:, 3::11] *= 2.0 ** -60
    elif kind == "tiny_group":  # one group per row 2^-100 below the rest: after a norm still under 2^-80 (IEEE path)
        x[:, 128:256] *= 2.0 ** -100
    elif kind == "tiny_amax":  # group amaxes below the fast division's 2^-80: the IEEE path
        x = x * 2.0 ** -84
    elif kind == "ties_scaled":  # E4M3 midpoints after dividing by scales whose reciprocals are inexact
        sc = torch.ldexp(1.0 + torch.randint(1, 2 ** 16, (rows, 1), device=DEV, generator=g) / 2.0 ** 16,
                         torch.randint(-20, 20, (rows, 1), device=DEV, generator=g).float())
        x = x * sc
        x[:, 0] = 448.0 * sc[:, 0]
        mids = torch.tensor([1.0625, 1.1875, 3.25, 3.75, 0.0234375, 240.0, 208.0, 17.0, 0.0029296875], device=DEV)
        x[:, 2:11] = mids * sc
    elif kind == "ties":
        # values on E4M3 midpoints after scaling by 1: 1 + 1/16 is halfway between 1 and 1.125
        x[:, 0] = 448.0
        x[:, 2:10] = torch.tensor([1.0625, 1.1875, 3.25, 3.75, 0.015625 * 1.5, 240.0, 208.0, 17.0], device=DEV)
    return x


KINDS = ["normal", "heavy", "zeros", "signed_zero", "signed_zero_fast", "wide", "tiny_amax", "denormal", "at_max", "nan",
         "inf", "ties", "ties_scaled"]
SHAPES = [(4, 128), (3, 1000), (5, 7168), (2, 172)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_act_quant_bit_exact(kind, shape):
    """Plain 1x128 quantization: every FP8 byte and every fp32 scale equals the library's."""
    from engine.kernels.quant import act_quant, act_quant_reference

    x = _inputs(*shape, kind)
    for dtype in (torch.float32, torch.bfloat16):
        xi = x.to(dtype).contiguous()
        d, s = act_quant(xi)
        rd, rs = act_quant_reference(xi)
        assert torch.equal(_bits(d), _bits(rd.to(d.device))), f"data bits differ ({kind}, {shape}, {dtype})"
        assert _library_scales(s, rs), f"scale bits differ ({kind}, {shape}, {dtype})"


@pytest.mark.parametrize("single_pass", [True, False, None])
@pytest.mark.parametrize("kind", ["normal", "heavy", "zeros", "at_max", "signed_zero_fast", "tiny_group", "nan"])
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_quant(kind, shape, single_pass):
    """Fused RMSNorm+quant: the quantization of the kernel's own normed values is bit-exact;
    the normed values are within a few ulp of torch's fp32 RMSNorm."""
    from engine.kernels.quant import act_quant_reference, rmsnorm_quant, rmsnorm_quant_reference

    x = _inputs(*shape, kind).to(torch.bfloat16).contiguous()
    w = (0.5 + torch.rand(shape[1], device=DEV)).contiguous()
    d, s, h = rmsnorm_quant(x, w, 1e-5, return_hp=True, single_pass=single_pass)
    rd, rs = act_quant_reference(h)
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    _, _, href = rmsnorm_quant_reference(x, w, 1e-5)
    rel = ((h - href).abs() / href.abs().clamp_min(1e-30))[(href != 0) & torch.isfinite(href)]
    assert rel.max().item() < 4e-6, rel.max().item()
    fd, _, _ = rmsnorm_quant_reference(x, w, 1e-5)
    same = (_bits(d) == _bits(fd)).float().mean().item()
    assert same > 0.999, same  # end to end vs torch: only last-ulp norm differences can flip a rounding


@pytest.mark.parametrize("round_bf16", [True, False])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 1000), (5, 7168), (64, 4096)])
def test_add_rmsnorm_quant(shape, round_bf16):
    """Residual add + RMSNorm + quant in one pass: the residual is bit-exact with torch's fp32 add (+ bf16 RNE,
    including the overflow to inf and NaN), the norm and its quantization are exactly `rmsnorm_quant` of that
    residual (same tiling)."""
    from engine.kernels.quant import add_rmsnorm_quant, add_rmsnorm_quant_reference, rmsnorm_quant

    x = _inputs(*shape, "heavy")
    o = _inputs(*shape, "normal") * 3
    x[-1, :3] = torch.tensor([3.3e38, -3.39e38, 1.0 + 2 ** -8], device=DEV)  # bf16 overflow, a tie
    o[-1, :3] = torch.tensor([9e36, -1e36, 0.0], device=DEV)
    w = (0.5 + torch.rand(shape[1], device=DEV)).contiguous()
    r, d, s, h = add_rmsnorm_quant(x, o, w, 1e-5, round_bf16=round_bf16)
    rr, _, _, _ = add_rmsnorm_quant_reference(x, o, w, 1e-5, round_bf16=round_bf16)
    assert torch.equal(r.view(torch.int32), rr.view(torch.int32))
    d2, s2, h2 = rmsnorm_quant(r, w, 1e-5, return_hp=True)
    assert torch.equal(h2.view(torch.int32), h.view(torch.int32))
    assert torch.equal(_bits(d), _bits(d2)) and torch.equal(s.view(torch.int32), s2.view(torch.int32))


@pytest.mark.parametrize("tiling", [dict(mode="persistent"), dict(mode="chunked"), dict(single_pass=True)])
@pytest.mark.parametrize("k", [1000, 7168])
def test_add_rmsnorm_quant_every_kernel(k, tiling):
    """The residual input in each RMSNorm kernel (the persistent one is the default for 33..128 groups): residual
    bit-exact with torch, norm and quantization exactly `rmsnorm_quant` of that residual with the same tiling,
    quantization library-exact on the kernel's normed values, normed values within 4e-6 of torch."""
    from engine.kernels.quant import act_quant_reference, add_rmsnorm_quant, add_rmsnorm_quant_reference, rmsnorm_quant

    x = _inputs(67, k, "heavy").to(torch.bfloat16).contiguous()
    o = (_inputs(67, k, "signed_zero_fast") * 3).to(torch.bfloat16).contiguous()
    w = (0.5 + torch.rand(k, device=DEV)).contiguous()
    r, d, s, h = add_rmsnorm_quant(x, o, w, 1e-5, **tiling)
    rr, _, _, rh = add_rmsnorm_quant_reference(x, o, w, 1e-5)
    assert torch.equal(r.view(torch.int32), rr.view(torch.int32))
    d2, s2, h2 = rmsnorm_quant(r, w, 1e-5, return_hp=True, **tiling)
    assert torch.equal(h2.view(torch.int32), h.view(torch.int32))
    assert torch.equal(_bits(d), _bits(d2)) and torch.equal(s.view(torch.int32), s2.view(torch.int32))
    rd, rs = act_quant_reference(h)
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    rel = ((h - rh).abs() / rh.abs().clamp_min(1e-30))[rh != 0]
    assert rel.max().item() < 4e-6, rel.max().item()


def test_rmsnorm_quant_wide_rows_default_to_the_chunked_kernel():
    """Rows over 128 groups (16384 columns) cannot be held whole: the default is the chunked two-pass kernel,
    library-exact on its normed values; an explicit persistent tiling is a clear error."""
    from engine.kernels.quant import act_quant_reference, rmsnorm_quant, rmsnorm_quant_reference

    x = _inputs(3, 20480, "heavy").to(torch.bfloat16).contiguous()
    w = (0.5 + torch.rand(20480, device=DEV)).contiguous()
    d, s, h = rmsnorm_quant(x, w, 1e-5, return_hp=True)
    rd, rs = act_quant_reference(h)
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    _, _, href = rmsnorm_quant_reference(x, w, 1e-5)
    assert ((h - href).abs() / href.abs().clamp_min(1e-30))[href != 0].max().item() < 4e-6
    with pytest.raises(ValueError, match="16384"):
        rmsnorm_quant(x, w, 1e-5, mode="persistent")


@pytest.mark.parametrize("kind", ["heavy", "zeros", "tiny_group"])
@pytest.mark.parametrize("k", [4096, 7168])
def test_rmsnorm_quant_row_bits_do_not_depend_on_the_row_count(k, kind):
    """The default tiling is a function of K only: a decode step's one row gets the bits it gets in a batch --
    also when rows of the batch take the IEEE re-quantization (zero and tiny groups)."""
    from engine.kernels.quant import rmsnorm_quant

    x = _inputs(64, k, kind).to(torch.bfloat16).contiguous()
    x[7:9] = _inputs(2, k, "heavy").to(torch.bfloat16)  # rows 7 and 8 in the fast domain, the others not (zeros)
    w = (0.5 + torch.rand(k, device=DEV)).contiguous()
    d64, s64, h64 = rmsnorm_quant(x, w, 1e-5, return_hp=True)
    for r in (5, 7):
        d1, s1, h1 = rmsnorm_quant(x[r:r + 1].contiguous(), w, 1e-5, return_hp=True)
        assert torch.equal(h1, h64[r:r + 1]) and torch.equal(s1.view(torch.int32), s64[r:r + 1].view(torch.int32))
        assert torch.equal(_bits(d1), _bits(d64[r:r + 1])), r


def test_act_and_swiglu_single_row_default_tile_same_bits():
    """A single row takes a 1-row tile by default (`_default_bm`): its bits are those it gets inside a batch."""
    from engine.kernels.quant import act_quant, swiglu_quant

    g = _inputs(33, 14336, "zeros").contiguous()
    u = _inputs(33, 14336, "heavy").contiguous()
    d1, s1, h1 = swiglu_quant(g[7:8].contiguous(), u[7:8].contiguous(), return_hp=True)
    d, s, h = swiglu_quant(g, u, return_hp=True)
    assert torch.equal(_bits(d1), _bits(d[7:8])) and torch.equal(s1, s[7:8]) and torch.equal(h1, h[7:8])
    a1, as1 = act_quant(u[3:4].contiguous())
    a, as_ = act_quant(u)
    assert torch.equal(_bits(a1), _bits(a[3:4])) and torch.equal(as1, as_[3:4])


@pytest.mark.parametrize("rows, dtype", [(1, torch.float32), (64, torch.float32), (8, torch.bfloat16)])
def test_swiglu_quant_reads_gemm_halves_in_place(rows, dtype):
    """The native backend passes the gate / up column halves of the stacked gate/up GEMM output (Llama-3-8B's
    14336 + 14336 columns, decode rows) without copying them: same bits as contiguous copies of the values."""
    from engine.kernels.quant import swiglu_quant

    k = 14336
    y = torch.cat([_inputs(rows, k, "heavy").clamp(-60, 60), _inputs(rows, k, "normal")], dim=1).to(dtype)
    gate, up = y.reshape(rows, 1, 2 * k).split([k, k], dim=-1)
    assert up.data_ptr() == y.data_ptr() + k * y.element_size()  # a view into the GEMM output, not a copy
    d, s, h = swiglu_quant(gate, up, return_hp=True)
    rd, rs, rh = swiglu_quant(gate.contiguous(), up.contiguous(), return_hp=True)
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    assert torch.equal(h.view(torch.int32), rh.view(torch.int32))


@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_quant(shape):
    """Fused SwiGLU+quant: bit-exact quantization of its own activation, activation close to torch's."""
    from engine.kernels.quant import act_quant_reference, swiglu_quant, swiglu_quant_reference

    g = _inputs(*shape, "heavy").clamp(-60, 60).to(torch.bfloat16).contiguous()
    u = _inputs(*shape, "normal").to(torch.bfloat16).contiguous()
    d, s, h = swiglu_quant(g, u, return_hp=True)
    rd, rs = act_quant_reference(h)
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    _, _, href = swiglu_quant_reference(g, u)
    assert torch.allclose(h, href, rtol=2e-5, atol=1e-30)  # tl.exp is the fast ex2 path: a few ulp


# ------------------------------------------------------------------ MXFP8 (fmt="mxfp8")
MX_KINDS = ["normal", "heavy", "zeros", "signed_zero", "wide", "denormal", "at_max", "nan", "inf", "ties", "mx_range"]


def _mx_inputs(rows: int, k: int, kind: str) -> torch.Tensor:
    """`_inputs`, plus "mx_range": blocks at E8M0's ends -- amaxes 2**-149 .. 2**127 (scale clamped to 2**-127 below
    2**-119), block amaxes just under a power of two (floor rule: elements up to 2**9 saturate at 448)."""
    if kind != "mx_range":
        return _inputs(rows, k, kind)
    g = torch.Generator(device=DEV).manual_seed(rows * 11 + k)
    x = torch.randn(rows, k, device=DEV, generator=g)
    exps = torch.randint(-149, 127, (rows, (k + 31) // 32), device=DEV, generator=g).float()
    x = torch.ldexp(x.clamp(-1.9, 1.9), exps.repeat_interleave(32, dim=1)[:, :k])
    x[:, 0] = 511.0  # 2**9 - 1 in a block whose amax sets X = 1: 511 saturates to 448
    x[0, 32:64] = torch.ldexp(torch.tensor(1.0, device=DEV), torch.tensor(-130, device=DEV))  # subnormal amax
    return x


@pytest.mark.parametrize("kind", MX_KINDS)
@pytest.mark.parametrize("shape", SHAPES + [(2, 100)])
def test_act_quant_mxfp8_bit_exact(kind, shape):
    """act_quant(fmt="mxfp8"): every FP8 byte and every E8M0 scale (as fp32) equals `quantize(x, "mxfp8")`'s,
    fp32 and bf16 inputs, K not a multiple of 128 or of 32 included."""
    from engine.kernels.quant import act_quant, act_quant_reference

    x = _mx_inputs(*shape, kind)
    for dtype in (torch.float32, torch.bfloat16):
        xi = x.to(dtype).contiguous()
        d, s = act_quant(xi, fmt="mxfp8")
        rd, rs = act_quant_reference(xi, "mxfp8")
        assert s.shape == rs.shape == (shape[0], (shape[1] + 31) // 32)
        assert torch.equal(_bits(d), _bits(rd.to(d.device))), f"data bits differ ({kind}, {shape}, {dtype})"
        assert _library_scales(s, rs), f"scale bits differ ({kind}, {shape}, {dtype})"


def test_act_quant_mxfp8_hits_the_format_edges():
    """The adversarial MX input really reaches the edges the test claims: the E8M0 floor (2**-127), saturated 448s,
    NaN blocks and -0; a quantizer that skipped the clamp or the saturation would differ there."""
    from engine.kernels.quant import act_quant

    x = _mx_inputs(4, 1000, "mx_range")
    x[1, 5] = float("nan")
    x[2, 7] = -0.0
    d, s = act_quant(x, fmt="mxfp8")
    assert (s == 2.0 ** -127).any() and torch.isnan(s[1, 0]) and s[:, 0].eq(1.0).sum() >= 2
    assert (d.float().abs() == 448.0).any() and torch.isnan(d[1, :32].float()).all()
    assert _bits(d)[2, 7] == 0x80


@pytest.mark.parametrize("tiling", [dict(mode="persistent"), dict(mode="chunked"), dict(single_pass=True),
                                    dict(single_pass=False)])
@pytest.mark.parametrize("kind", ["heavy", "zeros", "nan"])
@pytest.mark.parametrize("shape", [(3, 1000), (5, 7168), (2, 172)])
def test_rmsnorm_and_add_rmsnorm_quant_mxfp8(shape, kind, tiling):
    """RMSNorm -> MXFP8 in every RMSNorm kernel: the quantization of the kernel's own normed values is library-exact,
    the normed values are those of the 1x128 kernel with the same tiling (the format changes only the quantizer),
    and the residual variant quantizes exactly its normed residual."""
    from engine.kernels.quant import act_quant_reference, add_rmsnorm_quant, rmsnorm_quant

    x = _inputs(*shape, kind).to(torch.bfloat16).contiguous()
    w = (0.5 + torch.rand(shape[1], device=DEV)).contiguous()
    if tiling.get("mode") == "persistent" and shape[1] % 128:
        tiling = dict(mode="chunked")
    d, s, h = rmsnorm_quant(x, w, 1e-5, return_hp=True, fmt="mxfp8", **tiling)
    rd, rs = act_quant_reference(h, "mxfp8")
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    _, _, h128 = rmsnorm_quant(x, w, 1e-5, return_hp=True, **tiling)
    assert torch.equal(h.view(torch.int32), h128.view(torch.int32))
    o = (_inputs(*shape, "normal") * 3).to(torch.bfloat16).contiguous()
    r, d2, s2, h2 = add_rmsnorm_quant(x, o, w, 1e-5, fmt="mxfp8", **tiling)
    rd2, rs2 = act_quant_reference(h2, "mxfp8")
    assert torch.equal(_bits(d2), _bits(rd2)) and _library_scales(s2, rs2)


@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_quant_mxfp8(shape):
    """SwiGLU -> MXFP8: library-exact on the kernel's own activation, which is the 1x128 kernel's."""
    from engine.kernels.quant import act_quant_reference, swiglu_quant

    g = _inputs(*shape, "heavy").clamp(-60, 60).to(torch.bfloat16).contiguous()
    u = _inputs(*shape, "normal").to(torch.bfloat16).contiguous()
    d, s, h = swiglu_quant(g, u, return_hp=True, fmt="mxfp8")
    rd, rs = act_quant_reference(h, "mxfp8")
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    _, _, h128 = swiglu_quant(g, u, return_hp=True)
    assert torch.equal(h.view(torch.int32), h128.view(torch.int32))


def test_quant_kernels_reject_other_formats():
    """Only the two formats the kernels write: anything else is an error naming the call and the choices."""
    from engine.kernels.quant import act_quant, swiglu_quant

    x = torch.randn(2, 256, device=DEV)
    for call in (lambda: act_quant(x, fmt="mxfp4"), lambda: swiglu_quant(x, x, fmt="e4m3:1x32")):
        with pytest.raises(ValueError, match="mxfp8"):
            call()
