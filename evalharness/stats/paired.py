"""Paired comparisons of per-sample correctness of two systems on the same items
(a = baseline/reference, b = candidate): McNemar, paired bootstrap, flip rates."""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats as _st

from ._util import as_1d, as_binary, check_alpha, check_same_length, to_float, to_int
from .intervals import binomial_ci, bootstrap_ci

__all__ = ["mcnemar_exact", "paired_bootstrap_delta", "flip_rates", "discordance_rate",
           "discordant_counts"]


def discordant_counts(a_correct: Any, b_correct: Any) -> dict:
    """2x2 paired table of correctness.

    ``n11`` both correct, ``n00`` both wrong, ``n10`` a correct & b wrong
    (correct -> wrong), ``n01`` a wrong & b correct (wrong -> correct), ``n`` total.
    Inputs are booleans or 0/1 numbers, one per item, same order.
    """
    a = as_binary(a_correct, "a_correct")
    b = as_binary(b_correct, "b_correct")
    check_same_length(a, b, "a_correct and b_correct")
    return {"n11": to_int(np.count_nonzero(a & b)), "n00": to_int(np.count_nonzero(~a & ~b)),
            "n10": to_int(np.count_nonzero(a & ~b)), "n01": to_int(np.count_nonzero(~a & b)),
            "n": to_int(a.shape[0])}


def discordance_rate(a_correct: Any, b_correct: Any) -> float:
    """Observed discordant-pair rate ``psi = (n01 + n10) / n`` (input to the power/MDE functions)."""
    t = discordant_counts(a_correct, b_correct)
    if t["n"] == 0:
        raise ValueError("need at least one pair")
    return (t["n01"] + t["n10"]) / t["n"]


def mcnemar_exact(a_correct: Any, b_correct: Any) -> dict:
    """Exact (conditional) two-sided McNemar test of equal accuracy of a and b.

    Under H0 (``p01 = p10``) the discordant pairs split as
    ``n01 | (n01 + n10) ~ Binomial(n01 + n10, 1/2)``; the p-value is the two-sided
    exact binomial p-value (``scipy.stats.binomtest``; for p = 1/2 this equals
    ``min(1, 2 * P(X <= min(n01, n10)))``). With no discordant pairs p = 1.

    ``statistic`` is ``min(n01, n10)`` (the exact-test statistic convention);
    ``chi2`` = ``(n01 - n10)^2 / (n01 + n10)`` is also reported (0 when undefined).
    ``delta = (n01 - n10) / n`` = acc_b - acc_a.
    Returns ``{n01, n10, n_discordant, n, p_value, statistic, chi2, delta}``.
    """
    t = discordant_counts(a_correct, b_correct)
    n01, n10 = t["n01"], t["n10"]
    nd = n01 + n10
    p = 1.0 if nd == 0 else to_float(_st.binomtest(n01, nd, 0.5, alternative="two-sided").pvalue)
    return {"n01": n01, "n10": n10, "n_discordant": nd, "n": t["n"],
            "p_value": min(1.0, p), "statistic": min(n01, n10),
            "chi2": 0.0 if nd == 0 else (n01 - n10) ** 2 / nd,
            "delta": (n01 - n10) / t["n"] if t["n"] else 0.0}


def paired_bootstrap_delta(a: Any, b: Any, n_boot: int = 2000, alpha: float = 0.05,
                           seed: Any = 0, clusters: Any = None) -> dict:
    """Percentile paired-bootstrap ``1 - alpha`` interval of ``delta = mean(b) - mean(a)``.

    Pairs ``(a_i, b_i)`` are resampled together (whole clusters when ``clusters`` is
    given), which is the same as resampling ``d_i = b_i - a_i``::

        delta = mean(b) - mean(a) = mean(d),  [lo, hi] = [Q(delta*, alpha/2), Q(delta*, 1-alpha/2)]

    ``a``/``b`` may be per-item correctness (bool/0-1) or any per-item score. ``seed``:
    int or numpy Generator. Returns ``{delta, lo, hi, se, n, n_boot, alpha}``.
    """
    x = as_1d(a, "a")
    y = as_1d(b, "b")
    check_same_length(x, y, "a and b")
    r = bootstrap_ci(y - x, "mean", n_boot=n_boot, alpha=alpha, seed=seed, clusters=clusters)
    return {"delta": to_float(np.mean(y) - np.mean(x)), "lo": r["lo"], "hi": r["hi"],
            "se": r["se"], "n": r["n"], "n_clusters": r["n_clusters"],
            "n_boot": r["n_boot"], "alpha": r["alpha"]}


def flip_rates(a_correct: Any, b_correct: Any, alpha: float = 0.05,
               method: str = "wilson") -> dict:
    """Rates of items that flip between a (reference) and b (candidate), over all n items.

    ::

        correct_to_wrong = n10 / n     (a correct, b wrong: regressions)
        wrong_to_correct = n01 / n     (a wrong, b correct: improvements)

    each with a ``1 - alpha`` binomial interval (:func:`binomial_ci`, Wilson by default).
    ``net = (n01 - n10) / n`` = acc_b - acc_a.
    Returns ``{correct_to_wrong: {rate, lo, hi, k}, wrong_to_correct: {...}, n, net}``.
    """
    check_alpha(alpha)
    t = discordant_counts(a_correct, b_correct)
    n = t["n"]
    if n == 0:
        raise ValueError("need at least one pair")

    def one(k: int) -> dict:
        """Rate k/n with its interval."""
        ci = binomial_ci(k, n, alpha=alpha, method=method)
        return {"rate": ci["p"], "lo": ci["lo"], "hi": ci["hi"], "k": k}

    return {"correct_to_wrong": one(t["n10"]), "wrong_to_correct": one(t["n01"]),
            "n": n, "net": (t["n01"] - t["n10"]) / n}
