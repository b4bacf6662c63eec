"""An `lm_eval` language model over the harness's narrow engine interface.

:class:`HarnessLM` wraps any object that offers ``logits(tokens)`` and
``generate(prompt, max_new_tokens, stop_ids)`` (the engine, the FP32
reference, a third-party engine) plus a tokenizer with the harness protocol
(``encode(text, bos, eos)``, ``decode(ids)``, ``bos_id``, ``eos_id``), so one
class serves both sides of every comparison and both see exactly the same
token sequences.

The three lm-eval request types:

* ``loglikelihood``: (context, continuation) pairs. The pair is tokenized as a
  whole and split where the context's own tokens end, so word-boundary merges
  look the same as in running text. Requests are deduplicated, sorted by
  length (longest first, so padding is small), right-padded to the longest
  sequence of the batch (a causal model's earlier positions never see the
  padding) and left-truncated to the model's maximum context.
* ``loglikelihood_rolling``: the whole text, in disjoint chunks of at most
  ``max_length`` predicted tokens; each chunk gets as much preceding context as
  fits (the last chunk a full window), so every token is scored exactly once.
* ``generate_until``: greedy decoding of all requests together (the model's
  ``generate_batch``: the engine's serving runtime, the reference's padded
  batches) with EOS as stop id; each text is cut at its first stop string.
  Generation also stops early at a token whose own text already contains a
  stop string (nothing after it can survive the cut), which is exact and saves
  decode steps.

A layer-streamed model (`evalharness.streamed`) gets all batches of a call at once (lm-eval hands over every
request of a task in one call): they go through the model in layer-major passes (`map_logits`), with the same
batches and the same bits per batch as the resident model's batch-by-batch calls.

Right padding matters for dynamically scaled recipes: padding tokens take part
in per-tensor activation scales exactly as in a real batched server, which is
why ``batch_size`` is a serving setting of the run.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from lm_eval.api.model import LM

from engine.generation import GenerationRequest
from evalharness.generation import generate_many
from evalharness.progress import Progress, no_bars
from evalharness.streamed import map_logits

log = logging.getLogger(__name__)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rolling_chunks(tokens: Sequence[int], prefix_id: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """Split a document into (context, continuation) pairs that score every token exactly once.

    ``full = [prefix_id] + tokens``; chunk k predicts ``tokens[a:b]`` with
    ``b - a <= max_length`` and gets the ``max_length`` tokens of ``full`` that
    precede each predicted token as context (fewer at the start of the text).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    full = [prefix_id] + list(tokens)
    out = []
    for a in range(0, len(tokens), max_length):
        b = min(a + max_length, len(tokens))
        start = max(0, b - max_length)  # model input is full[start:b], length <= max_length
        out.append((full[start:a + 1], full[a + 1:b + 1]))
    return out


class HarnessLM(LM):
    """lm-eval ``LM`` over an engine-interface model (engine or reference) and a harness tokenizer.

    Args:
        model: object with ``logits(tokens (batch, t) long) -> (batch, t, vocab)`` and
            ``generate_batch(requests, max_batch)`` or ``generate(prompt, max_new_tokens, stop_ids) -> list[int]``.
        tokenizer: harness tokenizer (``engine.tokenizer.Tokenizer`` protocol).
        batch_size: sequences per ``logits`` call and requests decoded together.
        max_length: longest model input in tokens; default ``model.max_seq_len`` or ``model.cfg.max_position``.
        max_gen_toks: default generation budget when a request does not set ``max_gen_toks``.
        name: label used in log messages and progress bars (``engine`` / ``reference``).
        progress: draws a bar per request kind (sequences scored, requests generated) on a terminal; default none.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, name: str = "model", progress: Progress | None = None):
        """Wrap `model` and `tokenizer`; see the class doc for the arguments."""
        super().__init__()
        if tokenizer is None:
            raise ValueError(f"{name}: lm-eval tasks need a tokenizer; the model has none (set 'tokenizer' "
                             "in the suite's model entry)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tok = tokenizer
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or getattr(model, "max_seq_len", None) or model.cfg.max_position)
        self.max_gen_toks = int(max_gen_toks)
        self.name = name
        self.progress = progress if progress is not None else no_bars()
        self.prefix_id = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else (self.prefix_id or 0)
        self.counters = {"forward_batches": 0, "sequences": 0, "generate_calls": 0, "generated_tokens": 0,
                         "truncated_continuations": 0}
        self.stream_counters: dict[str, int] = {}  # a layer-streamed model's checkpoint bytes read and stages run
        self._stop_token_cache: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._vocab_text: list[str] | None = None

    # ------------------------------------------------------------------ tokenization

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation); the continuation keeps the context's trailing whitespace.

        The concatenation is encoded once and split after the longest prefix it
        shares with the context's own encoding (BOS first when the tokenizer has
        one). An empty context becomes the prefix token (BOS, else EOS).
        """
        stripped = context.rstrip()
        if stripped != context:
            continuation = context[len(stripped):] + continuation
            context = stripped
        if not context:
            cont = self.tok.encode(continuation, bos=False, eos=False)
            if self.prefix_id is None:
                if len(cont) < 2:
                    raise ValueError("empty context, one-token continuation and a tokenizer without BOS/EOS: "
                                     "nothing to condition on")
                return cont[:1], cont[1:]
            return [self.prefix_id], cont
        whole = self.tok.encode(context + continuation, bos=True, eos=False)
        ctx = self.tok.encode(context, bos=True, eos=False)
        split = _common_prefix(whole, ctx)
        if continuation and split >= len(whole):
            split = len(whole) - 1  # continuation absorbed into the context's last token: score that token
        split = max(split, 1)
        return whole[:split], whole[split:]

    # ------------------------------------------------------------------ scoring

    def score_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, continuation is the greedy one) for each (context, continuation) pair.

        Identical token sequences are computed once. Each input is
        ``(context + continuation)[:-1]``, left-truncated to ``max_length``; of a
        continuation longer than ``max_length`` only the last ``max_length``
        tokens are scored (counted in ``counters["truncated_continuations"]``).
        """
        keys: list[tuple[tuple[int, ...], int]] = []
        for ctx, cont in pairs:
            if not cont:
                keys.append(((), 0))
                continue
            if not ctx:
                raise ValueError(f"{self.name}: a continuation needs at least one context token")
            full = tuple(int(t) for t in list(ctx) + list(cont))
            n = len(cont)
            if n > self.max_length:  # only the last max_length tokens fit in one window; both models alike
                n = self.max_length
                self.counters["truncated_continuations"] += 1
                if self.counters["truncated_continuations"] == 1:
                    log.warning("%s: a continuation of %d tokens exceeds the context (%d); only its last %d "
                                "tokens are scored", self.name, len(cont), self.max_length, n)
            keys.append((full[-(self.max_length + 1):], n))
        unique = sorted({k for k in keys if k[1] > 0}, key=lambda k: (-len(k[0]), k))
        results: dict[tuple[tuple[int, ...], int], tuple[float, bool]] = {((), 0): (0.0, True)}
        bar = self.progress.bar(total=len(unique), desc=f"{self.name} loglikelihood", unit="seq")

        def inputs():
            """(first, (batch, t) right-padded inputs, the batch's keys) per batch of `batch_size` sequences."""
            for s in range(0, len(unique), self.batch_size):
                batch = unique[s:s + self.batch_size]
                width = max(len(full) - 1 for full, _ in batch)
                inp = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # (batch, t), right-padded
                for i, (full, _) in enumerate(batch):
                    inp[i, :len(full) - 1] = torch.tensor(full[:-1], dtype=torch.long)
                yield s, inp, batch

        def reduce(logits: torch.Tensor, item: tuple) -> None:
            """Each sequence's continuation log-likelihood and greedy flag from its batch's logits."""
            batch = item[2]
            self.counters["forward_batches"] += 1
            self.counters["sequences"] += len(batch)
            # All continuation positions of the batch at once (few large ops instead of many small ones).
            seq_idx, pos_idx, target = [], [], []
            for i, (full, n) in enumerate(batch):
                end = len(full) - 1
                seq_idx += [i] * n
                pos_idx += range(end - n, end)  # positions whose next-token prediction is a continuation token
                target += full[-n:]
            # The softmax runs where the logits are (a GPU's (scored, vocab) rows are megabytes a batch):
            # only two numbers per scored token come back; the per-sequence sums run on the host, in a
            # fixed order (a GPU's index_add_ of floats is atomic: its rounding would vary run to run).
            dev = logits.device
            rows = logits[torch.tensor(seq_idx, device=dev), torch.tensor(pos_idx, device=dev)]
            rows = rows.double()  # (scored, vocab)
            tgt = torch.tensor(target, dtype=torch.long, device=dev)
            token_lp = torch.log_softmax(rows, dim=-1).gather(-1, tgt[:, None])[:, 0]  # (scored,)
            miss = (rows.argmax(-1) != tgt).double()  # (scored,) 1 where greedy decoding disagrees
            token_lp, miss = torch.stack((token_lp, miss)).cpu()  # (2, scored) -> two (scored,)
            segs = torch.tensor(seq_idx, dtype=torch.long)
            ll = torch.zeros(len(batch), dtype=torch.float64).index_add_(0, segs, token_lp).tolist()
            misses = torch.zeros(len(batch), dtype=torch.float64).index_add_(0, segs, miss).tolist()
            for i, k in enumerate(batch):
                results[k] = (ll[i], misses[i] == 0)
            bar.update(len(batch))

        # a resident model scores batch by batch; a layer-streamed one all batches in layer-major passes
        map_logits(self.model, inputs(), reduce, self.stream_counters)
        bar.close()
        return [results[k] for k in keys]

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval: log P(continuation | context) and whether greedy decoding would produce it."""
        pairs = [self.encode_pair(*req.args[:2]) for req in requests]
        out = self.score_tokens(pairs)
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """lm-eval: total log-likelihood of each text, conditioned on the prefix token only."""
        if self.prefix_id is None:
            raise ValueError(f"{self.name}: rolling log-likelihood needs a BOS or EOS token to condition on")
        spans, pairs = [], []
        for req in requests:
            tokens = self.tok.encode(req.args[0], bos=False, eos=False)
            chunks = rolling_chunks(tokens, self.prefix_id, self.max_length)
            spans.append((len(pairs), len(pairs) + len(chunks)))
            pairs.extend(chunks)
        scored = self.score_tokens(pairs)
        out = [float(sum(ll for ll, _ in scored[a:b])) for a, b in spans]
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    # ------------------------------------------------------------------ generation

    def _stop_token_ids(self, until: tuple[str, ...]) -> tuple[int, ...]:
        """EOS plus every token whose own text contains one of the stop strings (cached per stop set)."""
        if until not in self._stop_token_cache:
            ids = {self.tok.eos_id} if self.tok.eos_id is not None else set()
            if until:
                if self._vocab_text is None:
                    self._vocab_text = [self.tok.decode([i]) for i in range(int(self.tok.vocab_size))]
                ids |= {i for i, text in enumerate(self._vocab_text) if any(s in text for s in until)}
            self._stop_token_cache[until] = tuple(sorted(ids))
        return self._stop_token_cache[until]

    def _decode_continuation(self, anchor: list[int], out: list[int]) -> str:
        """Text of `out` as it reads after `anchor` (the last prompt token).

        Sentencepiece-style decoders drop the leading space of the first piece
        of a text; decoding the anchor with the continuation and removing the
        anchor's own text keeps that space (" 42" stays " 42").
        """
        whole, head = self.tok.decode(anchor + out), self.tok.decode(anchor)
        return whole[len(head):] if whole.startswith(head) else self.tok.decode(out)

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """lm-eval: greedy generation per request until a stop string, EOS or ``max_gen_toks``.

        The distinct requests are decoded together (`evalharness.generation.generate_many`: the engine's serving
        runtime, the reference's padded batches), each with its own budget and stop tokens; each text is cut
        before its first stop string."""
        keys: list[tuple[str, tuple[str, ...], int]] = []
        warned = False
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] or {})
            until = kwargs.pop("until", None)
            if until is None:
                until = [self.tok.decode([self.tok.eos_id])] if self.tok.eos_id is not None else []
            elif isinstance(until, str):
                until = [until]
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            if kwargs.get("do_sample") and not warned:
                log.warning("%s: do_sample requested; the harness decodes greedily (deterministic comparison)",
                            self.name)
                warned = True
            keys.append((context, tuple(s for s in until if s), max_gen))
        unique = list(dict.fromkeys(keys))
        prompts, gen_reqs = [], []
        for context, until, max_gen in unique:
            prompt = self.tok.encode(context, bos=True, eos=False)
            prompt = prompt[-max(1, self.max_length - max_gen):]
            prompts.append(prompt)
            gen_reqs.append(GenerationRequest(tuple(prompt), max_gen, self._stop_token_ids(until)))
        texts: dict[tuple[str, tuple[str, ...], int], str] = {}
        # the bar counts the requests as they finish (the serving runtime decodes them together)
        with self.progress.bar(total=len(unique), desc=f"{self.name} generate_until", unit="req") as bar:
            gens = generate_many(self.model, gen_reqs, self.batch_size, on_done=bar.update)
        for key, prompt, gen in zip(unique, prompts, gens):
            self.counters["generate_calls"] += 1
            self.counters["generated_tokens"] += len(gen.tokens)
            text = self._decode_continuation(prompt[-1:], gen.tokens)
            cut = min((i for i in (text.find(s) for s in key[1]) if i >= 0), default=len(text))
            texts[key] = text[:cut]
        out = [texts[k] for k in keys]
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records about the model."""
        return {"harness_model": self.name, "max_length": self.max_length, "batch_size": self.batch_size}
