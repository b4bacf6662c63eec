"""Offline loaders for the task YAMLs in this folder (lm-eval `custom_dataset` functions).

lm-eval calls a task's ``custom_dataset`` with the task's metadata merged with
its ``dataset_kwargs``; the harness puts the data dir into the metadata
(``TaskManager(metadata={"data_dir": ...})``), falling back to
``$EVALHARNESS_DATA_DIR``. Each loader reads the original files of the shared
data folder (see its README for the formats) and returns an in-memory
``datasets.DatasetDict``; nothing is downloaded and nothing is written to the
HF cache. Parsed files are memoized per (path, mtime, size).

Also here: the small document functions the YAMLs reference with ``!function``
(WinoGrande's partial scoring, GSM8K's final-number exact match).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

DATA_DIR_ENV = "EVALHARNESS_DATA_DIR"


def data_dir(kwargs: dict[str, Any]) -> Path:
    """The shared data folder: metadata ``data_dir``, else ``$EVALHARNESS_DATA_DIR``; an error naming both."""
    value = kwargs.get("data_dir") or os.environ.get(DATA_DIR_ENV)
    if not value:
        raise FileNotFoundError("these tasks read the shared data folder: run with --data-dir DIR (or set "
                                f"${DATA_DIR_ENV}, or the tasks eval's 'data_dir' setting)")
    p = Path(value).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"data dir {p} does not exist (from --data-dir / ${DATA_DIR_ENV} / data_dir)")
    return p


def _file(kwargs: dict[str, Any], rel: str) -> Path:
    """A file under the data dir; an error naming it when missing."""
    p = data_dir(kwargs) / rel
    if not p.is_file():
        raise FileNotFoundError(f"task data file {p} is missing (expected in the shared data folder, see its README)")
    return p


def _memo(parse: Callable[[Path], list[dict]]) -> Callable[[Path], list[dict]]:
    """Cache a file parser on (path, mtime, size), so repeated task loads in one process are cheap."""
    cached = functools.lru_cache(maxsize=32)(lambda path, _m, _s: parse(Path(path)))

    @functools.wraps(parse)
    def wrapper(path: Path) -> list[dict]:
        """Parse `path`, or return the memoized rows of the same file version."""
        st = path.stat()
        return cached(str(path), st.st_mtime_ns, st.st_size)

    return wrapper


_DATASETS: dict[tuple[str, str], Any] = {}


def _loader(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Memoize a task loader per data dir: lm-eval rebuilds tasks for every model run, the data stays the same."""

    @functools.wraps(fn)
    def wrapper(**kwargs) -> Any:
        """The loader's DatasetDict for this data dir (built on first use)."""
        key = (fn.__name__, str(data_dir(kwargs).resolve()))
        if key not in _DATASETS:
            _DATASETS[key] = fn(**kwargs)
        return _DATASETS[key]

    return wrapper


def _dataset(**splits: list[dict]):
    """A DatasetDict of in-memory splits."""
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


@_memo
def _jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped)."""
    rows = []
    with path.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{i}: not JSON ({exc})") from None
    return rows


@_memo
def _lines(path: Path) -> list[dict]:
    """Non-empty lines of a text file as ``{"text": line}``."""
    return [{"text": t} for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]


# --------------------------------------------------------------------------- HellaSwag

def _clean_hellaswag(text: str) -> str:
    """Remove WikiHow artifacts: `` [title]`` becomes a sentence break, other ``[...]`` markers go."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


@_memo
def _hellaswag_docs(path: Path) -> list[dict]:
    """Parse the 6-lines-per-item text file: context, gold index (0-3), four endings."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if len(lines) % 6:
        raise ValueError(f"{path}: {len(lines)} lines is not a multiple of 6 (context, label, 4 endings)")
    docs = []
    for i in range(0, len(lines), 6):
        label = lines[i + 1].strip()
        if label not in ("0", "1", "2", "3"):
            raise ValueError(f"{path}:{i + 2}: gold index must be 0-3, got {label!r}")
        docs.append({"query": _clean_hellaswag(lines[i]), "choices": [_clean_hellaswag(e) for e in lines[i + 2:i + 6]],
                     "label": int(label)})
    return docs


@_loader
def hellaswag(**kwargs) -> Any:
    """HellaSwag validation (10,042 items)."""
    return _dataset(validation=_hellaswag_docs(_file(kwargs, "tasks/hellaswag/hellaswag_val_full.txt")))


# --------------------------------------------------------------------------- ARC

def _arc_rows(path: Path) -> list[dict]:
    """AI2 ARC jsonl rows flattened to question, choice texts/labels and the gold index."""
    out = []
    for r in _jsonl(path):
        labels = [c["label"] for c in r["question"]["choices"]]
        if r["answerKey"] not in labels:
            raise ValueError(f"{path}: item {r.get('id')}: answerKey {r['answerKey']!r} not among {labels}")
        out.append({"id": r["id"], "question": r["question"]["stem"],
                    "choices": [c["text"] for c in r["question"]["choices"]], "labels": labels,
                    "gold": labels.index(r["answerKey"])})
    return out


def _arc(kwargs: dict[str, Any], subset: str) -> Any:
    """One ARC subset with train / validation (Dev) / test splits."""
    return _dataset(**{split: _arc_rows(_file(kwargs, f"tasks/arc/ARC-{subset}-{name}.jsonl"))
                       for split, name in (("train", "Train"), ("validation", "Dev"), ("test", "Test"))})


@_loader
def arc_easy(**kwargs) -> Any:
    """ARC-Easy (test 2,376 items)."""
    return _arc(kwargs, "Easy")


@_loader
def arc_challenge(**kwargs) -> Any:
    """ARC-Challenge (test 1,172 items)."""
    return _arc(kwargs, "Challenge")


# --------------------------------------------------------------------------- PIQA

@_loader
def piqa(**kwargs) -> Any:
    """PIQA dev (1,838 items): goal, two solutions, label from the separate labels file."""
    rows = _jsonl(_file(kwargs, "tasks/piqa/dev.jsonl"))
    labels_path = _file(kwargs, "tasks/piqa/dev-labels.lst")
    labels = [int(t) for t in labels_path.read_text().split()]
    if len(labels) != len(rows):
        raise ValueError(f"{labels_path}: {len(labels)} labels for {len(rows)} PIQA items")
    return _dataset(validation=[{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": lab}
                                for r, lab in zip(rows, labels)])


# --------------------------------------------------------------------------- WinoGrande

@_loader
def winogrande(**kwargs) -> Any:
    """WinoGrande 1.1 dev (1,267 items)."""
    rows = _jsonl(_file(kwargs, "tasks/winogrande/dev.jsonl"))
    return _dataset(validation=[{k: r[k] for k in ("sentence", "option1", "option2", "answer")} for r in rows])


def winogrande_gold(doc: dict) -> int:
    """Index of the correct context (partial scoring: the options go into the context)."""
    return {"1": 0, "2": 1}[str(doc["answer"])]


def winogrande_contexts(doc: dict) -> list[str]:
    """The sentence up to the blank, filled with each option."""
    cut = doc["sentence"].index("_")
    return [doc["sentence"][:cut] + doc["option1"], doc["sentence"][:cut] + doc["option2"]]


def winogrande_continuation(doc: dict) -> str:
    """The part of the sentence after the blank (scored under each filled-in context)."""
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()


# --------------------------------------------------------------------------- LAMBADA

@_loader
def lambada(**kwargs) -> Any:
    """Original LAMBADA (plain text, lower-cased and tokenized): target = the last word of each passage."""
    docs = []
    for row in _lines(_file(kwargs, "tasks/lambada/lambada_test_plain_text.txt")):
        words = row["text"].strip().split(" ")
        docs.append({"text": row["text"].strip(), "context": " ".join(words[:-1]), "target": " " + words[-1]})
    return _dataset(test=docs)


# --------------------------------------------------------------------------- GSM8K

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _final_number(text: str) -> str | None:
    """The last number in `text`, without thousands separators and trailing zeros after a decimal point."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    s = found[-1].replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


def _gsm8k_rows(path: Path) -> list[dict]:
    """GSM8K rows with the gold final number (after ``####``)."""
    out = []
    for r in _jsonl(path):
        if "####" not in r["answer"]:
            raise ValueError(f"{path}: an answer lacks the '#### N' final line: {r['answer'][-60:]!r}")
        out.append({"question": r["question"], "answer": r["answer"],
                    "gold": _final_number(r["answer"].split("####")[-1]) or ""})
    return out


@_loader
def gsm8k(**kwargs) -> Any:
    """GSM8K test (1,319 items) and train (few-shot examples)."""
    return _dataset(train=_gsm8k_rows(_file(kwargs, "tasks/gsm8k/train.jsonl")),
                    test=_gsm8k_rows(_file(kwargs, "tasks/gsm8k/test.jsonl")))


def gsm8k_exact_match(doc: dict, results: list[str]) -> dict[str, float]:
    """1 when the final number of the generation equals the gold final number, else 0."""
    pred = _final_number(results[0])
    return {"exact_match": float(pred is not None and pred == doc["gold"])}
