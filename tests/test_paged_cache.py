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
