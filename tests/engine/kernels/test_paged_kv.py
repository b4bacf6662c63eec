"""The paged KV cache's kernels (engine/kernels/paged_kv.py): the fused quantize + scatter write and paged decode
attention, against the formats library / `Numerics.kv_store` (cache bits: exact) and the FP32 emulation (decode
outputs: the attention tolerance of test_attention.py), and the decode kernel's tuning knobs.

Markers `gpu` + `interpreter`: on the GPU (skipped without CUDA) and on CPU tensors under TRITON_INTERPRET=1, where
the decode tests take the shorter sequences of `by_device` (still several tiles and pages per sequence, masked tail
tiles, splits past a sequence's keys; the V-layout test leaves out the cases that reach no other kernel path there).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.kernels.test_attention import DEV, DISCRIM, TOL, _bits_equal, _rand, _rel_err, _scales_equal
from tests.support.interpret import by_device

# skipped without CUDA; under TRITON_INTERPRET=1 they run on CPU tensors (tests/conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]


# ------------------------------------------------------------- cache writes
def _write(cache, *args, kernel: bool | None = None) -> None:
    """`cache.write(*args)` through the fused write kernel (`kv_write`, as the native backend writes; the default
    on CUDA) or the formats library (kernel=False; the default on CPU tensors)."""
    from engine.kernels.paged_kv import kv_write

    cache.write(*args, kernel=kv_write if (DEV == "cuda" if kernel is None else kernel) else None)


def _kv_store(x: torch.Tensor, site: str) -> torch.Tensor:
    """The emulation's cache write (fp8-kv recipe: K e4m3:head, V e4m3:1x128), dequantized."""
    from engine.numerics import Numerics
    from engine.recipe import load_recipe

    return Numerics(load_recipe("fp8-kv")).kv_store(x, site, "layers.0.attn")


def _fill(cache, layer: int, lens: list[int], chunk: int, seed: int):
    """Write sequences 0..n-1 to the given lengths in rounds: every round writes `chunk` tokens (or what
    is left) to each unfinished sequence; sequences with the same round size share one write call (one
    K scale per head across them). Returns the emulation's dequantized K/V per sequence (kv_store of the
    same calls) and the list of write calls (seq_ids, starts, k, v)."""
    hkv, d, dv = cache.kv_heads, cache.head_dim, cache.head_dim_v
    exp_k = {s: [] for s in range(len(lens))}
    exp_v = {s: [] for s in range(len(lens))}
    for s, n in enumerate(lens):
        cache.allocate(s, n)
    done = [0] * len(lens)
    calls = []
    r = 0
    while any(dn < n for dn, n in zip(done, lens)):
        groups: dict[int, list[int]] = {}
        for s, n in enumerate(lens):
            if done[s] < n:
                groups.setdefault(min(chunk, n - done[s]), []).append(s)
        for t, seqs in groups.items():
            k = _rand(len(seqs), hkv, t, d, seed=seed + 97 * r + t, scale=1.0 + r, dtype=torch.float32)
            v = _rand(len(seqs), hkv, t, dv, seed=seed + 89 * r + t + 1, dtype=torch.float32)
            _write(cache, layer, seqs, [done[s] for s in seqs], k, v)
            calls.append((seqs, [done[s] for s in seqs], k, v))
            ek, ev = _kv_store(k, "kv.k"), _kv_store(v, "kv.v")
            for i, s in enumerate(seqs):
                exp_k[s].append(ek[i:i + 1])
                exp_v[s].append(ev[i:i + 1])
                done[s] += t
        r += 1
    return ({s: torch.cat(x, 2) for s, x in exp_k.items()}, {s: torch.cat(x, 2) for s, x in exp_v.items()},
            calls)


@pytest.mark.parametrize("page,dv", [(16, 128), (64, 128), (256, 128), (16, 320)])
def test_paged_cache_write_gather_bit_exact(page, dv):
    """Pages hold exactly the emulation's bits: gathered K/V equal Numerics.kv_store of the same write calls
    (K one scale per KV head per call, V per token and 128-group), for chunks that straddle pages."""
    from engine.formats import quantize
    from engine.kernels.paged_kv import PagedKVCache

    lens = [300, 37, 129]
    cache = PagedKVCache(2, 64, page, 2, 64, dv, max_seqs=4, device=DEV)
    exp_k, exp_v, calls = _fill(cache, 1, lens, chunk=50, seed=20)
    for s, n in enumerate(lens):
        k, v = cache.gather(1, s)
        assert k.shape == (1, 2, n, 64) and v.shape == (1, 2, n, dv)
        assert torch.equal(k, exp_k[s]) and torch.equal(v, exp_v[s]), f"sequence {s}"
    assert cache.seq_lens[:3].tolist() == lens
    kd, ks, vd, vs = cache.gather(1, 0, dequantize=False)
    assert ks[0, 0, 0] != ks[0, 0, 60]  # two write calls, two K scales: stored per token, not per sequence
    seqs, starts, k0, v0 = calls[0]  # the first call wrote tokens 0..49 of sequences 0 and 2
    assert seqs[0] == 0 and starts[0] == 0
    ref = quantize(v0[:1], "e4m3:1x128")
    assert _bits_equal(vd[:, :, :50], ref.data) and _scales_equal(vs[:, :, :50], ref.scale)
    rk = quantize(k0.transpose(0, 1).reshape(2, -1), "e4m3:token")  # one scale per KV head over the call
    assert _bits_equal(kd[:, :, :50], rk.data.reshape(2, len(seqs), 50, 64)[:, :1].transpose(0, 1))
    assert _scales_equal(ks[0, :, :50], rk.scale.reshape(2, 1).expand(2, 50))
    assert torch.equal(cache.gather(0, 0)[0], torch.zeros(1, 2, 300, 64, device=DEV))  # layer 0 untouched


@pytest.mark.parametrize("k_spec,v_spec,dk,dv,v_layout", [("e4m3:head", "e4m3:1x128", 128, 128, "dim"),
                                                          ("e4m3:head", "e4m3:1x128", 128, 128, "token"),
                                                          ("e4m3:token", "e4m3:1x128", 96, 320, "dim"),
                                                          ("e4m3:head", "e4m3:token", 64, 192, "token")])
def test_paged_cache_kernel_write_matches_library(k_spec, v_spec, dk, dv, v_layout):
    """The fused Triton write (quantize + scatter) stores the same bytes and scales as the formats-library
    path (K per head or per token, V per 128-group or per token; the kernel writing dimension-major or
    token-major V pages, the library token-major) on adversarial chunks: all-zero tokens, denormals, amax
    exactly 448, a NaN in K (the head's scale becomes NaN) and in V (one 128-group); seq ids / starts given
    as device tensors."""
    from engine.kernels.paged_kv import PagedKVCache

    caches = [PagedKVCache(1, 40, 16, 2, dk, dv, k_spec=k_spec, v_spec=v_spec, max_seqs=3, device=DEV,
                           v_layout=lay) for lay in ("token", v_layout)]
    assert (caches[1].v_data(0).stride(-1) == 1) == (v_layout == "token")
    for c in caches:
        for s in range(3):
            c.allocate(s, 120)
    calls = []
    for r, (ids, starts, t) in enumerate([([0, 2], [0, 0], 40), ([1], [0], 3), ([0, 1, 2], [40, 3, 40], 1),
                                          ([2], [41], 70)]):
        k = _rand(len(ids), 2, t, dk, seed=70 + r, scale=4.0, dtype=torch.float32)
        v = _rand(len(ids), 2, t, dv, seed=80 + r, dtype=torch.float32)
        if r == 0:
            k[0, :, 5] = 0.0
            v[1, :, 7] = 0.0
            v[0, 0, 9] *= 1e-40  # denormal fp32 inputs
            v[0, 1, 11, 0] = 448.0
        if r == 2:
            k[1, 1, 0, 3] = float("nan")
            v[2, 0, 0, dv - 1] = float("nan")
        calls.append((ids, starts, k, v))
    for j, c in enumerate(caches):  # caches[0]: the library write, caches[1]: the kernel
        for i, (ids, starts, k, v) in enumerate(calls):
            if i == 3:  # device tensors: no host-side bookkeeping at all
                ids, starts = torch.tensor(ids, device=DEV), torch.tensor(starts, device=DEV)
            _write(c, 0, ids, starts, k, v, kernel=j == 1)
    for s in range(3):
        lib, tri = caches[0].gather(0, s, dequantize=False), caches[1].gather(0, s, dequantize=False)
        assert _bits_equal(lib[0], tri[0]) and _bits_equal(lib[2], tri[2]), f"sequence {s} data"
        assert _scales_equal(lib[1], tri[1]) and _scales_equal(lib[3], tri[3]), f"sequence {s} scales"
    assert torch.isnan(caches[1].gather(0, 1)[0][0, 1, 3]).all()  # the NaN K head of that call
    assert caches[1].seq_lens[:3].tolist() == [41, 4, 111]


def test_kv_write_head_amax_in_kernel_same_bits(monkeypatch):
    """e4m3:head K: the per-head amax computed inside the write kernel (small chunks: decode steps of 1-40 rows, a
    3-token chunk; 16-, 32- and 64-row amax steps) stores the same bytes and scales as the torch reduction before the launch: a NaN in one head
    (that head's scale NaN), an all-zero head (scale 1), values at 448 and far beyond, rows naming one sequence
    twice; both V page layouts."""
    from engine.kernels import paged_kv
    from engine.kernels.paged_kv import PagedKVCache

    # the interpreter: one V layout (test_paged_cache_kernel_write_matches_library writes both there too)
    for v_layout in by_device(("dim", "token"), ("dim",)):
        caches = [PagedKVCache(1, 48, 16, 3, 64, 64, k_spec="e4m3:head", v_spec="e4m3:1x128", max_seqs=4, device=DEV,
                               v_layout=v_layout) for _ in range(2)]
        for c in caches:
            for s in range(4):
                c.allocate(s, 120)
        calls = []
        n64, n32 = by_device((40, 20), (33, 17))  # decode rows whose amax takes one 64-row / one 32-row step
        rows64 = ([i % 4 for i in range(n64)], [20 + i // 4 for i in range(n64)], 1)
        rows32 = ([i % 4 for i in range(n32)], [40 + i // 4 for i in range(n32)], 1)
        for r, (ids, starts, t) in enumerate([([0, 1, 2, 3], [0, 0, 0, 0], 1), ([3], [1], 3), ([0, 1, 2], [1, 1, 1], 1),
                                              ([2] * 5, [5, 6, 7, 8, 9], 1), rows64, rows32]):
            k = _rand(len(ids), 3, t, 64, seed=90 + r, scale=30.0, dtype=torch.float32)
            v = _rand(len(ids), 3, t, 64, seed=95 + r, dtype=torch.float32)
            if r == 0:
                k[:, 1] = 0.0  # an all-zero head
                k[2, 2, 0, 7] = 448.0 * 64
            if r == 2:
                k[1, 0, 0, 3] = float("nan")  # head 0 of this call: NaN scale
            calls.append((ids, starts, k, v))
        for i, c in enumerate(caches):
            monkeypatch.setattr(paged_kv, "HEAD_AMAX_MAX_TOKENS", 64 if i else 0)
            for ids, starts, k, v in calls:
                _write(c, 0, ids, starts, k, v, kernel=True)
        for s in range(4):
            a, b = caches[0].gather(0, s, dequantize=False), caches[1].gather(0, s, dequantize=False)
            assert _bits_equal(a[0], b[0]) and _bits_equal(a[2], b[2]), (v_layout, s)
            assert _scales_equal(a[1], b[1]) and _scales_equal(a[3], b[3]), (v_layout, s)
        k_scale = caches[1].gather(0, 1, dequantize=False)[1][0]  # (kv_heads, tokens)
        assert float(k_scale[1, 0]) == 1.0 and torch.isnan(k_scale[0, 1]) and not torch.isnan(k_scale[1:, 1]).any()


def test_paged_cache_bf16_and_allocation():
    """bf16 cache stores the cast values; free() recycles pages; writing past the allocation is refused."""
    from engine.kernels.paged_kv import PagedKVCache

    cache = PagedKVCache(1, 8, 16, 2, 64, dtype=torch.bfloat16, max_seqs=2, max_blocks_per_seq=6, device=DEV)
    k, v = _rand(1, 2, 40, 64, seed=30, dtype=torch.float32), _rand(1, 2, 40, 64, seed=31, dtype=torch.float32)
    cache.allocate(0, 40)
    assert cache.free_blocks() == 5
    _write(cache, 0, [0], [0], k, v)
    kg, vg = cache.gather(0, 0)
    assert torch.equal(kg, k.bfloat16().float()) and torch.equal(vg, v.bfloat16().float())
    with pytest.raises(ValueError, match="allocate"):
        _write(cache, 0, [0], [40], k[:, :, :9], v[:, :, :9])
    cache.free(0)
    assert cache.free_blocks() == 8 and cache.seq_lens[0].item() == 0
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        cache.allocate(1, 7 * 16)
    cache.allocate(0, 6 * 16)
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.allocate(1, 3 * 16)


# ------------------------------------------------------------ paged decode
DECODE_CASES = {
    # name: (page, cache dtype, tq, window, block_n)
    "fp8_page16": (16, torch.float8_e4m3fn, 1, None, 64),
    "fp8_page64_tq4_window": (64, torch.float8_e4m3fn, 4, 150, 64),
    "fp8_page256_bn128": (256, torch.float8_e4m3fn, 1, None, 128),
    "bf16_page64": (64, torch.bfloat16, 1, None, 64),
    "bf16_page16_tq3": (16, torch.bfloat16, 3, None, 32),
    "fp32_page64": (64, torch.float32, 1, None, 64),  # the fp32 recipe's cache
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_paged_decode(case):
    """Paged decode vs the emulation on the gathered cache and vs the prefill kernel on the same FP8 data:
    sequences of different lengths in one batch (rows mapped to sequences out of order), GQA, causal for
    tq > 1, sliding window, page sizes 16/64/256."""
    from engine.kernels.attention import flash_attention
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention, paged_decode_attention_reference

    page, dtype, tq, window, bn = DECODE_CASES[case]
    h, hkv, d = 8, 2, 128
    lens = by_device([1000, 37, 300, 2049], [200, 37, 129, 300])
    cache = PagedKVCache(1, sum(-(-n // page) for n in lens), page, hkv, d, dtype=dtype, max_seqs=4, device=DEV)
    _fill(cache, 0, lens, chunk=512, seed=40)
    seq_ids = [2, 0, 3, 1]
    q = _rand(4, h, tq, d, seed=41)
    out = paged_decode_attention(q, cache, 0, seq_ids=seq_ids, sliding_window=window, block_n=bn)
    ref = paged_decode_attention_reference(q, cache, 0, seq_ids=seq_ids, sliding_window=window)
    assert out.shape == (4, tq, h * d) and torch.isfinite(out).all()
    assert _rel_err(out, ref) <= TOL
    for i, s in enumerate(seq_ids):  # the prefill kernel on the very same stored values
        kd, ks, vd, vs = cache.gather(0, s, dequantize=False)
        n = lens[s]
        pre = flash_attention(q[i:i + 1], kd, vd, torch.arange(n - tq, n, device=DEV), torch.arange(n, device=DEV),
                              k_scale=ks, v_scale=vs, sliding_window=window)
        assert _rel_err(out[i:i + 1], pre) <= TOL
    if tq > 1 and window is None:  # causal inside the new tokens: dropping the mask would be visible
        unmasked = paged_decode_attention_reference(q, cache, 0, seq_ids=seq_ids,
                                                    q_pos=torch.full((4, tq), 10**6, device=DEV))
        assert _rel_err(unmasked, ref) > DISCRIM


def test_paged_decode_splits_and_fp8_output():
    """The result does not depend on the number of splits (1 vs many) beyond TOL; the FP8 output is
    bit-exact with the library's quantization of the kernel's fp32 output; explicit seq_lens shorter than
    the cache restrict the keys."""
    from engine.formats import quantize
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention, paged_decode_attention_reference

    cache = PagedKVCache(1, 64, 64, 2, 128, max_seqs=2, device=DEV)
    full = by_device([700, 1500], [200, 400])
    _fill(cache, 0, full, chunk=256, seed=50)
    q = _rand(2, 8, 1, 128, seed=51)
    one = paged_decode_attention(q, cache, 0, num_splits=1)
    many = paged_decode_attention(q, cache, 0, num_splits=13)
    assert _rel_err(many, one) <= TOL
    data, scales, hp = paged_decode_attention(q, cache, 0, out_quant="e4m3:1x128", return_hp=True)
    rq = quantize(hp, "e4m3:1x128")
    assert _bits_equal(data, rq.data) and _scales_equal(scales, rq.scale)
    lens = torch.tensor([n * 2 // 3 for n in full], device=DEV, dtype=torch.int32)
    short = paged_decode_attention(q, cache, 0, lens)
    assert _rel_err(short, paged_decode_attention_reference(q, cache, 0, lens)) <= TOL
    assert _rel_err(short, one) > DISCRIM


@pytest.mark.parametrize("dv", [128, 192])
def test_paged_decode_bf16_rounded_fp8_output(dv):
    """out_round='bf16' (an attention output stored in bf16, quantized for o_proj): the returned fp32 values are
    exactly the plain fp32 output rounded to bf16, and the FP8 data / scales are the library's quantization of
    those values -- in the epilogue (dv = 128) and in the second pass (dv = 192) alike."""
    from engine.formats import quantize
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention

    cache = PagedKVCache(1, 64, 64, 2, 128, head_dim_v=dv, max_seqs=2, device=DEV)
    _fill(cache, 0, by_device([300, 900], [150, 300]), chunk=256, seed=60)
    q = _rand(2, 8, 1, 128, seed=61)
    plain = paged_decode_attention(q, cache, 0, num_splits=4, num_stages=2)
    data, scales, hp = paged_decode_attention(q, cache, 0, num_splits=4, num_stages=2, out_quant="e4m3:1x128",
                                              out_round="bf16", return_hp=True)
    assert hp.dtype == torch.float32 and torch.equal(hp, plain.to(torch.bfloat16).float())
    assert not torch.equal(hp, plain)  # the rounding happened (random fp32 outputs are not all bf16 values)
    rq = quantize(hp, "e4m3:1x128")
    assert _bits_equal(data, rq.data) and _scales_equal(scales, rq.scale)
    with pytest.raises(ValueError, match="out_round"):
        paged_decode_attention(q, cache, 0, out_round="bf16")  # rounding without quantization: use out_dtype


@pytest.mark.parametrize("fp8", [False, True])
def test_paged_decode_direct_single_split_is_the_reduce_bit_for_bit(fp8):
    """num_splits=1 writes the output from the split itself (`direct`, no reduce launch): every output mode
    (fp32, bf16, E4M3 with the bf16 rounding and the fp32 copy) is bitwise the two-kernel path's, for a
    bf16 and an FP8 cache with GQA rows, tq > 1 and a sliding window; direct with several splits is refused."""
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention

    kw = dict(k_spec="e4m3:head", v_spec="e4m3:1x128") if fp8 else dict(dtype=torch.bfloat16)
    cache = PagedKVCache(1, 64, 64, 2, 128, max_seqs=3, device=DEV, **kw)
    _fill(cache, 0, by_device([100, 700, 1300], [100, 200, 300]), chunk=256, seed=70)
    q = _rand(3, 8, 2, 128, seed=71)
    for opts in (dict(), dict(out_dtype=torch.bfloat16), dict(sliding_window=200),
                 dict(out_quant="e4m3:1x128", out_round="bf16", return_hp=True)):
        two = paged_decode_attention(q, cache, 0, num_splits=1, direct=False, **opts)
        one = paged_decode_attention(q, cache, 0, num_splits=1, **opts)
        for a, b in zip(two if isinstance(two, tuple) else (two,), one if isinstance(one, tuple) else (one,)):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), opts
    with pytest.raises(ValueError, match="num_splits=1"):
        paged_decode_attention(q, cache, 0, num_splits=2, direct=True)


def test_paged_decode_v_layouts_bit_identical():
    """Dimension-major and token-major V pages hold the same values, and the decode kernel gives the same
    bits from both: tq 1 and 3 (causal inside the new tokens), a sliding window, one split (direct) and
    several, block_n below / equal to / above the page size, sequences whose lengths are not tile multiples
    (the masked tail tiles) -- and the result is right (vs the fp32 reference)."""
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention, paged_decode_attention_reference

    lens = by_device([1000, 37, 2049], [200, 37, 260])
    caches = {lay: PagedKVCache(1, 110, 32, 2, 128, max_seqs=3, device=DEV, v_layout=lay) for lay in ("token", "dim")}
    for c in caches.values():
        _fill(c, 0, lens, chunk=300, seed=90)
    # block_n 16 / 32 (tiles inside a page) and 64 (the default: tiles over two pages) against 32-token pages; one
    # split (direct) and several; num_splits=40 (the interpreter: 12): splits past the short sequence's keys. The
    # interpreter runs the first four cases: the others reach no other kernel path there (warps and stages change
    # nothing, block_n 32 is a tile inside a page as 16 is, and tq 2 has a window).
    more = [(1, dict(block_n=32, num_splits=7)), (1, dict(block_n=64, num_warps=2, num_stages=3)),
            (3, dict(sliding_window=333)), (1, dict(block_n=32, num_warps=1, sliding_window=100))]
    for tq, opts in [(1, dict()), (1, dict(num_splits=1)), (3, dict(block_n=16, num_splits=5)),
                     (2, dict(sliding_window=64, num_splits=by_device(40, 12)))] + by_device(more, []):
        q = _rand(3, 8, tq, 128, seed=91 + tq)
        tok = paged_decode_attention(q, caches["token"], 0, **opts)
        dim = paged_decode_attention(q, caches["dim"], 0, **opts)
        assert torch.equal(tok, dim), (tq, opts)
        ref = paged_decode_attention_reference(q, caches["token"], 0, sliding_window=opts.get("sliding_window"))
        assert _rel_err(dim, ref) <= TOL, (tq, opts)


@pytest.mark.parametrize("v_layout", ["dim", "token"])
def test_paged_decode_ignores_nan_bytes_past_the_end(v_layout):
    """Stale bytes after a sequence's end inside its last page (here NaN V written there, then a shorter
    seq_lens) never reach the output: the masked tail tile loads V without a token mask and must zero those
    tokens, not only their weights (0 * NaN = NaN); the output equals the reference on the first 90 keys."""
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention, paged_decode_attention_reference

    cache = PagedKVCache(1, 8, 64, 2, 128, max_seqs=1, device=DEV, v_layout=v_layout)
    _fill(cache, 0, [100], chunk=100, seed=95)
    v = _rand(1, 2, 10, 128, seed=96, dtype=torch.float32)
    v[:, :, :, 5] = float("nan")
    _write(cache, 0, [0], [90], _rand(1, 2, 10, 128, seed=97, dtype=torch.float32), v)  # tokens 90..99: NaN V
    q = _rand(1, 8, 1, 128, seed=98)
    lens = torch.tensor([90], device=DEV, dtype=torch.int32)
    assert torch.isnan(paged_decode_attention(q, cache, 0)).any()  # the NaN is there for the full length
    for splits in (1, 2):
        out = paged_decode_attention(q, cache, 0, lens, num_splits=splits)
        assert torch.isfinite(out).all(), splits
        assert _rel_err(out, paged_decode_attention_reference(q, cache, 0, lens)) <= TOL


def test_paged_decode_pv_fp16_matches_bf16_pv():
    """The fp16 PV path (bf16 weights P * v_scale scaled by a power of two per row, V widened to fp16) gives the
    bf16 PV path's products: outputs agree to accumulation order (<= 1e-5 relative), both within TOL of fp32."""
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention, paged_decode_attention_reference

    cache = PagedKVCache(1, 64, 64, 2, 128, max_seqs=2, device=DEV, dtype=torch.float8_e4m3fn,
                         k_spec="e4m3:head", v_spec="e4m3:1x128")
    _fill(cache, 0, by_device([900, 1500], [200, 300]), chunk=256, seed=80)
    q = _rand(2, 8, 1, 128, seed=81)
    ref = paged_decode_attention_reference(q, cache, 0)
    f16 = paged_decode_attention(q, cache, 0, num_splits=3, pv_fp16=True)
    b16 = paged_decode_attention(q, cache, 0, num_splits=3, pv_fp16=False)
    assert _rel_err(f16, b16) <= 1e-5 and _rel_err(f16, ref) <= TOL and _rel_err(b16, ref) <= TOL
    assert not torch.equal(f16, paged_decode_attention(q, cache, 0, num_splits=3, fold_v_scale=False))


def test_paged_decode_nan_in_v_propagates():
    """A NaN written into V of one sequence (its 128-group scale becomes NaN) poisons that sequence's
    output and nobody else's."""
    from engine.kernels.paged_kv import PagedKVCache, paged_decode_attention

    cache = PagedKVCache(1, 32, 16, 2, 128, max_seqs=2, device=DEV)
    _fill(cache, 0, [100, 120], chunk=64, seed=60)
    v = _rand(1, 2, 1, 128, seed=61, dtype=torch.float32)
    v[0, 1, 0, 7] = float("nan")
    cache.allocate(1, 121)
    _write(cache, 0, [1], [120], _rand(1, 2, 1, 128, seed=62, dtype=torch.float32), v)
    out = paged_decode_attention(_rand(2, 4, 1, 128, seed=63), cache, 0)
    assert torch.isfinite(out[0]).all()
    heads = out[1].reshape(1, 4, 128)
    assert torch.isnan(heads[:, 2:]).all(), "NaN in V dropped"  # query heads 2, 3 read kv head 1
    assert torch.isfinite(heads[:, :2]).all()


# ------------------------------------------------------------ paged decode knobs
def _cache(page: int, lens: list[int], seed: int):
    """An FP8 paged cache (2 KV heads, d 128) holding random sequences of the given lengths."""
    from engine.kernels.paged_kv import PagedKVCache

    cache = PagedKVCache(1, sum(-(-n // page) for n in lens), page, 2, 128, max_seqs=len(lens), device=DEV)
    for s, n in enumerate(lens):
        cache.allocate(s, n)
        _write(cache, 0, [s], [0], _rand(1, 2, n, 128, seed=seed + s, scale=1.0 + s, dtype=torch.float32),
                    _rand(1, 2, n, 128, seed=seed + 50 + s, dtype=torch.float32))
    return cache


def _att_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("page,window", [(16, None), (64, 300)])
def test_paged_decode_knobs_within_tolerance(page, window):
    """Every numerics flag / tile knob combination stays within the attention tolerance of the FP32 reference."""
    from engine.kernels.paged_kv import paged_decode_attention, paged_decode_attention_reference

    cache = _cache(page, by_device([777, 1500], [177, 400]), seed=30)
    q = _rand(2, 8, 2, 128, seed=31)
    ref = paged_decode_attention_reference(q, cache, 0, sliding_window=window)
    cfgs = [dict(qk_fp16=False, fold_v_scale=False), dict(qk_fp16=True, fold_v_scale=False),
            dict(qk_fp16=False, fold_v_scale=True), dict(),
            dict(block_n=32, num_stages=5, maxnreg=96, num_splits=7), dict(block_n=128, num_warps=8, num_splits=3)]
    for cfg in cfgs:
        out = paged_decode_attention(q, cache, 0, sliding_window=window, **cfg)
        assert torch.isfinite(out).all() and _att_rel(out, ref) <= TOL, (cfg, _att_rel(out, ref))


def test_paged_decode_qk_fp16_is_exact_for_extreme_q():
    """qk_fp16 rescales each q row by a power of two: rows of magnitude 2**-60 and 2**60 give the same output
    as the bf16 path (products are exact either way; only the fp32 accumulation order may differ)."""
    from engine.kernels.paged_kv import paged_decode_attention

    cache = _cache(64, [500, 300], seed=40)
    q = _rand(2, 8, 1, 128, seed=41, dtype=torch.float32)
    q[0, :4] *= 2.0**-60  # scores ~0: uniform attention
    q[0, 4:] *= 2.0**60  # huge scores: attention on the top key
    q[1, :4] *= 2.0**-3
    q = q.to(torch.bfloat16)
    a = paged_decode_attention(q, cache, 0, qk_fp16=True, fold_v_scale=False)
    b = paged_decode_attention(q, cache, 0, qk_fp16=False, fold_v_scale=False)
    assert torch.isfinite(a).all() and _att_rel(a, b) <= 1e-5, _att_rel(a, b)
