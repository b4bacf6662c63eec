"""The model-source grammar (engine.loading.parse_source): each kind, and a message naming the source and the
grammar for bad input."""

from __future__ import annotations

import pytest

from engine.errors import WeightsError
from engine.loading import ModelSource, checkpoint_sha256, load_model, parse_source
from evalharness.data import BUILTIN_DIR


def test_each_kind(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert parse_source(str(folder)) == ModelSource("hf_dir", str(folder), str(folder))
    assert parse_source("meta-llama/Llama-3-8B") == ModelSource("hf_id", "meta-llama/Llama-3-8B",
                                                                 "meta-llama/Llama-3-8B")
    src = parse_source("llama2c:/m/stories260K.bin")
    assert (src.kind, src.path, src.default_name) == ("llama2c", "/m/stories260K.bin", "stories260K")
    assert parse_source("/m/x.bin").kind == "llama2c"  # a *.bin file is a llama2.c checkpoint
    assert parse_source("builtin:tiny-llama") == ModelSource("builtin", "tiny-llama", "builtin:tiny-llama",
                                                             "tiny-llama")
    resolved = parse_source("builtin:tiny-llama", builtin_dir=BUILTIN_DIR)
    assert resolved.path == str(BUILTIN_DIR / "tiny-llama") and str(resolved) == resolved.path
    assert parse_source(resolved) is resolved
    assert parse_source("no/such/dir/anywhere").kind == "hf_dir"  # not an id: the loader says it is missing
    assert parse_source("llama2c:a/b.bin").with_path("/s/a/b.bin").text == "llama2c:/s/a/b.bin"


@pytest.mark.parametrize("text, match", [
    ("", "empty; give builtin:NAME, llama2c:FILE"),
    ("builtin:", "builtin: needs a NAME"),
    ("builtin:../x", "builtin: needs a NAME"),
    ("llama2c:", r"llama2c: needs the checkpoint file \(llama2c:FILE\)"),
    ("gguf:model.gguf", "unknown prefix 'gguf:'; give builtin:NAME"),
])
def test_bad_input_names_the_source_and_the_grammar(text, match):
    with pytest.raises(WeightsError, match=match):
        parse_source(text)


def test_unknown_builtin_lists_the_available_ones():
    with pytest.raises(WeightsError, match=r"unknown built-in 'tiny-lama'; available: \[.*'tiny-llama'"):
        parse_source("builtin:tiny-lama", builtin_dir=BUILTIN_DIR)
    with pytest.raises(WeightsError, match="built-in models ship with the harness"):
        load_model("builtin:tiny-llama")  # the engine alone does not know where built-ins are


def test_loader_takes_a_parsed_source():
    src = parse_source("builtin:tiny-llama", builtin_dir=BUILTIN_DIR)
    loaded = load_model(src)
    assert loaded.source == str(BUILTIN_DIR / "tiny-llama")
    assert loaded.sha256 == checkpoint_sha256(src) == load_model(src.path).sha256
