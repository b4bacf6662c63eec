"""The FP8 GEMMs of engine/kernels/gemm.py on block-scaled (e4m3:1x128 x e4m3:128x128) and per-tensor operands: the
Triton split-K kernel (decode tiles up to M = 64, 128x128 tiles above), the sliced kernel (split-K inside one
program), the M = 1 CUDA-core GEMV, the cuBLAS blockwise path, against their float64 references (tolerances:
tests/engine/kernels/gemm/common.py). The split-K reduce (fused) has its own module, test_split_k_reduce.py.

Markers: `gpu` (skipped without CUDA); `gpu` + `interpreter` also run on CPU tensors under TRITON_INTERPRET=1, with
the smaller cases of `by_device` (the same tiles, tails and splits); `interpreter` alone: checks at the interpreter's
tolerance (exact FP8 products, `TOL_INTERPRETER`) that only it can hold.

The K/128 % 4 trap: the old `torch._scaled_mm` call with unpadded scales must show a large error (> 0.1) at
K = 640 / 896 / 1152 while `fp8_block_linear` stays within tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engine.kernels.gemm.common import DEV, TOL, TOL_INTERPRETER, block_operands, blocky, rel, same_bits
from tests.support.interpret import INTERPRET, by_device
from tests.support.legacy_scaled_mm import legacy_scaled_mm_blockwise

M_SET = by_device([1, 2, 3, 5, 63, 64, 65], [5, 63, 65])  # BM 16 and 64 (masked rows), 128 x 128 tiles


@pytest.fixture(scope="module")
def P():
    """The decode plan (needs Triton)."""
    pytest.importorskip("triton")
    from engine.kernels import decode_plan

    return decode_plan


@pytest.fixture(scope="module")
def GF():
    """The FP8 kernels and their launch (needs Triton)."""
    pytest.importorskip("triton")
    from engine.kernels import gemm_fp8

    return gemm_fp8


@pytest.fixture(scope="module")
def G():
    """The kernel module (needs Triton)."""
    pytest.importorskip("triton")
    from engine.kernels import gemm

    return gemm


# ------------------------------------------------------------------ FP8 block
@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("m", M_SET)
@pytest.mark.parametrize("nk", by_device([(256, 512), (200, 320), (136, 1000)], [(256, 512), (136, 1000)]))  # N, K tails
def test_fp8_block_linear_random(G, m, nk):
    """Both paths (Triton for M <= 64, cuBLAS blockwise above) within tolerance, bf16 and fp32 out."""
    n, k = nk
    xd, xs, wd, ws = block_operands(m, n, k, seed=m)
    for dt in (torch.bfloat16, torch.float32):
        out = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=dt)
        ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
        assert out.shape == (m, n) and out.dtype == dt
        err = rel(out, ref)
        assert err <= TOL[dt], f"M={m} N={n} K={k} {dt}: rel err {err:.3e} > {TOL[dt]}"


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("m", by_device([3, 64, 130], [3, 130]))
def test_fp8_block_linear_bias_and_leading_dims(G, m):
    """Bias (N,) is added once; (B, T, K) activations give (B, T, N)."""
    n, k = 192, 384
    xd, xs, wd, ws = block_operands(2 * m, n, k, seed=7)
    bias = torch.randn(n, device=DEV) * 4
    x3, s3 = xd.reshape(2, m, k), xs.reshape(2, m, -1)
    out = G.fp8_block_linear(x3, s3, wd, ws, bias=bias, out_dtype=torch.float32)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
    assert out.shape == (2, m, n)
    assert rel(out.reshape(2 * m, n), ref) <= TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("m", by_device([1, 5, 64, 65, 128], [5, 65]))
def test_fp8_block_linear_adversarial(G, m):
    """Zero rows give exact zeros; amax at 448 (every element +-448) and all-zero K groups stay accurate."""
    n, k = 256, 640
    xd, xs, wd, ws = block_operands(m, n, k, seed=11)
    xd, xs = xd.clone(), xs.clone()
    xd[0] = 0  # a zero row quantizes to zeros with scale 1
    xs[0] = 1.0
    if m > 2:
        xd[2, 128:256] = 0  # one all-zero group inside a row
    out = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16)
    assert torch.equal(out[0], torch.zeros_like(out[0])), "a zero activation row must give an exact zero row"
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    assert rel(out, ref) <= TOL[torch.bfloat16]
    g = torch.Generator(device=DEV).manual_seed(3)
    sign = lambda r, c: torch.where(torch.rand(r, c, device=DEV, generator=g) < 0.5, -448.0, 448.0)
    xd448 = sign(m, k).to(torch.float8_e4m3fn)
    wd448 = sign(n, k).to(torch.float8_e4m3fn)
    xs448 = torch.rand(m, 5, device=DEV, generator=g) + 0.5
    ws448 = torch.rand(2, 5, device=DEV, generator=g) + 0.5
    out = G.fp8_block_linear(xd448, xs448, wd448, ws448, out_dtype=torch.float32)
    ref = G.fp8_block_linear_reference(xd448, xs448, wd448, ws448, out_dtype=torch.float32)
    assert torch.isfinite(out).all()
    assert rel(out, ref) <= TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 63, 64])
@pytest.mark.parametrize("nk", [(512, 1024), (200, 896)])
def test_small_m_kernel_matches_large_m_path(G, m, nk):
    """The Triton decode kernel (small_m=64) equals the cuBLAS blockwise path (small_m=0, M padded to 4),
    both with bf16 output (the format cuBLAS blockwise is measured with). Not under the interpreter: off CUDA both
    calls are the same Triton launch."""
    n, k = nk
    xd, xs, wd, ws = block_operands(m, n, k, seed=5)
    small = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16, small_m=64)
    large = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16, small_m=0)
    err = rel(small, large)
    assert err <= TOL[torch.bfloat16], f"small-M kernel vs large-M path: {err:.3e}"
    assert not torch.equal(small, torch.zeros_like(small))


@pytest.mark.gpu
@pytest.mark.interpreter
def test_split_k_is_deterministic_and_consistent(G):
    """Split-K changes only the fp32 summation order; the same call twice gives the same bits."""
    xd, xs, wd, ws = block_operands(4, 256, by_device(2048, 1024), seed=9)
    one = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, split_k=1)
    four = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, split_k=4)
    again = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, split_k=4)
    assert torch.equal(four, again)
    assert rel(four, one) <= 1e-5
    assert not torch.equal(one, torch.zeros_like(one))


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("m", by_device([1, 4, 16, 40], [4, 40]))
@pytest.mark.parametrize("fused", [True, False])
def test_bf16_rounded_fp32_output_is_the_bf16_output(G, GF, m, fused):
    """out_round='bf16' (a bf16 output kept in the engine's fp32 carrier) gives bit for bit the bf16 output widened
    to fp32, with and without bias, on the split-K Triton path (fused and separate reduce) and on cuBLAS (m = 40
    with small_m = 16); the fused reduce equals the separate one."""
    n, k = by_device((768, 4096), (192, 1024))
    xd, xs, wd, ws = block_operands(m, n, k, seed=21)
    bias = torch.randn(n, device=DEV)
    for b in (None, bias):
        if m <= 16:
            want = G.fp8_block_gemm_triton(xd, xs, wd, ws, b, out_dtype=torch.bfloat16, split_k=4,
                                           fused_reduce=fused, sliced=False).float()
            got = GF._launch_fp8(xd, xs, (xs.stride(0), xs.stride(1)), wd, ws, (ws.stride(0), ws.stride(1)), b,
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


@pytest.mark.gpu
@pytest.mark.interpreter
# the interpreter: K = 1100 is 9 groups, the last partial (in 2 slices 5 + 4, in 4 slices 3 + 3 + 3 + an empty one, in 8
# three empty ones), N = 136 a tail; M = 33 in 2 slices, refused in 4 and 8
@pytest.mark.parametrize("mnk", by_device([(1, 256, 1024), (2, 200, 1000), (4, 320, 1152), (8, 136, 2048),
                                           (16, 128, 640), (33, 64, 512)],
                                          [(4, 136, 1100), (33, 64, 512)]))
def test_sliced_kernel_is_split_k(G, GF, mnk):
    """The sliced kernel (split-K inside one program, slices summed in registers) gives the split-K kernel's bits
    with as many splits, 64-row tiles and 4 warps, and its reduce, on the GPU: slices of 2 / 4 / 8, 8-64 weight rows
    per slice, N tails (200, 136), a partial last group (K = 1000), uneven and empty slices (9 groups in 4 or 8
    slices), bias, bf16 / fp32 / bf16-rounded output. Under the interpreter, whose dot sums in numpy's order per
    shape, within 1e-6. Both within TOL of the float64 reference."""
    m, n, k = mnk
    xd, xs, wd, ws = block_operands(m, n, k, seed=m + n)
    bias = torch.randn(n, device=DEV)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
    rows = by_device({2: (32, 64), 4: (16, 32), 8: (8, 16)}, {2: (64,), 4: (32,), 8: (8, 16)})  # 8-64 rows a slice
    for s in (2, 4, 8):
        if s * _next_pow2(m) > 128:  # M = 33 in 4 / 8 slices: 256 / 512 MMA columns, refused by name
            with pytest.raises(ValueError, match=f"sliced={s} at M={m}"):
                G.fp8_block_gemm_triton(xd, xs, wd, ws, sliced=s)
            continue
        split = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias, out_dtype=torch.float32, split_k=s, block_n=64,
                                        num_warps=4, num_stages=3, fused_reduce=True, sliced=False)
        for r in rows[s]:
            got = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias, out_dtype=torch.float32, sliced=s, block_n=r)
            assert rel(got, ref) <= TOL[torch.float32], (s, r)
            if INTERPRET:
                assert rel(got, split) <= 1e-6, (s, r)
            else:
                assert torch.equal(got, split), (s, r)
        bf = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias, out_dtype=torch.bfloat16, sliced=s)
        rounded = GF._launch_fp8(xd, xs, (xs.stride(0), xs.stride(1)), wd, ws, (ws.stride(0), ws.stride(1)), bias,
                                torch.float32, None, round_bf16=True, sliced=s)
        assert rel(bf, ref) <= TOL[torch.bfloat16] and torch.equal(rounded, bf.float()), s
    with pytest.raises(ValueError, match="sliced=3"):
        G.fp8_block_gemm_triton(xd, xs, wd, ws, sliced=3)
    with pytest.raises(ValueError, match="block_n=128"):
        G.fp8_block_gemm_triton(xd, xs, wd, ws, sliced=4, block_n=128)


@pytest.mark.gpu
def test_sliced_auto_takes_small_m_split_k_calls(G, GF, P, monkeypatch):
    """On the GPU, split-K calls with 2 / 4 splits of 64-row tiles and M <= 16 / splits run the sliced kernel with the
    split-K plan's K partition (counted), the same bits as split-K (sliced=False); M above that, 8 splits, 32-row
    tiles and sliced=False stay on split-K."""
    calls = []
    real = GF._launch_sliced
    monkeypatch.setattr(GF, "_launch_sliced", lambda *a, **kw: calls.append(a[9]) or real(*a, **kw))
    xd, xs, wd, ws = block_operands(8, 192, 2048, seed=3)
    for m, kw, slices in ((4, dict(split_k=4), 4), (2, dict(split_k=4), 4), (8, dict(split_k=2), 2),
                          (5, dict(split_k=4), None), (2, dict(split_k=8), None),
                          (4, dict(split_k=4, block_n=32), None), (4, dict(split_k=4, sliced=False), None)):
        calls.clear()
        got = G.fp8_block_gemm_triton(xd[:m], xs[:m], wd, ws, out_dtype=torch.float32, **kw)
        want = G.fp8_block_gemm_triton(xd[:m], xs[:m], wd, ws, out_dtype=torch.float32, **dict(kw, sliced=False))
        assert calls == ([slices] if slices else []), (m, kw)
        assert torch.equal(got, want), (m, kw)
    calls.clear()
    G.fp8_block_gemm_triton(xd[:4], xs[:4], wd, ws, out_dtype=torch.float32, split_k=4,
                            policy=dataclasses.replace(P.DEFAULT_POLICY, sliced_auto=False))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 14336), (200, 1000), (136, 320)])
def test_m1_runs_the_cuda_core_gemv(G, GF, P, nk, monkeypatch):
    """M = 1 without knobs runs `_fp8_gemv_kernel` (counted): within TOL of the float64 reference with and without
    bias, in bf16 / fp32 / bf16-rounded fp32 (bit for bit the bf16 output widened), fp32 output within 1e-4
    (exact products, fp32 sums; the MMA kernel's bound is TOL), deterministic; N and K tails (200 x 1000)
    masked; a policy with gemv_m1=False restores the split-K kernel."""
    n, k = nk
    xd, xs, wd, ws = block_operands(1, n, k, seed=n + k)
    bias = torch.randn(n, device=DEV)
    calls = []
    real = GF._launch_gemv
    monkeypatch.setattr(GF, "_launch_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    for b in (None, bias):
        r = ref if b is None else ref + b
        f32 = G.fp8_block_linear(xd, xs, wd, ws, b, out_dtype=torch.float32)
        bf = G.fp8_block_linear(xd, xs, wd, ws, b, out_dtype=torch.bfloat16)
        rounded = G.fp8_block_linear(xd, xs, wd, ws, b, out_dtype=torch.float32, out_round="bf16")
        assert rel(f32, r) <= TOL[torch.float32] and rel(bf, r) <= TOL[torch.bfloat16]
        assert torch.equal(rounded, bf.float()) and torch.equal(f32, G.fp8_block_linear(xd, xs, wd, ws, b,
                                                                                       out_dtype=torch.float32))
        # exact products summed in fp32: far inside the FP8 tensor-core path's TOL (its MMA accumulates each
        # 128-group with reduced precision), which the split-K kernel still meets on the same operands
        mma = G.fp8_block_gemm_triton(xd, xs, wd, ws, b, out_dtype=torch.float32, split_k=2)
        assert rel(f32, r) <= 1e-4 and rel(mma, r) <= TOL[torch.float32]
    assert len(calls) == 8
    G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32,
                       policy=dataclasses.replace(P.DEFAULT_POLICY, gemv_m1=False))
    assert len(calls) == 8


@pytest.mark.gpu
def test_gemv_configs_entry_is_dispatched(G, P, GF, monkeypatch):
    """M = 1 runs the policy's GEMV entry for (device, N, K) exactly as `_launch_gemv` with those knobs; other knobs
    stay within 1e-4 of the reference (exact products, fp32 sums in another order)."""
    xd, xs, wd, ws = block_operands(1, 384, 1536, seed=7)
    dev = xd.device
    cfg = dict(block_n=4, groups=4, num_stages=2, num_warps=2)
    seen = []
    real = GF._launch_gemv
    monkeypatch.setattr(GF, "_launch_gemv", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    key = (P._device_name(dev.type, dev.index), 384, 1536)
    policy = dataclasses.replace(P.DEFAULT_POLICY, gemv_configs={**P.DEFAULT_POLICY.gemv_configs, key: cfg})
    tuned = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32, policy=policy)
    assert seen[-1] == dict(cfg, pdl=True)  # the entry's knobs, and the default options' PDL
    explicit = torch.empty_like(tuned)
    real(xd, xs, xs.stride(), wd, ws, ws.stride(), None, explicit, False, **cfg)
    assert torch.equal(tuned, explicit)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    for other in (dict(), dict(block_n=16, groups=2, num_stages=3, num_warps=4)):
        out = torch.empty_like(tuned)
        real(xd, xs, xs.stride(), wd, ws, ws.stride(), None, out, False, **other)
        assert rel(out, ref) <= 1e-4


@pytest.mark.gpu
@pytest.mark.interpreter
def test_triton_large_m_fallback(G):
    """The Triton kernel with large tiles (used when cuBLAS refuses) is accurate too."""
    xd, xs, wd, ws = block_operands(*by_device((200, 264, 1152), (130, 136, 640)), seed=13)
    out = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    assert rel(out, ref) <= TOL[torch.float32]


@pytest.mark.gpu
def test_cublas_blockwise_path_runs_on_sm90(G):
    """On sm_90 with F.scaled_mm the fast path must really run (not silently fall back) and be correct,
    also at K/128 % 4 != 0 (scale padding) and M % 4 != 0 (row padding)."""
    if torch.cuda.get_device_capability() != (9, 0) or not G.has_scaled_mm():
        pytest.skip("cuBLAS blockwise FP8 needs sm_90 and torch.nn.functional.scaled_mm")
    for m, n, k in [(128, 512, 512), (66, 264, 640), (130, 200, 1000)]:
        xd, xs, wd, ws = block_operands(m, n, k, seed=m)
        out = G.scaled_mm_blockwise(xd, xs, wd, ws, out_dtype=torch.bfloat16)
        ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
        assert rel(out, ref) <= TOL[torch.bfloat16], (m, n, k)


def _poison_tail(ws: torch.Tensor) -> torch.Tensor:
    """ws copied to the head of a buffer whose next 256 floats are 2**10; contiguous, so every GEMM path uses
    this storage as it is and an out-of-bounds read of the scale grid finds the poison."""
    buf = torch.full((ws.numel() + 256,), 2.0 ** 10, device=ws.device)
    buf[: ws.numel()] = ws.reshape(-1)
    return buf[: ws.numel()].view(ws.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [640, 896, 1152])
def test_k_over_128_mod_4_trap(G, k):
    """The old `_scaled_mm` with unpadded block scales is silently wrong at K/128 % 4 != 0; ours is not.

    How wrong depends on which scales the old call reads in place of the right ones. Part of them lie past the
    weight-scale tensor, so they used to be whatever the allocator left there: H200 runs saw relative errors
    from 0.098 to 0.53, and once (H200, 2026-11-29) a change of allocation order elsewhere made K = 640 read
    near-right values. The weight scales now sit at the head of a buffer whose tail holds 2**10 (far from any real scale),
    so what the trap reads is fixed. The bar is relative to the padded call's own error: at least 20x it, and
    above the bf16 tolerance."""
    m, n = 64, 256
    xd, xs, wd, ws = block_operands(m, n, k, seed=k)
    ws = _poison_tail(ws)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    good_err = 0.0
    for small_m in (64, 0):  # Triton decode kernel, then cuBLAS with padded scales
        good = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.bfloat16, small_m=small_m)
        good_err = max(good_err, rel(good, ref))
        assert rel(good, ref) <= TOL[torch.bfloat16], f"fp8_block_linear(small_m={small_m}) wrong at K={k}"
    try:
        bad = legacy_scaled_mm_blockwise(xd, xs, wd, ws, out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        pytest.skip(f"this torch rejects the legacy blockwise _scaled_mm call: {str(exc).splitlines()[0]}")
    err = rel(bad, ref)
    assert err > max(TOL[torch.bfloat16], 20 * good_err), \
        f"legacy _scaled_mm at K={k} gave rel err {err:.3e} (padded call {good_err:.1e}): the trap did not reproduce"


@pytest.mark.gpu
def test_legacy_call_is_right_when_k_over_128_is_a_multiple_of_4(G):
    """Control for the trap: at K/128 % 4 == 0 the same legacy call is accurate, on the same poisoned scale
    storage (so the error above is the scale-layout bug, not a broken call or the poison itself)."""
    m, n, k = 64, 256, 1024
    xd, xs, wd, ws = block_operands(m, n, k, seed=1)
    ws = _poison_tail(ws)
    try:
        out = legacy_scaled_mm_blockwise(xd, xs, wd, ws, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        pytest.skip(f"this torch rejects the legacy blockwise _scaled_mm call: {str(exc).splitlines()[0]}")
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
    assert rel(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.interpreter
def test_bad_operands_raise_clear_errors(G):
    """Wrong dtypes / scale shapes name the tensor and the expected layout."""
    xd, xs, wd, ws = block_operands(4, 256, 512)
    with pytest.raises(ValueError, match="w_scale must be fp32"):
        G.fp8_block_linear(xd, xs, wd, ws.t().contiguous())
    with pytest.raises(ValueError, match="x_scale must be fp32"):
        G.fp8_block_linear(xd, xs[:, :2], wd, ws)
    with pytest.raises(ValueError, match="x_data must be torch.float8_e4m3fn"):
        G.fp8_block_linear(xd.float(), xs, wd, ws)
    with pytest.raises(ValueError, match="w_data must be"):
        G.fp8_block_linear(xd, xs, wd[:, :256], ws)


# ------------------------------------------------------------------ FP8 per-tensor
@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize("m", by_device([1, 5, 64, 65, 128], [5, 65]))
def test_fp8_tensor_linear(G, m):
    """Per-tensor FP8: Triton for M <= 64, cuBLAS tensor-wise above; with bias; N, K not multiples of 16."""
    from engine.formats import quantize

    for n, k in by_device([(256, 512), (200, 328)], [(200, 328)]):
        xq = quantize(torch.randn(m, k, device=DEV) * 3, "e4m3:tensor")
        wq = quantize(torch.randn(n, k, device=DEV) / 7, "e4m3:tensor")
        bias = torch.randn(n, device=DEV)
        for dt in (torch.bfloat16, torch.float32):
            out = G.fp8_tensor_linear(xq.data, xq.scale, wq.data, wq.scale, bias=bias, out_dtype=dt)
            ref = G.fp8_tensor_linear_reference(xq.data, xq.scale, wq.data, wq.scale, bias=bias,
                                                out_dtype=torch.float32)
            assert rel(out, ref) <= TOL[dt], (m, n, k, dt)




# ------------------------------------------------------------------ at the interpreter's tolerance
@pytest.mark.interpreter
@pytest.mark.parametrize("m, n, k", [(1, 256, 512), (3, 200, 896), (17, 136, 1000)])
def test_split_k_tiles_vs_reference_exactly(G, m, n, k):
    """Every weight tile (32 / 64 / 128 rows) and K split count (1 / 2 / 3; 896 = 7 groups in 3 splits of 3, 3, 1)
    on N off the tile grid, K with a partial last group and K % 128 != 0, M in the BM 16 and 32 tiles, against the
    float64 reference within 1e-5: a split that drops or repeats a K group, or a tile that reads the wrong block's
    scale, misses by orders of magnitude more."""
    ops = block_operands(m, n, k, seed=m)
    ref = G.fp8_block_linear_reference(*ops, out_dtype=torch.float32)
    for bn, split in ((32, 1), (64, 2), (128, 3)):
        out = G.fp8_block_gemm_triton(*ops, out_dtype=torch.float32, split_k=split, block_n=bn, num_warps=4,
                                      num_stages=3, fused_reduce=True)
        assert out.shape == (m, n)
        assert rel(out, ref) <= TOL_INTERPRETER, f"M={m} N={n} K={k} block_n={bn} split_k={split}: {rel(out, ref):.2e}"


@pytest.mark.interpreter
@pytest.mark.parametrize("split, fused", [(1, True), (2, True), (2, False), (3, True)])
def test_bias_and_bf16_rounding_epilogues(G, GF, split, fused):
    """Bias in the epilogue (one split), in the fused reduce and in the reduce kernel, within 1e-5 of the reference;
    rounding to bf16 values in each (fp32 carrier) gives torch's round-to-nearest-even of the same fp32 output, and
    the bf16 output those values (the store rounds as the GPU's cvt.rn.bf16.f32: tests/support/interpret.py)."""
    m, n, k = 4, 200, 640
    x, xs, w, ws = ops = block_operands(m, n, k, seed=11)
    bias = blocky(1, n, 1, 8, seed=12)[0]
    ref = G.fp8_block_linear_reference(*ops, bias=bias, out_dtype=torch.float32)
    kw = dict(split_k=split, block_n=64, num_warps=4, num_stages=3, fused_reduce=fused)
    out = G.fp8_block_gemm_triton(*ops, bias=bias, out_dtype=torch.float32, **kw)
    assert rel(out, ref) <= TOL_INTERPRETER, rel(out, ref)
    rounded = GF._launch_fp8(x, xs, xs.stride(), w, ws, ws.stride(), bias, torch.float32, round_bf16=True, **kw)
    assert not same_bits(rounded, out), "rounding to bf16 values changed nothing"
    assert same_bits(rounded, out.to(torch.bfloat16).float())
    as_bf16 = G.fp8_block_gemm_triton(*ops, bias=bias, out_dtype=torch.bfloat16, **kw)
    assert torch.equal(as_bf16.float(), rounded)


@pytest.mark.interpreter
@pytest.mark.parametrize("n, k, block_n, groups", [(256, 1024, 8, 8), (200, 896, 4, 8), (136, 1000, 8, 2)])
def test_gemv_kernel_vs_reference_exactly(G, GF, n, k, block_n, groups):
    """The M = 1 CUDA-core kernel (`_launch_gemv`; on the GPU M = 1 calls take it by themselves): rows per program,
    groups per step, N and K tails (200, 136; K = 1000), a bias, within 1e-5 of the float64 reference."""
    x, xs, w, ws = block_operands(1, n, k, seed=n)
    bias = blocky(1, n, 1, 8, seed=n + 1)[0]
    ref = G.fp8_block_linear_reference(x, xs, w, ws, bias=bias, out_dtype=torch.float32)
    out = torch.empty((1, n), dtype=torch.float32, device=DEV)
    GF._launch_gemv(x, xs, xs.stride(), w, ws, ws.stride(), bias, out, False, block_n=block_n, groups=groups,
                   num_stages=2, num_warps=2)
    assert rel(out, ref) <= TOL_INTERPRETER, f"GEMV N={n} K={k} block_n={block_n} groups={groups}: {rel(out, ref):.2e}"
