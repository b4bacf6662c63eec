"""benchmarks/gather_parts.py: what the parts of a suite finished is gathered once, and the stubs keep what --resume
reads."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gather_parts import gather, main, write_stubs


def _write(path: Path, key: str, status: str = "ok", sha: str = "a" * 64, metrics: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"run_key": key, "status": status, "fingerprint": {"sha256": sha, "parts": {}},
           "metrics": {"ppl_kld.kld_mean": 0.01} if metrics is None else metrics, "samples": {"x": [1, 2]}}
    path.write_text(json.dumps(doc))


def test_gather_copies_what_the_results_do_not_hold_yet(tmp_path):
    results, p0, p1 = tmp_path / "results", tmp_path / "p0", tmp_path / "p1"
    _write(results / "m__a__default__cpu.json", "m__a__default__cpu", metrics={})  # a stub of an earlier call
    _write(results / "m__b__default__cpu.json", "m__b__default__cpu", status="error")
    _write(results / "m__c__default__cpu.json", "m__c__default__cpu", sha="c" * 64)
    _write(p0 / "m__a__default__cpu.json", "m__a__default__cpu")          # same status and fingerprint: known
    _write(p0 / "m__b__default__cpu.json", "m__b__default__cpu")          # ok now: new
    _write(p1 / "m__c__default__cpu.json", "m__c__default__cpu")          # another fingerprint: new
    _write(p1 / "m__d__default__cpu.json", "m__d__default__cpu")          # not there yet: new
    (p1 / "m__e__default__cpu.json").write_text('{"run_key": "m__e')      # unreadable (being written): skipped
    (p1 / "suite.json").write_text("{}")                                  # a part's manifest: not a run
    assert gather(results, [p0, p1, tmp_path / "missing"]) == [
        "m__b__default__cpu.json", "m__c__default__cpu.json", "m__d__default__cpu.json"]
    assert json.loads((results / "m__b__default__cpu.json").read_text())["status"] == "ok"
    assert json.loads((results / "m__a__default__cpu.json").read_text())["metrics"] == {}  # the stub stays
    assert not (results / "m__e__default__cpu.json").exists() and not (results / "suite.json").exists()
    assert not list(results.glob("*.tmp"))
    assert gather(results, [p0, p1]) == []  # a second gather finds nothing new


def test_stubs_keep_status_and_fingerprint_without_metrics_and_samples(tmp_path, capsys):
    results, part, stubs = tmp_path / "results", tmp_path / "part", tmp_path / "stub"
    _write(part / "m__a__default__cpu.json", "m__a__default__cpu", sha="d" * 64)
    assert main([str(results), str(part), "--stubs", str(stubs)]) == 0
    assert capsys.readouterr().out.split() == ["m__a__default__cpu.json"]
    doc = json.loads((stubs / "m__a__default__cpu.json").read_text())
    assert doc["metrics"] == {} and "samples" not in doc
    assert doc["status"] == "ok" and doc["fingerprint"]["sha256"] == "d" * 64
    assert write_stubs(results, tmp_path / "again") == 1
