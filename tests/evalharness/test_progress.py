"""Progress of `evalharness run` (evalharness/progress.py, tqdm) and the end-of-run table's task columns.

Off a terminal (pytest captures stderr): no bar characters, one line per finished eval and per finished run, the
run's line with the suite's ETA. On a terminal (a stream that says it is one): tqdm bars with rates, log lines
above them. The table: one `ref/eng/delta` column per task, equal to the result file's accuracies.
"""

from __future__ import annotations

import io
import json
import re
import time

import pytest

from evalharness.progress import Progress
from evalharness.report import results_table, table_tasks
from tests.conftest import REPO


class _Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_terminal_draws_bars_with_rate_and_lines_above_them():
    """On a terminal: a window bar with its rate and ETA, the runs bar's meter, log lines written whole."""
    out = _Terminal()
    p = Progress(out)
    assert p.tty
    with p.runs(3, finished=1):
        for _ in p.bar(range(3), total=3, desc="ppl_kld engine", unit="window"):
            time.sleep(0.12)  # past tqdm's redraw interval (0.1 s)
        p("[2/3] m__fp32__default__cpu-emulated: ok in 1.0s")
        meter = p.run_done()
    text = out.getvalue()
    assert re.search(r"ppl_kld engine: +67%.*\| 2/3 \[00:00<00:00, +\d+\.\d+window/s\]", text), text
    assert "\r" in text  # redrawn in place
    assert "[2/3] m__fp32__default__cpu-emulated: ok in 1.0s\n" in text
    assert re.fullmatch(r"2/3 runs, elapsed \d\d:\d\d, eta \d\d:\d\d, .+", meter), meter
    quiet = io.StringIO()
    q = Progress(quiet)
    assert not q.tty
    for _ in q.bar(range(4), total=4, desc="x"):
        pass
    assert quiet.getvalue() == ""


def _user_task(folder, n: int = 4) -> None:
    """A two-choice task in lm-eval's YAML format on a local jsonl (include_paths)."""
    rows = [{"q": f"Question {i}: is it so?", "choices": [" yes", " no"], "gold": i % 2} for i in range(n)]
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "yesno.yaml").write_text(
        f"task: my_yesno\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: gold\n"
        "doc_to_choice: choices\nmetric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n")


def test_run_off_a_terminal_prints_one_line_per_step_and_task_columns(tmp_path, capsys):
    """`run` with stderr captured: '[1/1] <key>: <eval> done in Xs (j/2 evals)' per eval, the run's line with
    the suite's runs, elapsed, ETA and rate, no bar; the table's task column equals the result's accuracies."""
    pytest.importorskip("lm_eval")
    from evalharness.cli import main

    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    _user_task(tasks_dir)
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: progress\nbackend: cpu-emulated\nmodels:\n"
        f"  - {{name: zoo-llama, path: {REPO / 'zoo/zoo-llama'}, corpus: {REPO / 'zoo/zoo-llama/heldout_sample.json'}}}\n"
        "recipes: [fp32]\nserving: [{name: default, batch_size: 4}]\n"
        "evals:\n  ppl_kld: {seq_len: 32, max_windows: 2}\n"
        f"  tasks: {{tasks: [my_yesno], include_paths: [{tasks_dir}], num_fewshot: 0}}\n")
    assert main(["run", str(suite), "--out", str(tmp_path / "out"), "--no-tracking"]) == 0
    cap = capsys.readouterr()
    key = "zoo-llama__fp32__default__cpu-emulated"
    lines = [line for line in cap.err.splitlines() if line.startswith("[1/1]")]
    assert re.fullmatch(rf"\[1/1\] {key}: ppl_kld done in \d+\.\ds \(1/2 evals\)", lines[0]), lines
    assert re.fullmatch(rf"\[1/1\] {key}: tasks done in \d+\.\ds \(2/2 evals\)", lines[1]), lines
    assert re.fullmatch(rf"\[1/1\] {key}: ok in \d+\.\ds \(1/1 runs, elapsed \d\d:\d\d, eta 00:00, .+/.+\)",
                        lines[2]), lines
    assert len(lines) == 3 and "\r" not in cap.err and "it/s]" not in cap.err  # no tqdm bar, lm-eval's neither
    m = json.loads((tmp_path / "out" / f"{key}.json").read_text())["metrics"]
    header, row = cap.out.splitlines()[:2]
    assert "my_yesno ref/eng/delta" in header.split("  ")
    cell = f"{m['tasks.my_yesno.acc_ref']:.4g}/{m['tasks.my_yesno.acc_eng']:.4g}/{m['tasks.my_yesno.delta']:+.4g}"
    assert cell in row.split()
    assert m["tasks.my_yesno.n"] == 4.0


def test_table_shows_configured_tasks_or_groups_over_their_members():
    """Configured names win; without them a group (`mmlu`) stands for its members (`mmlu_*`); no tasks, no
    columns; a run without the task shows '-'."""
    def doc(key, metrics, tasks=None):
        spec = {"evals": {"tasks": {"tasks": tasks}}} if tasks is not None else {"evals": {}}
        return {"run_key": key, "status": "ok", "metrics": metrics, "spec": spec, "timing": {"total_s": 1.0}}

    acc = {f"tasks.{t}.{s}": v for t in ("mmlu", "mmlu_humanities", "mmlu_anatomy", "arc_easy")
           for s, v in (("acc_ref", 0.5), ("acc_eng", 0.25), ("delta", -0.25))}
    assert table_tasks([doc("a", acc)]) == ["mmlu", "arc_easy"]
    assert table_tasks([doc("a", acc, tasks=["arc_easy", "mmlu_anatomy"])]) == ["arc_easy", "mmlu_anatomy"]
    assert table_tasks([doc("a", {"ppl_kld.kld_mean": 0.1})]) == []
    lines = results_table([doc("a", acc, tasks=["arc_easy"]), doc("b", {"ppl_kld.kld_mean": 0.1})]).splitlines()
    assert lines[0].split()[-2:] == ["ref/eng/delta", "time_s"] and "0.5/0.25/-0.25" in lines[1].split()
    assert lines[2].split()[-2] == "-"
    assert "ref/eng/delta" not in results_table([doc("b", {"ppl_kld.kld_mean": 0.1})])
