"""Bounded memory on big inputs. Row of the fault table: a 50 MB one-line corpus with `max_windows: 2` was read
and tokenized whole (1.65 GB peak RSS). Corpora are now read and tokenized only as far as the windows need."""

from __future__ import annotations

import tracemalloc

from engine.tokenizer import Llama2cTokenizer
from evalharness.data import load_corpus_tokens
from evalharness.evals import EvalContext
from tests.faults.support import llama2c_tokenizer

MB = 2**20


def _one_line_corpus(path, size: int):
    """`size` bytes of words on a single line (no newline anywhere)."""
    block = ("the cat sat on a mat and then it ran home " * 2000).encode()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
    return path


def test_fifty_mb_one_line_corpus_for_two_windows(tmp_path):
    """Two 128-token windows of a 50 MB single-line corpus: the Python memory peak of tokenizing stays below 16 MiB
    (the reader holds one 1 MiB block and one bounded line part; the whole file as text would be 50 MiB and its
    token list another 400 MiB), and the windows are the corpus's first tokens."""
    corpus = _one_line_corpus(tmp_path / "big.txt", 50 * MB)
    tok = Llama2cTokenizer(llama2c_tokenizer(tmp_path / "t.bin"))
    ctx = EvalContext(engine=None, reference=None, tokenizer=tok, corpus=str(corpus), vocab_size=tok.vocab_size,
                      batch_size=1, seed=0, cache={}, bos_id=tok.bos_id)
    tracemalloc.start()
    try:
        win = ctx.windows(128, None, 2, 200_000, True)  # ppl_kld's default max_tokens
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MB, f"{peak / MB:.1f} MiB"
    assert win.n == 2
    head = tok.encode(corpus.read_bytes()[:4096].decode().rsplit(" ", 1)[0], bos=False)
    assert win.inputs[0, 1:64].tolist() == head[:63]  # BOS, then the stream from its start


def test_more_windows_read_further_and_agree_with_a_full_read(tmp_path):
    """A later request for more windows reads further; its tokens extend the first read's (same chunking), and
    equal a read that asked for that many tokens at once."""
    corpus = _one_line_corpus(tmp_path / "c.txt", 4 * MB)
    tok = Llama2cTokenizer(llama2c_tokenizer(tmp_path / "t.bin"))
    few = load_corpus_tokens(str(corpus), tok, tok.vocab_size, 300)
    many = load_corpus_tokens(str(corpus), tok, tok.vocab_size, 50_000)
    assert len(few) == 300 and len(many) == 50_000 and many[:300] == few
    ctx = EvalContext(engine=None, reference=None, tokenizer=tok, corpus=str(corpus), vocab_size=tok.vocab_size,
                      batch_size=1, seed=0, cache={}, bos_id=tok.bos_id)
    a = ctx.windows(64, None, 2, 200_000, True)
    b = ctx.windows(64, None, 40, 200_000, True)
    assert b.n == 40 and b.inputs[:2].tolist() == a.inputs.tolist()
    assert b.inputs[:, 1:].reshape(-1).tolist() == many[: 40 * 63]
