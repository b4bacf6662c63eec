"""The `outliers:` model source (engine.outliers): function-preserving in FP32, outliers where quantization sees
them, and named by the model-source grammar."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.errors import WeightsError
from engine.loading import checkpoint_sha256, load_model, parse_source
from engine.outliers import OutlierPlan

ZOO = Path(__file__).resolve().parents[2] / "zoo"


def test_grammar(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    src = parse_source(f"outliers:{folder}")
    assert (src.kind, src.path, src.transform, src.default_name) == ("hf_dir", str(folder), "outliers", "m-outliers")
    assert src.with_path("/abs/m").text == "outliers:/abs/m"
    assert parse_source("outliers:org/name").kind == "hf_id"
    for bad in ("outliers:builtin:tiny-llama", "outliers:llama2c:x.bin", "outliers:outliers:" + str(folder)):
        with pytest.raises(WeightsError, match="outliers: takes an HF model folder or hub id"):
            parse_source(bad)


def test_plan_factors_are_powers_of_two():
    with pytest.raises(ValueError, match="mlp_scale = 100.0: must be a power of two"):
        OutlierPlan(mlp_scale=100.0)
    assert OutlierPlan().tag() != OutlierPlan(seed=1).tag()


@pytest.mark.slow  # 3-10 s each on a 2-core machine (transformers' import, two loads, two references)
@pytest.mark.parametrize("model", ["zoo-llama", "zoo-moe"])
def test_same_function_in_fp32(model):
    """Reference and engine (fp32 recipe) logits of the variant equal the original's; weights did change."""
    from engine.api import Engine
    from engine.model import Transformer
    from evalharness.reference import ReferenceLM

    torch.set_grad_enabled(False)
    folder = ZOO / model
    tokens = torch.randint(4, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    out = {}
    for label, source in (("orig", str(folder)), ("outl", f"outliers:{folder}")):
        loaded = load_model(source)
        ref = ReferenceLM(loaded).model(tokens).logits
        eng = Engine(Transformer(loaded.cfg, loaded.weights, where=loaded.source), "fp32").logits(tokens)
        out[label] = (loaded, ref, eng)
    (o, ref_o, eng_o), (v, ref_v, eng_v) = out["orig"], out["outl"]
    # measured: bit-identical (every factor is a power of two, so every product x_j w_j is unchanged); the
    # bound allows for a different accumulation order at fp32 rounding
    tol = 1e-5 * float(ref_o.abs().max())
    assert float((ref_v - ref_o).abs().max()) <= tol and float((eng_v - eng_o).abs().max()) <= tol
    up = "model.layers.0.mlp.up_proj.weight"
    ratio = (v.weights[up] / o.weights[up]).median(1).values  # (intermediate,): columns of hidden outliers aside
    assert int((ratio == 256.0).sum()) == OutlierPlan().mlp_channels and int((ratio == 1.0).sum()) == \
        ratio.numel() - OutlierPlan().mlp_channels
    assert v.sha256 != o.sha256 and v.sha256 == checkpoint_sha256(f"outliers:{folder}")


def test_k_head_scaled_and_queries_compensated():
    """zoo-llama's K head g x k_scale, its query heads / k_scale, every other head untouched."""
    folder = ZOO / "zoo-llama"
    o, v = load_model(str(folder)), load_model(f"outliers:{folder}")
    cfg, s = o.cfg, OutlierPlan().k_scale
    a = "model.layers.3.self_attn."
    # (kv_heads, head_dim * hidden): the columns of the hidden outlier channels are / hidden_scale in every row
    k = (v.weights[a + "k_proj.weight"] / o.weights[a + "k_proj.weight"]).view(cfg.num_kv_heads, -1)
    per_head = k.median(1).values  # (kv_heads,)
    assert sorted(per_head.tolist()) == [1.0] * (cfg.num_kv_heads - 1) + [s]
    g = int(per_head.argmax())
    group = cfg.num_heads // cfg.num_kv_heads
    q = (v.weights[a + "q_proj.weight"] / o.weights[a + "q_proj.weight"]).view(cfg.num_heads, -1)
    expect = torch.ones(cfg.num_heads)
    expect[g * group:(g + 1) * group] = 1.0 / s
    assert torch.equal(q.median(1).values, expect)


def test_layer_streaming_refuses_a_transformed_source():
    from engine.streaming import LayerStore

    with pytest.raises(WeightsError, match="run it resident"):
        LayerStore.open(f"outliers:{ZOO / 'zoo-llama'}")
