"""Every supported architecture under the `fp32` recipe matches transformers FP32: logits, every canonical tap,
MoE expert choices, and greedy decoding through the KV cache; plus the trained zoo MoE and the MoE numerics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.api import Engine
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.loading import load_model
from engine.model import Transformer
from engine.numerics import Numerics
from engine.recipe import load_recipe
from engine.routing import route
from evalharness.evals.layer_error import OverlapAccumulator, topk_overlap
from evalharness.reference import ReferenceLM
from tests.conftest import REPO, write_random_model

pytestmark = pytest.mark.numerics

TOL = 1e-4
BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
           first_k_dense_replace=1, n_shared_experts=1)
YARN_V3 = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=1.0,
               mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
YARN_V2 = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32, mscale=0.707,
               mscale_all_dim=0.707)
CASES = {  # name -> (transformers config class, overrides of BASE)
    "qwen3": ("Qwen3Config", dict(intermediate_size=96, head_dim=16)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                         mlp_only_layers=[0])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=4.0)),
    # V3: q LoRA, sigmoid + correction bias, group-limited (2 groups, 1 kept), YaRN with mscale, interleaved RoPE
    "deepseek_v3_yarn": ("DeepseekV3Config", dict(MLA, q_lora_rank=48, n_group=2, topk_group=1,
                                                  routed_scaling_factor=2.5, rope_parameters=YARN_V3)),
    "deepseek_v3_rotate_half": ("DeepseekV3Config", dict(MLA, q_lora_rank=48, n_group=4, topk_group=2,
                                                         rope_interleave=False, norm_topk_prob=False)),
    # V2-Lite style: no q LoRA, softmax scoring; group-limited greedy / plain greedy with YaRN
    "deepseek_v2_grouped": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, topk_method="group_limited_greedy",
                                                     n_group=2, topk_group=1, routed_scaling_factor=2.0)),
    "deepseek_v2_yarn": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, topk_method="greedy",
                                                  rope_parameters=YARN_V2)),
}


def _build(tmp_path, name: str):
    """(engine fp32, reference, loaded) for a random-init model of CASES[name]."""
    import transformers

    cls, kw = CASES[name]
    config = getattr(transformers, cls)(**{**BASE, **kw})
    loaded = load_model(str(write_random_model(tmp_path / name, config, seed=3)))
    return Engine(Transformer(loaded.cfg, loaded.weights), "fp32"), ReferenceLM(loaded), loaded


def _taps(lm, tokens) -> dict[str, torch.Tensor]:
    """All canonical taps of one forward pass."""
    out: dict[str, torch.Tensor] = {}
    lm.logits(tokens, tap=lambda n, t: out.__setitem__(n, t.clone()))
    return out


def _assert_taps_match(te: dict[str, torch.Tensor], tr: dict[str, torch.Tensor]) -> None:
    """Same tap names; expert sets identical per token; every other tap within TOL relative to its scale."""
    assert set(te) == set(tr), f"tap names differ: {sorted(set(te) ^ set(tr))}"
    for name, ref in tr.items():
        eng = te[name]
        assert eng.shape == ref.shape, f"tap {name}: shape {tuple(eng.shape)} vs reference {tuple(ref.shape)}"
        if name.endswith("moe.topk"):
            same = topk_overlap(eng, ref)
            assert bool((same == 1).all()), f"tap {name}: expert choice differs on {int((same < 1).sum())} tokens"
            continue
        err = (eng - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert err <= TOL * max(1.0, scale), f"tap {name}: max abs err {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_matches_reference(tmp_path, name):
    """Prefill logits and taps match transformers; KV-cache decoding matches both prefill and HF's own decoding."""
    engine, ref, loaded = _build(tmp_path, name)
    cfg = loaded.cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    te, tr = _taps(engine, tokens), _taps(ref, tokens)
    _assert_taps_match(te, tr)
    assert (te["logits"] - tr["logits"]).abs().max().item() <= TOL
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    assert all(f"layers.{i}.moe.topk" in te for i in moe_layers)
    assert (len(moe_layers) > 0) == (name != "qwen3")

    prompt = [1, 5, 9, 33, 12]
    gen, step_logits = engine.generate(prompt, max_new_tokens=8, return_logits=True)
    full = engine.logits(torch.tensor([prompt + gen[:-1]]))[0, len(prompt) - 1:]
    assert (step_logits - full).abs().max().item() <= TOL  # KV cache == full prefill
    ref_gen, ref_steps = ref.generate(prompt, max_new_tokens=8, return_logits=True)
    assert gen == ref_gen
    assert (step_logits - ref_steps).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def zoo():
    """The trained zoo MoE: (LoadedModel, engine Transformer), loaded once for this module."""
    loaded = load_model(str(REPO / "zoo" / "zoo-moe"))
    return loaded, Transformer(loaded.cfg, loaded.weights)


def _prepare_subset(model: Transformer, nx: Numerics, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """`Transformer.prepare` restricted to the weights whose names start with one of `prefixes` (fast)."""
    part = object.__new__(Transformer)
    part.weights = {n: t for n, t in model.weights.items() if n.startswith(prefixes)}
    return part.prepare(nx)


@pytest.mark.slow
def test_zoo_moe_matches_reference_and_fp8_block_runs(zoo):
    """Our trained DeepSeek-V3-architecture MoE: fp32 == transformers; fp8-block gives a finite, positive KLD."""
    loaded, model = zoo
    cfg = loaded.cfg
    assert cfg.mla is not None and cfg.moe is not None and cfg.moe.group_limited and cfg.moe.correction_bias
    assert cfg.moe_layers == (1, 2, 3, 4) and cfg.mla.rope_interleave
    ref = ReferenceLM(loaded)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    tr = _taps(ref, tokens)
    te = _taps(Engine(model, "fp32"), tokens)
    _assert_taps_match(te, tr)
    assert (te["logits"] - tr["logits"]).abs().max().item() <= TOL

    fp8 = Engine(model, "fp8-block").logits(tokens)
    lp_ref, lp_eng = torch.log_softmax(tr["logits"].double(), -1), torch.log_softmax(fp8.double(), -1)
    kld = (lp_ref.exp() * (lp_ref - lp_eng)).sum(-1).mean().item()
    assert 0 < kld < 0.5 and torch.isfinite(fp8).all(), kld


def test_zoo_moe_bf16_decode_matches_prefill(zoo):
    """Under bf16 (latent + rope-key cache in bf16), KV-cache decoding agrees with full prefill.

    Not bitwise (unlike the dense models): MLA re-expands the whole cached latent
    with kv_b_proj at every step, so that GEMM's M (and the CPU kernel's blocking)
    changes per step and bf16 rounds the differently-accumulated outputs. The
    decode-vs-prefill gap must stay a small fraction of bf16's own error vs fp32,
    and under fp32 decoding equals prefill to float tolerance.
    """
    _, model = zoo
    prompt = [0, 523, 88, 1024, 7]
    engine = Engine(model, "bf16")
    gen, steps = engine.generate(prompt, max_new_tokens=8, return_logits=True)
    seq = torch.tensor([prompt + gen[:-1]])
    full = engine.logits(seq)[0, len(prompt) - 1:]
    f32 = Engine(model, "fp32").logits(seq)[0, len(prompt) - 1:]
    gap, err = (steps - full).abs().max().item(), (full - f32).abs().max().item()
    assert gap <= 0.1 * err, (gap, err)
    assert gen == full.argmax(-1).tolist()
    gen32, steps32 = Engine(model, "fp32").generate(prompt, max_new_tokens=8, return_logits=True)
    full32 = Engine(model, "fp32").logits(torch.tensor([prompt + gen32[:-1]]))[0, len(prompt) - 1:]
    assert (steps32 - full32).abs().max().item() <= 1e-4


def test_nvfp4_experts_quantizes_routed_experts_only(zoo):
    """nvfp4-experts: routed experts in NVFP4; shared expert, attention and dense MLP as fp8-block; router fp32."""
    _, model = zoo
    layers = ("model.layers.0.mlp.", "model.layers.1.")
    block = _prepare_subset(model, Numerics(load_recipe("fp8-block")), layers)
    nv = _prepare_subset(model, Numerics(load_recipe("nvfp4-experts")), layers)
    p = "model.layers.1.mlp."
    for e in range(model.cfg.moe.num_experts):
        routed = f"{p}experts.{e}.up_proj.weight"
        assert not torch.equal(nv[routed], block[routed])
        assert torch.unique(nv[routed][0, :16].abs()).numel() <= 8  # E2M1: 8 magnitudes per 16-block scale
    for name in (p + "shared_experts.up_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(nv[name], block[name]), name
    assert torch.equal(nv[p + "gate.weight"], model.weights[p + "gate.weight"])  # router stays fp32
    assert torch.equal(nv[p + "gate.e_score_correction_bias"], model.weights[p + "gate.e_score_correction_bias"])


def test_moe_batched_down_quant_is_bit_identical_to_per_expert(zoo):
    """The one-shot quantization of all experts' down_proj inputs (row-local 1x128) equals per-expert quantization."""
    from engine.moe import moe_block

    _, model = zoo
    nx = Numerics(load_recipe("fp8-block"))
    w = _prepare_subset(model, nx, ("model.layers.2.mlp.",))
    hn = torch.randn(2, 48, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    seen: dict[str, torch.Tensor] = {}
    nx.tap = lambda name, t: seen.__setitem__(name, t)
    batched = moe_block(nx, w, model.cfg, 2, hn)
    assert len(seen["layers.2.moe.topk"].unique()) > 2  # several experts active
    nx._rowwise_spec = lambda site, modules: None  # force the per-expert path
    per_expert = moe_block(nx, w, model.cfg, 2, hn)
    assert torch.equal(batched, per_expert)
    nx_tensor = Numerics(load_recipe("fp8-tensor"))  # per-tensor scales are per expert: the paths differ
    assert nx_tensor._rowwise_spec("moe.input", ["layers.2.mlp.experts.0.down_proj"]) is None
    assert nx._rowwise_spec.__name__ == "<lambda>" and Numerics(load_recipe("fp8-block"))._rowwise_spec(
        "moe.input", ["layers.2.mlp.experts.0.down_proj"]) == "e4m3:1x128"


def test_routing_selection_bias_and_groups():
    """Correction bias changes the choice but not the weights; group limiting keeps experts of the best group."""
    from engine.config import MoeConfig

    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1, 0.5, 0.4, 0.3, 0.2]])
    cfg = MoeConfig(num_experts=8, top_k=2, intermediate_size=4, scoring="sigmoid", norm_topk_prob=True,
                    routed_scaling_factor=2.5, n_group=2, topk_group=1, group_score="top2sum", correction_bias=True)
    w, ids = route(logits, cfg, torch.zeros(8))
    assert sorted(ids[0].tolist()) == [0, 1] and abs(w.sum().item() - 2.5) < 1e-6
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0])  # pushes group 1 (experts 4..7) to the top
    w2, ids2 = route(logits, cfg, bias)
    assert sorted(ids2[0].tolist()) == [4, 5]
    s = torch.sigmoid(logits[0, [4, 5]])
    assert torch.allclose(w2[0].sort().values, (s / s.sum() * 2.5).sort().values)  # unbiased scores as weights
    soft = dataclasses.replace(cfg, scoring="softmax", group_score="max", correction_bias=False, norm_topk_prob=False,
                               routed_scaling_factor=1.0, topk_group=2)
    w3, ids3 = route(logits, soft)
    assert sorted(ids3[0].tolist()) == [0, 1]
    assert torch.allclose(w3[0], torch.softmax(logits, -1)[0, ids3[0]])


def test_topk_overlap_metric():
    """Overlap = mean over tokens of |engine set & reference set| / k, order-insensitive."""
    e = torch.tensor([[0, 1], [2, 3], [4, 5]])
    r = torch.tensor([[1, 0], [2, 7], [6, 7]])
    assert topk_overlap(e, r).tolist() == [1.0, 0.5, 0.0]
    acc = OverlapAccumulator()
    acc.update(e, r)
    acc.update(e[:1], r[:1])
    assert acc.result()["overlap"] == pytest.approx(2.5 / 4)


@pytest.mark.parametrize("change, key", [
    ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "scoring_func"),
    ({"model_type": "deepseek_v3", "topk_method": "greedy"}, "topk_method"),
    ({"model_type": "deepseek_v2", "norm_topk_prob": True}, "norm_topk_prob"),
    ({"model_type": "deepseek_v3", "moe_layer_freq": 2}, "moe_layer_freq"),
    ({"model_type": "deepseek_v3", "n_group": 3}, "n_group"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": None}, "kv_lora_rank"),
    ({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "original_max_position_embeddings"),
    ({"model_type": "deepseek_v3", "num_key_value_heads": 2}, "num_key_value_heads"),
])
def test_unsupported_settings_name_the_key(change, key):
    """Settings the engine does not implement fail at config time with the key in the message."""
    cfg = {**BASE, **MLA, "q_lora_rank": None, "n_group": 2, "topk_group": 1}
    cfg.update(change)
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_hf(cfg)
