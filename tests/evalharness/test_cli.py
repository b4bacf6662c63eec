"""End to end through the CLI: smoke suite -> results -> gate vs committed baselines; bad input; resume."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from evalharness.cli import main
from evalharness.results import load_result
from tests.conftest import REPO, write_random_llama

SMOKE = str(REPO / "suites" / "smoke.yaml")
BASELINES = str(REPO / "baselines")
TINY = ["--set", "models=[{name: tiny-llama, path: 'builtin:tiny-llama', corpus: 'builtin:tiny-llama'}]"]
# Runs here do not log to mlflow (tests/evalharness/test_tracking.py tests that; a logging failure only warns).
NO_TRACKING = "--no-tracking"


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch):
    """The smoke suite must run without any data dir; tests opt in explicitly."""
    monkeypatch.delenv("EVALHARNESS_DATA_DIR", raising=False)


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory) -> Path:
    """One run of the whole smoke matrix (three models x four recipes), shared by the tests marked slow below."""
    out = tmp_path_factory.mktemp("smoke")
    assert main(["run", SMOKE, "--out", str(out), NO_TRACKING]) == 0
    return out


@pytest.mark.slow
def test_smoke_run_writes_schema_results(smoke_results):
    """Twelve result files with schema version, spec, provenance and flat eval-prefixed metrics."""
    files = sorted(p.name for p in smoke_results.glob("*.json"))
    assert "suite.json" in files and len(files) == 13  # 3 models x 4 recipes + suite.json
    doc = load_result(smoke_results / "tiny-llama__fp8-block__default__cpu-emulated.json")
    assert doc["schema_version"] == 1 and doc["status"] == "ok"
    assert doc["spec"]["recipe"]["linear.input"] == "e4m3:1x128"
    prov = doc["provenance"]
    assert {"git_sha", "packages", "hardware", "model_sha256", "data_sha256", "seed"} <= set(prov)
    assert prov["hardware"]["cpu"] and prov["packages"]["torch"]
    assert prov["kernels"] == {"backend": "cpu-emulated"}  # Engine.kernel_settings(): no kernel ran
    m = doc["metrics"]
    assert m["ppl_kld.kld_mean"] > 0 and 0 < m["ppl_kld.top1_agree"] < 1
    assert m["ppl_kld.ppl_ref_lo"] < m["ppl_kld.ppl_ref"] < m["ppl_kld.ppl_ref_hi"]
    assert m["layer_error.layers.3.mlp.out.rel_l2"] > 0
    assert m["layer_error.quant.linear.input.saturation_frac"] >= 0
    fp32 = load_result(smoke_results / "tiny-llama__fp32__default__cpu-emulated.json")["metrics"]
    assert fp32["ppl_kld.kld_mean"] < 1e-9 and fp32["layer_error.logits.rel_l2"] < 1e-5
    assert len(doc["samples"]["ppl_kld"]["window_kld"]) == int(m["ppl_kld.n_windows"])
    by_pos = doc["samples"]["ppl_kld"]["kld_by_position"]
    assert len(by_pos) == 128 and all(v is not None and v >= 0 for v in by_pos)
    buckets = [m[f"ppl_kld.pos{lo}_{lo + 32}.kld_mean"] for lo in (0, 32, 64, 96)]
    assert abs(sum(buckets) / 4 - m["ppl_kld.kld_mean"]) < 0.05 * m["ppl_kld.kld_mean"]  # equal-size buckets
    worst = doc["samples"]["ppl_kld"]["worst_windows"][0]
    assert worst["kld_mean"] == max(doc["samples"]["ppl_kld"]["window_kld"]) == m["ppl_kld.kld_worst_window"]


@pytest.mark.slow
def test_gate_passes_against_committed_baselines(smoke_results, tmp_path, capsys):
    """The committed baselines gate a fresh smoke run: exit 0, JUnit and summary written."""
    junit, summary = tmp_path / "junit.xml", tmp_path / "summary.md"
    code = main(["gate", str(smoke_results), "--baselines", BASELINES, "--junit", str(junit),
                 "--summary", str(summary)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "gate: PASS" in out
    assert "<testsuite" in junit.read_text() and "failures=\"0\"" in junit.read_text()
    assert summary.read_text().startswith("# Numerics gate: PASS")


@pytest.mark.slow
def test_planted_bad_recipe_fails_gate_with_evidence(tmp_path, capsys):
    """fp8-block with an E4M3 residual stream, run on tiny-llama under the fp8-block key at the suite's full
    settings (so that the committed baseline applies), fails the gate (exit 1)."""
    planted = tmp_path / "planted.yaml"
    planted.write_text("name: fp8-block\nextends: fp8-block\nresidual: e4m3:tensor\n")
    out_dir = tmp_path / "res"
    assert main(["run", SMOKE, "--out", str(out_dir), NO_TRACKING, "--set", f"recipe={planted}"] + TINY) == 0
    capsys.readouterr()
    junit = tmp_path / "j.xml"
    code = main(["gate", str(out_dir), "--baselines", BASELINES, "--junit", str(junit)])
    out = capsys.readouterr().out
    assert code == 1, out
    line = next(ln for ln in out.splitlines() if "ppl_kld.kld_mean" in ln)
    assert line.startswith("FAIL") and "baseline=" in line and "delta=" in line and "threshold=" in line
    assert "p=" in line and "CI=" in line
    assert "<failure" in junit.read_text()


def test_resume_skips_finished_runs(tmp_path, capsys):
    """--resume reruns only the missing result and leaves finished files untouched."""
    out = tmp_path / "res"
    args = ["run", SMOKE, "--out", str(out), NO_TRACKING, "--set", "recipe=fp32,bf16",
            "--set", "evals.ppl_kld.max_windows=4", "--set", "evals.layer_error.windows=1"] + TINY
    assert main(args) == 0
    kept = out / "tiny-llama__fp32__default__cpu-emulated.json"
    before = kept.stat().st_mtime_ns
    (out / "tiny-llama__bf16__default__cpu-emulated.json").unlink()
    capsys.readouterr()
    assert main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "already finished (resume)" in err and "bf16__default__cpu-emulated: ok" in err
    assert kept.stat().st_mtime_ns == before
    assert load_result(out / "tiny-llama__bf16__default__cpu-emulated.json")["status"] == "ok"


def test_interrupted_suite_keeps_finished_results_and_resumes(tmp_path, monkeypatch):
    """A crash (Ctrl-C) in the second of three runs loses nothing; --resume completes the suite."""
    import evalharness.runner as runner

    out = tmp_path / "res"
    args = ["run", SMOKE, "--out", str(out), NO_TRACKING, "--set", "recipe=fp32,bf16,fp8-tensor",
            "--set", "evals.ppl_kld.max_windows=4", "--set", "evals.layer_error.windows=1"] + TINY
    real = runner.run_eval
    calls = {"n": 0}

    def flaky(name, ctx, cfg):
        calls["n"] += 1
        if calls["n"] == 3:  # first eval of the second run
            raise KeyboardInterrupt
        return real(name, ctx, cfg)

    monkeypatch.setattr(runner, "run_eval", flaky)
    assert main(args) == 130
    assert load_result(out / "tiny-llama__fp32__default__cpu-emulated.json")["status"] == "ok"
    assert not (out / "tiny-llama__bf16__default__cpu-emulated.json").exists()
    assert not list(out.glob(".*.tmp"))
    monkeypatch.setattr(runner, "run_eval", real)
    assert main(args + ["--resume"]) == 0
    assert load_result(out / "tiny-llama__bf16__default__cpu-emulated.json")["status"] == "ok"
    assert load_result(out / "tiny-llama__fp8-tensor__default__cpu-emulated.json")["status"] == "ok"


# ---------------------------------------------------------------- bad input

def _run_err(capsys, args) -> tuple[int, str]:
    """Run the CLI; return (exit code, stderr+stdout)."""
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.err + cap.out


def test_malformed_yaml_names_file_and_line(tmp_path, capsys):
    """A YAML syntax error: exit 2, file and line in the message."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodels: [\n")
    code, msg = _run_err(capsys, ["run", str(bad), "--out", str(tmp_path / "o")])
    assert code == 2 and "bad.yaml:" in msg and "malformed YAML" in msg


def test_unknown_suite_key_names_key(tmp_path, capsys):
    """A typo in a suite key is an error naming the file and key, not a silent default."""
    text = Path(SMOKE).read_text().replace("evals:\n", "evalz:\n", 1)
    bad = tmp_path / "typo.yaml"
    bad.write_text(text)
    code, msg = _run_err(capsys, ["run", str(bad), "--out", str(tmp_path / "o")])
    assert code == 2 and "typo.yaml" in msg and "'evalz'" in msg


def test_unknown_eval_setting(tmp_path, capsys):
    """A misspelled eval setting names the eval and the setting."""
    code, msg = _run_err(capsys, ["run", SMOKE, "--out", str(tmp_path / "o"), "--set", "evals.ppl_kld.max_window=3"])
    assert code == 2 and "evals.ppl_kld" in msg and "max_window" in msg


def test_missing_checkpoint(tmp_path, capsys):
    """A model path that does not exist: exit 2 naming it, and an error result on disk."""
    code, msg = _run_err(capsys, ["run", SMOKE, "--out", str(tmp_path / "o"), NO_TRACKING,
                                  "--set", "model=/nonexistent/model-dir"])
    assert code == 2 and "/nonexistent/model-dir" in msg
    res = load_result(next((tmp_path / "o").glob("model-dir__*.json")))
    assert res["status"] == "error" and "/nonexistent/model-dir" in res["error"]["message"]


def test_corrupt_checkpoint(tmp_path, random_llama, capsys):
    """A truncated safetensors file: exit 2 naming the file."""
    broken = tmp_path / "broken"
    shutil.copytree(random_llama, broken)
    st = broken / "model.safetensors"
    st.write_bytes(st.read_bytes()[:2000])
    code, msg = _run_err(capsys, ["run", SMOKE, "--out", str(tmp_path / "o"), NO_TRACKING, "--set", f"model={broken}",
                                  "--set", "tokenizer=bytes"])
    assert code == 2 and "model.safetensors" in msg and "corrupt" in msg


def test_tokenizer_vocab_mismatch(tmp_path, random_llama, capsys):
    """A 256-id byte tokenizer on a 97-token model: exit 2 with both sizes."""
    code, msg = _run_err(capsys, ["run", SMOKE, "--out", str(tmp_path / "o"), NO_TRACKING,
                                  "--set", f"model={random_llama}", "--set", "tokenizer=bytes"])
    assert code == 2 and "256" in msg and "97" in msg


def test_missing_data_dir(tmp_path, capsys):
    """--data-dir pointing nowhere is an error, not a silent skip."""
    code, msg = _run_err(capsys, ["run", SMOKE, "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path / "nope")])
    assert code == 2 and "data dir not found" in msg and "nope" in msg


def test_nan_outputs_are_a_failing_metric(tmp_path, random_llama, capsys):
    """A recipe that overflows (fp16 residual on huge activations) yields NaN: the run finishes, the gate FAILs."""
    w = load_file(str(random_llama / "model.safetensors"))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 1e6
    save_file(w, str(random_llama / "model.safetensors"), metadata={"format": "pt"})
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps({"vocab_size": 97, "tokens": [(i * 7) % 97 for i in range(600)]}))
    recipe = tmp_path / "fp16res.yaml"
    recipe.write_text("name: fp16-residual\nextends: fp32\nresidual: fp16\n")
    out = tmp_path / "o"
    code, _ = _run_err(capsys, ["run", SMOKE, "--out", str(out), NO_TRACKING, "--set", f"model={random_llama}",
                                "--set", f"corpus={corpus}", "--set", f"recipe={recipe}"])
    assert code == 0
    doc = load_result(next(out.glob("rand-llama__fp16-residual__*.json")))
    assert doc["status"] == "ok" and doc["metrics"]["ppl_kld.nonfinite_frac"] == 1.0
    assert doc["metrics"]["ppl_kld.kld_mean"] is None
    code, msg = _run_err(capsys, ["gate", str(out), "--baselines", str(tmp_path / "nobase")])
    assert code == 1 and "nonfinite_frac" in msg and "FAIL" in msg


@pytest.mark.slow
def test_corrupt_and_foreign_baselines(smoke_results, tmp_path, capsys):
    """A corrupt baseline and a baseline of another schema: exit 2 naming the file and what to do."""
    base = tmp_path / "baselines"
    shutil.copytree(BASELINES, base)
    victim = base / "smoke" / "tiny-llama__bf16__default__cpu-emulated.json"
    victim.write_text(victim.read_text()[:100])
    code, msg = _run_err(capsys, ["gate", str(smoke_results), "--baselines", str(base)])
    assert code == 2 and victim.name in msg and "corrupt JSON" in msg
    doc = json.loads((Path(BASELINES) / "smoke" / victim.name).read_text())
    doc["schema_version"] = 0
    victim.write_text(json.dumps(doc))
    code, msg = _run_err(capsys, ["gate", str(smoke_results), "--baselines", str(base)])
    assert code == 2 and "schema_version 0" in msg and "baseline update" in msg


@pytest.mark.slow
def test_missing_baseline_is_exit_2(smoke_results, tmp_path, capsys):
    """No baseline for a run: exit 2 with the command that creates one; --allow-missing downgrades it."""
    code, msg = _run_err(capsys, ["gate", str(smoke_results), "--baselines", str(tmp_path / "empty")])
    assert code == 2 and "evalharness baseline update" in msg
    code, _ = _run_err(capsys, ["gate", str(smoke_results), "--baselines", str(tmp_path / "empty"), "--allow-missing"])
    assert code == 0


@pytest.mark.slow
def test_baseline_update_prints_diff(smoke_results, tmp_path, capsys):
    """`baseline update` prints what changes before writing; a second update reports 'unchanged'."""
    base = tmp_path / "b"
    assert main(["baseline", "update", str(smoke_results), "--baselines", str(base)]) == 0
    assert "new baseline" in capsys.readouterr().out
    assert len(list((base / "smoke").glob("*.json"))) == 12
    assert main(["baseline", "update", str(smoke_results), "--baselines", str(base), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "unchanged" in out and "dry run" in out
    assert load_result(base / "smoke" / "tiny-llama__fp32__default__cpu-emulated.json")["kind"] == "baseline"


@pytest.mark.slow
def test_stories260k_on_wikitext_with_data_dir(data_dir, tmp_path):
    """With --data-dir the smoke suite also runs the real stories260K on WikiText-2 (run here alone, as the suite
    lists it: the other models' fp8-block runs are gated by test_gate_passes_against_committed_baselines)."""
    from evalharness.suite import load_suite

    assert "stories260k" not in {r.model["name"] for r in load_suite(SMOKE).runs}
    assert "stories260k" in {r.model["name"] for r in load_suite(SMOKE, data_dir=str(data_dir)).runs}
    stories = next(m for m in yaml.safe_load(Path(SMOKE).read_text())["models"] if m["name"] == "stories260k")
    out = tmp_path / "o"
    assert main(["run", SMOKE, "--out", str(out), NO_TRACKING, "--data-dir", str(data_dir), "--set", "recipe=fp8-block",
                 "--set", f"models=[{json.dumps(stories)}]"]) == 0
    doc = load_result(out / "stories260k__fp8-block__default__cpu-emulated.json")
    assert doc["status"] == "ok"
    m = doc["metrics"]
    assert 50 < m["ppl_kld.ppl_ref"] < 500 and m["ppl_kld.ppl_ratio"] > 1.0
    assert main(["gate", str(out), "--baselines", BASELINES]) == 0
