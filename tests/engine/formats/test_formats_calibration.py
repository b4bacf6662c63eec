"""AmaxObserver, stage-wise static scales, serialization, static-scale quantization."""

from __future__ import annotations

import json

import pytest
import torch

from engine.formats import (AmaxObserver, quantize, scales_from_jsonable, scales_to_jsonable,
                            stage_boundaries, stage_scales)


def f32(v):
    """Round a Python float to float32 (the library computes scales in float32)."""
    return float(torch.tensor(v, dtype=torch.float32))


def test_observer_running_amax_and_layer_view():
    """Running max over batches per (site, layer) key; layer_amax filters by site."""
    obs = AmaxObserver()
    obs.observe(("attn_in", 0), torch.tensor([1.0, -3.0]))
    obs.observe(("attn_in", 0), torch.tensor([2.0, 0.5]))
    obs.observe(("attn_in", 1), torch.tensor([[-7.0]]))
    obs.observe(("mlp_in", 0), torch.tensor([100.0]))
    assert obs.amax(("attn_in", 0)).item() == 3.0
    assert obs.layer_amax("attn_in") == {0: 3.0, 1: 7.0}
    assert len(obs) == 3 and ("mlp_in", 0) in obs
    d = json.loads(json.dumps(obs.to_dict()))
    obs2 = AmaxObserver.from_dict(d)
    assert obs2.layer_amax("attn_in") == {0: 3.0, 1: 7.0}
    obs.reset()
    assert len(obs) == 0


def test_observer_rowwise_and_nan():
    """Per-row observer keeps one amax per row; NaN propagates; shape changes are errors."""
    obs = AmaxObserver("row")
    obs.observe("w", torch.tensor([[1.0, -2.0], [3.0, 0.0]]))
    obs.observe("w", torch.tensor([[0.0, 5.0], [1.0, 1.0]]))
    assert obs.amax("w").tolist() == [5.0, 3.0]
    with pytest.raises(ValueError):
        obs.observe("w", torch.ones(3, 2))
    obs.observe("w", torch.tensor([[float("nan"), 0.0], [0.0, 0.0]]))
    assert torch.isnan(obs.amax("w")[0])
    with pytest.raises(ValueError):
        AmaxObserver("block")


def test_stage_boundaries():
    """Near-equal contiguous stages."""
    assert stage_boundaries(10, 3) == [0, 3, 6]
    assert stage_boundaries(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        stage_boundaries(3, 4)


def test_stage_scales_n_stages_and_boundaries():
    """scale = max amax over the stage * margin / max_normal; switches only at boundaries."""
    amax = {0: 1.0, 1: 2.0, 2: 4.0, 3: 0.5, 4: 8.0, 5: 1.0}
    s = stage_scales(amax, 6, 2, fmt="e4m3")
    assert s == {i: f32(4.0 / 448) for i in range(3)} | {i: f32(8.0 / 448) for i in range(3, 6)}
    s2 = stage_scales(amax, 6, boundaries=[0, 1, 4], fmt="e4m3:tensor", margin=2.0)
    assert s2[0] == f32(2.0 / 448)
    assert s2[1] == s2[2] == s2[3] == f32(8.0 / 448)
    assert s2[4] == s2[5] == f32(16.0 / 448)
    s3 = stage_scales(amax, 6, 6, fmt="int8")
    assert s3[2] == f32(4.0 / 127)
    # one stage over all layers == global max
    assert set(stage_scales(amax, 6, 1).values()) == {f32(8.0 / 448)}
    # zero amax -> scale 1 (like dynamic scales)
    assert stage_scales({0: 0.0}, 1, 1) == {0: 1.0}


def test_stage_scales_errors_and_missing_layers():
    """Exactly one of n_stages/boundaries; each stage needs an observation; layers in range."""
    with pytest.raises(ValueError):
        stage_scales({0: 1.0}, 2)
    with pytest.raises(ValueError):
        stage_scales({0: 1.0}, 2, 1, boundaries=[0])
    with pytest.raises(ValueError, match="no amax"):
        stage_scales({0: 1.0}, 4, 2)
    with pytest.raises(ValueError):
        stage_scales({0: 1.0, 9: 1.0}, 4, 1)
    with pytest.raises(ValueError):
        stage_scales({0: 1.0}, 4, boundaries=[1, 2])
    with pytest.raises(ValueError):
        stage_scales({0: 1.0}, 1, 1, margin=0.0)
    # missing layers inside a stage are fine
    assert stage_scales({0: 1.0, 3: 2.0}, 4, 2) == {0: f32(1 / 448), 1: f32(1 / 448),
                                                    2: f32(2 / 448), 3: f32(2 / 448)}


def test_stage_scales_rowwise_tensors_and_json_roundtrip():
    """Tensor amax gives tensor scales (elementwise stage max); JSON roundtrip is exact."""
    amax = {0: torch.tensor([1.0, 4.0]), 1: torch.tensor([2.0, 1.0])}
    s = stage_scales(amax, 2, 1)
    assert torch.equal(s[0], torch.tensor([2.0, 4.0]) / 448)
    back = scales_from_jsonable(json.loads(json.dumps(scales_to_jsonable(s))))
    assert torch.equal(back[1], s[1])
    sf = stage_scales({0: 3.0, 1: 5.0}, 2, 2)
    assert scales_from_jsonable(json.loads(json.dumps(scales_to_jsonable(sf)))) == sf


def test_static_stage_scale_used_by_quantize():
    """A calibrated stage scale is used as-is; values beyond it saturate and are reported."""
    obs = AmaxObserver()
    for b in range(3):
        obs.observe(("x", 0), torch.full((4,), float(b + 1)))  # amax 3
    scales = stage_scales(obs.layer_amax("x"), 1, 1, fmt="e4m3")
    x = torch.tensor([1.0, 3.0, 6.0, -12.0])
    q = quantize(x, "e4m3:tensor", scale=scales[0])
    assert q.scale.item() == scales[0]
    st = q.stats()
    assert st["saturation_frac"] == 0.5
    assert q.dequantize()[2:].tolist() == [f32(448 * scales[0]), -f32(448 * scales[0])]
