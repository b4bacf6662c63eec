"""Tuning knobs of the Triton kernels (the values benchmarks/tune_kernels.py sweeps) keep the numerics
(GPU only; skipped without CUDA).

* quant: every tiling / mode gives FP8 data + scales bit-exact with the formats library on the kernel's
  own pre-quant values; act_quant / SwiGLU tilings give identical bits to the default tiling;
* GEMM: block_n / split_k / pipeline knobs stay within the fp32 tolerance of test_gemm_gpu.py; the fused
  split-K reduction gives the same bits as the two-kernel path (NaN / Inf partials included), and a CUDA
  graph captured with it survives its counter buffer being outgrown; so does the cluster reduce (splits of a
  tile in one thread-block cluster, partials summed through distributed shared memory), in CUDA graphs with
  and without PDL; a DECODE_CONFIGS entry is what the dispatch runs;
* paged decode attention: qk_fp16 changes only the conversion path (scores agree to ~1e-6 even for q rows
  scaled by 2**+-60), fold_v_scale and the tile knobs stay within the attention tolerance of the FP32
  reference.

The tests marked `interpreter` also run on the CPU under TRITON_INTERPRET=1 (tests/test_gpu_tests_interpreter.py),
with the interpreter's bf16 / FP8 arithmetic made the GPU's (tests/interpret_util.py: `faithful_floats`).
"""

from __future__ import annotations

import pytest
import torch

from tests.interpret_util import GPU_TEST_DEVICE

# skipped without CUDA; under TRITON_INTERPRET=1 the tests marked `interpreter` run on the CPU (tests/conftest.py)
pytestmark = pytest.mark.gpu

DEV = GPU_TEST_DEVICE  # "cpu" under TRITON_INTERPRET=1
ATT_TOL = 1.5e-2  # tests/test_attention_gpu.py: max |out - ref| <= 1.5e-2 * max |ref|
GEMM_TOL = 2e-3  # tests/test_gemm_gpu.py, fp32 output of the FP8 tensor-core path


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of an FP8 tensor."""
    return t.contiguous().view(torch.uint8)


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal fp32 tensor on DEV."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV)


# --------------------------------------------------------------------------------------------- quant
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


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", [(5, 1000), (9, 7168)])
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


# ---------------------------------------------------------------------------------------------- GEMM
def _block_operands(m: int, n: int, k: int, seed: int):
    """e4m3:1x128 activations, e4m3:128x128 weights with per-block magnitudes 2**U{-4..4}."""
    from engine.formats import quantize

    def blocky(rows, cols, r, c, s):
        x = _randn(rows, cols, seed=s)
        g = torch.Generator().manual_seed(s + 1)
        mag = torch.exp2(torch.randint(-4, 5, (-(-rows // r), -(-cols // c)), generator=g).float()).to(DEV)
        return x * mag.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]

    xq = quantize(blocky(m, k, 1, 128, seed), "e4m3:1x128")
    wq = quantize(blocky(n, k, 128, 128, seed + 2), "e4m3:128x128")
    return xq.data, xq.scale, wq.data, wq.scale


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.interpreter
@pytest.mark.parametrize("m", [1, 5])
def test_fp8_gemm_knobs_and_fused_reduce(m):
    """block_n / split_k / warps / stages within tolerance; fused split-K reduce == two-kernel path, bit for bit."""
    from engine.kernels import gemm as G

    n, k = 320, 1152  # K/128 = 9 groups: uneven splits; N not a multiple of 128
    xd, xs, wd, ws = _block_operands(m, n, k, seed=10 + m)
    bias = _randn(n, seed=12)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
    for bn in (32, 128):
        for split in (1, 4):
            plain = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32, split_k=split,
                                            block_n=bn, num_warps=4, num_stages=3)
            assert _rel(plain, ref) < GEMM_TOL, (bn, split)
            fused = G.fp8_block_gemm_triton(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32, split_k=split,
                                            block_n=bn, num_warps=4, num_stages=3, fused_reduce=True)
            assert torch.equal(fused, plain), (bn, split)
    assert int(G._COUNTERS[xd.device].abs().sum()) == 0  # the last split of each tile reset its counter
    with pytest.raises(ValueError, match="block_n"):
        G.fp8_block_gemm_triton(xd, xs, wd, ws, block_n=48)


@pytest.mark.interpreter
@pytest.mark.parametrize("k, splits", [(2048, (2, 3, 4, 6, 8, 16)), (1152, (5, 9))])
def test_fused_reduce_bursts_same_bits(monkeypatch, k, splits):
    """The fused reduce loading four, two or one partials per round trip (the kernels' RED, forced through
    `reduce_burst`) gives the two-kernel path's bits at every split count, full bursts (4, 8, 16 splits) and a short
    last one (2, 3, 5, 6, 9), on the FP8 split-K kernel, and on the MX kernel (MXFP8 x MXFP8 and bf16 x NVFP4) at 4,
    5 and 9 splits."""
    from engine.formats import quantize
    from engine.kernels import gemm as G

    m, n = 5, 128
    xd, xs, wd, ws = _block_operands(m, n, k, seed=k)
    x = _randn(m, k, seed=3).to(torch.bfloat16)
    w32 = _randn(n, k, seed=4)
    mx_cases = [(quantize(x.float(), "mxfp8"), G.prepare_mx_weight(quantize(w32, "mxfp8"))),
                (x, G.prepare_mx_weight(quantize(w32, "nvfp4")))]
    for split in splits:
        assert G._plan_split(m, n, k // 128, 16, 64, xd.device, split)[0] == split
        kw = dict(split_k=split, block_n=64, num_warps=4, num_stages=3, sliced=False)
        plain = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, fused_reduce=False, **kw)
        mx = mx_cases if split in (4, 5, 9) else []
        mx_plain = [G.mx_linear(a, b, out_dtype=torch.float32, split_k=split, fused_reduce=False) for a, b in mx]
        for burst in (4, 2, 1):
            monkeypatch.setattr(G, "reduce_burst", lambda splits, programs, sms, r=burst: r)
            fused = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, fused_reduce=True, **kw)
            assert torch.equal(fused.view(torch.int32), plain.view(torch.int32)), (split, burst)
            for (a, b), ref in zip(mx, mx_plain):
                got = G.mx_linear(a, b, out_dtype=torch.float32, split_k=split, fused_reduce=True)
                assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (split, burst)


def test_fused_reduce_counters_outgrown_under_a_graph(monkeypatch):
    """A CUDA graph captured with the fused split-K reduce keeps working after a call with more tiles has grown the
    counter buffer: the old buffer is retired, not freed, and every call leaves its counters at zero."""
    from engine.kernels import gemm as G

    import weakref

    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setitem(G._COUNTERS, dev, torch.zeros(8, dtype=torch.int32, device=dev))
    monkeypatch.setattr(G, "_RETIRED", [])
    small = weakref.ref(G._COUNTERS[dev])  # only the module may keep the captured buffer alive
    xd, xs, wd, ws = _block_operands(4, 512, 2048, seed=40)  # 8 tiles of 64 rows
    kw = dict(out_dtype=torch.float32, split_k=4, block_n=64, num_warps=4, num_stages=3, fused_reduce=True,
              sliced=False)  # M = 4 with 4 splits would otherwise run the sliced kernel, which has no counters
    want = G.fp8_block_gemm_triton(xd, xs, wd, ws, **kw)
    assert G._COUNTERS[dev] is small()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = G.fp8_block_gemm_triton(xd, xs, wd, ws, **kw)
    big = _block_operands(4, 2048, 2048, seed=41)  # 32 tiles: a new counter buffer
    G.fp8_block_gemm_triton(*big, **kw)
    assert G._COUNTERS[dev] is not small() and G._COUNTERS[dev].numel() >= 4096
    assert small() is not None  # retired, not freed: the graph's counters are still this tensor's memory
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    assert int(small().abs().sum()) == 0 and int(G._COUNTERS[dev].abs().sum()) == 0


@pytest.fixture
def cluster_launches(monkeypatch):
    """Cluster sizes of the cluster-reduce launches made during the test (engine.kernels.cluster.launch spied)."""
    from engine.kernels import cluster as cl

    sizes, real = [], cl.launch

    def spy(kernel, grid, size, region, args, **options):
        sizes.append(size)
        return real(kernel, grid, size, region, args, **options)

    monkeypatch.setattr(cl, "launch", spy)
    return sizes


@pytest.mark.parametrize("m", [2, 5, 16, 33, 64])
def test_cluster_reduce_same_bits_as_fused(m, cluster_launches):
    """The K splits of each tile as one thread-block cluster, reduced through distributed shared memory: the same bits
    as the fused reduce for 2 / 4 / 8 splits (uneven last splits), 16-128 weight rows per tile, fp32 and bf16 output
    with bias, and the bf16-rounded fp32 carrier; every call really ran as a cluster."""
    from engine.kernels import gemm as G

    n, k = 320, 1920  # 15 K groups: every split count leaves a shorter last split; N not a multiple of the tile
    xd, xs, wd, ws = _block_operands(m, n, k, seed=50 + m)
    bias = _randn(n, seed=51)
    ref = G.fp8_block_linear_reference(xd, xs, wd, ws, bias=bias, out_dtype=torch.float32)
    cases = 0
    for bn in (16, 64, 128):
        for split in (2, 4, 8):
            for out_dtype in (torch.float32, torch.bfloat16):
                kw = dict(bias=bias, out_dtype=out_dtype, split_k=split, block_n=bn, num_warps=4, num_stages=3)
                fused = G.fp8_block_gemm_triton(xd, xs, wd, ws, fused_reduce=True, **kw)
                clus = G.fp8_block_gemm_triton(xd, xs, wd, ws, cluster=True, **kw)
                assert torch.equal(clus, fused), (bn, split, out_dtype)
                cases += 1
            assert _rel(clus, ref) < 1e-2  # bf16 output
            strides = (xs.stride(0), xs.stride(1)), (ws.stride(0), ws.stride(1))
            rounded = [G._launch_fp8(xd, xs, strides[0], wd, ws, strides[1], bias, torch.float32, split, block_n=bn,
                                     num_warps=4, num_stages=3, round_bf16=True, **{key: True})
                       for key in ("fused_reduce", "cluster")]
            assert torch.equal(rounded[1], rounded[0]) and torch.equal(rounded[1], rounded[1].bfloat16().float())
            cases += 1
    assert cluster_launches == [s for bn in (16, 64, 128) for s in (2, 4, 8) for _ in range(3)] and cases == 27


@pytest.mark.parametrize("how", ["fused_reduce", "cluster"])
@pytest.mark.parametrize("m", [2, 16])
def test_split_k_reduce_with_nan_and_inf_partials(m, how, cluster_launches):
    """NaN / Inf in one split's partial sums (a NaN activation, an Inf activation scale) reach the output through the
    fused reduce and through the cluster reduce exactly as through the reduce kernel; the fused reduce leaves its
    counters at zero, the cluster reduce really ran in clusters."""
    from engine.kernels import gemm as G

    n, k = 256, 1024
    xd, xs, wd, ws = _block_operands(m, n, k, seed=30 + m)
    xd = xd.clone()
    xd[0, 5] = float("nan")  # e4m3fn has a NaN and no Inf: the Inf comes from a scale
    xs = xs.clone()
    xs[m - 1, 6] = float("inf")
    for split in (2, 8):
        kw = dict(out_dtype=torch.float32, split_k=split, block_n=64, num_warps=4, num_stages=3)
        plain = G.fp8_block_gemm_triton(xd, xs, wd, ws, fused_reduce=False, **kw)
        got = G.fp8_block_gemm_triton(xd, xs, wd, ws, **{how: True}, **kw)
        assert bool(plain[0].isnan().all()) and not bool(plain[m - 1].isfinite().all())
        torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)
    if how == "cluster":
        assert cluster_launches == [2, 8]
    else:
        assert int(G._COUNTERS[xd.device].abs().sum()) == 0 and not cluster_launches


def test_cluster_reduce_in_a_graph_with_and_without_pdl(cluster_launches):
    """Cluster launches captured in a CUDA graph replay to the eager bits, with programmatic dependent launch on and
    off; the device holds at least one cluster of the kernel."""
    from engine.kernels import gemm as G
    from engine.kernels import pdl

    xd, xs, wd, ws = _block_operands(4, 1024, 4096, seed=70)
    kw = dict(out_dtype=torch.bfloat16, split_k=4, block_n=64, num_warps=4, num_stages=5, cluster=True)
    want = G.fp8_block_gemm_triton(xd, xs, wd, ws, fused_reduce=True, **{k_: v for k_, v in kw.items()
                                                                        if k_ != "cluster"})
    for on in (True, False):
        old = pdl.set_enabled(on)
        try:
            assert torch.equal(G.fp8_block_gemm_triton(xd, xs, wd, ws, **kw), want)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = G.fp8_block_gemm_triton(xd, xs, wd, ws, **kw)
            for _ in range(3):
                got.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(got, want), on
        finally:
            pdl.set_enabled(old)
    assert cluster_launches == [4] * 4


@pytest.mark.interpreter
def test_decode_configs_entry_is_dispatched(monkeypatch):
    """fp8_block_linear runs a DECODE_CONFIGS entry for (device, N, K, BM) exactly as the explicit knobs do."""
    from engine.kernels import gemm as G

    xd, xs, wd, ws = _block_operands(3, 256, 640, seed=20)
    dev = xd.device
    key = (G._device_name(dev.type, dev.index), 256, 640, 16)
    cfg = dict(split_k=3, block_n=32, num_warps=4, num_stages=2, fused_reduce=True)
    monkeypatch.setitem(G.DECODE_CONFIGS, key, cfg)
    tuned = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
    explicit = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, **cfg)
    assert torch.equal(tuned, explicit)
    monkeypatch.delitem(G.DECODE_CONFIGS, key)
    default = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
    assert _rel(default, tuned) < GEMM_TOL


def _measured_entries():
    """The DECODE_CONFIGS entries measured on this GPU ([] without CUDA: collection must not touch a device)."""
    from engine.kernels import gemm as G

    if not torch.cuda.is_available():
        return []
    name = G._device_name("cuda", torch.cuda.current_device())
    return sorted(key for key in G.DECODE_CONFIGS if key[0] == name)


@pytest.mark.parametrize("key", _measured_entries())
def test_measured_decode_configs_entry_on_its_shape(key):
    """Each committed entry for this GPU, on its real (N, K), at the largest and a small M of its tile: within the
    GEMM tolerance of the fp32 reference, and the dispatch's bits equal the explicit knobs' (whole-K entries
    included)."""
    from engine.kernels import gemm as G

    _, n, k, bm = key
    for m in sorted({bm, bm // 2 + 1}):
        xd, xs, wd, ws = _block_operands(m, n, k, seed=m + n)
        got = G.fp8_block_linear(xd, xs, wd, ws, out_dtype=torch.float32)
        ref = G.fp8_block_linear_reference(xd, xs, wd, ws, out_dtype=torch.float32)
        assert torch.isfinite(got).all() and _rel(got, ref) < GEMM_TOL, (key, m)
        explicit = G.fp8_block_gemm_triton(xd, xs, wd, ws, out_dtype=torch.float32, **G.DECODE_CONFIGS[key])
        assert torch.equal(got, explicit), (key, m)


# ------------------------------------------------------------------------------------------ attention
def _cache(page: int, lens: list[int], seed: int):
    """An FP8 paged cache (2 KV heads, d 128) holding random sequences of the given lengths."""
    from engine.kernels.paged_kv import PagedKVCache

    cache = PagedKVCache(1, sum(-(-n // page) for n in lens), page, 2, 128, max_seqs=len(lens), device=DEV)
    for s, n in enumerate(lens):
        cache.allocate(s, n)
        cache.write(0, [s], [0], _randn(1, 2, n, 128, seed=seed + s, scale=1.0 + s),
                    _randn(1, 2, n, 128, seed=seed + 50 + s))
    return cache


def _att_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.interpreter
@pytest.mark.parametrize("page,window", [(16, None), (64, 300)])
def test_paged_decode_knobs_within_tolerance(page, window):
    """Every numerics flag / tile knob combination stays within the attention tolerance of the FP32 reference."""
    from engine.kernels.paged_kv import paged_decode_attention, paged_decode_attention_reference

    cache = _cache(page, [777, 1500], seed=30)
    q = _randn(2, 8, 2, 128, seed=31).to(torch.bfloat16)
    ref = paged_decode_attention_reference(q, cache, 0, sliding_window=window)
    cfgs = [dict(qk_fp16=False, fold_v_scale=False), dict(qk_fp16=True, fold_v_scale=False),
            dict(qk_fp16=False, fold_v_scale=True), dict(),
            dict(block_n=32, num_stages=5, maxnreg=96, num_splits=7), dict(block_n=128, num_warps=8, num_splits=3)]
    for cfg in cfgs:
        out = paged_decode_attention(q, cache, 0, sliding_window=window, **cfg)
        assert torch.isfinite(out).all() and _att_rel(out, ref) <= ATT_TOL, (cfg, _att_rel(out, ref))


@pytest.mark.interpreter
def test_paged_decode_qk_fp16_is_exact_for_extreme_q():
    """qk_fp16 rescales each q row by a power of two: rows of magnitude 2**-60 and 2**60 give the same output
    as the bf16 path (products are exact either way; only the fp32 accumulation order may differ)."""
    from engine.kernels.paged_kv import paged_decode_attention

    cache = _cache(64, [500, 300], seed=40)
    q = _randn(2, 8, 1, 128, seed=41)
    q[0, :4] *= 2.0**-60  # scores ~0: uniform attention
    q[0, 4:] *= 2.0**60  # huge scores: attention on the top key
    q[1, :4] *= 2.0**-3
    q = q.to(torch.bfloat16)
    a = paged_decode_attention(q, cache, 0, qk_fp16=True, fold_v_scale=False)
    b = paged_decode_attention(q, cache, 0, qk_fp16=False, fold_v_scale=False)
    assert torch.isfinite(a).all() and _att_rel(a, b) <= 1e-5, _att_rel(a, b)
