"""lm-eval's TaskManager with its datasets read from the data dir (evalharness/taskdata/manager.py): lm-eval's own
task definitions, groups and prompts on the shared data folder's files, offline."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")


TASK_COUNTS = {"hellaswag": 10042, "arc_easy": 2376, "arc_challenge": 1172, "piqa": 1838, "winogrande": 1267,
               "lambada_standard": 5153, "gsm8k": 1319}


def test_lm_eval_tasks_load_offline_from_the_data_dir(data_dir, monkeypatch):
    """lm-eval's own task definitions load from the data dir with downloads disabled: its document counts, its
    prompts, targets, few-shot defaults and filters (what its YAMLs in site-packages say)."""
    from evalharness.evals.tasks import _offline
    from evalharness.taskdata import task_manager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _offline()
    tm = task_manager(list(TASK_COUNTS), [], str(data_dir))
    loaded = tm.load(list(TASK_COUNTS))["tasks"]
    assert set(loaded) == set(TASK_COUNTS)
    for name, task in loaded.items():
        assert len(task.eval_docs) == TASK_COUNTS[name], name
        assert task.get_config("metadata")["config_source"].split("/lm_eval/tasks/")[1].startswith(
            {"arc_easy": "arc/", "arc_challenge": "arc/", "lambada_standard": "lambada/"}.get(name, name)), name
    hs = loaded["hellaswag"]
    doc = hs.eval_docs[0]
    # lm-eval's process_docs capitalizes ctx_b: the file's "... on a roof. he" becomes "... on a roof. He"
    assert hs.doc_to_text(doc) == "Roof shingle removal: A man is sitting on a roof. He"
    assert hs.doc_to_target(doc) == 3 and len(hs.doc_to_choice(doc)) == 4
    arc = loaded["arc_easy"]
    assert arc.doc_to_text(arc.eval_docs[0]).startswith("Question: Which statement best explains")
    assert arc.doc_to_text(arc.eval_docs[0]).endswith("\nAnswer:") and arc.doc_to_target(arc.eval_docs[0]) == 0
    lam = loaded["lambada_standard"]
    assert lam.doc_to_target(lam.eval_docs[0]) == " signs" and not lam.doc_to_text(lam.eval_docs[0]).endswith(" ")
    gsm = loaded["gsm8k"]
    assert gsm.get_config("num_fewshot") == 5
    assert [f["name"] for f in gsm.get_config("filter_list")] == ["strict-match", "flexible-extract"]
    wg = loaded["winogrande"]
    assert wg.doc_to_text(wg.eval_docs[0]) == 1 and wg.doc_to_choice(wg.eval_docs[0])[1].endswith("so Maria")


def test_hellaswag_records_change_only_the_capitalization(data_dir):
    """Every HellaSwag prompt lm-eval builds from the local records is the file's context line, cleaned by
    lm-eval's own preprocess, with at most the first letter of its last sentence fragment capitalized (lm-eval
    capitalizes ctx_b, the fragment the endings complete)."""
    from lm_eval.tasks.hellaswag.utils import preprocess

    from evalharness.evals.tasks import _offline
    from evalharness.taskdata import task_manager

    _offline()
    task = task_manager(["hellaswag"], [], str(data_dir)).load(["hellaswag"])["tasks"]["hellaswag"]
    lines = (data_dir / "tasks/hellaswag/hellaswag_val_full.txt").read_text().splitlines()[::6]
    changed = 0
    for doc, line in zip(task.eval_docs, lines):
        query, line = task.doc_to_text(doc), preprocess(line)
        if query != line:
            changed += 1
            assert query.lower() == line.lower() and len(query) == len(line), (line, query)
    assert 3000 < changed < 3500  # the ActivityNet items (about a third of the validation split)


def test_mmlu_group_and_subjects_load_offline(data_dir):
    """lm-eval's mmlu group: 57 subject tasks in four subgroups, 14,042 test documents, 5-shot from dev (first
    five, in file order), lm-eval's prompt."""
    from evalharness.evals.tasks import _offline
    from evalharness.taskdata import task_manager

    _offline()
    loaded = task_manager(["mmlu"], [], str(data_dir)).load(["mmlu"])
    assert len(loaded["tasks"]) == 57 and sum(len(t.eval_docs) for t in loaded["tasks"].values()) == 14042
    assert set(loaded["group_map"]["mmlu"]) == {"mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"}
    aa = loaded["tasks"]["mmlu_abstract_algebra"]
    doc = aa.eval_docs[0]
    assert aa.doc_to_text(doc).startswith(doc["question"].strip() + "\nA. ")
    assert aa.doc_to_text(doc).endswith("\nAnswer:") and aa.doc_to_choice(doc) == ["A", "B", "C", "D"]
    dev = (data_dir / "tasks/mmlu/dev/abstract_algebra_dev.csv").read_text().splitlines()[1]
    assert [d["question"] for d in aa.fewshot_docs()][0] == dev.split(",")[0]


def test_other_lm_eval_tasks_on_the_same_datasets_read_the_data_dir(data_dir):
    """The stand-ins are keyed by dataset, not task name: lm-eval's variants on these datasets load offline too."""
    from evalharness.evals.tasks import _offline
    from evalharness.taskdata import task_manager

    _offline()
    names = ["gsm8k_cot", "mmlu_anatomy_generative", "arc_challenge_chat"]
    tm = task_manager(names, [], str(data_dir))
    for name in names:
        (task,) = tm.load([name])["tasks"].values()
        assert len(task.eval_docs) in (1319, 135, 1172), name


def test_without_a_data_dir_the_error_says_what_to_pass(tmp_path):
    """No data dir: the task's dataset names --data-dir; a data dir without the files: the missing file."""
    from evalharness.errors import DataError
    from evalharness.evals.tasks import _offline
    from evalharness.taskdata import task_manager

    _offline()
    with pytest.raises(DataError, match="'piqa' reads baber/piqa from the shared data folder: run with --data-dir"):
        task_manager(["piqa"], [], None).load(["piqa"])
    with pytest.raises(DataError, match=r"mmlu/dev/anatomy_dev.csv is missing: cais/mmlu \(anatomy\)"):
        task_manager(["mmlu_anatomy"], [], str(tmp_path)).load(["mmlu_anatomy"])
