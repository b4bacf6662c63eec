"""Degeneration measures for long greedy generations (pure functions, no models).

Sequences are any lists of hashable items: token ids, words or characters.

* ``distinct_n(seq, n)`` = |unique n-grams| / |n-grams| (Li et al. 2016).
* ``rep_n(seq, n)`` = 1 - distinct_n: the fraction of n-grams that repeat an
  earlier n-gram of the same sequence (seq-rep-n, Welleck et al. 2019).
* ``detect_loop(seq)``: the smallest period p such that the tail of the
  sequence is periodic with period p (``seq[j] == seq[j + p]`` for every j from
  the onset on) over at least ``min_repeats`` periods and ``min_len`` items;
  returns (p, onset), or (0, len(seq)) when there is no loop. "abcabcabc" has
  period 3 from onset 0; "xyzabcabcabc" period 3 from onset 3.
* ``compression_ratio(data)`` = raw bytes / zlib-compressed bytes (level 9):
  about 2-3 for English text, much larger for loops.
* ``entropy_collapse`` compares the mean predictive entropy (nats; per step from
  `engine.generation.step_statistics`, with the top-1/top-2 margin) over the
  first and last windows.
* ``first_divergence(a, b)`` locates where two greedy decodes part.
"""

from __future__ import annotations

import math
import zlib
from typing import Hashable, Sequence

import numpy as np


def ngrams(seq: Sequence[Hashable], n: int) -> list[tuple]:
    """All contiguous n-grams of `seq` (empty when it is shorter than n)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]


def distinct_n(seq: Sequence[Hashable], n: int) -> float:
    """Unique n-grams over all n-grams; NaN when the sequence has no n-gram."""
    grams = ngrams(seq, n)
    return len(set(grams)) / len(grams) if grams else math.nan


def rep_n(seq: Sequence[Hashable], n: int) -> float:
    """Fraction of n-grams that repeat an earlier one (1 - distinct-n); NaN when there is no n-gram."""
    d = distinct_n(seq, n)
    return 1.0 - d if d == d else math.nan


def detect_loop(seq: Sequence[Hashable], min_repeats: int = 3, min_len: int = 1,
                max_period: int | None = None) -> tuple[int, int]:
    """(period, onset) of the repetition loop the sequence ends in, or (0, len(seq)) when there is none.

    For each candidate period p (smallest first), the onset is the first index
    from which ``seq[j] == seq[j + p]`` holds to the end; p is accepted when the
    periodic tail ``seq[onset:]`` spans at least ``min_repeats`` periods and
    ``min_len`` items.
    """
    if min_repeats < 2:
        raise ValueError(f"min_repeats must be >= 2 (one occurrence is not a loop), got {min_repeats}")
    n = len(seq)
    if n < 2:
        return 0, n
    ids = {}
    arr = np.fromiter((ids.setdefault(x, len(ids)) for x in seq), dtype=np.int64, count=n)
    top = min(max_period or n, n // min_repeats)
    for p in range(1, top + 1):
        mismatch = np.flatnonzero(arr[:-p] != arr[p:])  # positions j where seq[j] != seq[j+p]
        onset = int(mismatch[-1]) + 1 if mismatch.size else 0
        tail = n - onset
        if tail >= min_repeats * p and tail >= min_len:
            return p, onset
    return 0, n


def compression_ratio(data: bytes | str) -> float:
    """len(data) / len(zlib.compress(data, 9)); text is UTF-8 encoded first. 1.0 for empty data."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if not raw:
        return 1.0
    return len(raw) / len(zlib.compress(raw, 9))


def entropy_collapse(ent: Sequence[float], window: int) -> tuple[float, float, float]:
    """(mean entropy of the first `window` steps, of the last `window` steps, last / first).

    The window shrinks to half the sequence when the sequence is shorter than
    two windows; the ratio is NaN when the first window's entropy is 0.
    """
    e = np.asarray(ent, dtype=np.float64)
    if e.size == 0:
        return math.nan, math.nan, math.nan
    w = max(1, min(window, e.size // 2 or 1))
    first, last = float(e[:w].mean()), float(e[-w:].mean())
    return first, last, (last / first if first > 0 else math.nan)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (within the shorter length); None if none."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None
