"""The decode plan's tables are data (engine/kernels/configs/<device>.json, package data) and its rules one frozen
policy: both equal what the Python tables and module constants held before (the frozen copy in
tests/data/decode_tables_7fffaf1.json), so moving them changed no kernel or configuration choice; a bad file is
refused by name. CPU only, no kernel launched."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from engine.kernels import decode_plan as P

REPO = Path(__file__).resolve().parents[4]
FROZEN = json.loads((REPO / "tests" / "data" / "decode_tables_7fffaf1.json").read_text())


def test_shipped_tables_equal_the_frozen_ones_entry_for_entry():
    """The loaded decode and GEMV entries are the frozen tables: same keys in the same order, same knobs with the
    same types (True is not 1 for wgmma / whole_k)."""
    want = [((r["device"], r["n"], r["k"], r["bm"]), r["knobs"]) for r in FROZEN["decode_configs"]]
    got = [(key, dict(knobs)) for key, knobs in P.DEFAULT_POLICY.decode_configs.items()]
    assert got == want and len(got) == 15
    assert [[type(v) for v in k.values()] for _, k in got] == [[type(v) for v in k.values()] for _, k in want]
    gemv = [((r["device"], r["n"], r["k"]), r["knobs"]) for r in FROZEN["gemv_configs"]]
    assert [(key, dict(knobs)) for key, knobs in P.DEFAULT_POLICY.gemv_configs.items()] == gemv and len(gemv) == 2


def test_default_policy_equals_the_frozen_rule_constants():
    """Every rule constant of the default policy is the frozen module constant (paths removed since: the autotuned
    stages and the GEMV's L2 prefetch, both off in the frozen copy)."""
    r = FROZEN["rules"]
    pol = P.DEFAULT_POLICY
    assert r["decode_stage_choice"] == "rule" and r["gemv_prefetch_bytes"] == 0
    assert pol.decode_stages == tuple((math.inf if lim == "inf" else lim, st) for lim, st in r["decode_stages"])
    assert pol.mx_split_rule == tuple(tuple(row) for row in r["mx_split_rule"])
    assert pol.sliced_auto_splits == tuple(r["sliced_auto_splits"])
    for name in ("gemv_m1", "fused_reduce", "tune_min_weight", "split_fill", "whole_k_at_bm64", "wgmma_rule",
                 "wgmma_wide", "wgmma_fill8", "wgmma_max_splits", "wgmma_min_groups", "wgmma_min_groups8",
                 "wgmma_max_stages", "sliced_auto"):
        assert getattr(pol, name) == r[name] and type(getattr(pol, name)) is type(r[name]), name


def test_policy_is_frozen_and_validated():
    """Nothing patches a policy; replace() builds another, and bad rules or knobs are refused by name."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.DEFAULT_POLICY.split_fill = 2.0
    assert dataclasses.replace(P.DEFAULT_POLICY, split_fill=2.0).split_fill == 2.0 and P.DEFAULT_POLICY.split_fill == 0.9
    with pytest.raises(ValueError, match="split_fill"):
        dataclasses.replace(P.DEFAULT_POLICY, split_fill=0)
    with pytest.raises(ValueError, match="sliced_auto_splits"):
        dataclasses.replace(P.DEFAULT_POLICY, sliced_auto_splits=(3,))
    with pytest.raises(ValueError, match=r"decode_configs\[\('g', 1, 2, 16\)\]: unknown knob"):
        P.DEFAULT_POLICY.with_configs({("g", 1, 2, 16): {"splitk": 2}})
    summary = P.DEFAULT_POLICY.summary()
    assert summary["default_tables"] is True and summary["decode_configs"] == 15 and json.dumps(summary)
    assert P.DEFAULT_POLICY.with_configs({("g", 1, 2, 16): {"split_k": 2}}).summary()["default_tables"] is False


def test_config_files_are_named_by_device_and_shipped():
    """Each device's file is named from its device name, and pyproject ships the folder as package data."""
    files = sorted((REPO / "engine" / "kernels" / "configs").glob("*.json"))
    assert [f.name for f in files] == ["nvidia-h200.json"]
    assert P.config_file_name("NVIDIA H200") == "nvidia-h200.json"
    assert '"kernels/configs/*.json"' in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("doc, needle", [
    ({"device": "g", "decode": []}, "expected an object with device"),
    ({"device": "", "decode": [], "gemv": []}, "device must be the GPU's name"),
    ({"device": "g", "decode": [{"n": 1, "k": 2, "bm": 16, "knobs": {"split_k": 2}, "why": "x"}], "gemv": []},
     "decode entry 0: expected the keys"),
    ({"device": "g", "decode": [], "gemv": [{"n": 1, "k": 2, "knobs": {"groups": 3}}]}, "gemv entry 0: groups=3"),
    ({"device": "g", "decode": [], "gemv": [{"n": 0, "k": 2, "knobs": {"groups": 2}}]}, "gemv entry 0: expected"),
])
def test_bad_device_files_are_refused_by_name(tmp_path, doc, needle):
    """A malformed device file names itself, the entry and what is wrong."""
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as err:
        P.load_device_configs(path)
    assert str(path) in str(err.value) and needle in str(err.value)
