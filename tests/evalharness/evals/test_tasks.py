"""The lm-eval adapter (HarnessLM), lm-eval's own tasks read offline from the data dir, and the `tasks` eval.

A tiny random Llama with a byte tokenizer is scored through the engine (fp32
recipe) and through the HF reference; both must give the log-likelihoods of a
direct computation with transformers. lm-eval's task definitions must load
offline from the shared data dir with lm-eval's prompts, groups must give
lm-eval's aggregates, and a second recipe must not run the reference again.
The accuracies against lm-eval's own evaluator on a zoo model, from an
installed wheel: tests/test_packaging.py.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from engine.api import Engine  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.model import Transformer  # noqa: E402
from engine.tokenizer import ByteTokenizer  # noqa: E402
from evalharness.evals import EvalContext, run_eval  # noqa: E402
from evalharness.errors import DataError  # noqa: E402
from evalharness.evals.tasks import paired_task_metrics  # noqa: E402
from evalharness.lm_adapter import HarnessLM, rolling_chunks  # noqa: E402
from evalharness.reference import ReferenceLM  # noqa: E402
from tests.conftest import write_random_llama  # noqa: E402

BOS, EOS = 256, 257
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(engine fp32, reference, tokenizer, loaded) for a random Llama over bytes (vocab 260, context 96)."""
    d = write_random_llama(tmp_path_factory.mktemp("tiny") / "m", seed=5, vocab_size=260, max_position_embeddings=96,
                           bos_token_id=BOS, eos_token_id=EOS)
    loaded = load_model(str(d))
    tok = ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS)
    return Engine(Transformer(loaded.cfg, loaded.weights), "fp32"), ReferenceLM(loaded), tok, loaded


def _req(kind: str, *args) -> Instance:
    """An lm-eval request instance."""
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def _direct_ll(ref: ReferenceLM, ids: list[int], n_cont: int, max_len: int) -> tuple[float, bool]:
    """Sum of log-probs of the last `n_cont` ids given the rest, straight from the HF model (no adapter code)."""
    inp = ids[:-1][-max_len:]
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([inp])).logits[0].double()  # (t, vocab)
    lp = torch.log_softmax(logits[-n_cont:], dim=-1)
    target = torch.tensor(ids[-n_cont:])
    return float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


PAIRS = [("The cat sat on the", " mat"), ("Question: 2+2=?\nAnswer:", " 4"), ("", "hello world"),
         ("trailing space ", "moves"), ("x" * 150, " long context is left-truncated")]


def test_loglikelihood_engine_reference_direct(tiny):
    """Engine (fp32) and reference LMs agree within 1e-4 with each other and with a direct HF computation;
    batching with right padding changes nothing; the greedy flags agree."""
    engine, ref, tok, loaded = tiny
    reqs = [_req("loglikelihood", c, x) for c, x in PAIRS]
    lm_e = HarnessLM(engine, tok, batch_size=3, name="engine")
    lm_r = HarnessLM(ref, tok, batch_size=3, name="reference")
    out_e, out_r = lm_e.loglikelihood(reqs), lm_r.loglikelihood(reqs)
    out_1 = HarnessLM(engine, tok, batch_size=1).loglikelihood(reqs)
    assert lm_e.max_length == 96 and lm_e.counters["forward_batches"] == 2  # 5 distinct sequences, batches of 3
    for (c, x), e, r, one in zip(PAIRS, out_e, out_r, out_1):
        c2, x2 = (c.rstrip(), c[len(c.rstrip()):] + x)
        ids = ([BOS] + list(c2.encode())) if c2 else [BOS]
        cont = list(x2.encode())
        want, greedy = _direct_ll(ref, ids + cont, len(cont), 96)
        assert abs(e[0] - want) <= TOL and abs(r[0] - want) <= TOL, (c, x, e, r, want)
        assert abs(one[0] - e[0]) <= TOL
        assert e[1] == r[1] == greedy
        assert e[0] < 0
    # The trailing space of a context belongs to the continuation.
    assert lm_e.encode_pair("a b ", "c") == ([BOS] + list(b"a b"), list(b" c"))
    assert lm_e.encode_pair("", "hi") == ([BOS], list(b"hi"))


def test_rolling_chunks_score_every_token_once():
    """Disjoint predicted spans covering the text; inputs never exceed max_length; the last window is full."""
    tokens = list(range(10, 33))  # 23 tokens
    chunks = rolling_chunks(tokens, prefix_id=1, max_length=8)
    predicted = [t for _, cont in chunks for t in cont]
    assert predicted == tokens
    for ctx, cont in chunks:
        assert 1 <= len(ctx) and len(ctx) + len(cont) - 1 <= 8
    assert chunks[0][0] == [1]
    assert len(chunks[-1][0]) + len(chunks[-1][1]) - 1 == 8
    assert rolling_chunks([5, 6], 1, 8) == [([1], [5, 6])]


def test_loglikelihood_rolling_is_sum_of_token_nlls(tiny):
    """One window: the rolling log-likelihood equals minus the sum of per-token NLLs of one forward pass;
    several windows: the sum over windows of direct computations."""
    engine, ref, tok, _ = tiny
    text = "It was the best of times, it was the worst of times."
    ids = list(text.encode())
    with torch.no_grad():
        logits = ref.model(input_ids=torch.tensor([[BOS] + ids[:-1]])).logits[0].double()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids), reduction="none")
    got = HarnessLM(engine, tok).loglikelihood_rolling([_req("loglikelihood_rolling", text)])[0]
    assert abs(got + float(nll.sum())) <= TOL
    lm = HarnessLM(ref, tok, max_length=16)
    want = sum(_direct_ll(ref, c + x, len(x), 16)[0] for c, x in rolling_chunks(ids, BOS, 16))
    got = lm.loglikelihood_rolling([_req("loglikelihood_rolling", text)])[0]
    assert abs(got - want) <= TOL and lm.counters["sequences"] == math.ceil(len(ids) / 16)


class ScriptedModel:
    """Engine-interface stand-in whose greedy output is a fixed byte string (honours stop ids and the budget)."""

    max_seq_len = 64

    def __init__(self, text: str):
        """Script the output `text` (as byte tokens)."""
        self.out = list(text.encode())
        self.calls = []

    def generate(self, prompt, max_new_tokens, stop_ids=(), return_logits=False):
        """The scripted tokens up to the budget, stopping after a stop id."""
        self.calls.append((list(prompt), max_new_tokens, tuple(stop_ids)))
        out = []
        for t in self.out[:max_new_tokens]:
            out.append(t)
            if t in stop_ids:
                break
        return out


def test_generate_until_respects_stop_strings():
    """Cut before the first stop string (any of several), at EOS, at max_gen_toks; early stop is exact."""
    tok = ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS)
    model = ScriptedModel("The answer is 42.\n\nQuestion: next one")
    lm = HarnessLM(model, tok)
    gen = lambda ctx, **kw: lm.generate_until([_req("generate_until", ctx, kw)])[0]  # noqa: E731
    assert gen("Q", until=["Question:", "\n\n"], max_gen_toks=40) == "The answer is 42."
    assert gen("Q", until=["42"], max_gen_toks=40) == "The answer is "
    assert gen("Q", until="is", max_gen_toks=40) == "The answer "
    assert gen("Q", until=["zzz"], max_gen_toks=5) == "The a"
    assert model.calls[-1][1] == 5
    # Single-character stop strings become stop ids (every byte token containing them): generation stops there.
    gen("Q", until=["."], max_gen_toks=40)
    assert ord(".") in model.calls[-1][2] and EOS in model.calls[-1][2]
    # The prompt is BOS + context, left-truncated to leave room for the generation.
    gen("x" * 100, until=["."], max_gen_toks=20)
    assert len(model.calls[-1][0]) == 64 - 20
    eos_model = ScriptedModel("ab")
    eos_model.out = [ord("a"), EOS, ord("b")]
    assert HarnessLM(eos_model, tok).generate_until([_req("generate_until", "Q", {"until": ["zz"]})]) == ["a"]


def test_generate_until_real_model_matches_greedy(tiny):
    """On a real model, generate_until = the greedy continuation decoded and cut at the stop string."""
    engine, ref, tok, _ = tiny
    full = tok.decode(ref.generate([BOS] + list(b"Once upon"), 12))
    stop = full[3:5] if len(full) >= 5 else "\x00"
    for model in (engine, ref):
        out = HarnessLM(model, tok).generate_until([_req("generate_until", "Once upon", {"until": [stop],
                                                                                       "max_gen_toks": 12})])
        assert out == [full[:full.find(stop)] if stop in full else full]


def test_paired_task_metrics_known_values():
    """Constructed correctness arrays: accuracies, flips, exact McNemar p and the delta interval."""
    ref = {"correct": [1] * 10 + [0] * 10, "pred": list(range(20)), "lls": [None] * 20, "version": 1.0}
    eng = {"correct": [1] * 4 + [0] * 6 + [0] * 10, "pred": list(range(20)), "lls": [None] * 20}
    m, s = paired_task_metrics(ref, eng)
    assert m["acc_ref"] == 0.5 and m["acc_eng"] == 0.2 and m["delta"] == pytest.approx(-0.3)
    assert m["flip_c2w"] == pytest.approx(0.3) and m["flip_w2c"] == 0.0
    assert m["mcnemar_p"] == pytest.approx(2 * 0.5 ** 6)  # 6 discordant pairs, all one way
    assert m["delta_lo"] < -0.3 < m["delta_hi"] < 0 and m["acc_eng_lo"] < 0.2 < m["acc_eng_hi"]
    assert 0.3 < m["mde"] < 0.7 and m["n"] == 20 and m["version"] == 1.0 and m["pred_agree"] == 1.0
    assert s["correct_eng"][:5] == [1, 1, 1, 1, 0]


def test_tasks_without_data_dir_fail_clearly(tmp_path):
    """No data dir, or one without the task's files: the error names what to pass or what is missing."""
    from evalharness.evals.tasks import _load_task, _offline, task_manager

    _offline()
    with pytest.raises(DataError, match="--data-dir"):
        _load_task(task_manager(["piqa"], [], None), "piqa")
    with pytest.raises(DataError, match=r"piqa/dev.jsonl is missing"):
        _load_task(task_manager(["piqa"], [], str(tmp_path)), "piqa")
    with pytest.raises(DataError, match="unknown task"):
        task_manager(["no_such_task_anywhere"], [], str(tmp_path))


class CountingModel:
    """Wraps an engine-interface model and counts its forward and generate calls."""

    def __init__(self, inner):
        """Wrap `inner`."""
        self.inner, self.calls = inner, 0
        self.cfg = inner.cfg

    def logits(self, tokens, tap=None):
        """Counted forward pass."""
        self.calls += 1
        return self.inner.logits(tokens)

    def generate(self, *args, **kwargs):
        """Counted generation."""
        self.calls += 1
        return self.inner.generate(*args, **kwargs)


def test_tasks_eval_caches_reference_across_recipes(tiny, data_dir):
    """Two recipes of one model: the reference runs once per task; fp32 agrees exactly, bf16 is paired
    against the same reference samples."""
    engine, ref, tok, loaded = tiny
    counting = CountingModel(ref)
    cache, counters = {}, {}
    cfg = {"tasks": ["piqa", "lambada_standard", "gsm8k"], "limit": 3, "num_fewshot": 0, "max_gen_toks": 4,
           "data_dir": str(data_dir)}
    results = {}
    for recipe in ("fp32", "bf16"):
        ctx = EvalContext(engine=Engine(engine.model, recipe), reference=counting, tokenizer=tok, corpus="",
                          vocab_size=260, batch_size=4, seed=0, cache=cache, counters=counters)
        results[recipe] = run_eval("tasks", ctx, cfg)
        if recipe == "fp32":
            ref_calls = counting.calls
            assert counters["reference_passes"] == 3 and ref_calls > 0
    assert counting.calls == ref_calls, "the second recipe ran the reference again"
    assert counters["reference_passes"] == 3 and counters["reference_cache_hits"] == 3
    m32, s32 = results["fp32"]
    for task in ("piqa", "lambada_standard", "gsm8k"):
        assert m32[f"{task}.n"] == 3
        assert m32[f"{task}.acc_eng"] == m32[f"{task}.acc_ref"] and m32[f"{task}.mcnemar_p"] == 1.0
        assert m32[f"{task}.pred_agree"] == 1.0
        assert s32[f"{task}.correct_eng"] == s32[f"{task}.correct_ref"]
        assert results["bf16"][1][f"{task}.correct_ref"] == s32[f"{task}.correct_ref"]
    assert m32["piqa.ll_absdiff_mean"] <= TOL < results["bf16"][0]["piqa.ll_absdiff_mean"]
    assert m32["piqa.version"] == 1.0 and "gsm8k.ll_absdiff_mean" not in m32


def test_evals_suite_and_full_run_overrides_parse():
    """suites/evals.yaml validates, and so do the full-run overrides documented in its header."""
    import re as _re

    from evalharness.suite import load_suite
    from tests.conftest import REPO

    path = REPO / "suites" / "evals.yaml"
    header = path.read_text().split("\nname:")[0]
    sets = _re.findall(r"--set (\S+=\S+)", header)
    assert len(sets) >= 10
    suite = load_suite(path, sets=sets)
    run = suite.runs[0]
    assert set(run.evals) == {"layer_error", "ppl_kld", "tasks", "longctx"}
    assert run.evals["tasks"]["limit"] is None and run.evals["longctx"]["new_tokens"] == 1024
    assert [r.recipe.name for r in suite.runs if r.model["name"] == "zoo-llama"][-1] == "fp8-kv"


class ZeroModel:
    """Uniform logits and a fixed generation: lets lm-eval's own machinery run in milliseconds."""

    max_seq_len = 2048

    def logits(self, tokens, tap=None):
        """All-zero logits (batch, t, 260)."""
        return torch.zeros(tokens.shape[0], tokens.shape[1], 260)

    def generate(self, prompt, max_new_tokens, stop_ids=(), return_logits=False):
        """' 42' then spaces."""
        return (list(b" 42") + [32] * max_new_tokens)[:max_new_tokens]


def test_reused_task_objects_reset_per_run_settings(data_dir):
    """Task objects are shared by every run of a process; few-shot count and generation budget must not leak
    from one run into the next."""
    from evalharness.evals.tasks import _offline, evaluate_task, task_manager

    _offline()
    tm = task_manager(["gsm8k"], [], str(data_dir))
    lm = HarnessLM(ZeroModel(), ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS))
    one, default, again = (evaluate_task(lm, tm, "gsm8k", 2, shots, 0, budget)["leaves"]["gsm8k"]
                           for shots, budget in ((1, 3), (None, None), (1, 3)))
    assert (one["num_fewshot"], default["num_fewshot"], again["num_fewshot"]) == (1, 5, 1)
    assert one["prompt_hashes"] == again["prompt_hashes"] != default["prompt_hashes"]
    assert one["pred"] == again["pred"] and lm.counters["generated_tokens"] == 2 * 3 + 2 * 256 + 2 * 3


def _local_mc_task(folder, name: str, n: int, extra: str = "") -> None:
    """A user task folder: `n` two-choice questions (gold alternating 0 / 1) in data.jsonl and the task YAML
    `mine.yaml` reading them with lm-eval's local-file support (dataset_path: json); `extra` YAML appended."""
    import json

    rows = [{"q": f"Question {i}: pick", "choices": [" yes", " no"], "gold": i % 2} for i in range(n)]
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "mine.yaml").write_text(
        f"task: {name}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: gold\n"
        "doc_to_choice: choices\nmetric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        + extra)


def test_include_paths_user_task_with_local_json(tmp_path):
    """A user task folder (include_paths) with lm-eval's own local-file support (dataset_path: json), offline."""
    _local_mc_task(tmp_path, "my_local_qa", 5, extra="metadata: {version: 2.0}\n")
    tok = ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS)
    ctx = EvalContext(engine=ZeroModel(), reference=ZeroModel(), tokenizer=tok, corpus="", vocab_size=260,
                      batch_size=4, seed=0, cache={}, counters={})
    m, s = run_eval("tasks", ctx, {"tasks": ["my_local_qa"], "include_paths": [str(tmp_path)]})
    assert m["my_local_qa.n"] == 5 and m["my_local_qa.version"] == 2.0
    # Uniform logits: the shorter choice (" no", 3 bytes) has the higher log-likelihood: right for odd golds.
    assert s["my_local_qa.correct_eng"] == s["my_local_qa.correct_ref"] == [0, 1, 0, 1, 0]
    assert m["my_local_qa.delta"] == 0.0 and m["my_local_qa.ll_absdiff_mean"] == 0.0


def test_tasks_eval_times_each_task(tmp_path):
    """ctx.timing gets '<task>.eng_s' for every run and '<task>.ref_s' only in the run that computed the
    reference (the next recipe reuses it): what the device results record as the time each task took."""
    _local_mc_task(tmp_path, "my_timed_qa", 4)
    tok = ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS)
    cache: dict = {}
    timings = []
    for _ in range(2):
        ctx = EvalContext(engine=ZeroModel(), reference=ZeroModel(), tokenizer=tok, corpus="", vocab_size=260,
                          batch_size=4, seed=0, cache=cache, counters={})
        run_eval("tasks", ctx, {"tasks": ["my_timed_qa"], "include_paths": [str(tmp_path)]})
        timings.append(dict(ctx.timing))
    assert set(timings[0]) == {"tasks.my_timed_qa.ref_s", "tasks.my_timed_qa.eng_s", "reference_s"}
    assert set(timings[1]) == {"tasks.my_timed_qa.eng_s"}
    assert all(0 < v < 60 for t in timings for v in t.values())
    # the cached reference pass is what `reference_s` (the runner's '<eval>.reference_s') counts
    assert timings[0]["tasks.my_timed_qa.ref_s"] <= timings[0]["reference_s"]


def _zero_ctx(data_dir=None, cache=None) -> EvalContext:
    """An EvalContext whose two models are ZeroModels (lm-eval's machinery in milliseconds)."""
    tok = ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS)
    return EvalContext(engine=ZeroModel(), reference=ZeroModel(), tokenizer=tok, corpus="", vocab_size=260,
                       batch_size=8, seed=0, cache={} if cache is None else cache, counters={},
                       data_dir=None if data_dir is None else str(data_dir))


def test_group_statistics_pool_its_tasks_as_lm_eval_aggregates(data_dir):
    """mmlu as a group: per-subject and per-subgroup statistics, the group's pooled over its 57 tasks, equal to
    lm-eval's own aggregate (mmlu weights by size) and to lm-eval's per-task accuracies."""
    import lm_eval

    from evalharness.evals.tasks import _offline, task_manager

    m, s = run_eval("tasks", _zero_ctx(data_dir), {"tasks": ["mmlu"], "limit": 2, "num_fewshot": 0})
    _offline()
    tm = task_manager(["mmlu"], [], str(data_dir))
    order = list(tm.load(["mmlu"])["tasks"])  # the group's tasks, in lm-eval's order
    assert len(order) == 57 and m["mmlu.n"] == 114 and m["mmlu_stem.n"] == 2 * 19
    assert all(f"{g}.n" in m for g in ("mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"))
    assert s["mmlu.correct_eng"] == [v for t in order for v in s[f"{t}.correct_eng"]]
    assert "mmlu.ll_absdiff" not in s and "mmlu_anatomy.ll_absdiff" in s
    lm = HarnessLM(ZeroModel(), ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS), batch_size=8)
    res = lm_eval.simple_evaluate(model=lm, tasks=["mmlu"], task_manager=tm, limit=2, num_fewshot=0,
                                  bootstrap_iters=0, log_samples=False)["results"]
    for name in ["mmlu", "mmlu_stem", "mmlu_humanities", "mmlu_abstract_algebra", "mmlu_world_religions"]:
        assert m[f"{name}.acc_eng"] == pytest.approx(res[name]["acc,none"], abs=1e-12), name
        assert m[f"{name}.acc_ref"] == m[f"{name}.acc_eng"] and m[f"{name}.pred_agree"] == 1.0


def test_few_shot_without_a_few_shot_split_fails_clearly(data_dir):
    """HellaSwag's training split (its few-shot pool) is not in the shared data: a few-shot run says so."""
    with pytest.raises(DataError, match="'hellaswag' has no few-shot examples.*num_fewshot: 0"):
        run_eval("tasks", _zero_ctx(data_dir), {"tasks": ["hellaswag"], "limit": 2, "num_fewshot": 1})


def test_lambada_tag_names_the_dataset_the_data_dir_lacks(data_dir):
    """lm-eval's `lambada` is a tag of lambada_openai (data not in the shared folder) and lambada_standard: the
    error names the alternative."""
    with pytest.raises(DataError, match="cannot load 'lambada' offline.*lambada_standard"):
        run_eval("tasks", _zero_ctx(data_dir), {"tasks": ["lambada"], "limit": 2})


def test_user_task_on_a_local_dataset_overrides_lm_evals(tmp_path, data_dir):
    """A user's task YAML (include_paths) of the same name as lm-eval's replaces it, and a task that names a
    dataset the data dir stands in for (allenai/ai2_arc) reads the local files with the user's own prompt."""
    (tmp_path / "arc_easy.yaml").write_text(
        "task: arc_easy\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: 'Q: {{question}}\\nA:'\ndoc_to_target: '{{choices.label.index(answerKey)}}'\n"
        "doc_to_choice: '{{choices.text}}'\nmetric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "metadata: {version: 7.0}\n")
    from evalharness.evals.tasks import _load_task, _offline, task_manager

    _offline()
    tm = task_manager(["arc_easy"], [str(tmp_path)], str(data_dir))
    task = _load_task(tm, "arc_easy")[0]["tasks"]["arc_easy"]
    assert task.doc_to_text(task.eval_docs[0]).startswith("Q: Which statement") and len(task.eval_docs) == 2376
    m, _ = run_eval("tasks", _zero_ctx(data_dir), {"tasks": ["arc_easy"], "limit": 3,
                                                   "include_paths": [str(tmp_path)]})
    assert m["arc_easy.version"] == 7.0 and m["arc_easy.n"] == 3



def test_units_pool_a_group_in_its_task_order_unless_its_tasks_score_differently():
    """units(): every leaf, then each group as its leaves' documents concatenated in the group's order; a group
    mixing acc and exact_match tasks gets no pooled unit."""
    from evalharness.evals.tasks import units

    def leaf(name, metric, correct):
        n = len(correct)
        return {"task": name, "metric": metric, "doc_ids": list(range(n)), "prompt_hashes": [f"{name}{i}" for i in
                range(n)], "correct": correct, "extra": {}, "pred": correct, "lls": [None] * n, "num_fewshot": 0}

    result = {"leaves": {"a": leaf("a", "acc", [1.0, 0.0]), "b": leaf("b", "acc", [0.0]),
                         "c": leaf("c", "exact_match", [1.0])},
              "groups": {"g": ["b", "a"], "mixed": ["a", "c"]}, "group_versions": {"g": "2"}}
    out = {u["task"]: u for u in units(result)}
    assert set(out) == {"a", "b", "c", "g"}
    assert out["g"]["correct"] == [0.0, 1.0, 0.0] and out["g"]["prompt_hashes"] == ["b0", "a0", "a1"]
    assert paired_task_metrics(out["g"], out["g"])[0]["version"] == 2.0


def test_process_docs_applied_once_per_split(tmp_path):
    """A task's process_docs (lm-eval applies it on every access of the evaluation documents, three per pass) runs
    once per split for the shared task object: the same processed documents, the same object each time."""
    from evalharness.evals import tasks as T

    _local_mc_task(tmp_path, "my_processed_qa", 6, extra="process_docs: !function helpers.shout\n")
    (tmp_path / "helpers.py").write_text(
        "def shout(dataset):\n    return dataset.map(lambda d: {'q': d['q'].upper()})\n")
    T._offline()
    tm = T.task_manager(["my_processed_qa"], [str(tmp_path)], None)
    loaded, _ = T._load_task(tm, "my_processed_qa")
    tobj = loaded["tasks"]["my_processed_qa"]
    first, second = tobj.eval_docs, tobj.eval_docs
    assert first is second and [d["q"] for d in first][:2] == ["QUESTION 0: PICK", "QUESTION 1: PICK"]
    tok = ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS)
    ctx = EvalContext(engine=ZeroModel(), reference=ZeroModel(), tokenizer=tok, corpus="", vocab_size=260,
                      batch_size=4, seed=0, cache={}, counters={})
    m, _ = run_eval("tasks", ctx, {"tasks": ["my_processed_qa"], "include_paths": [str(tmp_path)]})
    assert m["my_processed_qa.n"] == 6
