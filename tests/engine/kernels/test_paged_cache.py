"""The paged KV cache's storage on the CPU (library write path): the V page layouts hold the same values."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.paged_cache import PagedKVCache


def _filled(v_layout: str, dtype=torch.float8_e4m3fn, page: int = 16, dv: int = 192) -> PagedKVCache:
    """Two sequences (45 and 70 tokens) written in three calls that straddle pages."""
    cache = PagedKVCache(2, 16, page, 2, 64, dv, dtype=dtype, max_seqs=3, device="cpu", v_layout=v_layout)
    g = torch.Generator().manual_seed(5)
    cache.allocate(0, 45)
    cache.allocate(1, 70)
    for ids, starts, t in (([0, 1], [0, 0], 30), ([0], [30], 15), ([1], [30], 40)):
        k = torch.randn(len(ids), 2, t, 64, generator=g) * 3
        v = torch.randn(len(ids), 2, t, dv, generator=g)
        v[0, 1, 2] = 0.0  # an all-zero token (scale 1)
        cache.write(1, ids, starts, k, v)
    return cache


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_v_layouts_store_the_same_values(dtype):
    """Dimension-major and token-major V pages gather to identical data, scales and dequantized values; the
    dimension-major storage really is transposed (tokens contiguous) while `v_data` keeps the token-major
    shape; K is the same in both."""
    tok, dim = _filled("token", dtype), _filled("dim", dtype)
    vt, vd = tok.v_data(1), dim.v_data(1)
    assert vt.shape == vd.shape == (17, 2, 16, 192)
    assert vt.stride()[-2:] == (192, 1) and vd.stride()[-2:] == (1, 16)
    for s, n in ((0, 45), (1, 70)):
        a, b = tok.gather(1, s, dequantize=False), dim.gather(1, s, dequantize=False)
        for x, y in zip(a, b):
            if x is None:
                assert y is None
            else:
                assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                                                          y.view(torch.uint8) if y.element_size() == 1 else y)
        kt, vt_ = tok.gather(1, s)
        kd, vd_ = dim.gather(1, s)
        assert vt_.shape == (1, 2, n, 192) and torch.equal(kt, kd) and torch.equal(vt_, vd_)
        assert vt_.abs().sum() > 0  # something was written
    assert torch.equal(dim.gather(0, 0)[1], torch.zeros(1, 2, 45, 192))  # layer 0 untouched


def test_v_layout_defaults_and_prefix_copy():
    """'auto' is dimension-major for FP8 and token-major otherwise; copy_prefix copies dimension-major pages
    whole (the copy gathers to the source's values); an unknown layout is refused by name."""
    assert PagedKVCache(1, 4, 16, 1, 64, device="cpu").v_layout == "dim"
    assert PagedKVCache(1, 4, 16, 1, 64, dtype=torch.bfloat16, device="cpu").v_layout == "token"
    cache = _filled("dim")
    cache.allocate(2, 32)
    cache.copy_prefix(1, 2, 32)
    src, dst = cache.gather(1, 1, 32), cache.gather(1, 2, 32)
    assert torch.equal(src[0], dst[0]) and torch.equal(src[1], dst[1])
    with pytest.raises(ValueError, match="v_layout 'row'"):
        PagedKVCache(1, 4, 16, 1, 64, device="cpu", v_layout="row")


def _cache(dtype, kv_heads: int = 8) -> PagedKVCache:
    return PagedKVCache(1, 4, 64, kv_heads, 128, dtype=dtype, max_seqs=1, device="cpu")


@pytest.mark.parametrize("batch,context,want", [
    (1, 192, (4, 3, 3)),       # 3 tiles over 3 splits: short walks, latency-bound -> 4 warps, 3 stages
    (8, 192, (4, 3, 3)),       # the splits recomputed for 4 warps still cover the 3 tiles
    (64, 192, (2, 3, 1)),      # one split of 3 tiles is a short walk, but 512 programs of 4 warps: keep 2 warps
    (32, 192, (4, 3, 1)),      # 256 programs <= 2 per SM: 4 warps
    (8, 32768, (2, 5, 8)),     # the long-context default (H200, 2026-11-29): 4 programs of 2 warps per SM
    (1, 4096, (4, 3, 33)),     # 2 warps: min(528 / 8, 64 tiles) = 64 one-tile splits -> 4 warps: 264 / 8 = 33
    (32, 8192, (2, 5, 2)),     # 128 tiles over 2 splits: long walks
])
def test_decode_plan_fp8_short_and_long_contexts(batch, context, want):
    """FP8 pages: splits by the 2-warp rule first; each split walking <= SHORT_TILES tiles gets 3 stages, and 4 warps
    with the splits again for 4 warps unless those are more than 2 programs per SM (132 SMs, 8 KV heads,
    block_n 64)."""
    from engine.kernels.paged_kv import decode_plan

    assert decode_plan(_cache(torch.float8_e4m3fn), 132, batch, context, 64) == want


def test_decode_plan_keeps_given_knobs_and_bf16_tiles():
    """Given splits / warps are kept (only the unset ones are chosen); non-FP8 pages keep 4 warps, 5 stages at
    every context, with the 4-warp split rule."""
    from engine.kernels.paged_kv import decode_plan, decode_splits

    fp8, bf16 = _cache(torch.float8_e4m3fn), _cache(torch.bfloat16)
    assert decode_plan(fp8, 132, 1, 192, 64, num_splits=1) == (4, 3, 1)
    assert decode_plan(fp8, 132, 8, 32768, 64, num_splits=2) == (2, 5, 2)
    assert decode_plan(fp8, 132, 1, 192, 64, num_warps=2) == (2, 3, 3)  # given warps, short-walk stages
    for ctx in (192, 32768):
        assert decode_plan(bf16, 132, 8, ctx, 64) == (4, 5, decode_splits(132, 8, 8, ctx, 64, num_warps=4))
