"""A corrupt or foreign entry of the on-disk reference cache (`DIR/ref_cache/`) is never trusted: it is rejected
(counted in the result's counters), recomputed and replaced, and the numbers equal those of an intact cache."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from evalharness.results import load_result
from tests.faults.support import cli, model, token_corpus, write_suite

KEY = "m__fp8-block__default__cpu-emulated.json"
EVALS = {"ppl_kld": {"seq_len": 32, "max_windows": 3, "ref_topk": 8}}


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other windows"])
def test_damaged_reference_cache_entry_is_recomputed(tmp_path, capsys, damage):
    """Garbage bytes, a file cut short, or a well-formed entry of other windows (one window fewer) under the key's
    name: the run recomputes the reference and its metrics equal the first run's."""
    entry = {"name": "m", "path": str(model(tmp_path, "m")), "corpus": str(token_corpus(tmp_path / "c.json"))}
    suite = write_suite(tmp_path / "s.yaml", [entry], recipes=("fp8-block",), evals=EVALS)
    out = tmp_path / "out"
    assert cli(capsys, "run", suite, "--out", out, "--no-tracking")[0] == 0
    first = load_result(out / KEY)
    [entry_file] = (out / "ref_cache").glob("ppl_kld-*.safetensors")
    if damage == "garbage":
        entry_file.write_bytes(b"\x00garbage" * 100)
    elif damage == "truncated":
        entry_file.write_bytes(entry_file.read_bytes()[:-100])
    else:
        from safetensors import safe_open

        with safe_open(str(entry_file), framework="pt") as f:
            meta = f.metadata()
        rec = {name: t[:-1].contiguous() for name, t in load_file(str(entry_file)).items()}
        save_file(rec, str(entry_file), metadata=meta)
    code, text = cli(capsys, "run", suite, "--out", out, "--no-tracking")
    assert code == 0, text
    again = load_result(out / KEY)
    assert again["status"] == "ok" and again["counters"]["reference_cache_rejected"] == 1
    assert again["metrics"] == first["metrics"] and again["samples"] == first["samples"]
    rec = load_file(str(entry_file))  # replaced by an intact entry
    assert rec["lp"].shape == (3, 32, 8) and bool(torch.isfinite(rec["lp"]).all())
