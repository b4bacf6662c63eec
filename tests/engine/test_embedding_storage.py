"""The token-embedding table stored in its recipe format (`engine.backends.native.prepare_embedding`): a lookup of the
stored rows gives exactly the emulation's values (the fp32 rows of the whole table's fake quantization), for
every row-local format; formats with multi-row scale tiles are refused (the caller keeps fp32 values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.backends.native import embedding_lookup, prepare_embedding
from engine.numerics import Numerics
from engine.recipe import load_recipe


def _table(v: int = 300, d: int = 256) -> torch.Tensor:
    """A table with adversarial rows: zeros, huge, tiny (E4M3 subnormal after scaling), a single spike."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(v, d, generator=g) * torch.logspace(-3, 2, v)[:, None]
    w[0] = 0.0
    w[1] = 3.0e4
    w[2] = 1e-30
    w[3, :] = 1e-6
    w[3, 5] = 1e3  # one large element: the rest of its 128-group underflows to E4M3 subnormals / zero
    return w


@pytest.mark.parametrize("spec", ["bf16", "fp16", "fp32", "e4m3:1x128", "mxfp8", "mxfp4", "nvfp4", "e4m3:tensor"])
def test_lookup_equals_the_emulated_table_rows(spec):
    from engine.formats import fake_quantize

    w = _table()
    # the emulation's prepared table for this spec (what `Transformer.prepare` hands `Numerics.embed`)
    emu_table = fake_quantize(w.float(), spec).float()
    nw = prepare_embedding(w, spec)
    assert nw is not None
    tokens = torch.tensor([[0, 1, 2, 3, 299], [7, 7, 150, 1, 0]])
    got = embedding_lookup(tokens, nw)
    want = F.embedding(tokens, emu_table)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 256)
    assert torch.equal(got, want), (spec, (got - want).abs().max())
    if spec not in ("fp32",):
        assert nw.storage_bytes() < w.numel() * 4  # really stored in the narrow format


def test_numerics_prepare_matches_fake_quantize():
    """`Numerics.prepare_weight` on the embed site is the fake quantization the lookup test compares against."""
    from engine.formats import fake_quantize

    w = _table()
    recipe = load_recipe("fp8-block-embed")
    emu = Numerics(recipe).prepare_weight(w, "embed", "embed")
    assert torch.equal(emu, fake_quantize(w.float(), "e4m3:1x128").float())
    tokens = torch.tensor([3, 1, 0])
    assert torch.equal(Numerics(recipe).embed(tokens, emu), emu[tokens])


def test_storage_bytes_and_refused_formats():
    w = _table(256, 512)
    nw = prepare_embedding(w, "e4m3:1x128")
    assert nw.q.data.dtype == torch.float8_e4m3fn
    assert nw.storage_bytes() == 256 * 512 + 256 * (512 // 128) * 4
    assert prepare_embedding(w, "bf16").storage_bytes() == 256 * 512 * 2
    assert prepare_embedding(w, "e4m3:128x128") is None  # a scale tile spans 128 rows: not row-local


@pytest.mark.parametrize("base,embed", [("fp8-block", "fp8-block-embed"), ("fp8-kv", "fp8-kv-embed")])
def test_embed_recipes_differ_from_their_base_only_in_embed(base, embed):
    from engine.recipe import SITES

    a, b = load_recipe(base), load_recipe(embed)
    diff = [s for s in SITES if a.spec(s) != b.spec(s)]
    assert diff == ["embed"] and b.spec("embed") == "e4m3:1x128" and b.spec("lm_head") == "bf16"
    assert (b.spec("kv.k"), b.spec("kv.v")) == (("e4m3:head", "e4m3:1x128") if base == "fp8-kv" else ("bf16", "bf16"))
