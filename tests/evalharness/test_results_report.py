"""`evalharness report` and `evalharness trend` on synthetic result files: numbers in the markdown,
PNG plots written and non-empty, dates and gated-metric selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalharness.cli import main
from evalharness.errors import ResultError
from evalharness.results import write_json_atomic
from evalharness.results_report import build_report
from evalharness.trend import build_trend, collect, dir_date

GATE = {"rules": [{"metric": "ppl_kld.nonfinite_frac", "max": 0.0},
                  {"metric": "ppl_kld.kld_mean", "direction": "lower", "rel_tol": 0.25},
                  {"metric": "ppl_kld.ppl_ratio", "direction": "lower", "abs_tol": 0.002},
                  {"metric": "layer_error.*.rel_l2", "direction": "lower", "rel_tol": 0.5}]}


def _result(model: str, recipe: str, kld: float, ratio: float, depth: list[float], status: str = "ok",
            tasks: dict | None = None, created: str = "2026-11-28T02:00:00+00:00") -> dict:
    """A synthetic schema-1 result."""
    m = {"ppl_kld.kld_mean": kld, "ppl_kld.kld_mean_lo": kld * 0.8, "ppl_kld.kld_mean_hi": kld * 1.2,
         "ppl_kld.ppl_ratio": ratio, "ppl_kld.ppl_ratio_lo": ratio - 0.004, "ppl_kld.ppl_ratio_hi": ratio + 0.004,
         "ppl_kld.kld_p99": kld * 7, "ppl_kld.kld_p999": kld * 15, "ppl_kld.kld_max": kld * 40,
         "ppl_kld.top1_agree": 0.95, "ppl_kld.top1_agree_lo": 0.94, "ppl_kld.top1_agree_hi": 0.96,
         "ppl_kld.nonfinite_frac": 0.0, "layer_error.logits.rel_l2": depth[-1] * 0.5}
    for i, v in enumerate(depth):
        m[f"layer_error.layers.{i}.resid_out.rel_l2"] = v
        m[f"layer_error.layers.{i}.mlp.out.rel_l2"] = v * 2
    for task, (delta, lo, hi) in (tasks or {}).items():
        m.update({f"tasks.{task}.delta": delta, f"tasks.{task}.delta_lo": lo, f"tasks.{task}.delta_hi": hi,
                  f"tasks.{task}.acc_ref": 0.5, f"tasks.{task}.acc_eng": 0.5 + delta, f"tasks.{task}.n": 200.0,
                  f"tasks.{task}.mcnemar_p": 0.3})
    key = f"{model}__{recipe}__default__cpu-emulated"
    doc = {"schema_version": 1, "kind": "result", "run_key": key, "status": status,
           "spec": {"model": {"name": model}, "recipe": {"name": recipe}, "serving": {"name": "default"}},
           "provenance": {"git_sha": "abc1234", "created_at": created, "hardware": {"cpu": "Test CPU"}},
           "metrics": m if status == "ok" else {}, "samples": {}, "timing": {"total_s": 1.5},
           "error": None if status == "ok" else {"type": "WeightsError", "message": "cannot load zoo-moe"}}
    return doc


def _write_dir(d: Path, docs: list[dict]) -> Path:
    """A results dir with suite.json."""
    write_json_atomic(d / "suite.json", {"schema_version": 1, "kind": "suite", "name": "nightly", "gate": GATE,
                                         "skipped": []})
    for doc in docs:
        write_json_atomic(d / f"{doc['run_key']}.json", doc)
    return d


@pytest.fixture
def results_dir(tmp_path) -> Path:
    """zoo-llama under fp32 / bf16 / fp8-block (with tasks), and a zoo-moe run that failed to load."""
    return _write_dir(tmp_path / "2026-11-28", [
        _result("zoo-llama", "fp32", 0.0, 1.0, [0.0, 0.0, 0.0]),
        _result("zoo-llama", "bf16", 9.4e-05, 1.0003, [0.002, 0.003, 0.005]),
        _result("zoo-llama", "fp8-block", 0.005117, 1.003692, [0.02, 0.03, 0.036],
                tasks={"arc_easy": (-0.012, -0.03, 0.006), "piqa": (0.004, -0.01, 0.018)}),
        _result("zoo-moe", "fp8-block", 0.0, 1.0, [0.0], status="error"),
    ])


def test_report_markdown_numbers_and_plots(results_dir, tmp_path):
    """The report lists every run with its numbers and intervals, the failed run, task deltas, and the plots."""
    out = tmp_path / "rep"
    md = build_report(results_dir, out).read_text()
    assert "# Numerics report: nightly" in md and "4 run(s), 3 ok, 1 error" in md
    assert "| zoo-llama | fp8-block | default | cpu-emulated | ok | 1.004 [0.9997, 1.008] | 0.005117 [0.004094, 0.00614] |" in md
    assert "| 0.03582 | 0.07676 | 0.2047 | 0.95 [0.94, 0.96] | 0.018 |" in md  # p99, p99.9, max, top1, logits
    assert "`zoo-moe__fp8-block__default__cpu-emulated`: WeightsError: cannot load zoo-moe" in md
    assert "| zoo-llama | fp8-block | default | arc_easy | 0.5 | 0.488 | -0.012 [-0.03, 0.006] | 0.3 | 200 |" in md
    for name in ("error_vs_depth_zoo-llama.png", "kld_zoo-llama.png", "ppl_ratio_zoo-llama.png",
                 "task_deltas_zoo-llama.png"):
        png = out / name
        assert png.exists() and png.stat().st_size > 2000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md
    assert not (out / "error_vs_depth_zoo-moe.png").exists()  # no ok run: no plot


def test_report_without_tasks_has_no_task_plot(tmp_path):
    """Task deltas appear only when tasks.* metrics exist."""
    d = _write_dir(tmp_path / "r", [_result("m", "fp8-block", 0.01, 1.01, [0.01, 0.02])])
    md = build_report(d, tmp_path / "o").read_text()
    assert "Task deltas" not in md and not (tmp_path / "o" / "task_deltas_m.png").exists()


def _history(tmp_path: Path) -> list[Path]:
    """Three nightlies; fp8-block's KLD grows on the last night."""
    dirs = []
    for day, kld, ratio in (("2026-11-26", 0.0050, 1.0036), ("2026-11-27", 0.0051, 1.0037),
                            ("2026-11-28", 0.0102, 1.0081)):
        dirs.append(_write_dir(tmp_path / "nightly" / day, [
            _result("zoo-llama", "bf16", 9.4e-05, 1.0003, [0.002, 0.003, 0.004, 0.004, 0.005],
                    created=f"{day}T02:00:00+00:00"),
            _result("zoo-llama", "fp8-block", kld, ratio, [0.02, 0.03, 0.03, 0.033, 0.036],
                    created=f"{day}T02:00:00+00:00")]))
    return dirs


def test_trend_series_table_and_pngs(tmp_path):
    """One time series per gated metric (per-tap globs matching > 8 metrics excluded), by date, last change."""
    dirs = _history(tmp_path)
    data = build_trend(list(reversed(dirs)), tmp_path / "trend")  # order given does not matter
    assert data["dates"] == ["2026-11-26", "2026-11-27", "2026-11-28"]
    assert set(data["metrics"]) == {"ppl_kld.nonfinite_frac", "ppl_kld.kld_mean", "ppl_kld.ppl_ratio"}
    key = "zoo-llama__fp8-block__default__cpu-emulated"
    assert data["metrics"]["ppl_kld.kld_mean"][key] == [0.005, 0.0051, 0.0102]
    md = (tmp_path / "trend" / "trend.md").read_text()
    assert f"| {key} | 0.005 | 0.0051 | 0.0102 | +100.00% |" in md
    assert "| ppl_kld.kld_mean | zoo-llama__fp8-block__default__cpu-emulated | 0.0102 | +100.00% |" in md
    for metric in data["metrics"]:
        png = tmp_path / "trend" / f"trend_{metric}.png"
        assert png.stat().st_size > 2000
    assert json.loads((tmp_path / "trend" / "trend.json").read_text())["dates"][-1] == "2026-11-28"


def test_trend_explicit_metrics_and_dates(tmp_path):
    """--metric picks metrics by glob; undated folder names fall back to provenance.created_at."""
    d = _write_dir(tmp_path / "run-a", [_result("m", "fp8-block", 0.01, 1.01, [0.1, 0.2],
                                                 created="2026-10-01T05:06:07+00:00")])
    assert dir_date(d, [json.loads(p.read_text()) for p in d.glob("m__*.json")]) == "2026-10-01T05:06"
    assert dir_date(Path("nightly_2026-11-28T0215"), []) == "2026-11-28T02:15"
    data = collect([d], metrics=["layer_error.layers.*.resid_out.rel_l2"])
    assert sorted(data["metrics"]) == ["layer_error.layers.0.resid_out.rel_l2", "layer_error.layers.1.resid_out.rel_l2"]
    with pytest.raises(ResultError, match="no result files"):
        collect([tmp_path])


def test_report_and_trend_cli(tmp_path, capsys):
    """`evalharness report DIR --out OUT --history ...` embeds the trend; `evalharness trend` writes its own."""
    dirs = _history(tmp_path)
    out = tmp_path / "rep"
    assert main(["report", str(dirs[-1]), "--out", str(out), "--history", *map(str, dirs)]) == 0
    md = (out / "report.md").read_text()
    assert "## Trend over the nightly history" in md and "+100.00%" in md
    assert (out / "trend" / "trend_ppl_kld.kld_mean.png").stat().st_size > 2000
    assert main(["trend", *map(str, dirs), "--out", str(tmp_path / "t")]) == 0
    assert "ppl_kld.kld_mean" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_report_of_the_h200_gpu_suite_shows_backends_and_three_way(tmp_path):
    """Two runs of the H200 run of suites/gpu.yaml (benchmarks/results/h200-2026-11-29/suite_gpu/: zoo-moe fp8-block
    on both backends, its suite.json cut to them, in tests/data/): one row per backend, and the three-way table with
    the format / kernel / total KLD of the native run (values as measured, no kernel tap flagged)."""
    from evalharness.results_report import build_report
    from tests.conftest import REPO

    md = build_report(REPO / "tests" / "data" / "suite_gpu_h200_zoo_moe", tmp_path).read_text()
    assert "| zoo-moe | fp8-block | default | cuda-emulated | ok |" in md
    assert "| zoo-moe | fp8-block | default | cuda-native | ok |" in md
    row = next(line for line in md.splitlines()
               if line.startswith("| zoo-moe | fp8-block | default | cuda-native |") and "none" in line)
    assert "| 0.0221 [0.01615, 0.02805] | 0.01561 [0.01114, 0.02008] |" in row and row.rstrip().endswith("| none |")
    assert (tmp_path / "kld_zoo-moe.png").exists()


def test_report_long_context_table_names_models_whose_reference_finds_no_passkey(tmp_path):
    """The long-context section shows passkey accuracies with intervals, divergence, repetition, loops and KLD
    growth per run, and names the model on which the FP32 reference retrieves no passkey (the probe is blind
    there); no section without longctx metrics."""
    docs = []
    for model, ref_acc in (("small", 0.0), ("big", 0.9)):
        doc = _result(model, "fp8-kv", 0.01, 1.01, [0.01, 0.02])
        doc["metrics"].update({
            "longctx.passkey_n": 40.0, "longctx.passkey_acc_ref": ref_acc, "longctx.passkey_acc_ref_lo": 0.0,
            "longctx.passkey_acc_ref_hi": 0.95, "longctx.passkey_acc_eng": ref_acc * 0.5,
            "longctx.passkey_acc_eng_lo": 0.0, "longctx.passkey_acc_eng_hi": 0.6, "longctx.passkey_mcnemar_p": 0.02,
            "longctx.div_frac": 0.75, "longctx.div_real_error_frac": 0.25, "longctx.rep3_eng": 0.31,
            "longctx.rep3_ref": 0.3, "longctx.loop_eng": 0.125, "longctx.loop_ref": 0.0,
            "longctx.kld_first": 0.005, "longctx.kld_last": 0.008, "longctx.kld_growth": 1.6})
        docs.append(doc)
    md = build_report(_write_dir(tmp_path / "r", docs), tmp_path / "o").read_text()
    assert "## Long context" in md
    assert ("| big | fp8-kv | default | 0.45 [0, 0.6] | 0.9 [0, 0.95] | 0.02 | 0.75 (0.25) | 0.31 / 0.3 | "
            "0.125 / 0 | 0.005 → 0.008 (x1.6) |") in md
    assert "The FP32 reference retrieves no passkey on small:" in md
    plain = build_report(_write_dir(tmp_path / "p", [_result("m", "fp8-block", 0.01, 1.01, [0.01])]), tmp_path / "q")
    assert "Long context" not in plain.read_text()


def test_report_task_table_shows_a_group_not_its_subjects(tmp_path):
    """A configured group (lm-eval's mmlu) appears by its pooled statistics; its subjects stay in the result file."""
    doc = _result("m", "fp8-block", 0.01, 1.01, [0.01], tasks={"mmlu": (-0.01, -0.02, 0.0),
                                                              "mmlu_anatomy": (-0.1, -0.3, 0.1)})
    doc["spec"]["evals"] = {"tasks": {"tasks": ["mmlu"]}}
    md = build_report(_write_dir(tmp_path / "r", [doc]), tmp_path / "o").read_text()
    assert "| m | fp8-block | default | mmlu | 0.5 | 0.49 | -0.01 [-0.02, 0] | 0.3 | 200 |" in md
    assert "mmlu_anatomy" not in md
