"""Recipes: named recipes, `extends`, per-module overrides, and clear errors for bad recipe files."""

from __future__ import annotations

import pytest

from engine.errors import RecipeError
from engine.recipe import SITES, load_recipe, named_recipes


def test_named_recipes_resolve():
    """The four core recipes exist and differ exactly where documented."""
    assert {"fp32", "bf16", "fp8-tensor", "fp8-block"} <= set(named_recipes())
    fp32, bf16 = load_recipe("fp32"), load_recipe("bf16")
    tensor, block = load_recipe("fp8-tensor"), load_recipe("fp8-block")
    assert all(fp32.spec(s) in ("fp32",) for s in SITES if s not in ("moe.weight", "moe.input"))
    assert bf16.spec("residual") == "bf16" and bf16.spec("attn.softmax") == "fp32" and bf16.spec("router") == "fp32"
    assert tensor.spec("linear.weight") == "e4m3:tensor" and tensor.spec("linear.input") == "e4m3:tensor"
    assert block.spec("linear.weight") == "e4m3:128x128" and block.spec("linear.input") == "e4m3:1x128"
    assert block.spec("moe.weight") == "e4m3:128x128"  # inherits linear.weight
    for hp in ("norm", "router", "attn.softmax", "embed", "lm_head"):
        assert block.spec(hp) in ("fp32", "bf16"), hp


def test_extends_and_override(tmp_path):
    """A user YAML extends a named recipe and overrides single sites and modules."""
    p = tmp_path / "mine.yaml"
    p.write_text("name: mine\nextends: fp8-block\nresidual: e4m3:tensor\n"
                 "overrides:\n  'layers.0.*': {linear.weight: bf16}\n")
    r = load_recipe(str(p))
    assert r.name == "mine" and r.spec("residual") == "e4m3:tensor"
    assert r.spec("linear.weight", "layers.0.attn.q_proj") == "bf16"
    assert r.spec("linear.weight", "layers.1.attn.q_proj") == "e4m3:128x128"
    assert r.spec("linear.input") == "e4m3:1x128"  # inherited from fp8-block
    child = tmp_path / "child.yaml"
    child.write_text("extends: mine.yaml\nkv.k: e4m3:head\n")
    c = load_recipe(str(child))
    assert c.name == "child" and c.spec("kv.k") == "e4m3:head" and c.spec("residual") == "e4m3:tensor"


@pytest.mark.parametrize("body,needle", [
    ("name: x\nextends: fp32\nresidule: bf16\n", "unknown key(s) ['residule']"),
    ("name: x\nextends: fp32\nresidual: e9m9:tensor\n", "site 'residual'"),
    ("name: x\nextends: fp32\nnorm: e4m3:tensor\n", "compute precision"),
    ("name: x\nextends: nope\n", "unknown recipe 'nope'"),
    ("name: x\nextends: fp32\naccumulate: tc99:promote\n", "accumulate"),
    ("name: [unclosed\n", "malformed YAML"),
    ("- a\n- b\n", "must be a YAML mapping"),
])
def test_bad_recipe_files_name_file_and_key(tmp_path, body, needle):
    """Each malformed recipe raises RecipeError naming the file and what is wrong."""
    p = tmp_path / "bad.yaml"
    p.write_text(body)
    with pytest.raises(RecipeError) as exc:
        load_recipe(str(p))
    assert needle in str(exc.value)
    assert "bad.yaml" in str(exc.value) or "recipe 'x'" in str(exc.value)


def test_cyclic_extends(tmp_path):
    """a extends b extends a is reported, not a recursion error."""
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(RecipeError, match="cyclic"):
        load_recipe(str(tmp_path / "a.yaml"))


def test_recipe_is_frozen():
    """Recipes are immutable data."""
    r = load_recipe("fp8-block")
    with pytest.raises(Exception):
        r.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        r.sites["residual"] = "fp32"  # type: ignore[index]
