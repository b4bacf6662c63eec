"""Tests of a candidate against a baseline: paired difference tests, TOST equivalence
and non-inferiority.

Sign convention throughout: the difference is ``d = y - x`` (candidate ``y`` minus
baseline ``x``), as in ``mean(b) - mean(a)`` elsewhere in this package. NOTE this is the
opposite of ``scipy.stats.wilcoxon(x, y)`` / ``ttest_rel(x, y)``, which use ``x - y``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from scipy import stats as _st

from ._util import (as_1d, check_alpha, check_alternative, check_same_length, diff_stats,
                    one_sided_p, t_quantile, to_float, to_int)

__all__ = ["paired_test", "tost_equivalence", "noninferiority"]

_METHODS = ("wilcoxon", "t", "sign")


def paired_test(x: Any, y: Any = None, method: str = "wilcoxon",
                alternative: str = "two-sided") -> dict:
    """Paired test of the differences ``d_i = y_i - x_i`` (or of ``x`` itself if y is None).

    ``alternative`` refers to d: ``'greater'`` = y tends to exceed x.

    * ``'t'``: one-sample t test of mean(d) = 0, ``T = mean(d) / (s_d / sqrt(n))``,
      df = n - 1 (``scipy.stats.ttest_1samp``).
    * ``'wilcoxon'``: signed-rank test on the non-zero differences (zeros dropped,
      "wilcox" zero method), ``W+ = sum of ranks of |d_i| with d_i > 0``
      (``scipy.stats.wilcoxon``, exact null distribution for small n without ties;
      the statistic is scipy's: min(W+, W-) two-sided, W+ one-sided).
    * ``'sign'``: ``S = #{d_i > 0}`` among the non-zero differences,
      ``S ~ Binomial(n_nonzero, 1/2)`` under H0 (``scipy.stats.binomtest``).

    Degenerate inputs never raise: all differences zero (or no non-zero ones) gives
    ``p = 1, statistic = 0``; the t test with n < 2 gives p = 1; the t test with zero
    spread but non-zero mean gives ``statistic = +/-inf`` and p = 0 on the side of the
    mean (1 on the other side).
    Returns ``{statistic, p_value, n, n_nonzero, mean_diff, median_diff, method,
    alternative}``.
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    check_alternative(alternative)
    if y is None:
        d = as_1d(x, "x")
    else:
        a = as_1d(x, "x")
        b = as_1d(y, "y")
        check_same_length(a, b)
        d = b - a
    n = d.shape[0]
    nz = d[d != 0.0]
    out = {"n": to_int(n), "n_nonzero": to_int(nz.shape[0]), "mean_diff": to_float(np.mean(d)),
           "median_diff": to_float(np.median(d)), "method": method, "alternative": alternative}
    if nz.shape[0] == 0:
        out.update(statistic=0.0, p_value=1.0)
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "sign":
            k = int(np.count_nonzero(nz > 0))
            p = _st.binomtest(k, nz.shape[0], 0.5, alternative=alternative).pvalue
            stat = float(k)
        elif method == "wilcoxon":
            r = _st.wilcoxon(nz, alternative=alternative, zero_method="wilcox")
            stat, p = float(r.statistic), float(r.pvalue)
        else:
            m = float(np.mean(d))
            sd = float(np.std(d, ddof=1)) if n >= 2 else math.nan
            if n < 2:
                stat, p = 0.0, 1.0
            elif sd == 0.0:
                stat = math.copysign(math.inf, m)
                if alternative == "two-sided":
                    p = 0.0
                else:
                    p = one_sided_p(m, 0.0, n - 1, 0.0, alternative)
            else:
                r = _st.ttest_1samp(d, 0.0, alternative=alternative)
                stat, p = float(r.statistic), float(r.pvalue)
    out.update(statistic=to_float(stat), p_value=min(1.0, max(0.0, to_float(p))))
    return out


def _margins(margin: Any) -> tuple[float, float]:
    """Equivalence bounds: a scalar m > 0 gives (-m, m); a pair gives (low, high), low < high."""
    if margin is None:
        raise ValueError("margin is required")
    if np.ndim(margin) == 0:
        m = float(margin)
        if not m > 0:
            raise ValueError(f"a scalar margin must be > 0, got {margin!r}")
        return -m, m
    low, high = (float(v) for v in margin)
    if not low < high:
        raise ValueError(f"margin (low, high) needs low < high, got {margin!r}")
    return low, high


def tost_equivalence(x: Any, y: Any = None, margin: Any = None, alpha: float = 0.05,
                     paired: bool = True, clusters: Any = None) -> dict:
    """Two one-sided t tests (TOST) for equivalence of ``mu = E[y - x]`` within a margin.

    ``margin`` is ``m`` (bounds ``(-m, m)``) or ``(low, high)``. With y None, ``x`` is
    tested directly (one-sample, mu = E[x]). Hypotheses
    ``H0: mu <= low or mu >= high`` vs ``H1: low < mu < high``::

        p_lower = 1 - F_t((mean - low)  / se; df)     (H0: mu <= low)
        p_upper =     F_t((mean - high) / se; df)     (H0: mu >= high)
        p_value = max(p_lower, p_upper);  equivalent = p_value < alpha

    ``mean``, ``se``, ``df``: paired/one-sample from the differences (cluster-robust when
    ``clusters`` is given, see :func:`mean_ci`); ``paired=False`` uses Welch's SE and
    Welch-Satterthwaite df. Equivalently, ``[lo, hi] = mean -/+ t_{1-alpha, df} * se``
    (the ``1 - 2 alpha`` CI) lies strictly inside ``(low, high)``.
    n < 2 (SE not estimable) gives p = 1, not equivalent.
    Returns ``{p_value, lo, hi, equivalent, margin: [low, high], mean_diff, se, df,
    p_lower, p_upper, n, alpha}``.
    """
    alpha = check_alpha(alpha)
    low, high = _margins(margin)
    s = diff_stats(x, y, paired=paired, clusters=clusters)
    m, se, df = s["mean_diff"], s["se"], s["df"]
    p_lo = one_sided_p(m, se, df, low, "greater")
    p_hi = one_sided_p(m, se, df, high, "less")
    p = max(p_lo, p_hi)
    half = t_quantile(1.0 - alpha, df) * se if se != 0.0 else 0.0
    return {"p_value": to_float(p), "lo": to_float(m - half), "hi": to_float(m + half),
            "equivalent": bool(p < alpha), "margin": [low, high], "mean_diff": to_float(m),
            "se": to_float(se), "df": to_float(df), "p_lower": to_float(p_lo),
            "p_upper": to_float(p_hi), "n": to_int(s["n"]), "alpha": alpha}


def noninferiority(x: Any, y: Any = None, margin: float = None, alpha: float = 0.05,
                   higher_is_better: bool = True, paired: bool = True,
                   clusters: Any = None) -> dict:
    """One-sided t test that candidate ``y`` is not worse than baseline ``x`` by > margin.

    With ``d = y - x`` (or ``x`` itself when y is None), mean/se/df as in
    :func:`tost_equivalence`, ``margin >= 0`` in the units of the metric:

    * ``higher_is_better=True`` (accuracy): ``H0: mu <= -margin`` vs ``H1: mu > -margin``::

          p = 1 - F_t((mean + margin)/se; df),   bound = mean - t_{1-alpha,df} * se  (lower)
          noninferior = p < alpha   (<=> bound > -margin)

    * ``higher_is_better=False`` (NLL, error): ``H0: mu >= margin`` vs ``H1: mu < margin``::

          p = F_t((mean - margin)/se; df),       bound = mean + t_{1-alpha,df} * se  (upper)
          noninferior = p < alpha   (<=> bound < margin)

    n < 2 gives p = 1, bound NaN, not non-inferior.
    Returns ``{p_value, bound, noninferior, margin, mean_diff, se, df, n, alpha,
    higher_is_better}``.
    """
    alpha = check_alpha(alpha)
    if margin is None:
        raise ValueError("margin is required")
    mg = float(margin)
    if not mg >= 0:
        raise ValueError(f"margin must be >= 0, got {margin!r}")
    s = diff_stats(x, y, paired=paired, clusters=clusters)
    m, se, df = s["mean_diff"], s["se"], s["df"]
    half = t_quantile(1.0 - alpha, df) * se if se != 0.0 else 0.0
    if higher_is_better:
        p = one_sided_p(m, se, df, -mg, "greater")
        bound = m - half
    else:
        p = one_sided_p(m, se, df, mg, "less")
        bound = m + half
    return {"p_value": to_float(p), "bound": to_float(bound), "noninferior": bool(p < alpha),
            "margin": mg, "mean_diff": to_float(m), "se": to_float(se), "df": to_float(df),
            "n": to_int(s["n"]), "alpha": alpha, "higher_is_better": bool(higher_is_better)}
