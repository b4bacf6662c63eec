"""GPU baselines are keyed by hardware class; a missing one for this hardware is a clear error."""

from __future__ import annotations

import json

from evalharness.baselines import update_baselines
from evalharness.gate import baseline_path, gate_results
from tests.conftest import REPO

KEY = "tiny-llama__fp8-block__default__cpu-emulated"


def _result_on(tmp_path, hw: str):
    """A results dir holding one committed smoke result, relabelled as measured on hardware class `hw`."""
    out = tmp_path / f"results-{hw}"
    out.mkdir()
    doc = json.loads((REPO / "baselines" / "smoke" / f"{KEY}.json").read_text())
    doc["provenance"]["hardware"]["hardware_class"] = hw
    (out / f"{KEY}.json").write_text(json.dumps(doc))
    (out / "suite.json").write_text(json.dumps({"name": "smoke", "gate": {"rules": [
        {"metric": "ppl_kld.kld_mean", "direction": "lower", "abs_tol": 1e-6, "rel_tol": 0.25}]}}))
    return out


def test_gpu_baselines_live_under_their_hardware_class(tmp_path):
    """`baseline update` of an h200 result writes baselines/<suite>/h200/<key>.json; gating it passes."""
    res, bdir = _result_on(tmp_path, "h200"), tmp_path / "baselines"
    written = update_baselines(res, bdir, log=lambda s: None)
    assert written == [bdir / "smoke" / "h200" / f"{KEY}.json"]
    assert baseline_path(bdir, "smoke", KEY, "cpu") == bdir / "smoke" / f"{KEY}.json"
    verdicts, missing = gate_results(res, bdir)
    assert not missing and verdicts and all(v.verdict == "PASS" for v in verdicts)


def test_missing_baseline_for_this_hardware_names_the_classes_that_have_one(tmp_path):
    """An a100 result against h200-only baselines: missing, and the message says which classes exist."""
    bdir = tmp_path / "baselines"
    update_baselines(_result_on(tmp_path, "h200"), bdir, log=lambda s: None)
    _, missing = gate_results(_result_on(tmp_path, "a100"), bdir)
    assert len(missing) == 1
    assert "hardware class 'a100'" in missing[0] and "baselines exist for: h200" in missing[0]
    assert "baseline update" in missing[0]
