"""Confidence intervals for one sample: mean (iid or cluster-robust), binomial
proportion, quantile (distribution-free) and the percentile bootstrap."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from scipy import stats as _st

from ._util import (as_1d, check_alpha, cluster_index, mean_se, t_quantile, to_float,
                    to_int)

__all__ = ["mean_ci", "binomial_ci", "quantile_ci", "bootstrap_ci"]


# --------------------------------------------------------------------------- mean

def mean_ci(x: Any, alpha: float = 0.05, clusters: Any = None, lower: float | None = None) -> dict:
    """Two-sided ``1 - alpha`` Student-t confidence interval for the mean of ``x``.

    iid (``clusters`` is None)::

        mean = sum(x)/n,  se = s/sqrt(n)  (s: sample SD, ddof=1),  df = n - 1
        [lo, hi] = mean -/+ t_{1-alpha/2, df} * se

    Cluster-robust (``clusters`` = one id per observation, e.g. the window index of
    each token; tokens of one window are correlated so the iid SE is too small)::

        mean = sum_i x_i / N                 (token-weighted mean, i.e. the cluster means
                                              averaged with weights n_g/N = ratio
                                              estimator sum_g S_g / sum_g n_g)
        e_g  = sum_{i in g} (x_i - mean)     (residual total of cluster g)
        se   = sqrt( G/(G-1) * sum_g e_g^2 ) / N,   df = G - 1

    (CR1 sandwich / linearisation variance; it equals the iid SE exactly when every
    cluster holds one observation, and grows by ~sqrt(cluster size) for perfectly
    correlated clusters.)

    ``lower``: the smallest value the mean can take (0 for a mean of nonnegative values,
    such as a KL divergence); the interval is intersected with ``[lower, inf)``, which keeps
    its coverage (a t-interval of skewed data, e.g. all windows 0 but one, reaches below 0).

    Returns ``{mean, se, lo, hi, n, n_clusters, df, alpha}``; ``n_clusters`` equals
    ``n`` without clusters (each observation its own cluster). ``se``/``lo``/``hi``
    are NaN when not estimable (n < 2 or fewer than 2 clusters); ``lo == hi == mean``
    when the data have zero spread.
    """
    alpha = check_alpha(alpha)
    arr = as_1d(x, "x")
    if clusters is None:
        m, se, df = mean_se(arr)
        g = arr.shape[0]
    else:
        codes, g = cluster_index(clusters, arr.shape[0])
        m, se, df = mean_se(arr, codes, g)
    q = t_quantile(1.0 - alpha / 2.0, df)
    half = q * se
    lo, hi = to_float(m - half), to_float(m + half)
    if lower is not None:  # NaN (not estimable) stays NaN
        lo, hi = (lower if v < lower else v for v in (lo, hi))
    return {"mean": to_float(m), "se": to_float(se), "lo": lo, "hi": hi, "n": to_int(arr.shape[0]),
            "n_clusters": to_int(g), "df": to_int(df), "alpha": alpha}


# --------------------------------------------------------------------- binomial

_BINOM_METHODS = {"wilson": "wilson", "clopper-pearson": "exact", "exact": "exact"}


def binomial_ci(k: int, n: int, alpha: float = 0.05, method: str = "wilson") -> dict:
    """Two-sided ``1 - alpha`` interval for a binomial proportion ``p = k/n``.

    ``method='wilson'`` (score interval; good coverage, never outside [0, 1]), with
    ``z = z_{1-alpha/2}`` and ``p^ = k/n``::

        centre = (p^ + z^2/(2n)) / (1 + z^2/n)
        half   = z/(1 + z^2/n) * sqrt( p^(1-p^)/n + z^2/(4n^2) )
        [lo, hi] = centre -/+ half

    ``method='clopper-pearson'`` (alias ``'exact'``; guaranteed >= 1-alpha coverage)::

        lo = Beta^{-1}(alpha/2;   k,   n-k+1)   (0 when k = 0)
        hi = Beta^{-1}(1-alpha/2; k+1, n-k)     (1 when k = n)

    Both are computed by ``scipy.stats.binomtest(k, n).proportion_ci``.
    Returns ``{p, lo, hi, k, n, method}``.
    """
    alpha = check_alpha(alpha)
    if method not in _BINOM_METHODS:
        raise ValueError(f"method must be one of {sorted(_BINOM_METHODS)}, got {method!r}")
    k_i, n_i = int(k), int(n)
    if k_i != k or n_i != n:
        raise ValueError("k and n must be integers")
    if n_i < 1 or not (0 <= k_i <= n_i):
        raise ValueError(f"need n >= 1 and 0 <= k <= n, got k={k}, n={n}")
    ci = _st.binomtest(k_i, n_i).proportion_ci(confidence_level=1.0 - alpha,
                                               method=_BINOM_METHODS[method])
    lo = min(max(float(ci.low), 0.0), 1.0)
    hi = min(max(float(ci.high), 0.0), 1.0)
    return {"p": k_i / n_i, "lo": lo, "hi": hi, "k": k_i, "n": n_i,
            "method": "wilson" if method == "wilson" else "clopper-pearson"}


# --------------------------------------------------------------------- quantile

def quantile_ci(x: Any, q: float, alpha: float = 0.05) -> dict:
    """Distribution-free (order-statistic) ``>= 1 - alpha`` interval for the q-quantile.

    With sorted data ``x_(1) <= ... <= x_(n)`` and ``B ~ Binomial(n, q)`` the number of
    observations below the true quantile xi_q (``F`` its CDF)::

        P(x_(l) <= xi_q <= x_(u)) >= P(l <= B <= u-1) = F(u-1) - F(l-1)

    ``l`` is the largest rank with ``F(l-1) <= alpha/2`` and ``u`` the smallest with
    ``F(u-1) >= 1 - alpha/2``; each tail then has probability <= alpha/2 (exact for
    continuous data, conservative with ties). When no such rank exists inside 1..n
    (n too small for the requested q/alpha) the bound is ``-inf`` / ``+inf``.

    ``value`` is the point estimate ``np.quantile(x, q)`` (linear interpolation).
    Returns ``{q, value, lo, hi, n, coverage, lo_rank, hi_rank}`` where ``coverage`` is
    ``F(u-1) - F(l-1)`` (the guaranteed coverage) and ranks are 1-based (0 / n+1 for an
    infinite bound).
    """
    alpha = check_alpha(alpha)
    qf = float(q)
    if not (0.0 < qf < 1.0):
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    arr = np.sort(as_1d(x, "x"))
    n = arr.shape[0]
    cdf = _st.binom.cdf(np.arange(n + 1), n, qf)  # F(0..n)
    eps = 1e-12
    l_rank = int(np.count_nonzero(cdf <= alpha / 2.0 + eps))          # 0 -> -inf
    u_rank = int(np.count_nonzero(cdf < 1.0 - alpha / 2.0 - eps)) + 1  # n+1 -> +inf
    lo = float(arr[l_rank - 1]) if l_rank >= 1 else -math.inf
    hi = float(arr[u_rank - 1]) if u_rank <= n else math.inf
    f_lo = float(cdf[l_rank - 1]) if l_rank >= 1 else 0.0
    f_hi = float(cdf[u_rank - 1]) if u_rank <= n else 1.0
    return {"q": qf, "value": to_float(np.quantile(arr, qf)), "lo": lo, "hi": hi,
            "n": to_int(n), "coverage": to_float(f_hi - f_lo), "lo_rank": l_rank,
            "hi_rank": u_rank}


# -------------------------------------------------------------------- bootstrap

_MAX_BATCH_ELEMS = 1 << 22  # resampled indices held in memory at once


def _is_two_sample(data: Any) -> bool:
    """True when ``data`` is a 2-tuple/list of array-likes ``(x, y)``."""
    if isinstance(data, tuple) and len(data) == 2:
        return True
    if isinstance(data, list) and len(data) == 2:
        return all(np.ndim(d) >= 1 for d in data)
    return False


def _resolve_statistic(statistic: Any, two: bool) -> tuple[Callable, str | None]:
    """Return ``(callable, builtin_name)`` for a statistic given as a name or a callable.

    Built-ins: one sample ``'mean'`` (``mean(x)``), ``'median'`` (``median(x)``);
    two samples ``'mean_diff'`` (``mean(y) - mean(x)``).
    """
    if callable(statistic):
        return statistic, None
    if two:
        if statistic in ("mean_diff", "mean"):
            return (lambda a, b: np.mean(b) - np.mean(a)), "mean_diff"
        raise ValueError("for two samples statistic must be a callable f(x, y) or 'mean_diff'")
    if statistic == "mean":
        return np.mean, "mean"
    if statistic == "median":
        return np.median, "median"
    raise ValueError("statistic must be a callable or one of 'mean', 'median'")


def _scalar(v: Any) -> float:
    """Coerce a statistic's return value to a float scalar, rejecting arrays."""
    a = np.asarray(v, dtype=float)
    if a.size != 1:
        raise ValueError("statistic must return a scalar")
    return float(a.reshape(()))


def _draws(rng: np.random.Generator, n_units: int, n_boot: int):
    """Yield index batches of shape (b, n_units), b*n_units <= ~4M, n_boot rows in all."""
    batch = max(1, min(n_boot, _MAX_BATCH_ELEMS // max(n_units, 1)))
    done = 0
    while done < n_boot:
        b = min(batch, n_boot - done)
        yield rng.integers(0, n_units, size=(b, n_units))
        done += b


def bootstrap_ci(data: Any, statistic: Any = "mean", n_boot: int = 2000,
                 alpha: float = 0.05, seed: Any = 0, clusters: Any = None,
                 paired: bool | None = None) -> dict:
    """Percentile-bootstrap ``1 - alpha`` interval for ``statistic``.

    ``data`` is one array ``x`` (``statistic(x)``) or a pair ``(x, y)``
    (``statistic(x, y)``). A pair of equal length is resampled *as pairs* (the same
    indices for x and y, preserving their correlation) unless ``paired=False``; a pair
    of unequal length (or ``paired=False``) is resampled independently per sample.
    ``statistic`` is a callable or a built-in name: ``'mean'``, ``'median'`` (one
    sample) or ``'mean_diff'`` = ``mean(y) - mean(x)`` (two samples).

    With ``clusters`` (one id per observation/pair) whole clusters are resampled with
    replacement (cluster bootstrap), so within-cluster correlation is kept; the
    ``'mean'`` statistic is then the token-weighted ``sum_g* S_g / sum_g* n_g``.

    With ``B = n_boot`` replicates ``t*_1..t*_B``::

        lo = Q(t*, alpha/2),  hi = Q(t*, 1 - alpha/2)    (Q: np.quantile, linear)
        se = SD(t*, ddof=1)

    Deterministic: ``seed`` is an int or a ``numpy.random.Generator`` (passed to
    ``np.random.default_rng``); the same seed and inputs give identical results, and a
    built-in name draws the same resamples as the equivalent callable (replicates then
    agree up to floating-point rounding).
    Returns ``{estimate, lo, hi, se, n_boot, alpha, n, n_clusters, paired, method}``
    (``n_clusters`` is the number of resampling units, None for independent samples;
    ``paired`` is None for one sample).
    """
    alpha = check_alpha(alpha)
    n_boot = int(n_boot)
    if n_boot < 2:
        raise ValueError("n_boot must be >= 2")
    two = _is_two_sample(data)
    fn, builtin = _resolve_statistic(statistic, two)
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)

    if two:
        x = as_1d(data[0], "x")
        y = as_1d(data[1], "y")
        if paired is None:
            paired = x.shape[0] == y.shape[0]
        if paired and x.shape[0] != y.shape[0]:
            raise ValueError("paired bootstrap needs x and y of equal length")
        estimate = _scalar(fn(x, y))
        if not paired:
            if clusters is not None:
                raise ValueError("clusters are only supported for one-sample or paired data")
            pos = 0
            for ix in _draws(rng, x.shape[0], n_boot):
                iy = rng.integers(0, y.shape[0], size=(ix.shape[0], y.shape[0]))
                if builtin == "mean_diff":
                    vals = y[iy].mean(axis=1) - x[ix].mean(axis=1)
                else:
                    vals = [_scalar(fn(x[a], y[b])) for a, b in zip(ix, iy)]
                boot[pos:pos + ix.shape[0]] = vals
                pos += ix.shape[0]
            return _boot_result(estimate, boot, alpha, x.shape[0] + y.shape[0], None,
                                False)
        n = x.shape[0]
        if builtin == "mean_diff":
            # paired resampling: mean(y*) - mean(x*) == mean((y - x)*)
            vec_data, vec_stat = y - x, "mean"
        else:
            vec_data, vec_stat = None, None
        rep = lambda idx: _scalar(fn(x[idx], y[idx]))  # noqa: E731
    else:
        x1 = as_1d(data, "x")
        n = x1.shape[0]
        estimate = _scalar(fn(x1))
        vec_data, vec_stat = x1, builtin
        rep = lambda idx: _scalar(fn(x1[idx]))  # noqa: E731

    pos = 0
    if clusters is None:
        for idx in _draws(rng, n, n_boot):
            b = idx.shape[0]
            if vec_stat == "mean":
                boot[pos:pos + b] = vec_data[idx].mean(axis=1)
            elif vec_stat == "median":
                boot[pos:pos + b] = np.median(vec_data[idx], axis=1)
            else:
                boot[pos:pos + b] = [rep(r) for r in idx]
            pos += b
        return _boot_result(estimate, boot, alpha, n, n, True if two else None)

    codes, g = cluster_index(clusters, n)
    sizes = np.bincount(codes, minlength=g)
    if vec_stat == "mean":
        sums = np.bincount(codes, weights=vec_data, minlength=g)
        counts = sizes.astype(float)
    else:
        members = np.split(np.argsort(codes, kind="stable"), np.cumsum(sizes)[:-1])
    for cidx in _draws(rng, g, n_boot):
        b = cidx.shape[0]
        if vec_stat == "mean":
            boot[pos:pos + b] = sums[cidx].sum(axis=1) / counts[cidx].sum(axis=1)
        else:
            boot[pos:pos + b] = [rep(np.concatenate([members[c] for c in r])) for r in cidx]
        pos += b
    return _boot_result(estimate, boot, alpha, n, g, True if two else None)


def _boot_result(estimate: float, boot: np.ndarray, alpha: float, n: int,
                 n_clusters: int | None, paired: bool | None) -> dict:
    """Percentile interval ``[Q(alpha/2), Q(1-alpha/2)]`` and SD of the replicates."""
    lo, hi = np.quantile(boot, [alpha / 2.0, 1.0 - alpha / 2.0])
    return {"estimate": to_float(estimate), "lo": to_float(lo), "hi": to_float(hi),
            "se": to_float(np.std(boot, ddof=1)), "n_boot": to_int(boot.shape[0]),
            "alpha": alpha, "n": to_int(n),
            "n_clusters": None if n_clusters is None else to_int(n_clusters),
            "paired": paired, "method": "percentile"}
