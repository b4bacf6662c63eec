"""The quant kernels of engine/kernels/quant.py (act_quant, RMSNorm / residual add + RMSNorm / SwiGLU -> E4M3 1x128 or
MXFP8) against the formats library: bit-exact quantization.

* Kernel tests (markers `gpu` + `interpreter`): on the GPU (skipped without CUDA), and on CPU tensors under
  TRITON_INTERPRET=1 (tests/support/interpret.py), where they take the smaller cases of `by_device`: the same kernel
  paths (K a multiple of 128 or with a partial last 1x128 group / 1x32 block, masked row tiles, one-pass / two-pass
  / persistent RMSNorm and its residual variant, fp32 / bf16 inputs, every adversarial input kind) with fewer and
  shorter rows. The fast division (`_quant_groups_fast`, inline PTX) is CUDA-only: its bits are checked on the GPU,
  its arithmetic on the CPU (the last section).
* Tiling knobs: every tiling / mode gives FP8 data + scales bit-exact with the library on the kernel's own pre-quant
  values; act_quant / SwiGLU tilings give the default tiling's bits.
* SwiGLU on strided gate / up views (the halves of the stacked gate/up GEMM output): the bits of contiguous copies.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.interpret import GPU_TEST_DEVICE, INTERPRET, by_device

DEV = GPU_TEST_DEVICE  # "cpu" under TRITON_INTERPRET=1; the kernel tests skip without CUDA otherwise (tests/conftest.py)


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
# the interpreter: K = 128 (whole groups, full row tiles) and K = 1000 (a partial last group, a masked row tile); the
# GPU adds 56 groups (the persistent RMSNorm by default) and a second tail
SHAPES = by_device([(4, 128), (3, 1000), (5, 7168), (2, 172)], [(4, 128), (3, 1000)])


@pytest.mark.gpu
@pytest.mark.interpreter
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


@pytest.mark.gpu
@pytest.mark.interpreter
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


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("round_bf16", [True, False])
@pytest.mark.parametrize("shape", by_device([(1, 4096), (3, 1000), (5, 7168), (64, 4096)], [(3, 1000)]))
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


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("tiling", [dict(mode="persistent"), dict(mode="chunked"), dict(single_pass=True)])
@pytest.mark.parametrize("k", by_device([1000, 7168], [1000]))
def test_add_rmsnorm_quant_every_kernel(k, tiling):
    """The residual input in each RMSNorm kernel (the persistent one is the default for 33..128 groups): residual
    bit-exact with torch, norm and quantization exactly `rmsnorm_quant` of that residual with the same tiling,
    quantization library-exact on the kernel's normed values, normed values within 4e-6 of torch. More rows than
    the persistent kernel has programs (2 per SM: 8 under the interpreter), so its row loop runs more than once."""
    from engine.kernels.quant import act_quant_reference, add_rmsnorm_quant, add_rmsnorm_quant_reference, rmsnorm_quant

    rows = by_device(67, 11)
    x = _inputs(rows, k, "heavy").to(torch.bfloat16).contiguous()
    o = (_inputs(rows, k, "signed_zero_fast") * 3).to(torch.bfloat16).contiguous()
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


@pytest.mark.gpu
@pytest.mark.interpreter
def test_rmsnorm_quant_wide_rows_default_to_the_chunked_kernel():
    """Rows over 128 groups (16384 columns) cannot be held whole: the default is the chunked two-pass kernel,
    library-exact on its normed values; an explicit persistent tiling is a clear error."""
    from engine.kernels.quant import act_quant_reference, rmsnorm_quant, rmsnorm_quant_reference

    x = _inputs(by_device(3, 1), 20480, "heavy").to(torch.bfloat16).contiguous()
    w = (0.5 + torch.rand(20480, device=DEV)).contiguous()
    d, s, h = rmsnorm_quant(x, w, 1e-5, return_hp=True)
    rd, rs = act_quant_reference(h)
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    _, _, href = rmsnorm_quant_reference(x, w, 1e-5)
    assert ((h - href).abs() / href.abs().clamp_min(1e-30))[href != 0].max().item() < 4e-6
    with pytest.raises(ValueError, match="16384"):
        rmsnorm_quant(x, w, 1e-5, mode="persistent")


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["heavy", "zeros", "tiny_group"])
@pytest.mark.parametrize("k", by_device([4096, 7168], [1000, 4224]))  # <= 32 groups: one-pass rows; 33..128: persistent
def test_rmsnorm_quant_row_bits_do_not_depend_on_the_row_count(k, kind):
    """The default tiling is a function of K only: a decode step's one row gets the bits it gets in a batch --
    also when rows of the batch take the IEEE re-quantization (zero and tiny groups)."""
    from engine.kernels.quant import rmsnorm_quant

    x = _inputs(by_device(64, 12), k, kind).to(torch.bfloat16).contiguous()
    x[7:9] = _inputs(2, k, "heavy").to(torch.bfloat16)  # rows 7 and 8 in the fast domain, the others not (zeros)
    w = (0.5 + torch.rand(k, device=DEV)).contiguous()
    d64, s64, h64 = rmsnorm_quant(x, w, 1e-5, return_hp=True)
    for r in (5, 7):
        d1, s1, h1 = rmsnorm_quant(x[r:r + 1].contiguous(), w, 1e-5, return_hp=True)
        assert torch.equal(h1, h64[r:r + 1]) and torch.equal(s1.view(torch.int32), s64[r:r + 1].view(torch.int32))
        assert torch.equal(_bits(d1), _bits(d64[r:r + 1])), r


@pytest.mark.gpu
@pytest.mark.interpreter
def test_act_and_swiglu_single_row_default_tile_same_bits():
    """A single row takes a 1-row tile by default (`_default_bm`): its bits are those it gets inside a batch."""
    from engine.kernels.quant import act_quant, swiglu_quant

    k = by_device(14336, 1000)
    g = _inputs(33, k, "zeros").contiguous()
    u = _inputs(33, k, "heavy").contiguous()
    d1, s1, h1 = swiglu_quant(g[7:8].contiguous(), u[7:8].contiguous(), return_hp=True)
    d, s, h = swiglu_quant(g, u, return_hp=True)
    assert torch.equal(_bits(d1), _bits(d[7:8])) and torch.equal(s1, s[7:8]) and torch.equal(h1, h[7:8])
    a1, as1 = act_quant(u[3:4].contiguous())
    a, as_ = act_quant(u)
    assert torch.equal(_bits(a1), _bits(a[3:4])) and torch.equal(as1, as_[3:4])


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("rows, dtype", by_device([(1, torch.float32), (64, torch.float32), (8, torch.bfloat16)],
                                              [(1, torch.float32), (17, torch.float32), (8, torch.bfloat16)]))
def test_swiglu_quant_reads_gemm_halves_in_place(rows, dtype):
    """The native backend passes the gate / up column halves of the stacked gate/up GEMM output (on the GPU
    Llama-3-8B's 14336 + 14336 columns, decode rows) without copying them: same bits as contiguous copies of the
    values."""
    from engine.kernels.quant import swiglu_quant

    k = by_device(14336, 1000)
    y = torch.cat([_inputs(rows, k, "heavy").clamp(-60, 60), _inputs(rows, k, "normal")], dim=1).to(dtype)
    gate, up = y.reshape(rows, 1, 2 * k).split([k, k], dim=-1)
    assert up.data_ptr() == y.data_ptr() + k * y.element_size()  # a view into the GEMM output, not a copy
    d, s, h = swiglu_quant(gate, up, return_hp=True)
    rd, rs, rh = swiglu_quant(gate.contiguous(), up.contiguous(), return_hp=True)
    assert torch.equal(_bits(d), _bits(rd)) and _library_scales(s, rs)
    assert torch.equal(h.view(torch.int32), rh.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.interpreter
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


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("kind", MX_KINDS)
@pytest.mark.parametrize("shape", by_device(SHAPES + [(2, 100)], SHAPES))  # 100: a partial 1x128 group and 1x32 block
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


@pytest.mark.gpu
@pytest.mark.interpreter
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


TILINGS = [dict(mode="persistent"), dict(mode="chunked"), dict(single_pass=True), dict(single_pass=False)]
# the interpreter: the one-pass (chunked's default tile holds 8 groups: the single-pass launch) and two-pass kernels
# with a partial last 1x32 block (K = 1000), the persistent one where K is a multiple of 128 (1024)
MX_NORM_CASES = by_device([(shape, tiling) for shape in [(3, 1000), (5, 7168), (2, 172)] for tiling in TILINGS],
                          [((3, 1000), TILINGS[2]), ((3, 1000), TILINGS[3]), ((3, 1024), TILINGS[0])])


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["heavy", "zeros", "nan"])
@pytest.mark.parametrize("shape, tiling", MX_NORM_CASES)
def test_rmsnorm_and_add_rmsnorm_quant_mxfp8(shape, kind, tiling):
    """RMSNorm -> MXFP8 in every RMSNorm kernel: the quantization of the kernel's own normed values is library-exact,
    the normed values are those of the 1x128 kernel with the same tiling (the format changes only the quantizer),
    and the residual variant quantizes exactly its normed residual. The persistent kernel runs where K is a multiple
    of 128 (the chunked one instead elsewhere)."""
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


@pytest.mark.gpu
@pytest.mark.interpreter
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


@pytest.mark.gpu
@pytest.mark.interpreter
def test_quant_kernels_reject_other_formats():
    """Only the two formats the kernels write: anything else is an error naming the call and the choices."""
    from engine.kernels.quant import act_quant, swiglu_quant

    x = torch.randn(2, 256, device=DEV)
    for call in (lambda: act_quant(x, fmt="mxfp4"), lambda: swiglu_quant(x, x, fmt="e4m3:1x32")):
        with pytest.raises(ValueError, match="mxfp8"):
            call()


# ------------------------------------------------------------------ tiling knobs
def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal fp32 tensor on DEV."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV)


def _heavy(rows: int, k: int, seed: int) -> torch.Tensor:
    """Heavy-tailed rows with a zero group and a group holding the row max exactly at 448."""
    x = _randn(rows, k, seed=seed) / (torch.rand(rows, k, generator=torch.Generator().manual_seed(seed)).to(DEV)
                                      .clamp_min(1e-3))
    x[:, :128] = 0.0
    x[0, 130] = 448.0
    return x


RMS_CONFIGS = [dict(), dict(single_pass=True), dict(single_pass=False, gb=2, num_stages=3),
               dict(mode="chunked", bm=2, gb=4, num_warps=8, num_stages=2),
               dict(mode="persistent", num_warps=8, num_stages=3, programs_per_sm=2)]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("shape", by_device([(5, 1000), (9, 7168)], [(5, 1000)]))
def test_rmsnorm_quant_every_tiling_is_library_exact(shape):
    """Each mode / tiling: quantization bit-exact on its own normed values, normed values within 4e-6 of torch."""
    from engine.kernels.quant import act_quant_reference, rmsnorm_quant, rmsnorm_quant_reference

    x = _heavy(*shape, seed=shape[1]).to(torch.bfloat16).contiguous()
    w = (0.5 + torch.rand(shape[1], generator=torch.Generator().manual_seed(1))).to(DEV)
    _, _, href = rmsnorm_quant_reference(x, w, 1e-5)
    for cfg in RMS_CONFIGS:
        d, s, h = rmsnorm_quant(x, w, 1e-5, return_hp=True, **cfg)
        rd, rs = act_quant_reference(h)
        assert torch.equal(_bits(d), _bits(rd)) and torch.equal(s.view(torch.int32), rs.view(torch.int32)), cfg
        rel = ((h - href).abs() / href.abs().clamp_min(1e-30))[href != 0].max().item()
        assert rel < 4e-6, (cfg, rel)
        d2, s2 = rmsnorm_quant(x, w, 1e-5, **cfg)  # without the fp32 side output: the same bits
        assert torch.equal(_bits(d2), _bits(d)) and torch.equal(s2, s), cfg


@pytest.mark.gpu
@pytest.mark.interpreter
def test_act_and_swiglu_tilings_same_bits():
    """Tilings never change act_quant / SwiGLU bits; the IEEE silu (fast_silu=False) is within 2e-5 of torch too."""
    from engine.kernels.quant import act_quant, swiglu_quant, swiglu_quant_reference

    x = _heavy(7, 1000, seed=3).contiguous()
    d0, s0 = act_quant(x)
    d1, s1 = act_quant(x, bm=4, gb=2, num_warps=2)
    assert torch.equal(_bits(d0), _bits(d1)) and torch.equal(s0, s1)
    g = _heavy(7, 1000, seed=4).clamp(-60, 60).to(torch.bfloat16).contiguous()
    u = _randn(7, 1000, seed=5).to(torch.bfloat16).contiguous()
    _, _, href = swiglu_quant_reference(g, u)
    ref = swiglu_quant(g, u, return_hp=True)
    for cfg in (dict(bm=2, gb=4), dict(bm=32, gb=1, num_warps=8)):
        d, s, h = swiglu_quant(g, u, return_hp=True, **cfg)
        assert torch.equal(_bits(d), _bits(ref[0])) and torch.equal(s, ref[1]) and torch.equal(h, ref[2]), cfg
    _, _, h_ieee = swiglu_quant(g, u, return_hp=True, fast_silu=False)
    for h in (ref[2], h_ieee):
        assert torch.allclose(h, href, rtol=2e-5, atol=1e-30)


@pytest.mark.gpu
@pytest.mark.interpreter
def test_quant_knobs_reject_bad_values():
    """Non power-of-two tilings and one-pass rows wider than 16384 raise clear errors."""
    from engine.kernels.quant import act_quant, rmsnorm_quant

    x = _randn(2, 256, seed=6)
    with pytest.raises(ValueError, match="power of two"):
        act_quant(x, bm=3)
    wide = _randn(1, 16512, seed=7)
    with pytest.raises(ValueError, match="16384"):
        rmsnorm_quant(wide, torch.ones(16512, device=DEV), 1e-5, mode="persistent")


# ------------------------------------------------------------------ SwiGLU on strided gate / up views
def _gemm_like(rows: int, k: int, dtype, seed: int) -> torch.Tensor:
    """A (rows, 2K) GEMM-like output on DEV with zeros, tiny, huge, NaN and +-inf entries in the gate half."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, 2 * k, generator=g) * 4
    y[0, :k] = 0.0
    y[-1, 5] = float("nan")
    y[-1, 7] = float("inf")
    y[-1, 9] = -float("inf")
    y[min(1, rows - 1), 130:140] = 1e-40
    y[min(1, rows - 1), 3] = 1e30
    return y.to(dtype).to(DEV)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Same bits (FP8 bytes, fp32 words)."""
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    bad = int((a != b).sum())
    assert bad == 0, f"{what}: {bad} of {a.numel()} differ"


STRIDED = 256  # K of the strided-view cases: two 1x128 groups


def _strided_case(case: str):
    """(gate, up, knobs) of a strided-view case."""
    k = STRIDED
    if case == "stacked_halves_2d":
        gate, up = _gemm_like(5, k, torch.float32, 0).split([k, k], dim=-1)
        assert not gate.is_contiguous() and gate.stride(0) == 2 * k
        return gate, up, {}
    if case == "stacked_halves_3d":  # decode: (batch, 1 token, 2K)
        return (*_gemm_like(3, k, torch.float32, 1).reshape(3, 1, 2 * k).split([k, k], dim=-1), {})
    if case == "bf16_halves":
        return (*_gemm_like(4, k, torch.bfloat16, 2).split([k, k], dim=-1), {})
    if case == "mixed_dtypes":  # an fp32 gate half with a bf16 up tensor: each is read in its own dtype
        y = _gemm_like(4, k, torch.float32, 6)
        return y[:, :k], y[:, k:].to(torch.bfloat16), {}
    if case == "column_strided_copy":  # columns not contiguous: the wrapper copies, same bits
        y = _gemm_like(4, k, torch.float32, 3)
        assert y[:, 0::2].stride(-1) == 2
        return y[:, 0::2], y[:, 1::2], {}
    y = _gemm_like(7, k, torch.float32, 4)  # row tiles that straddle the rows, several groups per program
    return (*y.split([k, k], dim=-1), dict(bm=4, gb=2, num_warps=2) if case == "knobs_bm4_gb2" else dict(bm=1, gb=1))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["stacked_halves_2d", "stacked_halves_3d", "bf16_halves", "mixed_dtypes",
                                  "column_strided_copy", "knobs_bm4_gb2", "knobs_bm1_gb1"])
def test_swiglu_quant_strided_views_same_bits(case):
    """The native backend hands `swiglu_quant` the two column halves of the stacked gate/up GEMM's output, which the
    kernel reads at their row stride: FP8 data, scales and fp32 activation have the bits of the same kernel on
    contiguous copies of the same values (a kernel reading the up half at the gate's offset, or at K instead of the
    row stride, would not)."""
    from engine.kernels.quant import swiglu_quant

    gate, up, knobs = _strided_case(case)
    d, s, h = swiglu_quant(gate, up, return_hp=True, **knobs)
    rd, rs, rh = swiglu_quant(gate.contiguous(), up.contiguous(), return_hp=True, **knobs)
    assert d.shape == gate.shape and h.shape == gate.shape and s.shape == (*gate.shape[:-1], gate.shape[-1] // 128)
    _same(d, rd, "FP8 data")
    _same(s, rs, "scales")
    _same(h, rh, "fp32 activation")


@pytest.mark.gpu
@pytest.mark.interpreter
def test_swiglu_quant_refuses_mismatched_halves():
    """gate and up of different rows or columns: a ValueError naming both."""
    from engine.kernels.quant import swiglu_quant

    k = STRIDED
    y = _gemm_like(4, k, torch.float32, 5)
    for g, u in ((y[:, :k], y[:3, k:]), (y[:, :k], y[:, k:k + 128])):
        with pytest.raises(ValueError, match="gate.*up"):
            swiglu_quant(g, u)


def test_row_view_keeps_gemm_halves_in_place_and_copies_the_rest():
    from engine.kernels.quant import _row_view

    y = torch.zeros(3, 1, 512)
    gate, up = y.split([256, 256], dim=-1)
    g2, u2 = _row_view(gate), _row_view(up)
    assert g2.shape == (3, 256) and g2.stride() == (512, 1) and g2.data_ptr() == y.data_ptr()
    assert u2.data_ptr() == y.data_ptr() + 256 * y.element_size()
    cols = _row_view(y[:, 0, 0::2])  # strided columns: copied to contiguous rows
    assert cols.is_contiguous() and cols.data_ptr() != y.data_ptr()
    with pytest.raises(ValueError, match="0-d"):
        _row_view(torch.tensor(1.0))


def test_swiglu_quant_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    from engine.kernels import quant

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    y = torch.zeros(2, 512)
    with pytest.raises(ValueError, match="CUDA"):
        quant.swiglu_quant(y[:, :256], y[:, 256:])


# ------------------------------------------------------------------ the fast division, on the CPU
# On the GPU the E4M3 quantizers divide each element by its group scale with Markstein's refinement
# (q = x * r, r = RN(1/s); nr = fma(q, s, -x); q' = fma(nr, -r, q)) instead of the IEEE division, for tiles whose
# group amaxes are finite and >= 2^-80. The kernels run it on CUDA only (the interpreter's fma rounds twice), so
# these tests replay the same operations with an exactly rounded fma built from float64 (product exact, TwoSum
# error, round-to-odd, then one rounding to float32) and compare against torch's IEEE division: bit-identical E4M3
# codes everywhere in that domain, bit-identical fp32 quotients wherever E4M3 does not flush them to zero. The
# kernel tests above check the kernels' bits on the GPU.
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
    is inline PTX), and the backend option `KernelOptions(fast_division=False)` turns it off there too."""
    from engine.kernels import quant
    from engine.kernels.options import KernelOptions

    cpu = torch.zeros(1)
    assert quant.fast_division(cpu) is False

    class FakeCuda:
        is_cuda = True

    monkeypatch.setattr(torch.version, "hip", None)
    assert quant.fast_division(FakeCuda(), KernelOptions(fast_division=False)) is False
    assert quant.fast_division(FakeCuda()) is True
    monkeypatch.setattr(torch.version, "hip", "6.2")  # a ROCm build: the fast path's inline PTX cannot compile
    assert quant.fast_division(FakeCuda()) is False
