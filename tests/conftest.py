"""Shared fixtures: the data dir (skip cleanly without it), random-init HF model folders, CLI runner; the GPU and
interpreter markers.

Markers (pyproject.toml): `gpu` tests need a CUDA GPU and skip without one. `interpreter` tests also run on CPU
tensors under the Triton interpreter: `TRITON_INTERPRET=1 python3 -m pytest -q -m interpreter` (tests/support/
interpret.py). In that run this conftest patches the interpreter's floats to the GPU's once, before any kernel
runs, and skips the GPU tests not marked `interpreter`; a failure to patch fails every interpreter test (a run
that compared no GPU bits must not pass). Tests marked `interpreter` alone (checks that exist for the interpreter
only) skip outside that run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.interpret import INTERPRET, patch_interpreter

REPO = Path(__file__).resolve().parents[1]
_INTERPRETER_UNPATCHED: list[str] = []  # why the interpreter could not be patched (TRITON_INTERPRET=1 runs)


def pytest_configure(config):
    if INTERPRET:
        why = patch_interpreter()
        if why:
            _INTERPRETER_UNPATCHED.append(why)
        _one_thread()
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        # `-n N`: N workers share the cores; one thread each (and in the CLI runs they start), or the thread pools'
        # idle workers spin against the other workers (2 cores: the slow step took 1.6x longer with 2 threads each)
        os.environ["OMP_NUM_THREADS"] = "1"
        _one_thread()


def _one_thread() -> None:
    """One intra-op thread for torch and numpy's BLAS. The interpreter runs a kernel's programs one after another in
    Python, issuing small numpy / torch operations that gain nothing from thread pools, whose idle workers spin; under
    pytest-xdist the workers would compete with each other's spinning threads."""
    torch.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # numpy's BLAS keeps its threads
        return
    threadpool_limits(1)


def _page_run(item) -> Path | None:
    """The docs page a test runs the command blocks of (tests/test_docs.py), else None."""
    if item.nodeid.startswith("tests/test_docs.py::test_command_blocks_run_as_written"):
        return item.callspec.params["page"]
    return None


def _xdist_group(item) -> str | None:
    """The pytest-xdist group of a test (`-n N --dist loadgroup`), or None to spread it on its own. A test using a
    module- or class-scoped fixture (a suite run shared by several tests) goes with its module, so that fixture is
    built once; the docs page runs, independent, each alone, except the pages that serve on a fixed port
    (`# serves:`), which take turns."""
    page = _page_run(item)
    if page is not None:
        return "docs-serving" if "# serves:" in page.read_text() else None
    fixtures = item._fixtureinfo.name2fixturedefs.values()
    shared = any(defs[-1].scope in ("module", "class", "package") for defs in fixtures)
    return Path(item.nodeid.split("::")[0]).stem if shared else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Without TRITON_INTERPRET=1: `gpu` tests skip without CUDA, tests marked `interpreter` alone skip. With it: the
    `gpu` tests not marked `interpreter` skip (they need the GPU); the `interpreter` ones run on CPU tensors. Every
    test gets its pytest-xdist group (`_xdist_group`); the docs page runs, the longest tests, come first."""
    cuda = torch.cuda.is_available()
    items.sort(key=lambda item: _page_run(item) is None)  # the longest units (page runs) are handed out first
    for item in items:
        group = _xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        gpu = item.get_closest_marker("gpu") is not None
        interpreted = item.get_closest_marker("interpreter") is not None
        if INTERPRET:
            if gpu and not interpreted:
                item.add_marker(pytest.mark.skip(reason="TRITON_INTERPRET=1: not marked `interpreter` (needs the GPU)"))
        elif interpreted and not gpu:
            item.add_marker(pytest.mark.skip(reason="an interpreter check: runs under TRITON_INTERPRET=1 only"))
        elif gpu and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def pytest_runtest_setup(item):
    """Under TRITON_INTERPRET=1 an `interpreter` test fails when the interpreter could not be patched: unpatched, it
    would compare the interpreter's own bf16 / FP8 arithmetic, not the GPU's, with the formats library."""
    if INTERPRET and _INTERPRETER_UNPATCHED and item.get_closest_marker("interpreter") is not None:
        pytest.fail(f"TRITON_INTERPRET=1: cannot patch the Triton interpreter ({_INTERPRETER_UNPATCHED[0]}); "
                    "tests/support/interpret.py must be updated for this Triton version", pytrace=False)


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
