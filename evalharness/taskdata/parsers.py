"""The shared data folder's task files as the records of the Hugging Face datasets lm-eval's tasks read.

One function per file format (see the data folder's README), named in ``datasets.yaml``. Each takes the files of
one split (in the order the YAML lists them) and the dataset config (``dataset_name``; MMLU's subject) and returns
the split's records with the fields and types of the HF dataset, so that the task's own ``process_docs``,
``doc_to_text``, ``doc_to_target`` and ``doc_to_choice`` apply unchanged. Fields the tasks never read and that the
files do not hold are left out. A malformed file raises :class:`DataError` naming the file and line.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Callable

from evalharness.errors import DataError

Parser = Callable[[list[Path], "str | None"], list[dict]]


def _one(files: list[Path], parser: str) -> Path:
    """The single file a parser takes."""
    if len(files) != 1:
        raise DataError(f"task data parser '{parser}' reads one file per split, got {[str(f) for f in files]}")
    return files[0]


def _jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped)."""
    rows = []
    with path.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{i}: not JSON ({exc}); the data folder's file is damaged") from None
    return rows


def _require(row: dict, keys: tuple[str, ...], where: str) -> None:
    """Every key in `row`, else an error naming the first missing one."""
    for key in keys:
        if key not in row:
            raise DataError(f"{where}: no '{key}' field (has {sorted(row)}); expected the format of the data "
                            "folder's README")


_SENTENCE_END = re.compile(r"[.!?][\"')]?\s")


def hellaswag(files: list[Path], config: str | None) -> list[dict]:
    """HellaSwag's 6-lines-an-item text file (context, gold index 0-3, four endings) as ``Rowan/hellaswag`` records.

    The context line is ``activity_label: ctx_a ctx_b`` with ``ctx_b`` (the start of the sentence the endings
    complete) not yet capitalized; lm-eval's ``process_docs`` capitalizes it. It is recovered as the text after
    the last sentence end when the context ends mid-sentence (the ActivityNet items), else empty (WikiHow).
    """
    path = _one(files, "hellaswag")
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or len(lines) % 6:
        raise DataError(f"{path}: {len(lines)} lines is not a positive multiple of 6 (context, gold index, 4 endings)")
    rows = []
    for i in range(0, len(lines), 6):
        label, sep, ctx = lines[i].partition(": ")
        if not sep:
            raise DataError(f"{path}:{i + 1}: the context line has no 'activity label: ' prefix")
        gold = lines[i + 1].strip()
        if gold not in ("0", "1", "2", "3"):
            raise DataError(f"{path}:{i + 2}: the gold index must be 0-3, got {gold!r}")
        ctx_a, ctx_b = ctx, ""
        if not ctx.rstrip().endswith((".", "!", "?", '"', "'", ")")):
            ends = list(_SENTENCE_END.finditer(ctx))
            cut = ends[-1].end() if ends else 0
            ctx_a, ctx_b = ctx[:cut].rstrip(), ctx[cut:]
        rows.append({"ind": i // 6, "activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": ctx,
                     "endings": lines[i + 2:i + 6], "label": gold})
    return rows


def arc(files: list[Path], config: str | None) -> list[dict]:
    """AI2's ARC jsonl (``question.stem``, ``question.choices[].{text,label}``, ``answerKey``) as
    ``allenai/ai2_arc`` records (``question``, ``choices.{text,label}``, ``answerKey``)."""
    path = _one(files, "arc")
    rows = []
    for i, r in enumerate(_jsonl(path), 1):
        where = f"{path}: item {i}"
        _require(r, ("id", "question", "answerKey"), where)
        q = r["question"]
        if not isinstance(q, dict) or "stem" not in q or "choices" not in q:
            raise DataError(f"{where}: 'question' must hold 'stem' and 'choices' (AI2's ARC layout)")
        labels = [str(c["label"]) for c in q["choices"]]
        if r["answerKey"] not in labels:
            raise DataError(f"{where}: answerKey {r['answerKey']!r} is not among the choice labels {labels}")
        rows.append({"id": r["id"], "question": q["stem"],
                     "choices": {"text": [c["text"] for c in q["choices"]], "label": labels},
                     "answerKey": r["answerKey"]})
    return rows


def piqa(files: list[Path], config: str | None) -> list[dict]:
    """PIQA's jsonl (``goal``, ``sol1``, ``sol2``) and its labels file (one 0/1 a line) as ``baber/piqa`` records."""
    if len(files) != 2:
        raise DataError(f"task data parser 'piqa' reads the jsonl and its labels file, got {[str(f) for f in files]}")
    data, labels_path = files
    rows = _jsonl(data)
    labels = labels_path.read_text(encoding="utf-8").split()
    if len(labels) != len(rows) or any(v not in ("0", "1") for v in labels):
        raise DataError(f"{labels_path}: expected {len(rows)} labels of 0 or 1 (one per item of {data.name}), "
                        f"got {len(labels)}")
    out = []
    for i, (r, lab) in enumerate(zip(rows, labels), 1):
        _require(r, ("goal", "sol1", "sol2"), f"{data}: item {i}")
        out.append({"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(lab)})
    return out


def winogrande(files: list[Path], config: str | None) -> list[dict]:
    """WinoGrande's jsonl as ``allenai/winogrande`` records (``sentence`` with ``_``, ``option1/2``, ``answer``)."""
    path = _one(files, "winogrande")
    out = []
    for i, r in enumerate(_jsonl(path), 1):
        where = f"{path}: item {i}"
        _require(r, ("sentence", "option1", "option2", "answer"), where)
        if "_" not in r["sentence"] or str(r["answer"]) not in ("1", "2"):
            raise DataError(f"{where}: the sentence needs a '_' blank and the answer must be '1' or '2'")
        out.append({"sentence": r["sentence"], "option1": r["option1"], "option2": r["option2"],
                    "answer": str(r["answer"])})
    return out


def lambada(files: list[Path], config: str | None) -> list[dict]:
    """The original LAMBADA's plain text (one passage a line, the last word the target) as ``cimec/lambada``
    records (``text``)."""
    path = _one(files, "lambada")
    return [{"text": line.strip()} for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def gsm8k(files: list[Path], config: str | None) -> list[dict]:
    """GSM8K's jsonl (``question``, ``answer`` ending in ``#### N``) as ``openai/gsm8k`` records."""
    path = _one(files, "gsm8k")
    out = []
    for i, r in enumerate(_jsonl(path), 1):
        _require(r, ("question", "answer"), f"{path}: item {i}")
        out.append({"question": r["question"], "answer": r["answer"]})
    return out


MMLU_HEADER = ["question", "choice0", "choice1", "choice2", "choice3", "answer"]


def mmlu(files: list[Path], config: str | None) -> list[dict]:
    """One MMLU subject's CSV (header ``question,choice0..3,answer``, answer = the index 0-3) as ``cais/mmlu``
    records (``question``, ``subject``, ``choices``, ``answer``)."""
    path = _one(files, "mmlu")
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header != MMLU_HEADER:
            raise DataError(f"{path}: the header must be {','.join(MMLU_HEADER)}, got {header}")
        out = []
        for row in reader:
            if len(row) != 6 or row[5] not in ("0", "1", "2", "3"):
                raise DataError(f"{path}:{reader.line_num}: expected 6 fields with an answer index 0-3, got {row}")
            out.append({"question": row[0], "subject": config or "", "choices": row[1:5], "answer": int(row[5])})
    return out


PARSERS: dict[str, Parser] = {"hellaswag": hellaswag, "arc": arc, "piqa": piqa, "winogrande": winogrande,
                              "lambada": lambada, "gsm8k": gsm8k, "mmlu": mmlu}
