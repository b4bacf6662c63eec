"""Shared fixtures: the data dir (skip cleanly without it), random-init HF model folders, CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.interpret_util import INTERPRET, patch_interpreter

REPO = Path(__file__).resolve().parents[1]
_INTERPRETER_UNPATCHED: list[str] = []  # why the interpreter could not be patched (TRITON_INTERPRET=1 runs)


def pytest_configure(config):
    if INTERPRET:
        why = patch_interpreter()
        if why:
            _INTERPRETER_UNPATCHED.append(why)


def pytest_collection_modifyitems(config, items):
    """GPU tests (marker `gpu`) skip without CUDA. Under TRITON_INTERPRET=1 only those also marked `interpreter` run,
    on CPU tensors through the patched interpreter (tests/interpret_util.py); the others skip."""
    cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if INTERPRET:
            if item.get_closest_marker("interpreter") is None:
                item.add_marker(pytest.mark.skip(reason="TRITON_INTERPRET=1: not marked `interpreter` (needs the GPU)"))
            elif _INTERPRETER_UNPATCHED:
                item.add_marker(pytest.mark.skip(reason=f"cannot patch the interpreter: {_INTERPRETER_UNPATCHED[0]}"))
        elif not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def shared_data_dir() -> Path | None:
    """$EVALHARNESS_DATA_DIR, else <repo>/../shared/data; None when absent."""
    env = os.environ.get("EVALHARNESS_DATA_DIR")
    p = Path(env) if env else REPO.parent / "shared" / "data"
    return p if p.is_dir() else None


@pytest.fixture
def data_dir() -> Path:
    """The shared data folder, or skip with the reason."""
    p = shared_data_dir()
    if p is None:
        pytest.skip("shared data dir not found (set EVALHARNESS_DATA_DIR or place it at ../shared/data)")
    return p


def write_random_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Write a random-init HF model folder (config.json + model.safetensors) built with transformers' config classes."""
    import transformers

    kind = overrides.pop("model_type", "llama")
    cfg_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[kind]
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    config = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make activations non-trivial: default init (std 0.02) gives near-uniform logits
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def randomize_weights(model, seed: int = 0, bias_std: float = 0.1) -> None:
    """Re-initialise an HF model so activations are non-trivial (default init, std 0.02, gives near-uniform logits).

    Matrices (incl. 3D fused expert stacks) ~ N(0, 1/fan_in), norm weights ~ U(0.5, 1.5), other vectors
    ~ N(0, 0.1); DeepSeek-V3's e_score_correction_bias buffers ~ N(0, bias_std) so that selection-only
    biases change the expert choice.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * bias_std)


def write_random_model(path: Path, config, seed: int = 0) -> Path:
    """Write a random-init HF model folder (config.json + model.safetensors) for any transformers config object."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def random_llama(tmp_path) -> Path:
    """A random-init Llama folder."""
    return write_random_llama(tmp_path / "rand-llama")


def write_suite(path: Path, text: str) -> Path:
    """Write a suite YAML file."""
    path.write_text(text)
    return path
