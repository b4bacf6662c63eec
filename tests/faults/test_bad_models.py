"""Bad models, tokenizers and corpora: each is an error result of its own runs, with a message that names the file,
tensor or key; `run` exits 2 (bad input) or 1 (a crash) at the end, and the suite goes on with the next model.

Rows of the fault table: a checkpoint tensor of the wrong shape, a missing tensor, `"hidden_size": "256"`, a
truncated or garbage llama2.c tokenizer (each: a traceback, exit 1 and every later model skipped before), a binary
file as corpus and a tokenizer much smaller than the model's vocabulary (both accepted silently before)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from evalharness.results import load_result
from tests.faults.support import cli, llama2c_tokenizer, model, text_corpus, token_corpus, write_suite

GOOD = "good__fp32__default__cpu-emulated.json"


@pytest.fixture
def good(tmp_path) -> dict:
    """A model entry that loads and runs: the suite must reach it after the bad one."""
    return {"name": "good", "path": str(model(tmp_path, "good-model")),
            "corpus": str(token_corpus(tmp_path / "c.json"))}


def _suite_with(tmp_path, bad: dict, good: dict) -> str:
    return str(write_suite(tmp_path / "suite.yaml", [bad, good], recipes=("fp32", "bf16")))


def _assert_recorded(tmp_path, code: int, out: str, name: str, expect_code: int, *words: str) -> dict:
    """The bad model's runs are error results naming `words`, the good model ran, `run` exited `expect_code`."""
    assert code == expect_code, out
    res = tmp_path / "out"
    for recipe in ("fp32", "bf16"):
        doc = load_result(res / f"{name}__{recipe}__default__cpu-emulated.json")
        assert doc["status"] == "error" and doc["error"]["bad_input"] is (expect_code == 2)
        for w in words:
            assert w in doc["error"]["message"], (w, doc["error"]["message"])
    assert load_result(res / GOOD)["status"] == "ok"
    assert load_result(res / "good__bf16__default__cpu-emulated.json")["status"] == "ok"
    for w in words:
        assert w in out
    return load_result(res / f"{name}__fp32__default__cpu-emulated.json")


def _checkpoint(tmp_path, edit) -> dict:
    """A model entry whose safetensors file was edited by `edit(tensors)`."""
    folder = model(tmp_path, "bad")
    w = load_file(str(folder / "model.safetensors"))
    edit(w)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return {"name": "bad", "path": str(folder), "corpus": str(token_corpus(tmp_path / "bc.json"))}


def test_tensor_shape_disagrees_with_config(tmp_path, good, capsys):
    """A tensor whose shape is not the config's: error results naming the tensor and both shapes, exit 2."""
    import torch

    bad = _checkpoint(tmp_path, lambda w: w.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(90, 64)}))
    code, out = cli(capsys, "run", _suite_with(tmp_path, bad, good), "--out", tmp_path / "out", "--no-tracking")
    doc = _assert_recorded(tmp_path, code, out, "bad", 2, "model.layers.0.mlp.up_proj.weight", "(90, 64)", "(96, 64)")
    assert "re-export" in doc["error"]["message"]


def test_missing_tensor(tmp_path, good, capsys):
    """A tensor the config needs is absent: error results naming it, exit 2, the next model runs."""
    bad = _checkpoint(tmp_path, lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"))
    code, out = cli(capsys, "run", _suite_with(tmp_path, bad, good), "--out", tmp_path / "out", "--no-tracking")
    _assert_recorded(tmp_path, code, out, "bad", 2, "model.layers.1.self_attn.k_proj.weight", "lacks 1 tensor")


def test_config_value_of_the_wrong_type(tmp_path, good, capsys):
    """`"hidden_size": "64"` (a string) in config.json: error results naming the file and the key, exit 2."""
    folder = model(tmp_path, "bad")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_size"] = "64"
    (folder / "config.json").write_text(json.dumps(cfg))
    bad = {"name": "bad", "path": str(folder), "corpus": str(token_corpus(tmp_path / "bc.json"))}
    code, out = cli(capsys, "run", _suite_with(tmp_path, bad, good), "--out", tmp_path / "out", "--no-tracking")
    _assert_recorded(tmp_path, code, out, "bad", 2, "config.json", "'hidden_size' must be an integer", "'64'")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_broken_llama2c_tokenizer(tmp_path, good, capsys, damage):
    """A llama2.c tokenizer.bin cut inside a record, or random bytes: error results naming the file, exit 2."""
    tok = llama2c_tokenizer(tmp_path / "tok.bin")
    if damage == "truncated":
        tok.write_bytes(tok.read_bytes()[:-3])
    else:
        import random

        tok.write_bytes(bytes(random.Random(7).randrange(256) for _ in range(3000)))
    bad = {"name": "bad", "path": str(model(tmp_path, "bad")), "tokenizer": f"llama2c:{tok}",
           "corpus": str(text_corpus(tmp_path / "text.txt"))}
    code, out = cli(capsys, "run", _suite_with(tmp_path, bad, good), "--out", tmp_path / "out", "--no-tracking")
    doc = _assert_recorded(tmp_path, code, out, "bad", 2, str(tok))
    assert doc["error"]["type"] == "TokenizerError" and "not a llama2.c" in doc["error"]["message"]


def test_a_valid_llama2c_tokenizer_still_loads(tmp_path, capsys):
    """The control of the tokenizer tests: the same tokenizer intact reads the text corpus and the run is ok."""
    tok = llama2c_tokenizer(tmp_path / "t.bin")
    entry = {"name": "ok", "path": str(model(tmp_path, "m")), "tokenizer": f"llama2c:{tok}",
             "corpus": str(text_corpus(tmp_path / "text.txt"))}
    code, out = cli(capsys, "run", write_suite(tmp_path / "s.yaml", [entry]), "--out", tmp_path / "out",
                    "--no-tracking")
    assert code == 0, out
    assert load_result(tmp_path / "out" / "ok__fp32__default__cpu-emulated.json")["metrics"]["ppl_kld.n_windows"] == 2


def test_crash_while_loading_is_exit_1_and_the_suite_goes_on(tmp_path, good, capsys, monkeypatch):
    """A failure that is not bad input (here the reference cannot be built): error results with the traceback,
    exit 1, and the next model still runs."""
    import evalharness.runner as runner

    real = runner.ReferenceLM

    def reference(loaded, **kw):
        if "bad" in loaded.source:
            raise RuntimeError("reference exploded")
        return real(loaded, **kw)

    monkeypatch.setattr(runner, "ReferenceLM", reference)
    bad = {"name": "bad", "path": str(model(tmp_path, "bad")), "corpus": str(token_corpus(tmp_path / "bc.json"))}
    code, out = cli(capsys, "run", _suite_with(tmp_path, bad, good), "--out", tmp_path / "out", "--no-tracking")
    doc = _assert_recorded(tmp_path, code, out, "bad", 1, "reference exploded")
    assert "Traceback" in doc["error"]["traceback"]


def test_binary_file_as_corpus(tmp_path, capsys):
    """A binary file named as a text corpus: the run's error names the file and the byte offset (exit 2), instead
    of a corpus of replacement characters."""
    blob = tmp_path / "weights.bin.txt"
    shutil.copy(model(tmp_path, "m") / "model.safetensors", blob)
    entry = {"name": "b", "path": str(tmp_path / "m"), "tokenizer": f"llama2c:{llama2c_tokenizer(tmp_path / 't.bin')}",
             "corpus": str(blob)}
    code, out = cli(capsys, "run", write_suite(tmp_path / "s.yaml", [entry]), "--out", tmp_path / "out",
                    "--no-tracking")
    assert code == 2, out
    doc = load_result(tmp_path / "out" / "b__fp32__default__cpu-emulated.json")
    msg = doc["error"]["message"]
    assert doc["status"] == "error" and str(blob) in msg and "offset" in msg and "UTF-8" in msg


def test_tokenizer_much_smaller_than_the_vocabulary(tmp_path, capsys):
    """A 97-piece tokenizer on a 1000-id model is another model's tokenizer, not padding: exit 2 naming both sizes;
    a tokenizer a few ids smaller (padding) is accepted."""
    tok = llama2c_tokenizer(tmp_path / "t.bin")
    entry = {"name": "big", "path": str(model(tmp_path, "m", vocab_size=1000)), "tokenizer": f"llama2c:{tok}",
             "corpus": str(text_corpus(tmp_path / "text.txt"))}
    code, out = cli(capsys, "run", write_suite(tmp_path / "s.yaml", [entry]), "--out", tmp_path / "out",
                    "--no-tracking")
    assert code == 2 and "97" in out and "1000" in out and "another model" in out, out
    entry.update(name="padded", path=str(model(tmp_path, "m2", vocab_size=128)))
    code, out = cli(capsys, "run", write_suite(tmp_path / "s2.yaml", [entry]), "--out", tmp_path / "out2",
                    "--no-tracking")
    assert code == 0, out
