"""Perplexity intervals: PPL of one model and the PPL ratio of two models scored on the
same tokens (paired, so the strong positive correlation between models is used)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._util import (as_1d, check_alpha, check_same_length, cluster_index,
                    cluster_residual_totals, mean_se, t_quantile, to_float, to_int)
from .intervals import mean_ci

__all__ = ["ppl_ci", "ppl_ratio_ci"]


def _exp(v: float) -> float:
    """``exp(v)`` that maps NaN to NaN and overflows to ``inf`` instead of raising."""
    if math.isnan(v):
        return math.nan
    try:
        return math.exp(v)
    except OverflowError:
        return math.inf


def ppl_ci(nll: Any, clusters: Any = None, alpha: float = 0.05) -> dict:
    """Perplexity with a ``1 - alpha`` interval from the mean per-token NLL (nats).

    ::

        mean_nll = sum_i nll_i / N,     ppl = exp(mean_nll)
        [lo, hi] = exp(mean_nll -/+ t_{1-alpha/2, df} * se)

    where ``se``/``df`` are the iid or, with ``clusters`` (e.g. window index of each
    token), the cluster-robust values of :func:`mean_ci`. exp is monotone, so the
    interval keeps its coverage; it is asymmetric around ``ppl``.
    Returns ``{ppl, lo, hi, mean_nll, se, n, n_clusters, df, alpha}``.
    """
    m = mean_ci(nll, alpha=alpha, clusters=clusters)
    return {"ppl": _exp(m["mean"]), "lo": _exp(m["lo"]), "hi": _exp(m["hi"]),
            "mean_nll": m["mean"], "se": m["se"], "n": m["n"],
            "n_clusters": m["n_clusters"], "df": m["df"], "alpha": m["alpha"]}


def ppl_ratio_ci(nll_a: Any, nll_b: Any, clusters: Any = None, alpha: float = 0.05) -> dict:
    """Ratio ``PPL_b / PPL_a`` of two models scored on the same tokens, paired interval.

    ``nll_a[i]`` and ``nll_b[i]`` must be the NLL of the same token under model a
    (e.g. FP32 reference) and model b (e.g. FP8 engine). With ``d_i = nll_b[i] - nll_a[i]``::

        log_ratio = mean(d) = mean(nll_b) - mean(nll_a),   ratio = exp(log_ratio)
        [lo, hi]  = exp(log_ratio -/+ t_{1-alpha/2, df} * se_d)

    ``se_d`` is the (iid or cluster-robust, see :func:`mean_ci`) SE of mean(d). Because
    the differences are formed per token (or per cluster), the covariance of the two
    models is accounted for::

        var(d) = var(a) + var(b) - 2 cov(a, b)
        se_d^2 = se_a^2 + se_b^2 - 2 corr * se_a * se_b

    ``corr`` is the correlation of the units that enter the variance: per-token Pearson
    correlation of a and b without clusters; with clusters, the correlation of the
    cluster residual totals ``e_g(a)``, ``e_g(b)`` (``sum e_a e_b / sqrt(sum e_a^2 sum e_b^2)``).
    With that definition the identity above is exact. Models scored on the same text
    typically have corr ~ 0.9+, so the paired interval is far narrower than the unpaired
    one with ``se_unpaired = sqrt(se_a^2 + se_b^2)``, which is also reported.
    ``corr`` is NaN when a or b has zero spread.

    Returns ``{ratio, lo, hi, log_ratio, se, corr, se_a, se_b, se_unpaired, ppl_a, ppl_b,
    n, n_clusters, df, alpha}``.
    """
    alpha = check_alpha(alpha)
    a = as_1d(nll_a, "nll_a")
    b = as_1d(nll_b, "nll_b")
    check_same_length(a, b, "nll_a and nll_b")
    d = b - a
    n = a.shape[0]
    if clusters is None:
        codes, g = None, n
        m_d, se_d, df = mean_se(d)
        _, se_a, _ = mean_se(a)
        _, se_b, _ = mean_se(b)
        ua, ub = a - a.mean(), b - b.mean()
    else:
        codes, g = cluster_index(clusters, n)
        m_d, se_d, df = mean_se(d, codes, g)
        _, se_a, _ = mean_se(a, codes, g)
        _, se_b, _ = mean_se(b, codes, g)
        ua = cluster_residual_totals(a, codes, g)
        ub = cluster_residual_totals(b, codes, g)
    saa, sbb = float(np.dot(ua, ua)), float(np.dot(ub, ub))
    if saa > 0.0 and sbb > 0.0:
        corr = max(-1.0, min(1.0, float(np.dot(ua, ub)) / math.sqrt(saa * sbb)))
    else:
        corr = math.nan
    # exact zero when the two arrays are identical: keep the interval degenerate
    half = t_quantile(1.0 - alpha / 2.0, df) * se_d if se_d != 0.0 else 0.0
    return {"ratio": _exp(m_d), "lo": _exp(m_d - half), "hi": _exp(m_d + half),
            "log_ratio": to_float(m_d), "se": to_float(se_d), "corr": corr,
            "se_a": to_float(se_a), "se_b": to_float(se_b),
            "se_unpaired": to_float(math.sqrt(se_a ** 2 + se_b ** 2)),
            "ppl_a": _exp(float(np.mean(a))), "ppl_b": _exp(float(np.mean(b))),
            "n": to_int(n), "n_clusters": to_int(g), "df": to_int(df), "alpha": alpha}
