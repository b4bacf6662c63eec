"""lm-eval's templates compiled once per string (evalharness.evals.lm_templates): same prompts, fewer compilations.

The request building of a user task with Jinja templates and few-shot examples runs with and without the caching
environment; every request's arguments must be equal, the caching run must compile each distinct template once,
and lm-eval's own environment must be back afterwards (also after an error). With the shared data dir: the same for
MMLU, 5-shot (the task whose request building the cache was made for).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

import lm_eval.utils as lm_utils  # noqa: E402
from jinja2 import Environment  # noqa: E402

from evalharness.evals import tasks as T  # noqa: E402
from evalharness.evals.lm_templates import CachingEnvironment, compiled_templates  # noqa: E402


def _templated_task(folder, name: str, n: int) -> None:
    """A user multiple-choice task whose text, target and choices are Jinja templates, 3-shot from its own split."""
    rows = [{"q": f"Question {i}", "a": f"opt{i}", "b": f"alt{i}", "gold": i % 2} for i in range(n)]
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "t.yaml").write_text(
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n    train: {folder / 'data.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\nfewshot_split: train\nnum_fewshot: 3\n"
        "doc_to_text: \"{{q | upper}}: {{a}} or {{b}}?{% if gold %} (odd){% endif %}\\nAnswer:\"\n"
        "doc_to_target: \"{{gold}}\"\ndoc_to_choice: \"{{[a, b]}}\"\n"
        "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n")


def _requests(tm, task: str, limit: int, fewshot: int | None) -> list[tuple]:
    """Every request lm-eval builds for `task` (its type and arguments), in order."""
    loaded, defaults = T._load_task(tm, task)
    out = []
    for name, tobj in sorted(loaded["tasks"].items()):
        T._configure(name, tobj, defaults[name], fewshot, 0, None)
        tobj.build_all_requests(limit=limit, rank=0, world_size=1)
        out += [(name, i.request_type, i.arguments) for i in tobj.instances]
    return out


def test_cached_templates_build_the_same_requests(tmp_path):
    T._offline()
    _templated_task(tmp_path, "my_templated_qa", 12)
    tm = T.task_manager(["my_templated_qa"], [str(tmp_path)], None)
    plain = _requests(tm, "my_templated_qa", 12, None)
    original = lm_utils.env
    with compiled_templates():
        env = lm_utils.env
        assert isinstance(env, CachingEnvironment) and env is not original
        known = set(env.compiled)  # the cache lives as long as the process (other tests' templates)
        cached = _requests(tm, "my_templated_qa", 12, None)
    assert lm_utils.env is original
    assert len(plain) == 24 and cached == plain  # 12 documents x 2 choices, 3-shot contexts
    assert "QUESTION 3: opt3 or alt3? (odd)\nAnswer:" in plain[6][2][0]
    # text, target and choice templates: each compiled once however many documents and shots used them
    added = set(env.compiled) - known
    assert 1 <= len(added) <= 3
    assert added <= {"{{q | upper}}: {{a}} or {{b}}?{% if gold %} (odd){% endif %}\nAnswer:",
                                 "{{gold}}", "{{[a, b]}}"}


def test_environment_restored_after_an_error():
    original = lm_utils.env
    with pytest.raises(RuntimeError, match="boom"):
        with compiled_templates():
            assert lm_utils.env is not original
            raise RuntimeError("boom")
    assert lm_utils.env is original and isinstance(original, Environment)


def test_caching_environment_keeps_lm_evals_settings():
    """StrictUndefined (a missing field is an error, not an empty string), kept newlines, lm-eval's filters."""
    with compiled_templates():
        env = lm_utils.env
        assert lm_utils.apply_template("{{x | regex_replace('a', 'b')}}\n", {"x": "aa"}) == "bb\n"
        with pytest.raises(Exception, match="y"):
            lm_utils.apply_template("{{y}}", {"x": 1})
        # a template with its own globals is not cached under its source
        env.from_string("{{z}}", globals={"z": 1})
        assert "{{z}}" not in env.compiled


def test_mmlu_five_shot_prompts_unchanged(data_dir):
    T._offline()
    tm = T.task_manager(["mmlu"], [], str(data_dir))
    plain = _requests(tm, "mmlu", 2, 5)
    with compiled_templates():
        cached = _requests(tm, "mmlu", 2, 5)
    assert len(plain) == 57 * 2 * 4 and cached == plain
