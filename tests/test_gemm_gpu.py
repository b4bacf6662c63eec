"""Quantized GEMMs (engine/kernels/gemm.py) vs their fp32 references on the GPU (skipped without CUDA / Triton).

Error metric: relative Frobenius error ||out - ref||_F / ||ref||_F, where ref is the fp32 product
of the dequantized operands (computed in float64, see the `*_reference` functions). Tolerances:

* bf16 output: 1e-2 (bf16 rounding of the output alone is ~1e-3 rms);
* fp32 output: 2e-3 for FP8 tensor-core paths (Hopper FP8 MMA accumulates with reduced precision
  inside each 128-wide K group before the fp32 promotion); 1e-4 for the MX kernel with exactly
  bf16-representable operands (bf16 MMA, fp32 accumulation); 1e-2 when fp32 activations are
  rounded to bf16 in the MX kernel (w4a16).

Data has per-block magnitudes spread over 2**-4 .. 2**4 so that every scale matters: a kernel that
applies the scale of the wrong block fails by orders of magnitude more than the tolerance. The
K/128 % 4 trap: the old `torch._scaled_mm` call with unpadded scales must show a large error
(> 0.1) at K = 640 / 896 / 1152 while `fp8_block_linear` stays within tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpret_util import GPU_TEST_DEVICE, INTERPRET

# skipped without CUDA; under TRITON_INTERPRET=1 the tests marked `interpreter` run on the CPU (tests/conftest.py)
pytestmark = pytest.mark.gpu
DEV = GPU_TEST_DEVICE  # "cpu" under TRITON_INTERPRET=1

TOL = {torch.bfloat16: 1e-2, torch.float32: 2e-3}
TOL_MX_EXACT_FP32 = 1e-4
TOL_MX_ROUNDED_X = 1e-2
M_SET = [1, 2, 3, 5, 63, 64, 65]


@pytest.fixture(scope="module")
def G():
    """The kernel module (needs Triton)."""
    pytest.importorskip("triton")
    from engine.kernels import gemm

    return gemm


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error (absolute when ref is all zeros)."""
    out, ref = out.float(), ref.float()
    den = ref.norm()
    return float((out - ref).norm() / den) if den > 0 else float((out - ref).norm())


def _blocky(rows: int, cols: int, r: int, c: int, seed: int) -> torch.Tensor:
    """Gaussian (rows, cols) times a per-(r x c)-block magnitude 2**U{-4..4}."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, cols, device=DEV, generator=g)
    mag = torch.exp2(torch.randint(-4, 5, (-(-rows // r), -(-cols // c)), device=DEV, generator=g).float())
    return x * mag.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]


def _block_operands(m: int, n: int, k: int, seed: int = 0):
    """e4m3:1x128 activations and e4m3:128x128 weights from the formats library."""
    from engine.formats import quantize

    xq = quantize(_blocky(m, k, 1, 128, seed), "e4m3:1x128")
    wq = quantize(_blocky(n, k, 128, 128, seed + 1), "e4m3:128x128")
    assert xq.data.dtype == torch.float8_e4m3fn and xq.scale.shape == (m, -(-k // 128))
    assert wq.data.dtype == torch.float8_e4m3fn and wq.scale.shape == (-(-n // 128), -(-k // 128))
    return xq.data, xq.scale, wq.data, wq.scale


# ------------------------------------------------------------------ FP8 block
@pytest.mark.interpreter
@pytest.mark.parametrize("m", M_SET)
@pytest.mark.parametrize("nk", [(256, 512), (200, 320), (136, 1000)])  # N % 128 != 0, K % 128 != 0, K % 16 != 0
def test_fp8_block_linear_random(G, m, nk):
    """Both paths (Triton for M <= 64, cuBLAS blockwise above) within tolerance, bf16 and fp32 out."""
    n, k = nk
    xd, xs, wd, ws = _block_operands(m, n, k, seed=m)
    for dt in (torch.bfloat16, torch.float32):
        out = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=dt)
        ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
        assert out.shape == (m, n) and out.dtype == dt
        err = _rel(out, ref)
        assert err <= TOL[dt], f"M={m} N={n} K={k} {dt}: rel err {err:.3e} > {TOL[dt]}"


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [3, 64, 130])
def test_fp8_block_linear_bias_and_leading_dims(G, m):
    """Bias (N,) is added once; (B, T, K) activations give (B, T, N)."""
    n, k = 192, 384
    xd, xs, wd, ws = _block_operands(2 * m, n, k, seed=7)
    bias = torch.randn(n, device=DEV) * 4
    x3, s3 = xd.reshape(2, m, k), xs.reshape(2, m, -1)
    out = G.fp8_block_linear(x3, s3, wd, ws, bias=bias, out_dtype=torch.float32)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
    assert out.shape == (2, m, n)
    assert _rel(out.reshape(2 * m, n), ref) <= TOL[torch.float32]


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 5, 64, 65, 128])
def test_fp8_block_linear_adversarial(G, m):
    """Zero rows give exact zeros; amax at 448 (every element +-448) and all-zero K groups stay accurate."""
    n, k = 256, 640
    xd, xs, wd, ws = _block_operands(m, n, k, seed=11)
    xd, xs = xd.clone(), xs.clone()
    xd[0] = 0  # a zero row quantizes to zeros with scale 1
    xs[0] = 1.0
    if m > 2:
        xd[2, 128:256] = 0  # one all-zero group inside a row
    out = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16)
    assert torch.equal(out[0], torch.zeros_like(out[0])), "a zero activation row must give an exact zero row"
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    assert _rel(out, ref) <= TOL[torch.bfloat16]
    g = torch.Generator(device=DEV).manual_seed(3)
    sign = lambda r, c: torch.where(torch.rand(r, c, device=DEV, generator=g) < 0.5, -448.0, 448.0)
    xd448 = sign(m, k).to(torch.float8_e4m3fn)
    wd448 = sign(n, k).to(torch.float8_e4m3fn)
    xs448 = torch.rand(m, 5, device=DEV, generator=g) + 0.5
    ws448 = torch.rand(2, 5, device=DEV, generator=g) + 0.5
    out = G.fp8_block_linear(xd448, xs448, wd448, ws448, out_dtype=torch.float32)
    ref = G.fp8_block_linear_reference(xd448, xs448, wd448, ws448, out_dtype=torch.float32)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) <= TOL[torch.float32]


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 4, 16, 63, 64])
@pytest.mark.parametrize("nk", [(512, 1024), (200, 896)])
def test_small_m_kernel_matches_large_m_path(G, m, nk):
    """The Triton decode kernel (small_m=64) equals the cuBLAS blockwise path (small_m=0, M padded to 4),
    both with bf16 output (the format cuBLAS blockwise is measured with)."""
    n, k = nk
    xd, xs, wd, ws = _block_operands(m, n, k, seed=5)
    small = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16, small_m=64)
    large = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16, small_m=0)
    err = _rel(small, large)
    assert err <= TOL[torch.bfloat16], f"small-M kernel vs large-M path: {err:.3e}"
    assert not torch.equal(small, torch.zeros_like(small))


@pytest.mark.interpreter
def test_split_k_is_deterministic_and_consistent(G):
    """Split-K changes only the fp32 summation order; the same call twice gives the same bits."""
    xd, xs, wd, ws = _block_operands(4, 256, 2048, seed=9)
    one = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, split_k=1)
    four = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, split_k=4)
    again = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, split_k=4)
    assert torch.equal(four, again)
    assert _rel(four, one) <= 1e-5
    assert not torch.equal(one, torch.zeros_like(one))


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 4, 16, 40])
@pytest.mark.parametrize("fused", [True, False])
def test_bf16_rounded_fp32_output_is_the_bf16_output(G, m, fused):
    """out_round='bf16' (a bf16 output kept in the engine's fp32 carrier) gives bit for bit the bf16 output widened
    to fp32, with and without bias, on the split-K Triton path (fused and separate reduce) and on cuBLAS (m = 40
    with small_m = 16); the fused reduce equals the separate one."""
    xd, xs, wd, ws = _block_operands(m, 768, 4096, seed=21)
    bias = torch.randn(768, device=DEV)
    for b in (None, bias):
        if m <= 16:
            want = G.fp8_block_gemm_triton(xd, xs, wd, ws, b, out_dtype=torch.bfloat16, split_k=4,
                                           fused_reduce=fused, sliced=False).float()
            got = G._launch_fp8(xd, xs, (xs.stride(0), xs.stride(1)), wd, ws, (ws.stride(0), ws.stride(1)), b,
                                torch.float32, 4, fused_reduce=fused, round_bf16=True, sliced=False)
            assert torch.equal(got, want)
            other = G.fp8_block_gemm_triton(xd, xs, wd, ws, b, out_dtype=torch.bfloat16, split_k=4,
                                            fused_reduce=not fused, sliced=False).float()
            assert torch.equal(other, want)
        want = G.fp8_block_linear(xd, xs, wd, ws, b, out_dtype=torch.bfloat16, small_m=16).float()
        got = G.fp8_block_linear(xd, xs, wd, ws, b, out_dtype=torch.float32, small_m=16, out_round="bf16")
        assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(ValueError, match="out_round"):
        G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16, out_round="bf16")


def _next_pow2(m: int) -> int:
    """The next power of two >= m."""
    return 1 << max(0, m - 1).bit_length()


@pytest.mark.interpreter
@pytest.mark.parametrize("mnk", [(1, 256, 1024), (2, 200, 1000), (4, 320, 1152), (8, 136, 2048), (16, 128, 640),
                                 (33, 64, 512)])
def test_sliced_kernel_is_split_k(G, mnk):
    """The sliced kernel (split-K inside one program, slices summed in registers) gives the split-K kernel's bits
    with as many splits, 64-row tiles and 4 warps, and its reduce, on the GPU: slices of 2 / 4 / 8, 8-64 weight rows
    per slice, N tails (200, 136), a partial last group (K = 1000), uneven and empty slices (9 groups in 4 or 8
    slices), bias, bf16 / fp32 / bf16-rounded output. Under the interpreter, whose dot sums in numpy's order per
    shape, within 1e-6. Both within TOL of the float64 reference."""
    m, n, k = mnk
    xd, xs, wd, ws = _block_operands(m, n, k, seed=m + n)
    bias = torch.randn(n, device=DEV)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
    rows = {2: (32, 64), 4: (16, 32), 8: (8, 16)}
    for s in (2, 4, 8):
        if s * _next_pow2(m) > 128:  # M = 33 in 4 / 8 slices: 256 / 512 MMA columns, refused by name
            with pytest.raises(ValueError, match=f"sliced={s} at M={m}"):
                G.fp8_block_gemm_triton(xd, xs, wd, ws, sliced=s)
            continue
        split = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias, out_dtype=torch.float32, split_k=s, block_n=64,
                                        num_warps=4, num_stages=3, fused_reduce=True, sliced=False)
        for r in rows[s]:
            got = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias, out_dtype=torch.float32, sliced=s, block_n=r)
            assert _rel(got, ref) <= TOL[torch.float32], (s, r)
            if INTERPRET:
                assert _rel(got, split) <= 1e-6, (s, r)
            else:
                assert torch.equal(got, split), (s, r)
        bf = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias, out_dtype=torch.bfloat16, sliced=s)
        rounded = G._launch_fp8(xd, xs, (xs.stride(0), xs.stride(1)), wd, ws, (ws.stride(0), ws.stride(1)), bias,
                                torch.float32, None, round_bf16=True, sliced=s)
        assert _rel(bf, ref) <= TOL[torch.bfloat16] and torch.equal(rounded, bf.float()), s
    with pytest.raises(ValueError, match="sliced=3"):
        G.fp8_block_gemm_triton(xd, xs, wd, ws, sliced=3)
    with pytest.raises(ValueError, match="block_n=128"):
        G.fp8_block_gemm_triton(xd, xs, wd, ws, sliced=4, block_n=128)


def test_sliced_auto_takes_small_m_split_k_calls(G, monkeypatch):
    """On the GPU, split-K calls with 2 / 4 splits of 64-row tiles and M <= 16 / splits run the sliced kernel with the
    split-K plan's K partition (counted), the same bits as split-K (sliced=False); M above that, 8 splits, 32-row
    tiles and sliced=False stay on split-K."""
    calls = []
    real = G._launch_sliced
    monkeypatch.setattr(G, "_launch_sliced", lambda *a, **kw: calls.append(a[9]) or real(*a, **kw))
    xd, xs, wd, ws = _block_operands(8, 192, 2048, seed=3)
    for m, kw, slices in ((4, dict(split_k=4), 4), (2, dict(split_k=4), 4), (8, dict(split_k=2), 2),
                          (5, dict(split_k=4), None), (2, dict(split_k=8), None),
                          (4, dict(split_k=4, block_n=32), None), (4, dict(split_k=4, sliced=False), None)):
        calls.clear()
        got = G.fp8_block_gemm_triton(xd[:m], xs[:m], wd, ws, out_dtype=torch.float32, **kw)
        want = G.fp8_block_gemm_triton(xd[:m], xs[:m], wd, ws, out_dtype=torch.float32, **dict(kw, sliced=False))
        assert calls == ([slices] if slices else []), (m, kw)
        assert torch.equal(got, want), (m, kw)
    monkeypatch.setattr(G, "SLICED_AUTO", False)
    calls.clear()
    G.fp8_block_gemm_triton(xd[:4], xs[:4], wd, ws, out_dtype=torch.float32, split_k=4)
    assert calls == []


@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 14336), (200, 1000), (136, 320)])
def test_m1_runs_the_cuda_core_gemv(G, nk, monkeypatch):
    """M = 1 without knobs runs `_fp8_gemv_kernel` (counted): within TOL of the float64 reference with and without
    bias, in bf16 / fp32 / bf16-rounded fp32 (bit for bit the bf16 output widened), fp32 output within 1e-4
    (exact products, fp32 sums; the MMA kernel's bound is TOL), deterministic; N and K tails (200 x 1000)
    masked; GEMV_M1 = False restores the split-K kernel."""
    n, k = nk
    xd, xs, wd, ws = _block_operands(1, n, k, seed=n + k)
    bias = torch.randn(n, device=DEV)
    calls = []
    real = G._launch_gemv
    monkeypatch.setattr(G, "_launch_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    for b in (None, bias):
        r = ref if b is None else ref + b
        f32 = G.fp8_block_linear(xd, xs, wd, ws, b, out_dtype=torch.float32)
        bf = G.fp8_block_linear(xd, xs, wd, ws, b, out_dtype=torch.bfloat16)
        rounded = G.fp8_block_linear(xd, xs, wd, ws, b, out_dtype=torch.float32, out_round="bf16")
        assert _rel(f32, r) <= TOL[torch.float32] and _rel(bf, r) <= TOL[torch.bfloat16]
        assert torch.equal(rounded, bf.float()) and torch.equal(f32, G.fp8_block_linear(xd, xs, wd, ws, b,
                                                                                       out_dtype=torch.float32))
        # exact products summed in fp32: far inside the FP8 tensor-core path's TOL (its MMA accumulates each
        # 128-group with reduced precision), which the split-K kernel still meets on the same operands
        mma = G.fp8_block_gemm_triton(xd, xs, wd, ws, b, out_dtype=torch.float32, split_k=2)
        assert _rel(f32, r) <= 1e-4 and _rel(mma, r) <= TOL[torch.float32]
    assert len(calls) == 8
    monkeypatch.setattr(G, "GEMV_M1", False)
    G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
    assert len(calls) == 8


def test_gemv_configs_entry_is_dispatched(G, monkeypatch):
    """M = 1 runs a GEMV_CONFIGS entry for (device, N, K) exactly as `_launch_gemv` with those knobs; other knobs
    stay within 1e-4 of the reference (exact products, fp32 sums in another order)."""
    xd, xs, wd, ws = _block_operands(1, 384, 1536, seed=7)
    dev = xd.device
    cfg = dict(block_n=4, groups=4, num_stages=2, num_warps=2)
    seen = []
    real = G._launch_gemv
    monkeypatch.setattr(G, "_launch_gemv", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    monkeypatch.setitem(G.GEMV_CONFIGS, (G._device_name(dev.type, dev.index), 384, 1536), cfg)
    tuned = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
    assert seen[-1] == cfg
    explicit = torch.empty_like(tuned)
    real(xd, xs, xs.stride(), wd, ws, ws.stride(), None, explicit, False, **cfg)
    assert torch.equal(tuned, explicit)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    for other in (dict(), dict(block_n=16, groups=2, num_stages=3, num_warps=4)):
        out = torch.empty_like(tuned)
        real(xd, xs, xs.stride(), wd, ws, ws.stride(), None, out, False, **other)
        assert _rel(out, ref) <= 1e-4


@pytest.mark.interpreter
def test_triton_large_m_fallback(G):
    """The Triton kernel with large tiles (used when cuBLAS refuses) is accurate too."""
    xd, xs, wd, ws = _block_operands(200, 264, 1152, seed=13)
    out = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    assert _rel(out, ref) <= TOL[torch.float32]


def test_cublas_blockwise_path_runs_on_sm90(G):
    """On sm_90 with F.scaled_mm the fast path must really run (not silently fall back) and be correct,
    also at K/128 % 4 != 0 (scale padding) and M % 4 != 0 (row padding)."""
    if torch.cuda.get_device_capability() != (9, 0) or not G.has_scaled_mm():
        pytest.skip("cuBLAS blockwise FP8 needs sm_90 and torch.nn.functional.scaled_mm")
    for m, n, k in [(128, 512, 512), (66, 264, 640), (130, 200, 1000)]:
        xd, xs, wd, ws = _block_operands(m, n, k, seed=m)
        out = G.scaled_mm_blockwise(xd, xs, wd, ws, out_dtype=torch.bfloat16)
        ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
        assert _rel(out, ref) <= TOL[torch.bfloat16], (m, n, k)


def _poison_tail(ws: torch.Tensor) -> torch.Tensor:
    """ws copied to the head of a buffer whose next 256 floats are 2**10; contiguous, so every GEMM path uses
    this storage as it is and an out-of-bounds read of the scale grid finds the poison."""
    buf = torch.full((ws.numel() + 256,), 2.0 ** 10, device=ws.device)
    buf[: ws.numel()] = ws.reshape(-1)
    return buf[: ws.numel()].view(ws.shape)


@pytest.mark.parametrize("k", [640, 896, 1152])
def test_k_over_128_mod_4_trap(G, k):
    """The old `_scaled_mm` with unpadded block scales is silently wrong at K/128 % 4 != 0; ours is not.

    How wrong depends on which scales the old call reads in place of the right ones. Part of them lie past the
    weight-scale tensor, so they used to be whatever the allocator left there: H200 runs saw relative errors
    from 0.098 to 0.53, and in session 11 a change of allocation order elsewhere made K = 640 read near-right
    values. The weight scales now sit at the head of a buffer whose tail holds 2**10 (far from any real scale),
    so what the trap reads is fixed. The bar is relative to the padded call's own error: at least 20x it, and
    above the bf16 tolerance."""
    m, n = 64, 256
    xd, xs, wd, ws = _block_operands(m, n, k, seed=k)
    ws = _poison_tail(ws)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    good_err = 0.0
    for small_m in (64, 0):  # Triton decode kernel, then cuBLAS with padded scales
        good = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16, small_m=small_m)
        good_err = max(good_err, _rel(good, ref))
        assert _rel(good, ref) <= TOL[torch.bfloat16], f"fp8_block_linear(small_m={small_m}) wrong at K={k}"
    try:
        bad = G.legacy_scaled_mm_blockwise(xd, xs, wd, ws, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        pytest.skip(f"this torch rejects the legacy blockwise _scaled_mm call: {str(exc).splitlines()[0]}")
    err = _rel(bad, ref)
    assert err > max(TOL[torch.bfloat16], 20 * good_err), \
        f"legacy _scaled_mm at K={k} gave rel err {err:.3e} (padded call {good_err:.1e}): the trap did not reproduce"


def test_legacy_call_is_right_when_k_over_128_is_a_multiple_of_4(G):
    """Control for the trap: at K/128 % 4 == 0 the same legacy call is accurate, on the same poisoned scale
    storage (so the error above is the scale-layout bug, not a broken call or the poison itself)."""
    m, n, k = 64, 256, 1024
    xd, xs, wd, ws = _block_operands(m, n, k, seed=1)
    ws = _poison_tail(ws)
    try:
        out = G.legacy_scaled_mm_blockwise(xd, xs, wd, ws, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        pytest.skip(f"this torch rejects the legacy blockwise _scaled_mm call: {str(exc).splitlines()[0]}")
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    assert _rel(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.interpreter
def test_bad_operands_raise_clear_errors(G):
    """Wrong dtypes / scale shapes name the tensor and the expected layout."""
    xd, xs, wd, ws = _block_operands(4, 256, 512)
    with pytest.raises(ValueError, match="w_scale must be fp32"):
        G.fp8_block_linear(xd, xs, wd, ws.t().contiguous())
    with pytest.raises(ValueError, match="x_scale must be fp32"):
        G.fp8_block_linear(xd, xs[:, :2], wd, ws)
    with pytest.raises(ValueError, match="x_data must be torch.float8_e4m3fn"):
        G.fp8_block_linear(xd.float(), xs, wd, ws)
    with pytest.raises(ValueError, match="w_data must be"):
        G.fp8_block_linear(xd, xs, wd[:, :256], ws)


# ------------------------------------------------------------------ FP8 per-tensor
@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 5, 64, 65, 128])
def test_fp8_tensor_linear(G, m):
    """Per-tensor FP8: Triton for M <= 64, cuBLAS tensor-wise above; with bias; N, K not multiples of 16."""
    from engine.formats import quantize

    for n, k in [(256, 512), (200, 328)]:
        xq = quantize(torch.randn(m, k, device=DEV) * 3, "e4m3:tensor")
        wq = quantize(torch.randn(n, k, device=DEV) / 7, "e4m3:tensor")
        bias = torch.randn(n, device=DEV)
        for dt in (torch.bfloat16, torch.float32):
            out = G.fp8_tensor_linear(xq.data, xq.scale, wq.data, wq.scale, bias=bias, out_dtype=dt)
            ref = G.fp8_tensor_linear_reference(xq.data, xq.scale, wq.data, wq.scale, bias=bias,
                                                out_dtype=torch.float32)
            assert _rel(out, ref) <= TOL[dt], (m, n, k, dt)


# ------------------------------------------------------------------ MX / NVFP4
try:  # a module-level kernel: the interpreter resolves the helpers it calls from the module's globals
    import triton
    import triton.language as tl

    from engine.kernels.gemm import _e2m1_bytes_to_bf16, _e2m1_nibble_to_f32, _e2m1_to_f32, _e4m3_to_f32, _e8m0_to_f32

    @triton.jit
    def _decode_scale_codes(c_ptr, e8_ptr, e4_ptr):
        c = tl.load(c_ptr + tl.arange(0, 256))
        tl.store(e8_ptr + tl.arange(0, 256), _e8m0_to_f32(c))
        tl.store(e4_ptr + tl.arange(0, 256), _e4m3_to_f32(c))

    @triton.jit
    def _decode_fp4_bytes(b_ptr, lo_ptr, hi_ptr, lo_old_ptr, hi_old_ptr, lo_ptx_ptr, hi_ptx_ptr, PTX: tl.constexpr):
        b = tl.load(b_ptr + tl.arange(0, 256))
        tl.store(lo_ptr + tl.arange(0, 256), _e2m1_nibble_to_f32(b, 0))
        tl.store(hi_ptr + tl.arange(0, 256), _e2m1_nibble_to_f32(b, 4))
        tl.store(lo_old_ptr + tl.arange(0, 256), _e2m1_to_f32(b & 15))
        tl.store(hi_old_ptr + tl.arange(0, 256), _e2m1_to_f32(b >> 4))
        if PTX:  # inline PTX: not under the interpreter
            lo, hi = _e2m1_bytes_to_bf16(b.to(tl.uint8))
            tl.store(lo_ptx_ptr + tl.arange(0, 256), lo.to(tl.float32))
            tl.store(hi_ptx_ptr + tl.arange(0, 256), hi.to(tl.float32))
except ImportError:  # no Triton: the GPU tests skip
    _decode_scale_codes = _decode_fp4_bytes = None


@pytest.mark.interpreter
def test_mx_scale_code_decoders_are_exact(G):
    """The MX kernel's scale decoders on every code: `_e8m0_to_f32` = 2**(code - 127) (code 0: 2**-127, 255: NaN) and
    `_e4m3_to_f32` = torch's E4M3 value, signed zeros, subnormals and NaN included."""
    codes = torch.arange(256, dtype=torch.int32, device=DEV)
    e8, e4 = (torch.empty(256, device=DEV) for _ in range(2))
    _decode_scale_codes[(1,)](codes, e8, e4)
    want8 = torch.exp2(codes.double() - 127).float()
    want8[255] = float("nan")
    want4 = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    for got, want in ((e8, want8), (e4, want4)):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.interpreter
def test_mx_fp4_decoders_are_exact(G):
    """The MX kernel's E2M1 decoders on every packed byte, low and high nibble: the fp32 bits of the formats library's
    E2M1 values (-0 for code 8; 0.5, code 1, through the subnormal 2**-127 times 2**126 in `_e2m1_nibble_to_f32`). On
    the GPU also the PRMT table decode to bf16 (`_e2m1_bytes_to_bf16`, inline PTX)."""
    from engine.formats import decode_codes

    ptx = not INTERPRET
    b = torch.arange(256, dtype=torch.int32, device=DEV)
    outs = [torch.empty(256, device=DEV) for _ in range(6)]
    _decode_fp4_bytes[(1,)](b, *outs, PTX=ptx)
    want = [decode_codes((b & 15).to(torch.uint8), "e2m1").float(),
            decode_codes((b >> 4).to(torch.uint8), "e2m1").float()]
    assert torch.signbit(want[0][8]) and want[1][0x18] == 0.5  # -0 and a subnormal-path code are in the table
    for got, ref in zip(outs[:6 if ptx else 4], want * 3):
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.interpreter
@pytest.mark.parametrize("pair", [("mxfp8", "mxfp8"), ("bf16", "nvfp4"), ("bf16", "mxfp4"), ("fp32", "mxfp8")])
@pytest.mark.parametrize("m, split", [(5, 1), (5, 3), (70, 1)])
def test_mx_row_scales_give_the_gather_path_bits(G, monkeypatch, pair, m, split):
    """The per-row scale loads (`MX_ROW_SCALES`) and, on the GPU, the PTX E2M1 decode with bf16 scaling (`MX_FP4_PTX`)
    change how the operands are made, and the fused split-K reduce how partials are summed, not a bit of the output:
    the same fp32 bits as one gathered scale load per element and the reduce kernel, decode and prefill tiles, with
    a split, with a bias (NVFP4: and its tensor scale), blocks at the bottom of the float range included."""
    from engine.formats import quantize

    xkind, wspec = pair
    n, k = 136, 608  # K % 128 != 0: a partial last chunk
    w = _blocky(n, k, 1, 32, seed=m)
    w[:, 32:64] *= 2.0 ** -30  # tiny blocks
    w[:8, 96:160] *= 2.0 ** -124  # blocks at the bottom of the range: products below fp32's / bf16's normal minimum
    wp = G.prepare_mx_weight(quantize(w, wspec))
    args, kw = _mx_x(xkind, m, k, seed=m + 7)
    outs = []
    bias = torch.randn(n, device=DEV)
    for rows, ptx, fused in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        monkeypatch.setattr(G, "MX_ROW_SCALES", rows)
        monkeypatch.setattr(G, "MX_FP4_PTX", ptx)  # on the GPU only (mx_linear's gate)
        outs.append(G.mx_linear(*args, wp, bias=bias, out_dtype=torch.float32, split_k=split, fused_reduce=fused,
                                **kw))
    assert torch.isfinite(outs[0]).all() and outs[0].abs().sum() > 0
    for out in outs[1:]:
        assert torch.equal(outs[0].view(torch.int32), out.view(torch.int32))


@pytest.mark.interpreter
@pytest.mark.parametrize("spec", ["mxfp8", "mxfp4", "nvfp4"])
def test_prepared_mx_weight_dequantizes_bit_exactly(G, spec):
    """Repacking (FP4 nibbles, 1-byte scale codes, K padding) loses nothing: same fp32 bits as QTensor.dequantize."""
    from engine.formats import quantize

    wq = quantize(_blocky(72, 200, 1, 32, seed=2), spec)
    wp = G.prepare_mx_weight(wq)
    assert wp.data.shape[1] == (128 if spec != "mxfp8" else 256)
    assert torch.equal(G.dequantize_mx_weight(wp).view(torch.int32), wq.dequantize().view(torch.int32))


def _mx_x(kind: str, m: int, k: int, seed: int):
    """Activation argument(s) for mx_linear: an mxfp8 QTensor, (data, scale), or a bf16 / fp32 tensor."""
    from engine.formats import quantize

    x = _blocky(m, k, 1, 32, seed)
    if kind == "mxfp8":
        return (quantize(x, "mxfp8"),), {}
    if kind == "mxfp8_raw":
        q = quantize(x, "mxfp8")
        return (q.data,), {"x_scale": q.scale}
    return (x.to(torch.bfloat16 if kind == "bf16" else torch.float32),), {}


def _check_mx(G, wspec: str, xkind: str, m: int, dtypes) -> None:
    """mx_linear vs mx_linear_reference at N=200, K=352 (K % 128 != 0, N % 64 != 0) with a bias."""
    from engine.formats import quantize

    n, k = 200, 352
    wq = quantize(_blocky(n, k, 1, 32, seed=m + 1), wspec)
    wp = G.prepare_mx_weight(wq)
    args, kw = _mx_x(xkind, m, k, seed=m)
    bias = torch.randn(n, device=DEV)
    ref = G.mx_linear_reference(*args, wp, bias=bias, out_dtype=torch.float32, **kw)
    for dt in dtypes:
        tol = TOL[dt] if dt != torch.float32 else TOL_MX_ROUNDED_X if xkind == "fp32" else TOL_MX_EXACT_FP32
        out = G.mx_linear(*args, wp, bias=bias, out_dtype=dt, **kw)
        assert out.shape == (m, n) and out.dtype == dt
        err = _rel(out, ref)
        assert err <= tol, f"{xkind} x {wspec} M={m} {dt}: rel err {err:.3e} > {tol}"


@pytest.mark.interpreter
@pytest.mark.parametrize("wspec", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("xkind", ["mxfp8", "mxfp8_raw", "bf16", "fp32"])
@pytest.mark.parametrize("m", [1, 65])
def test_mx_linear(G, wspec, xkind, m):
    """Every (activation, weight) pairing of the dequant-in-kernel GEMM, decode and prefill tiles, fp32 out."""
    _check_mx(G, wspec, xkind, m, (torch.float32,))


@pytest.mark.interpreter
@pytest.mark.parametrize("pair", [("mxfp8", "mxfp8"), ("bf16", "nvfp4"), ("bf16", "mxfp4")])
@pytest.mark.parametrize("m", [2, 3, 5, 63, 64, 200])
def test_mx_linear_m_sweep(G, pair, m):
    """Other M (partial row tiles), bf16 output."""
    xkind, wspec = pair
    _check_mx(G, wspec, xkind, m, (torch.bfloat16,))


@pytest.mark.interpreter
@pytest.mark.parametrize("wspec", ["mxfp4", "nvfp4"])
def test_mx_linear_split_k_and_adversarial(G, wspec):
    """Forced split-K (the NVFP4 tensor scale then lives in the reduction), zero rows exact, a huge
    weight block next to tiny ones, and a QTensor weight prepared on the fly."""
    from engine.formats import quantize

    n, k = 96, 1024
    w = _blocky(n, k, 1, 32, seed=4)
    w[:, 64:96] *= 2.0 ** 20
    wq = quantize(w, wspec)
    x = _blocky(3, k, 1, 32, seed=6).to(torch.bfloat16)
    x[1] = 0
    ref = G.mx_linear_reference(x, wq, out_dtype=torch.float32)
    outs = [G.mx_linear(x, wq, out_dtype=torch.float32, split_k=s) for s in (1, 4)]
    for out in outs:
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert _rel(out, ref) <= TOL_MX_EXACT_FP32
    assert _rel(outs[0], outs[1]) <= 1e-5
