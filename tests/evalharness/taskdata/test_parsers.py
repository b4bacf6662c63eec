"""The data folder's file formats as HF dataset records (evalharness/taskdata/parsers.py), on small files written
here: the fields and types lm-eval's tasks read, and errors that name the file and line."""

from __future__ import annotations

import json

import pytest

from evalharness.errors import DataError
from evalharness.taskdata import parsers


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def test_hellaswag_recovers_ctx_b_only_when_the_context_ends_mid_sentence(tmp_path):
    """ActivityNet-style contexts (ending mid-sentence) split at the last sentence end; WikiHow-style ones
    (complete sentences) keep ctx_b empty; the label is a string as in Rowan/hellaswag."""
    f = _write(tmp_path / "h.txt", "\n".join([
        "Roof shingle removal: A man is sitting on a roof. he", "3", "a", "b", "c", "d",
        "Health: How to rest. Sleep well. Drink water.", "0", "e", "f", "g", "h",
        "High jump: the boy", "1", "i", "j", "k", "l"]))
    rows = parsers.hellaswag([f], None)
    assert [(r["activity_label"], r["ctx_a"], r["ctx_b"], r["label"]) for r in rows] == [
        ("Roof shingle removal", "A man is sitting on a roof.", "he", "3"),
        ("Health", "How to rest. Sleep well. Drink water.", "", "0"),
        ("High jump", "", "the boy", "1")]
    assert rows[0]["endings"] == ["a", "b", "c", "d"] and rows[0]["ctx"] == "A man is sitting on a roof. he"


@pytest.mark.parametrize("text, match", [("x: y\n3\na\nb\nc", "multiple of 6"),
                                         ("x: y\n7\na\nb\nc\nd", r"h.txt:2: the gold index must be 0-3"),
                                         ("no label\n1\na\nb\nc\nd", r"h.txt:1: .*activity label")])
def test_hellaswag_errors_name_file_and_line(tmp_path, text, match):
    with pytest.raises(DataError, match=match):
        parsers.hellaswag([_write(tmp_path / "h.txt", text)], None)


def test_arc_flattens_the_question_into_the_hf_layout(tmp_path):
    """AI2's nested question becomes ai2_arc's question / choices.{text,label} / answerKey."""
    item = {"id": "q1", "question": {"stem": "Why?", "choices": [{"text": "A1", "label": "A"},
                                                                 {"text": "B1", "label": "B"}]}, "answerKey": "B"}
    (row,) = parsers.arc([_write(tmp_path / "a.jsonl", json.dumps(item) + "\n\n")], "ARC-Easy")
    assert row == {"id": "q1", "question": "Why?", "choices": {"text": ["A1", "B1"], "label": ["A", "B"]},
                   "answerKey": "B"}
    item["answerKey"] = "C"
    with pytest.raises(DataError, match="answerKey 'C' is not among"):
        parsers.arc([_write(tmp_path / "a.jsonl", json.dumps(item))], None)
    with pytest.raises(DataError, match=r"a.jsonl:1: not JSON"):
        parsers.arc([_write(tmp_path / "a.jsonl", "{oops")], None)


def test_piqa_joins_the_labels_file(tmp_path):
    data = _write(tmp_path / "d.jsonl", "\n".join(json.dumps({"goal": f"g{i}", "sol1": "s1", "sol2": "s2"})
                                                  for i in range(2)))
    rows = parsers.piqa([data, _write(tmp_path / "l.lst", "1\n0\n")], None)
    assert [(r["goal"], r["label"]) for r in rows] == [("g0", 1), ("g1", 0)]
    with pytest.raises(DataError, match="expected 2 labels"):
        parsers.piqa([data, _write(tmp_path / "l.lst", "1\n")], None)
    with pytest.raises(DataError, match="no 'sol2' field"):
        parsers.piqa([_write(tmp_path / "d.jsonl", json.dumps({"goal": "g", "sol1": "s"})),
                      _write(tmp_path / "l.lst", "0")], None)


def test_winogrande_lambada_gsm8k(tmp_path):
    wg = {"sentence": "A _ b.", "option1": "x", "option2": "y", "answer": 2}
    assert parsers.winogrande([_write(tmp_path / "w.jsonl", json.dumps(wg))], None)[0]["answer"] == "2"
    with pytest.raises(DataError, match="'_' blank"):
        parsers.winogrande([_write(tmp_path / "w.jsonl", json.dumps(dict(wg, sentence="no blank")))], None)
    assert parsers.lambada([_write(tmp_path / "l.txt", "a b c\n\n d e \n")], None) == [{"text": "a b c"},
                                                                                        {"text": "d e"}]
    g = parsers.gsm8k([_write(tmp_path / "g.jsonl", json.dumps({"question": "q", "answer": "#### 4", "x": 1}))], "main")
    assert g == [{"question": "q", "answer": "#### 4"}]


def test_mmlu_csv_with_quoted_commas(tmp_path):
    """The header is checked; quoted fields keep their commas; the answer index becomes an int."""
    f = _write(tmp_path / "s.csv", 'question,choice0,choice1,choice2,choice3,answer\n'
                                   '"Which, of these?","True, True",b,c,d,3\n')
    assert parsers.mmlu([f], "anatomy") == [{"question": "Which, of these?", "subject": "anatomy",
                                             "choices": ["True, True", "b", "c", "d"], "answer": 3}]
    with pytest.raises(DataError, match="the header must be"):
        parsers.mmlu([_write(tmp_path / "s.csv", "q,a,b,c,d,answer\n")], "x")
    with pytest.raises(DataError, match=r"s.csv:2: expected 6 fields with an answer index 0-3"):
        parsers.mmlu([_write(tmp_path / "s.csv", "question,choice0,choice1,choice2,choice3,answer\nq,a,b,c,d,E\n")],
                     "x")
