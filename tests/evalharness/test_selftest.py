"""The gate selftest: catalog validation, planted recipes, and an end-to-end run on the smoke suite
(reduced: tiny-llama, fp8 recipes, 12 windows) through the real runner and gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine.errors import RecipeError
from engine.recipe import load_recipe
from evalharness.cli import main
from evalharness.errors import SuiteError
from evalharness.selftest import NOISE_K, is_moe, load_catalog
from tests.conftest import REPO

SMOKE = str(REPO / "suites" / "smoke.yaml")


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch):
    """The selftest runs on the embedded / zoo models only."""
    monkeypatch.delenv("EVALHARNESS_DATA_DIR", raising=False)


# ---------------------------------------------------------------- catalog

def test_catalog_covers_the_issue_list():
    """Six planted regressions (router, K scales, residual, softmax, tc14, block scales) and >= 3 nulls."""
    entries = load_catalog()
    planted = {e.id: e for e in entries if e.kind == "planted"}
    nulls = {e.id: e for e in entries if e.kind == "null"}
    assert set(planted) == {"router-e4m3", "kv-k-per-tensor", "residual-e4m3", "softmax-bf16",
                            "accum-tc14-no-promotion", "block-scale-shift-1"}
    assert planted["router-e4m3"].requires == "moe" and planted["kv-k-per-tensor"].baseline == "fp8-kv"
    assert {"rerun", "seed-1", "kv-batch-size-1", "tensor-batch-size-3"} <= set(nulls)
    assert nulls["seed-1"].seed == 1 and nulls["kv-batch-size-1"].batch_size == 1


@pytest.mark.parametrize("entry_id,site,baseline_value,planted_value", [
    ("kv-k-per-tensor", "kv.k", "e4m3:head", "e4m3:tensor"),
    ("residual-e4m3", "residual", "bf16", "e4m3:tensor"),
    ("softmax-bf16", "attn.softmax", "fp32", "bf16"),
    ("accum-tc14-no-promotion", "accumulate", "fp32", "tc14"),
    ("block-scale-shift-1", "linear.input", "e4m3:1x128", "e4m3:1x128:shift-1"),
])
def test_planted_recipe_changes_exactly_one_thing(entry_id, site, baseline_value, planted_value):
    """Each planted recipe differs from its baseline only in the sites it plants (block scales: two)."""
    e = next(x for x in load_catalog() if x.id == entry_id)
    base, planted = load_recipe(e.baseline).to_dict(), load_recipe(str(e.recipe)).to_dict()
    assert base[site] == baseline_value and planted[site] == planted_value
    diff = {k for k in base if k not in ("name", "description") and base[k] != planted.get(k)}
    expected = {"linear.input", "linear.weight"} if entry_id == "block-scale-shift-1" else {site}
    assert diff == expected


def test_router_planted_recipe_needs_an_fp8_router_site():
    """router: e4m3 is only injectable once the engine accepts FP8 at the router site; until then the
    selftest reports it n/a (not injectable) instead of crashing."""
    e = next(x for x in load_catalog() if x.id == "router-e4m3")
    try:
        r = load_recipe(str(e.recipe))
    except RecipeError as exc:
        assert "router" in str(exc)
    else:
        assert r.spec("router") == "e4m3:tensor"


@pytest.mark.parametrize("text,needle", [
    ("planted:\n  - {id: a, recipe: x.yaml, baseline: fp8-block, colour: red}\n", "unknown key(s) ['colour']"),
    ("planted:\n  - {id: a, baseline: fp8-block}\n", "'recipe'"),
    ("planted:\n  - {id: a, recipe: missing.yaml, baseline: fp8-block}\n", "recipe file not found"),
    ("planted:\n  - {id: a, recipe: p.yaml, baseline: fp8-kv}\n", "must 'extends: fp8-kv'"),
    ("nulls:\n  - {id: a, baseline: fp8-block, batch_size: 0}\n", "batch_size must be a positive integer"),
    ("nulls:\n  - {id: a, baseline: fp8-block}\n  - {id: a, baseline: fp8-block}\n", "duplicate id 'a'"),
    ("nulls:\n  - {id: a, baseline: fp8-block, requires: gpu}\n", "requires must be one of"),
    ("extra: []\n", "sections 'planted' and 'nulls'"),
])
def test_bad_catalog(tmp_path, text, needle):
    """Catalog errors name the file, the section and index."""
    (tmp_path / "p.yaml").write_text("name: p\nextends: fp8-block\nresidual: e4m3:tensor\n")
    cat = tmp_path / "catalog.yaml"
    cat.write_text(text)
    with pytest.raises(SuiteError) as ei:
        load_catalog(cat)
    assert str(cat) in str(ei.value) and needle in str(ei.value)


def test_moe_detection():
    """zoo-moe declares routed experts; zoo-llama, the builtin and llama2.c checkpoints do not."""
    assert is_moe({"name": "m", "path": str(REPO / "zoo" / "zoo-moe")})
    assert not is_moe({"name": "l", "path": str(REPO / "zoo" / "zoo-llama")})
    assert not is_moe({"name": "t", "path": "builtin:tiny-llama"})
    assert not is_moe({"name": "s", "path": "llama2c:/nowhere/x.bin"})


def test_unknown_only_and_models(tmp_path, capsys):
    """--only / --models with unknown names: exit 2 listing what exists, before running anything."""
    assert main(["selftest", "--suite", SMOKE, "--out", str(tmp_path / "o"), "--only", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["selftest", "--suite", SMOKE, "--out", str(tmp_path / "o"), "--models", "gpt-5"]) == 2
    assert "gpt-5" in capsys.readouterr().err and not (tmp_path / "o" / "baseline").exists()


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def selftest_report(tmp_path_factory) -> tuple[int, dict, Path, str]:
    """One reduced selftest of the smoke suite's gate: tiny-llama, fp8-block (+ the catalog's baselines),
    12 windows of 64 tokens (Wilcoxon p >= 2**-12: enough for Holm over this matrix), 1 layer-error window."""
    out = tmp_path_factory.mktemp("selftest")
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["selftest", "--suite", SMOKE, "--out", str(out), "--models", "tiny-llama",
                     "--set", "recipe=fp8-block", "--set", "evals.ppl_kld.max_windows=12",
                     "--set", "evals.layer_error.windows=1", "--set", "evals.ppl_kld.seq_len=64",
                     "--set", "evals.layer_error.seq_len=64"])
    return code, json.loads((out / "selftest.json").read_text()), out, buf.getvalue()


def _entry(report: dict, entry_id: str) -> dict:
    """One entry of the report by id."""
    return next(e for e in report["entries"] if e["id"] == entry_id)


@pytest.mark.slow
def test_selftest_no_false_alarms(selftest_report):
    """Every null variant (re-run, another seed, batch 1 with per-head KV scales, batch 3 with per-tensor
    activation scales) passes the gate: 0 false alarms."""
    _, report, _, _ = selftest_report
    assert report["nulls"] == 4 and report["false_alarms"] == 0 and report["false_alarm_rate"] == 0.0
    for nid in ("rerun", "seed-1", "kv-batch-size-1", "tensor-batch-size-3"):
        e = _entry(report, nid)
        assert e["status"] == "ok" and e["gate_exit"] == 0 and e["n_fail"] == 0
        assert e["evidence"].startswith("closest: PASS")
    # The batch-size nulls really perturb the numerics (they are not identical re-runs).
    assert _entry(report, "kv-batch-size-1")["effect"]["value"] != _entry(report, "kv-batch-size-1")["effect"]["baseline"]


@pytest.mark.slow
def test_selftest_catches_every_regression_above_the_noise_floor(selftest_report):
    """100% of the planted regressions with an effect >= 3 noise floors are caught (gate FAIL), each with
    its evidence line; the rest are reported with their (sub-noise) effect size."""
    code, report, _, _ = selftest_report
    assert report["planted_above_noise"] >= 2
    assert report["caught_above_noise"] == report["planted_above_noise"]
    for pid in ("residual-e4m3", "block-scale-shift-1"):
        e = _entry(report, pid)
        assert e["status"] == "caught" and e["gate_exit"] == 1 and e["effect"]["z"] >= NOISE_K
        assert e["evidence"].startswith("FAIL tiny-llama__fp8-block__") and "threshold=" in e["evidence"]
        assert "baseline=" in e["evidence"] and "delta=" in e["evidence"]
    assert "p_adj=" in _entry(report, "residual-e4m3")["evidence"]  # Holm over the matrix, shown
    for e in report["entries"]:
        if e["kind"] == "planted" and e["status"] == "MISSED":
            assert e["effect"]["z"] < NOISE_K and e["id"] in report["missed_below_noise"]
    assert _entry(report, "router-e4m3")["status"] == "n/a"  # no MoE model among the selected ones
    assert "no moe model" in _entry(report, "router-e4m3")["reason"]
    assert report["errors"] == 0 and report["passed"] and code == 0


@pytest.mark.slow
def test_selftest_measured_effects(selftest_report):
    """Pin the measured outcome on tiny-llama: residual and block-scale faults move the end-to-end metrics
    by > 10 sigma; the softmax / tc14 / per-tensor-K faults move them by less than the noise floor, yet
    are caught deterministically by the op-local conformance rules (`layer_error.local.*`), which name
    the op: 5/5 applicable planted regressions caught (strict)."""
    code, report, _, _ = selftest_report
    assert _entry(report, "residual-e4m3")["effect"]["z"] > 10
    assert _entry(report, "block-scale-shift-1")["effect"]["z"] > 100
    local_metric = {"softmax-bf16": "layer_error.local.attn.softmax.rel_l2",
                    "accum-tc14-no-promotion": "layer_error.local.linear.accum.rel_l2",
                    "kv-k-per-tensor": "layer_error.local.kv.k.headroom_bits"}
    for pid, metric in local_metric.items():
        e = _entry(report, pid)
        assert e["status"] == "caught" and e["gate_exit"] == 1 and abs(e["effect"]["z"]) < NOISE_K, e
        assert any(f["metric"] == metric for f in e["fails"]), e["fails"]
    assert report["caught"] == 5 and report["planted_applicable"] == 5 and report["passed_strict"]
    assert not report["missed_below_noise"]


@pytest.mark.slow
def test_selftest_outputs(selftest_report):
    """The console table, selftest.json and selftest.md carry the rates and one evidence line per entry."""
    _, report, out, stdout = selftest_report
    md = (out / "selftest.md").read_text()
    assert "detection 5/5" in md and "false alarms 0/4 (0%)" in md and "| planted | residual-e4m3 |" in md
    assert "selftest: detection 5/5 (100%; 2/2 of those above 3 noise floors), false alarms 0/4" in stdout
    assert all(e["evidence"] or e["reason"] for e in report["entries"])
    # Variants are gated as a whole matrix: the variant dir holds every baseline cell plus its own.
    vdir = out / "variants" / "residual-e4m3"
    keys = {p.stem for p in vdir.glob("*.json")} - {"suite"}
    assert keys == {f"tiny-llama__{r}__default__cpu-emulated" for r in ("fp8-block", "fp8-kv", "fp8-tensor")}
    manifest = yaml.safe_load((vdir / "suite.json").read_text())
    assert manifest["name"] == "smoke" and manifest["gate"]["correction"] == "holm"


def test_no_op_planted_change_is_not_applicable(tmp_path):
    """A planted change that leaves every metric of every cell identical to the baseline (per-tensor vs
    per-head K scales on an MLA model with one cached K head) is reported n/a, not MISSED; one changed
    metric makes it a real outcome again."""
    from evalharness.gate import baseline_path, hardware_class
    from evalharness.results import load_result
    from evalharness.selftest import _no_op

    key = "zoo-moe__fp8-block__default__cpu-emulated"
    src = REPO / "baselines" / "smoke" / f"{key}.json"
    vdir, bdir = tmp_path / "variant", tmp_path / "baselines"
    vdir.mkdir()
    (vdir / "suite.json").write_text(json.dumps({"name": "smoke"}))
    doc = json.loads(src.read_text())
    bpath = baseline_path(bdir, "smoke", key, hardware_class(load_result(src)))
    bpath.parent.mkdir(parents=True, exist_ok=True)
    bpath.write_text(json.dumps(doc))
    (vdir / f"{key}.json").write_text(json.dumps(doc))
    assert _no_op(vdir, bdir, {key})
    doc["metrics"]["ppl_kld.kld_mean"] *= 1.0000001
    (vdir / f"{key}.json").write_text(json.dumps(doc))
    assert not _no_op(vdir, bdir, {key})
    assert not _no_op(vdir, bdir, {"zoo-moe__nope__default__cpu-emulated"})  # nothing compared: not a no-op
