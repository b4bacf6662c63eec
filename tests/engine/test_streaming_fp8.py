"""Layer streaming of an FP8 checkpoint with block scales (DeepSeek-V3's layout: an E4M3 weight plus
`<name>_scale_inv`, one fp32 scale per 128 x 128 block, partial blocks at the edges): each weight read comes back as
codes x its block's scale in fp32, the other tensors as stored; a missing or mis-tiled scale is an error naming the
tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import WeightsError
from engine.streaming import LayerStore

ZOO = Path(__file__).resolve().parents[2] / "zoo" / "zoo-llama"
FP8 = torch.float8_e4m3fn


def _block_fp8(w: torch.Tensor, bo: int = 128, bi: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 codes, scale_inv (ceil(out/bo), ceil(in/bi)), their fp32 product) with each block's amax at the
    format's max."""
    out, inn = w.shape
    so, si = -(-out // bo), -(-inn // bi)
    scale = torch.empty(so, si)
    for i in range(so):
        for j in range(si):
            amax = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].abs().max()
            scale[i, j] = torch.clamp(amax, min=1e-12) / torch.finfo(FP8).max
    full = scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inn]
    codes = (w / full).to(FP8)
    return codes, scale, codes.float() * full


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """zoo-llama with every 2-D projection of its decoder layers stored as E4M3 + 128 x 128 block scales."""
    d = tmp_path_factory.mktemp("fp8") / "zoo-llama-fp8"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ZOO / f, d / f)
    tensors, want = {}, {}
    for name, t in load_file(str(ZOO / "model.safetensors")).items():
        if ".layers." in name and name.endswith("proj.weight"):
            tensors[name], tensors[name + "_scale_inv"], want[name] = _block_fp8(t.float())
        else:
            tensors[name] = t
            want[name] = t.float()
    save_file(tensors, str(d / "model.safetensors"))
    return d, want


def test_fp8_weights_stream_as_codes_times_their_block_scales(fp8_checkpoint):
    d, want = fp8_checkpoint
    store = LayerStore.open(str(d))
    got = store.load(0, "cpu")
    proj = [n for n in got if n.endswith("proj.weight")]
    assert len(proj) == 7  # q, k, v, o, gate, up, down of layer 0
    for name in proj:
        assert torch.equal(got[name], want[name]), name
    down = got["model.layers.0.mlp.down_proj.weight"]
    assert down.shape[1] % 128 != 0  # zoo-llama's intermediate 688: a partial block at the edge is covered
    # the codes are not the fp32 weights: the store really dequantized FP8 (error within E4M3's half ulp)
    orig = load_file(str(ZOO / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].float()
    rel = ((down - orig).norm() / orig.norm()).item()
    assert 1e-4 < rel < 0.05, rel


def test_fp8_without_or_with_mis_tiled_scales_is_an_error_naming_the_tensor(fp8_checkpoint, tmp_path):
    d, _ = fp8_checkpoint
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = load_file(str(d / "model.safetensors"))
    for case, edit in (("missing", lambda t: t.pop(name + "_scale_inv")),
                       ("mis-tiled", lambda t: t.__setitem__(name + "_scale_inv", torch.ones(3, 5)))):
        bad = tmp_path / case
        shutil.copytree(d, bad)
        t = dict(tensors)
        edit(t)
        save_file(t, str(bad / "model.safetensors"))
        with pytest.raises(WeightsError, match=name.replace(".", r"\.")):
            LayerStore.open(str(bad)).load(0, "cpu")
    assert json.loads((d / "config.json").read_text())["hidden_size"] == 256


def test_the_block_size_comes_from_the_config(fp8_checkpoint, tmp_path):
    """quantization_config.weight_block_size (rows, columns) sets the blocks; a malformed one is an error."""
    d, _ = fp8_checkpoint
    other = tmp_path / "b64x32"
    shutil.copytree(d, other)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 32]}
    (other / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(ZOO / "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj.weight"  # (688, 256): 11 x 8 blocks, the last row block partial
    codes, scale, want = _block_fp8(tensors[name].float(), 64, 32)
    assert scale.shape == (11, 8)
    tensors[name], tensors[name + "_scale_inv"] = codes, scale
    save_file(tensors, str(other / "model.safetensors"))
    assert torch.equal(LayerStore.open(str(other)).load(0, "cpu")[name], want)
    cfg["quantization_config"]["weight_block_size"] = [64]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="weight_block_size must be two positive integers"):
        LayerStore.open(str(other)).load(0, "cpu")
