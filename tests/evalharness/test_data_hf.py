"""`hf:` corpus references go through `datasets.load_dataset` (here: a local folder of text files, offline)."""

from __future__ import annotations

import pytest

from evalharness.data import load_corpus_tokens
from evalharness.errors import DataError

datasets = pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """Offline, with an empty datasets cache in tmp. `datasets` and `huggingface_hub` read HF_DATASETS_OFFLINE /
    HF_HUB_OFFLINE / HF_DATASETS_CACHE once, at import (done above), so their module constants are patched too:
    setting the environment alone would leave `load_dataset` trying the network."""
    import huggingface_hub.constants

    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setattr(datasets.config, name, True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


class Bytes:
    """A byte-level tokenizer (ids 0..255)."""

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


def test_local_dataset_folder_loads_through_datasets(tmp_path):
    """A folder with train.txt is a `text` dataset: its lines are the records, joined by blank lines."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "train.txt").write_text("ab\ncd\n")
    toks = load_corpus_tokens(f"hf:{d}:train", Bytes(), 256, 100)
    assert bytes(toks).decode() == "ab\n\ncd"
    assert load_corpus_tokens(f"hf:{d}:train", Bytes(), 256, 3) == list(b"ab\n")


def test_bad_hf_references_are_clear_errors(tmp_path):
    """Malformed reference, missing dataset (offline), missing field: each names the reference and the fix."""
    with pytest.raises(DataError, match=r"expected hf:NAME\[:CONFIG\]:SPLIT"):
        load_corpus_tokens("hf:wikitext", Bytes(), 256, 10)
    with pytest.raises(DataError, match="use a file from --data-dir"):
        load_corpus_tokens("hf:surely-not-a-dataset-xyz:test", Bytes(), 256, 10)
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "train.txt").write_text("ab\n")
    with pytest.raises(DataError, match="no field 'body'"):
        load_corpus_tokens(f"hf:{d}:train#body", Bytes(), 256, 10)
