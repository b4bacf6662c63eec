"""Layer-streamed lm-eval log-likelihoods and longctx's KLD by position: the resident metrics and samples bit for bit;
generating tasks and parts are not run on a streamed model, the others are, and the run is an error naming them."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from engine.api import Engine  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.model import Transformer  # noqa: E402
from engine.streaming import LayerStore, StreamedEngine, stages  # noqa: E402
from engine.tokenizer import ByteTokenizer  # noqa: E402
from evalharness.errors import PartlyRunError  # noqa: E402
from evalharness.evals import EvalContext, run_eval  # noqa: E402
from evalharness.lm_adapter import HarnessLM  # noqa: E402
from evalharness.reference import ReferenceLM  # noqa: E402
from evalharness.streamed_reference import StreamedReference  # noqa: E402
from tests.conftest import write_random_llama  # noqa: E402

BOS, EOS = 256, 257


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(resident (engine, reference), streamed (engine, reference), corpus path) of a random byte-level Llama."""
    folder = tmp_path_factory.mktemp("streamed-evals")
    d = write_random_llama(folder / "m", seed=3, vocab_size=260, max_position_embeddings=64, bos_token_id=BOS,
                           eos_token_id=EOS)
    loaded = load_model(str(d))
    store = LayerStore.open(str(d))
    g = torch.Generator().manual_seed(0)
    corpus = folder / "tokens.json"
    corpus.write_text(json.dumps({"vocab_size": 260, "tokens": torch.randint(0, 256, (400,), generator=g).tolist()}))
    resident = (Engine(Transformer(loaded.cfg, loaded.weights), "fp8-block"), ReferenceLM(loaded))
    streamed = (StreamedEngine(store, "fp8-block"), StreamedReference(store))
    return resident, streamed, str(corpus), loaded.sha256


def _ctx(models, corpus, sha) -> EvalContext:
    engine, reference = models
    return EvalContext(engine=engine, reference=reference, tokenizer=ByteTokenizer(vocab_size=260, bos_id=BOS,
                                                                                   eos_id=EOS),
                       corpus=corpus, vocab_size=260, batch_size=2, seed=0, cache={}, counters={}, bos_id=BOS,
                       model_sha=sha)


def _tasks(folder) -> dict:
    """A user task folder (include_paths, local JSON): a two-choice task and a generating one."""
    rows = [{"q": f"Question {i}: is {i} even?", "choices": [" yes", " no"], "gold": i % 2, "a": str(i)}
            for i in range(5)]
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    data = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\ntest_split: test\n"
    (folder / "mc.yaml").write_text(
        "task: streamed_mc\n" + data + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_target: gold\n"
        "doc_to_choice: choices\nmetric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n")
    (folder / "gen.yaml").write_text(
        "task: streamed_gen\n" + data + "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "generation_kwargs: {until: ['\\n'], max_gen_toks: 4}\n"
        "metric_list:\n  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n")
    return {"include_paths": [str(folder)]}


def test_streamed_loglikelihood_task_equals_resident_and_generating_task_is_named(tiny, tmp_path):
    """The tasks eval on a streamed model: the log-likelihood task's metrics and samples equal the resident run's
    bit for bit; the generating task of the same eval is not run, and the PartlyRunError names it, the memory
    generation needs and the multi-GPU route, carrying the other task's results."""
    resident, streamed, corpus, sha = tiny
    cfg = _tasks(tmp_path)
    m_res, s_res = run_eval("tasks", _ctx(resident, corpus, sha), dict(cfg, tasks=["streamed_mc"]))
    ctx = _ctx(streamed, corpus, sha)
    with pytest.raises(PartlyRunError, match=r"'streamed_gen' was not run \(generate_until: streamed_gen\).*GiB.*"
                                             r"tensor / expert parallelism") as err:
        run_eval("tasks", ctx, dict(cfg, tasks=["streamed_gen", "streamed_mc"]))
    assert err.value.metrics == m_res and err.value.samples == s_res
    assert m_res["streamed_mc.n"] == 5 and m_res["streamed_mc.ll_absdiff_mean"] > 0  # fp8-block differs
    # one layer-major pass of the engine and one of the reference: every stage once each
    assert ctx.counters["streamed_stages"] == 2 * len(stages(streamed[0].cfg)) and ctx.counters["streamed_bytes_read"]


def test_streamed_adapter_scores_in_passes_bit_for_bit(tiny):
    """HarnessLM's loglikelihood and loglikelihood_rolling over a streamed engine, in several passes of at most
    `pass_tokens` tokens (the memory plan's), give the resident engine's numbers exactly."""
    (engine, _), (streamed, _), _, _ = tiny
    tok = ByteTokenizer(vocab_size=260, bos_id=BOS, eos_id=EOS)
    pairs = [("The cat sat on the", " mat"), ("Question: 2+2=?\nAnswer:", " 4"), ("", "hello world"),
             ("x" * 90, " left-truncated context"), ("a b", " c d e")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=0) for p in pairs]
    rolling = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=0)
               for t in ("short text", "y" * 150)]
    lm_res, lm_str = HarnessLM(engine, tok, batch_size=2), HarnessLM(streamed, tok, batch_size=2)
    streamed.pass_tokens = 100
    try:
        assert lm_str.loglikelihood(reqs) == lm_res.loglikelihood(reqs)
        passes = lm_str.stream_counters["streamed_stages"] // len(stages(streamed.cfg))
        assert passes >= 2 and lm_str.counters == lm_res.counters
        assert lm_str.loglikelihood_rolling(rolling) == lm_res.loglikelihood_rolling(rolling)
    finally:
        streamed.pass_tokens = None


def test_streamed_longctx_kld_equals_resident_and_generating_parts_are_named(tiny):
    """longctx on a streamed model: the KLD-by-position metrics and samples equal the resident run's bit for bit;
    degeneration and passkey are not run, named in the PartlyRunError that carries the KLD part's results."""
    resident, streamed, corpus, sha = tiny
    cfg = {"kld_docs": 3, "kld_seq_len": 24, "kld_buckets": 4}
    m_res, s_res = run_eval("longctx", _ctx(resident, corpus, sha), dict(cfg, parts=["kld"]))
    m_str, s_str = run_eval("longctx", _ctx(streamed, corpus, sha), dict(cfg, parts=["kld"]))
    assert m_str == m_res and s_str == s_res and m_res["kld_mean"] > 0
    with pytest.raises(PartlyRunError, match=r"longctx: part\(s\) \['degeneration', 'passkey'\] were not run") as err:
        run_eval("longctx", _ctx(streamed, corpus, sha), cfg)
    assert err.value.metrics == m_res and err.value.samples == s_res
    topk = dict(cfg, parts=["kld"], ref_topk=8)  # the reference as top-k records
    assert run_eval("longctx", _ctx(streamed, corpus, sha), topk) == run_eval("longctx", _ctx(resident, corpus, sha),
                                                                              topk)


@pytest.mark.slow
def test_streamed_suite_runs_the_other_tasks_and_errors_naming_the_generating_one(tmp_path):
    """A suite run of a streamed model asking for a log-likelihood task, a generating task and ppl_kld: the result
    is an error (bad input) naming the generating task, with the other task's and ppl_kld's metrics kept; the
    suite goes on."""
    from evalharness import runner
    from evalharness.results import load_result
    from evalharness.suite import load_suite

    _tasks(tmp_path)
    model = write_random_llama(tmp_path / "m", seed=1, vocab_size=256, max_position_embeddings=64)
    corpus = tmp_path / "tokens.json"
    corpus.write_text(json.dumps({"vocab_size": 256, "tokens": list(range(3, 256)) * 2}))
    (tmp_path / "s.yaml").write_text(
        f"name: t\nmodels: [{{name: tiny, path: '{model}', tokenizer: bytes}}]\n"
        f"corpus: '{corpus}'\nrecipes: [fp8-block]\nserving: [{{name: default, batch_size: 2}}]\n"
        "execution: streamed\n"
        f"evals: {{tasks: {{tasks: [streamed_mc, streamed_gen], include_paths: ['{tmp_path}'], limit: 3}}, "
        "ppl_kld: {seq_len: 16, max_windows: 2}}\n")
    lines: list[str] = []
    (outcome,) = runner.run_suite(load_suite(tmp_path / "s.yaml"), tmp_path / "out", log=lines.append)
    doc = load_result(outcome.path)
    assert outcome.status == "error" and outcome.bad_input and doc["error"]["bad_input"]
    assert "tasks: tasks eval: 'streamed_gen' was not run" in doc["error"]["message"]
    assert doc["metrics"]["tasks.streamed_mc.n"] == 3 and "ppl_kld.kld_mean" in doc["metrics"]
    assert not any(k.startswith("tasks.streamed_gen.") for k in doc["metrics"])
    assert any("memory plan: streamed" in s for s in lines)
