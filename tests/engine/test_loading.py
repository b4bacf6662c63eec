"""Loading: `evalharness run` on a local HF folder of every listed architecture, one weight copy shared by the
engine and the FP32 reference, bf16 / sharded checkpoints to fp32, and the suite's `reference_device` setting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.api import Engine
from engine.errors import WeightsError
from engine.loading import load_model
from engine.model import Transformer
from evalharness.cli import main
from evalharness.errors import SuiteError
from evalharness.reference import ReferenceLM
from evalharness.results import load_result
from evalharness.runner import resolve_reference_device
from evalharness.suite import load_suite
from tests.conftest import write_random_llama, write_random_model, write_suite
from tests.engine.test_architectures import BASE, CASES

VOCAB = BASE["vocab_size"]  # every model below: a token corpus must match the vocabulary exactly
# name -> how to build it: ("llama", overrides) via write_random_llama, or a CASES key of test_architectures.
ARCHS = {
    "llama": ("llama", {}),
    "mistral": ("llama", {"model_type": "mistral", "sliding_window": 16}),
    "qwen2": ("llama", {"model_type": "qwen2"}),
    "qwen3": ("case", "qwen3"),
    "mixtral": ("case", "mixtral"),
    "qwen2_moe": ("case", "qwen2_moe"),
    "qwen3_moe": ("case", "qwen3_moe"),
    "olmoe": ("case", "olmoe"),
    "deepseek_v2": ("case", "deepseek_v2_grouped"),
    "deepseek_v3": ("case", "deepseek_v3_yarn"),
}


def _config(name: str, **extra):
    """The transformers config object of a CASES entry (plus `extra` overrides)."""
    import transformers

    cls, kw = CASES[name]
    return getattr(transformers, cls)(**{**BASE, **kw, **extra})


def _write(path: Path, arch: str, seed: int = 0) -> Path:
    """A random-init HF folder of architecture `arch` (see ARCHS)."""
    how, what = ARCHS[arch]
    if how == "llama":
        return write_random_llama(path, seed=seed, **dict(what))
    return write_random_model(path, _config(what), seed=seed)


def _token_corpus(path: Path, n: int = 400) -> Path:
    """A token-corpus JSON for vocabulary VOCAB (no tokenizer needed)."""
    ids = torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    path.write_text(json.dumps({"vocab_size": VOCAB, "tokens": ids}))
    return path


@pytest.fixture(scope="module")
def arch_results(tmp_path_factory) -> Path:
    """One `evalharness run` over a suite naming each architecture's folder by path only, fp32 + fp8-block."""
    root = tmp_path_factory.mktemp("archs")
    models = "\n".join(f"  - {{name: {a}, path: {_write(root / a, a)}}}" for a in ARCHS)
    suite = write_suite(root / "suite.yaml", f"""name: loading
backend: cpu-emulated
reference_device: cpu
corpus: {_token_corpus(root / "corpus.json")}
models:
{models}
recipes: [fp32, fp8-block]
serving:
  - {{name: default, batch_size: 2}}
evals:
  layer_error: {{windows: 1, seq_len: 32}}
  ppl_kld: {{seq_len: 32, max_windows: 2}}
""")
    out = root / "out"
    assert main(["run", str(suite), "--out", str(out), "--no-tracking"]) == 0
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_run_on_local_folder_of_each_architecture(arch_results, arch):
    """fp32 reproduces the reference (KLD 0 up to rounding, logits rel_l2 tiny); fp8-block has a finite KLD > 0."""
    fp32 = load_result(arch_results / f"{arch}__fp32__default__cpu-emulated.json")
    fp8 = load_result(arch_results / f"{arch}__fp8-block__default__cpu-emulated.json")
    assert fp32["status"] == "ok", fp32["error"]
    assert fp8["status"] == "ok", fp8["error"]
    assert fp32["metrics"]["ppl_kld.kld_mean"] <= 1e-10
    assert fp32["metrics"]["layer_error.logits.rel_l2"] < 1e-5
    kld = fp8["metrics"]["ppl_kld.kld_mean"]
    assert kld is not None and math.isfinite(kld) and kld > 0
    assert fp8["metrics"]["layer_error.logits.rel_l2"] > 1e-4  # fp8 tiles really quantized something
    assert fp32["provenance"]["reference_device"] == "cpu"


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "deepseek_v3_yarn"])
def test_engine_and_reference_share_one_fp32_copy(tmp_path, case):
    """Every engine master tensor lives in a reference parameter's storage; fp32 `prepare` returns the masters;
    the stacked experts (gate rows first) give transformers' own `from_pretrained` logits bit for bit."""
    import transformers

    folder = write_random_model(tmp_path / case, _config(case), seed=2)
    loaded = load_model(str(folder))
    ref = ReferenceLM(loaded)
    model = Transformer(loaded.cfg, loaded.weights)
    ref_storages = {p.untyped_storage().data_ptr() for p in [*ref.model.parameters(), *ref.model.buffers()]}
    for name, w in model.weights.items():
        assert w.untyped_storage().data_ptr() in ref_storages, f"engine weight {name} is a copy"
    layers = ref.model.model.layers
    assert model.weights["model.layers.1.self_attn.o_proj.weight"].data_ptr() == \
        layers[1].self_attn.o_proj.weight.data_ptr()
    moe = next(i for i in range(loaded.cfg.num_layers) if loaded.cfg.is_moe(i))
    stack = layers[moe].mlp.experts.gate_up_proj  # (experts, 2*inter, d)
    inter = loaded.cfg.moe.intermediate_size
    gate1 = model.weights[f"model.layers.{moe}.mlp.experts.1.gate_proj.weight"]
    up1 = model.weights[f"model.layers.{moe}.mlp.experts.1.up_proj.weight"]
    assert gate1.data_ptr() == stack[1].data_ptr() and up1.data_ptr() == stack[1, inter:].data_ptr()
    assert loaded.weight_bytes == sum(p.numel() * 4 for p in ref.model.parameters()) + \
        sum(b.numel() * 4 for n, b in ref.model.named_buffers() if "correction_bias" in n)

    engine = Engine(model, "fp32")
    assert all(engine.weights[n] is w for n, w in model.weights.items())

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=tokens, use_cache=False).logits
    assert torch.equal(ref.logits(tokens), want)


def test_bf16_sharded_checkpoint_loads_to_fp32(tmp_path):
    """A bf16 Mixtral split over several shards with an index: every tensor fp32, equal to its bf16 value."""
    import transformers

    src = write_random_model(tmp_path / "fp32", _config("mixtral"), seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    dst = tmp_path / "bf16"
    model.save_pretrained(dst, max_shard_size="40KB")
    shards = sorted(dst.glob("*.safetensors"))
    assert len(shards) >= 3 and (dst / "model.safetensors.index.json").exists()
    on_disk: dict[str, torch.Tensor] = {}
    for f in shards:
        on_disk.update(load_file(str(f)))
    assert all(t.dtype == torch.bfloat16 for t in on_disk.values())

    loaded = load_model(str(dst))
    assert all(t.dtype == torch.float32 for t in loaded.weights.values())
    eng = Transformer(loaded.cfg, loaded.weights).weights
    checked = 0
    for name, t in on_disk.items():
        m = name.replace("block_sparse_moe.experts", "mlp.experts").replace(".w1.", ".gate_proj.")
        m = m.replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj.").replace("block_sparse_moe.gate", "mlp.gate")
        assert torch.equal(eng[m], t.float()), name
        checked += 1
    assert checked == len(on_disk) == len(eng)


def test_missing_or_misshapen_expert_is_named(tmp_path):
    """A routed-expert tensor missing from the checkpoint, or of the wrong shape: WeightsError naming it."""
    folder = write_random_model(tmp_path / "m", _config("qwen3_moe"), seed=5)
    st = folder / "model.safetensors"
    w = load_file(str(st))
    victim = "model.layers.1.mlp.experts.3.up_proj.weight"
    good = w.pop(victim)
    save_file(w, str(st), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"lacks 1 tensor.*experts\.3\.up_proj"):
        load_model(str(folder))
    w[victim] = good[:, :-1].contiguous()
    save_file(w, str(st), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"experts\.3\.up_proj\.weight' has shape"):
        load_model(str(folder))


def test_reference_device_setting(tmp_path, capsys):
    """`reference_device` is validated when the suite loads (exit 2 naming it); auto follows the engine."""
    folder = write_random_llama(tmp_path / "m")
    text = (f"name: s\nreference_device: DEV\ncorpus: {_token_corpus(tmp_path / 'c.json')}\n"
            f"models: [{{name: m, path: {folder}}}]\nrecipes: [fp32]\nevals: {{ppl_kld: {{seq_len: 16}}}}\n")
    assert load_suite(write_suite(tmp_path / "ok.yaml", text.replace("DEV", "cpu"))).reference_device == "cpu"
    assert load_suite(write_suite(tmp_path / "auto.yaml", text.replace("reference_device: DEV\n", ""))
                      ).reference_device == "auto"
    bad = write_suite(tmp_path / "bad.yaml", text.replace("DEV", "gpu"))
    with pytest.raises(SuiteError, match="reference_device must be one of.*'gpu'"):
        load_suite(bad)
    assert main(["run", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "reference_device" in capsys.readouterr().err
    assert resolve_reference_device("auto", "cpu") == "cpu" and resolve_reference_device("cpu", "cuda") == "cpu"
    assert resolve_reference_device("auto", "cuda") == "cuda"
    if not torch.cuda.is_available():
        with pytest.raises(SuiteError, match="no CUDA GPU"):
            resolve_reference_device("cuda", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reference_on_cpu_next_to_cuda_engine(tmp_path):
    """Engine on CUDA, reference on the host: the evals compare across devices; on one device they share weights."""
    folder = _write(tmp_path / "m", "deepseek_v3")
    suite = write_suite(tmp_path / "s.yaml", f"""name: s
backend: cuda-emulated
reference_device: cpu
corpus: {_token_corpus(tmp_path / "c.json")}
models: [{{name: m, path: {folder}}}]
recipes: [fp32, fp8-block]
evals:
  layer_error: {{windows: 1, seq_len: 32}}
  ppl_kld: {{seq_len: 32, max_windows: 2}}
""")
    out = tmp_path / "o"
    assert main(["run", str(suite), "--out", str(out)]) == 0
    fp32 = load_result(out / "m__fp32__default__cuda-emulated.json")
    fp8 = load_result(out / "m__fp8-block__default__cuda-emulated.json")
    assert fp32["status"] == fp8["status"] == "ok"
    assert fp32["provenance"]["reference_device"] == "cpu"
    assert fp32["metrics"]["ppl_kld.kld_mean"] < 1e-6  # fp32 on two devices: GEMM order only
    assert fp8["metrics"]["ppl_kld.kld_mean"] > 10 * fp32["metrics"]["ppl_kld.kld_mean"]

    loaded = load_model(str(folder)).to("cuda")
    ref = ReferenceLM(loaded, device="cuda")
    model = Transformer(loaded.cfg, loaded.weights).to("cuda")
    q = "model.layers.0.self_attn.kv_b_proj.weight"
    assert model.weights[q].data_ptr() == ref.model.model.layers[0].self_attn.kv_b_proj.weight.data_ptr()
