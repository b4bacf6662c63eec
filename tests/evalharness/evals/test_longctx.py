"""The `longctx` eval: degeneration measures on constructed sequences with known answers, first-divergence
classification and passkey scoring with scripted models, KLD by position, the reference cache, and a passkey
run on a real trained model where the fp32 engine must equal the reference exactly."""

from __future__ import annotations

import math
import re

import pytest
import torch

from engine.api import Engine
from engine.loading import load_model
from engine.model import Transformer
from engine.tokenizer import ByteTokenizer, load_tokenizer
from evalharness.errors import DataError
from evalharness.evals import EvalContext, run_eval
from engine.generation import step_statistics
from evalharness.evals.degeneration import (compression_ratio, detect_loop, distinct_n, entropy_collapse,
                                            first_divergence, rep_n)
from evalharness.evals.longctx import (PASSKEY_NEEDLE, PASSKEY_QUESTION, passkey_prompt, run_degeneration,
                                       run_kld_by_position, run_passkey)
from evalharness.reference import ReferenceLM
from tests.conftest import REPO, write_random_llama

BOS, EOS = 256, 257
SETTINGS = {"parts": None, "new_tokens": 20, "prompt_lens": [8], "prompts_per_len": 1, "entropy_window": 4,
            "loop_min_len": 6, "tie_margin": 0.5, "passkey_lens": None, "passkey_depths": [0.0, 0.5, 1.0],
            "passkey_trials": 2, "kld_docs": 2, "kld_seq_len": None, "kld_buckets": 4, "max_tokens": 200_000,
            "bos": True}


# --------------------------------------------------------------------------- pure measures

def test_distinct_and_rep_known_values():
    """distinct-1 of 'a a a b' = 2/4, rep-2 = 1 - 2/3; 'abcabcabc' bigrams: 8 of which 3 unique."""
    words = "a a a b".split()
    assert distinct_n(words, 1) == 2 / 4
    assert rep_n(words, 2) == pytest.approx(1 - 2 / 3)
    assert rep_n("abcabcabc", 2) == pytest.approx(5 / 8)
    assert rep_n("abcdefgh", 4) == 0.0 and distinct_n("abcdefgh", 3) == 1.0
    assert math.isnan(distinct_n("ab", 3))


def test_detect_loop_period_and_onset():
    """Smallest period of the repeating tail and where it starts; no loop -> (0, len)."""
    assert detect_loop("abcabcabc") == (3, 0)
    assert detect_loop("xyzabcabcabc") == (3, 3)
    assert detect_loop("aaaa") == (1, 0)
    assert detect_loop(list("qwertyuiop")) == (0, 10)
    assert detect_loop("hello world abab") == (0, 16)  # 'abab' is only two periods (min_repeats=3)
    assert detect_loop("hello world ababab") == (2, 12)
    assert detect_loop("hello world ababab", min_len=8) == (0, 18)
    assert detect_loop([7, 1, 2, 3, 4] + [5, 6] * 10) == (2, 5)


def test_compression_entropy_divergence_margin():
    """zlib ratio is large for loops and ~1 for random bytes; entropy of uniform logits is log V;
    collapse compares windows; first divergence and the top-1/top-2 margin."""
    assert compression_ratio("abc" * 300) > 20 > 1.5 > compression_ratio(bytes(range(256)))
    ent, _ = step_statistics(torch.zeros(3, 50))
    assert torch.allclose(ent, torch.full((3,), math.log(50), dtype=torch.float64))
    assert entropy_collapse([2.0, 2.0, 1.0, 0.5], window=2) == (2.0, 0.75, 0.375)
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2, 3]) is None
    assert step_statistics(torch.tensor([[0.0, 3.0, 1.0, 2.5]]))[1].item() == pytest.approx(0.5)


# --------------------------------------------------------------------------- scripted models

class Scripted:
    """Engine-interface stand-in: a fixed greedy output with chosen top-1/top-2 margins per step."""

    max_seq_len = 64

    def __init__(self, tokens: list[int], margins: list[float], vocab: int = 300):
        """Script the output tokens and the top-1/top-2 margin of each step."""
        self.tokens, self.margins, self.vocab = tokens, margins, vocab

    def generate(self, prompt, max_new_tokens, stop_ids=(), return_logits=False):
        """The scripted tokens; logits put the token first and another one `margin` below it."""
        out = self.tokens[:max_new_tokens]
        logits = torch.zeros(len(out), self.vocab)
        for i, t in enumerate(out):
            logits[i, t] = 5.0
            logits[i, (t + 1) % self.vocab] = 5.0 - self.margins[i]
        return (out, logits) if return_logits else out


def _ctx(engine, reference, tokenizer=None, corpus="builtin:tiny-llama", vocab=None, cache=None, counters=None):
    """An EvalContext over the given models."""
    if vocab is None:
        import json

        from evalharness.data import builtin_path

        vocab = json.loads((builtin_path("tiny-llama") / "config.json").read_text())["vocab_size"]
    return EvalContext(engine=engine, reference=reference, tokenizer=tokenizer, corpus=corpus, vocab_size=vocab,
                       batch_size=2, seed=0, cache={} if cache is None else cache,
                       counters={} if counters is None else counters,
                       bos_id=tokenizer.bos_id if tokenizer is not None else 1)


def test_first_divergence_near_tie_vs_real_error():
    """The engine departs at step 7, where the reference's margin is 0.3: a near-tie under tie_margin 0.5,
    a real error under 0.1. The reference loops with period 3 from the start; the engine does not loop."""
    ref_tokens = [10, 11, 12] * 7
    eng_tokens = ref_tokens[:7] + list(range(40, 54))
    margins = [2.0] * 21
    margins[7] = 0.3
    ref, eng = Scripted(ref_tokens, margins), Scripted(eng_tokens, [1.0] * 21)
    m, s = run_degeneration(_ctx(eng, ref), SETTINGS)
    assert m["div_frac"] == 1.0 and m["div_index_mean"] == 7.0 and s["div_index"] == [7]
    assert m["div_near_tie"] == 1.0 and m["div_real_error"] == 0.0 and s["div_kind"] == ["near_tie"]
    assert s["div_ref_margin"] == [pytest.approx(0.3)] and s["div_eng_margin"] == [pytest.approx(1.0)]
    assert (m["loop_ref"], m["loop_period_ref"], m["loop_onset_ref"]) == (1.0, 3.0, 0.0)
    assert (m["loop_eng"], m["loop_onset_eng"]) == (0.0, 20.0)
    assert m["rep2_ref"] == pytest.approx(1 - 3 / 19) and m["rep2_eng"] == pytest.approx(3 / 19)
    assert m["compression_ref"] > m["compression_eng"]
    m2, s2 = run_degeneration(_ctx(eng, ref), dict(SETTINGS, tie_margin=0.1))
    assert s2["div_kind"] == ["real_error"] and m2["div_real_error_frac"] == 1.0
    m3, _ = run_degeneration(_ctx(ref, ref), SETTINGS)
    assert m3["div_frac"] == 0.0 and m3["div_index_mean"] == 20.0 and m3["rep4_eng"] == m3["rep4_ref"]


class PasskeyReader:
    """Engine-interface stand-in that answers with the first number of its prompt (optionally a wrong one
    when the needle sits in the middle)."""

    max_seq_len = 2000

    def __init__(self, tokenizer, wrong_in_middle: bool = False):
        """Read with `tokenizer`; answer wrongly in the middle when asked."""
        self.tok, self.wrong = tokenizer, wrong_in_middle

    def generate(self, prompt, max_new_tokens, stop_ids=(), return_logits=False):
        """' NNNNN.' read from the prompt; '00000' for a needle in the middle third when `wrong_in_middle`."""
        text = self.tok.decode(prompt)
        m = re.search(r"\d{5}", text)
        key = m.group(0)
        if self.wrong and 0.3 < m.start() / len(text) < 0.7:
            key = "00000"
        return self.tok.encode(f" {key}.", bos=False)[:max_new_tokens]


def test_passkey_prompt_and_scoring():
    """Prompts fill the length with whole filler sentences, put the needle at the requested depth and end with
    the question; accuracy per (L, d) with Wilson intervals; a model wrong at mid depth shows up in that cell."""
    tok = ByteTokenizer(vocab_size=300, bos_id=BOS, eos_id=EOS)
    for depth in (0.0, 0.5, 1.0):
        ids = passkey_prompt(tok, 1000, depth, "12345")
        text = tok.decode(ids)
        assert 1000 - 100 < len(ids) <= 1000 and ids[0] == BOS and text.endswith(PASSKEY_QUESTION)
        pos = text.index(PASSKEY_NEEDLE.format(key="12345")) / len(text)
        assert abs(pos - (0.15 + 0.8 * depth)) < 0.15, (depth, pos)
    good, bad = PasskeyReader(tok), PasskeyReader(tok, wrong_in_middle=True)
    m, s = run_passkey(_ctx(bad, good, tokenizer=tok), dict(SETTINGS, passkey_lens=[1000, 1990]))
    assert m["passkey_n"] == 12 and m["passkey_acc_ref"] == 1.0
    for length in (1000, 1990):
        assert m[f"passkey.L{length}.d0.acc_eng"] == 1.0 and m[f"passkey.L{length}.d100.acc_eng"] == 1.0
        assert m[f"passkey.L{length}.d50.acc_eng"] == 0.0 and m[f"passkey.L{length}.d50.acc_ref"] == 1.0
        assert m[f"passkey.L{length}.d50.acc_eng_hi"] < 0.9
    assert m["passkey_acc_eng"] == pytest.approx(8 / 12) and m["passkey_agree"] == pytest.approx(8 / 12)
    assert s["passkey_correct_ref"] == [1] * 12 and sum(s["passkey_correct_eng"]) == 8
    assert len(set(s["passkey_prompt_tokens"])) > 1  # different random keys and depths
    # Default lengths: a quarter, half and all of the context minus the answer budget (8 tokens).
    m, _ = run_passkey(_ctx(good, good, tokenizer=tok), dict(SETTINGS, passkey_trials=1))
    assert {k for k in m if k.endswith("d50.acc_eng")} == {f"passkey.L{n}.d50.acc_eng" for n in (498, 996, 1992)}
    small = PasskeyReader(tok)
    small.max_seq_len = 200  # shorter than the bare prompt in bytes
    with pytest.raises(DataError, match="bare passkey prompt"):
        run_passkey(_ctx(small, small, tokenizer=tok), SETTINGS)


# --------------------------------------------------------------------------- real models

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base Transformer, reference, byte tokenizer, corpus path) of a random Llama with a 512-token context."""
    root = tmp_path_factory.mktemp("lc")
    d = write_random_llama(root / "m", seed=7, vocab_size=260, max_position_embeddings=512, bos_token_id=BOS,
                           eos_token_id=EOS)
    corpus = root / "corpus.txt"
    corpus.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 20)
    loaded = load_model(str(d))
    return Transformer(loaded.cfg, loaded.weights), ReferenceLM(loaded), ByteTokenizer(260, BOS, EOS), str(corpus)


class GrowingNoise:
    """Engine stand-in: the reference's logits plus noise whose scale grows linearly with position."""

    def __init__(self, ref):
        """Perturb the logits of `ref`."""
        self.ref, self.cfg = ref, ref.cfg

    def logits(self, tokens, tap=None):
        """Reference logits + N(0, (0.02 * position)^2)."""
        z = self.ref.logits(tokens)
        pos = torch.arange(z.shape[1], dtype=torch.float32)[None, :, None]
        return z + torch.randn(z.shape, generator=torch.Generator().manual_seed(0)) * 0.02 * pos


def test_kld_by_position_sees_growing_error(tiny):
    """fp32 engine: KLD ~0 everywhere; error growing with position: growth >> 1 and a positive slope."""
    base, ref, tok, corpus = tiny
    cfg = dict(SETTINGS, kld_buckets=4, kld_seq_len=128)
    m, s = run_kld_by_position(_ctx(Engine(base, "fp32"), ref, tok, corpus, 260), cfg)
    assert m["kld_seq_len"] == 128 and m["kld_docs"] == 2 and s["kld_bucket_edges"] == [0, 32, 64, 96, 128]
    assert m["kld_mean"] <= 1e-8 and len(s["kld_by_position"]) == 128
    m, s = run_kld_by_position(_ctx(GrowingNoise(ref), ref, tok, corpus, 260), cfg)
    assert m["kld_growth"] > 10 and m["kld_slope_per_1k"] > 0
    assert m["kld_bucket0"] < m["kld_bucket1"] < m["kld_bucket2"] < m["kld_bucket3"] == m["kld_last"]
    assert len(s["kld_last_bucket_docs"]) == 2


def test_longctx_eval_reuses_reference_across_recipes(tiny):
    """All parts for two recipes sharing the cache: the reference runs once per part; fp32 equals it exactly."""
    base, ref, tok, corpus = tiny
    cache, counters = {}, {}
    cfg = dict(new_tokens=16, prompt_lens=[24, 100], prompts_per_len=1, passkey_lens=[400],
               passkey_depths=[0.0, 1.0], passkey_trials=1, kld_docs=1, kld_seq_len=256, kld_buckets=2)
    out = {}
    for recipe in ("fp32", "bf16"):
        out[recipe] = run_eval("longctx", _ctx(Engine(base, recipe), ref, tok, corpus, 260, cache, counters), cfg)
        assert counters["reference_passes"] == 3
    assert counters["reference_cache_hits"] == 3
    m, s = out["fp32"]
    assert m["new_tokens"] == 16 and m["n_prompts"] == 2 and s["prompt_len"] == [24, 100]
    assert m["div_frac"] == 0.0 and m["rep2_eng"] == m["rep2_ref"] and m["passkey_agree"] == 1.0
    assert m["kld_mean"] <= 1e-8 < out["bf16"][0]["kld_mean"]


@pytest.mark.slow
def test_passkey_zoo_llama_fp32_engine_equals_reference():
    """A really trained model (zoo-llama, in the repo): the fp32 engine's passkey answers equal the reference's."""
    path = REPO / "zoo" / "zoo-llama"
    if not (path / "model.safetensors").is_file():
        pytest.skip("zoo/zoo-llama is not in this checkout")
    loaded = load_model(str(path))
    tok = load_tokenizer(None, loaded.directory)
    eng, ref = Engine(Transformer(loaded.cfg, loaded.weights), "fp32"), ReferenceLM(loaded)
    ctx = _ctx(eng, ref, tok, str(path / "heldout_sample.json"), loaded.cfg.vocab_size)
    m, s = run_passkey(ctx, dict(SETTINGS, passkey_lens=[96], passkey_depths=[0.0, 1.0], passkey_trials=1))
    assert m["passkey_n"] == 2 and m["passkey_agree"] == 1.0
    assert s["passkey_correct_eng"] == s["passkey_correct_ref"]
    assert m["passkey_acc_eng"] == m["passkey_acc_ref"] and m["passkey_mcnemar_p"] == 1.0
