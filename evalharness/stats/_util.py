"""Input validation and conversion helpers shared by the ``evalharness.stats`` modules.

Every public function of the package converts its results with :func:`to_float`,
:func:`to_int` or :func:`to_bool`, so that callers only ever receive plain Python
``float``/``int``/``bool``/``list``/``dict`` objects (JSON-serialisable; note that a
degenerate result may be ``nan`` or ``inf``, which :func:`json.dumps` writes as
``NaN``/``Infinity`` unless ``allow_nan=False``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import stats as _st

ALTERNATIVES = ("two-sided", "greater", "less")


def to_float(v: Any) -> float:
    """Convert a numpy/Python scalar to a plain Python ``float`` (``float(v)``)."""
    return float(v)


def to_int(v: Any) -> int:
    """Convert a numpy/Python integer scalar to a plain Python ``int`` (``int(v)``)."""
    return int(v)


def to_bool(v: Any) -> bool:
    """Convert a numpy/Python truth value to a plain Python ``bool`` (``bool(v)``)."""
    return bool(v)


def as_1d(x: Any, name: str = "x", min_n: int = 1) -> np.ndarray:
    """Return ``x`` as a finite 1-D ``float64`` array with at least ``min_n`` elements.

    Booleans are accepted (True -> 1.0). Raises ``ValueError`` for a wrong number of
    dimensions, too few elements or non-finite values (NaN/inf): a NaN silently
    propagating into a regression gate is worse than a loud failure.
    """
    arr = np.asarray(x, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size < min_n:
        raise ValueError(f"{name} needs at least {min_n} element(s), got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    return arr


def as_binary(x: Any, name: str = "x") -> np.ndarray:
    """Return a 1-D boolean array from bools or numbers in {0, 1}; raise ``ValueError`` otherwise."""
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype == bool:
        return arr
    num = np.asarray(arr, dtype=float)
    if not np.all((num == 0.0) | (num == 1.0)):
        raise ValueError(f"{name} must contain only booleans or 0/1 values")
    return num == 1.0


def check_same_length(a: np.ndarray, b: np.ndarray, names: str = "x and y") -> None:
    """Raise ``ValueError`` unless ``len(a) == len(b)`` (paired data)."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{names} must have the same length for a paired analysis "
                         f"({a.shape[0]} != {b.shape[0]})")


def check_alpha(alpha: float, name: str = "alpha") -> float:
    """Validate a significance level ``0 < alpha < 1`` and return it as a float."""
    a = float(alpha)
    if not (0.0 < a < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {alpha!r}")
    return a


def check_alternative(alternative: str) -> str:
    """Validate ``alternative`` in {'two-sided', 'greater', 'less'}."""
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    return alternative


def cluster_index(clusters: Any, n: int) -> tuple[np.ndarray, int]:
    """Map arbitrary cluster ids to dense integer codes.

    Returns ``(codes, G)`` with ``codes[i]`` in ``0..G-1`` identifying the cluster of
    observation ``i`` (via ``np.unique(..., return_inverse=True)``) and ``G`` the number
    of distinct clusters. ``clusters`` must be 1-D with length ``n``.
    """
    c = np.asarray(clusters)
    if c.ndim != 1 or c.shape[0] != n:
        raise ValueError(f"clusters must be 1-D with one id per observation (length {n}), "
                         f"got shape {c.shape}")
    _, codes = np.unique(c, return_inverse=True)
    codes = np.asarray(codes).reshape(-1)
    return codes, int(codes.max()) + 1 if n else 0


def mean_se(x: np.ndarray, codes: np.ndarray | None = None,
            n_clusters: int | None = None) -> tuple[float, float, int]:
    """Mean of ``x``, its standard error and the t degrees of freedom.

    iid (``codes`` is None)::

        m  = sum(x) / n
        se = s / sqrt(n),   s^2 = sum((x_i - m)^2) / (n - 1),   df = n - 1

    cluster-robust (``codes`` gives a cluster per observation, G clusters)::

        m   = sum(x) / N                       (token-weighted mean = ratio estimator
                                                sum_g S_g / sum_g n_g of cluster sums)
        e_g = sum_{i in g} (x_i - m)            (cluster residual totals)
        se  = sqrt( G/(G-1) * sum_g e_g^2 ) / N,   df = G - 1

    This is the CR1 sandwich (linearisation) variance of an intercept-only regression;
    with one observation per cluster it equals the iid formula exactly. ``se`` is NaN
    when it is not estimable (n < 2, or G < 2).
    """
    n = x.shape[0]
    m = float(np.mean(x))
    if codes is None:
        if n < 2:
            return m, math.nan, max(n - 1, 0)
        return m, float(np.std(x, ddof=1) / math.sqrt(n)), n - 1
    g = int(n_clusters)
    if g < 2:
        return m, math.nan, max(g - 1, 0)
    e = np.bincount(codes, weights=x - m, minlength=g)
    se = math.sqrt(g / (g - 1) * float(np.dot(e, e))) / n
    return m, se, g - 1


def cluster_residual_totals(x: np.ndarray, codes: np.ndarray, n_clusters: int) -> np.ndarray:
    """Per-cluster residual totals ``e_g = sum_{i in g} (x_i - mean(x))`` (see :func:`mean_se`)."""
    return np.bincount(codes, weights=x - np.mean(x), minlength=n_clusters)


def t_quantile(p: float, df: float) -> float:
    """Student-t quantile ``t_{p, df}`` via ``scipy.stats.t.ppf``; NaN when df < 1."""
    if not df >= 1:
        return math.nan
    return float(_st.t.ppf(p, df))


def one_sided_p(m: float, se: float, df: float, null: float, direction: str) -> float:
    """p-value of a one-sided t test of the mean ``m`` against ``null``.

    ``direction='greater'`` tests H0: mu <= null vs H1: mu > null,
    ``p = 1 - F_t((m - null)/se; df)``; ``'less'`` tests H0: mu >= null vs H1: mu < null,
    ``p = F_t((m - null)/se; df)``.

    Degenerate cases: se NaN (not estimable) -> p = 1 (no evidence); se == 0 (all
    differences identical) -> p = 0 if m lies strictly on the H1 side of ``null``, else 1.
    """
    if math.isnan(se) or not df >= 1:
        return 1.0
    if se == 0.0:
        if direction == "greater":
            return 0.0 if m > null else 1.0
        return 0.0 if m < null else 1.0
    t = (m - null) / se
    if direction == "greater":
        return float(_st.t.sf(t, df))
    return float(_st.t.cdf(t, df))


def diff_stats(x: Any, y: Any | None, paired: bool = True, clusters: Any = None,
               names: str = "x and y") -> dict:
    """Mean difference ``y - x`` (or mean of ``x`` when ``y`` is None), its SE and df.

    * one-sample / paired: ``d = y - x`` (per pair), ``m, se, df`` from :func:`mean_se`
      (cluster-robust when ``clusters`` is given).
    * unpaired (``paired=False``), Welch::

          m  = mean(y) - mean(x)
          se = sqrt(s_x^2/n_x + s_y^2/n_y)
          df = se^4 / ((s_x^2/n_x)^2/(n_x-1) + (s_y^2/n_y)^2/(n_y-1))   (Welch-Satterthwaite)

    Returns a dict with keys ``mean_diff, se, df, n, n_clusters``.
    """
    if y is None:
        d = as_1d(x, "x")
        paired = True
    elif paired:
        a = as_1d(x, "x")
        b = as_1d(y, "y")
        check_same_length(a, b, names)
        d = b - a
    else:
        if clusters is not None:
            raise ValueError("clusters are only supported for paired / one-sample analyses")
        a = as_1d(x, "x")
        b = as_1d(y, "y")
        na, nb = a.shape[0], b.shape[0]
        if na < 2 or nb < 2:
            return {"mean_diff": float(b.mean() - a.mean()), "se": math.nan, "df": 0.0,
                    "n": na + nb, "n_clusters": None}
        va, vb = float(np.var(a, ddof=1)) / na, float(np.var(b, ddof=1)) / nb
        se = math.sqrt(va + vb)
        if va + vb > 0:
            df = (va + vb) ** 2 / (va ** 2 / (na - 1) + vb ** 2 / (nb - 1))
        else:
            df = float(na + nb - 2)
        return {"mean_diff": float(b.mean() - a.mean()), "se": se, "df": float(df),
                "n": na + nb, "n_clusters": None}
    if clusters is None:
        m, se, df = mean_se(d)
        return {"mean_diff": m, "se": se, "df": float(df), "n": d.shape[0], "n_clusters": None}
    codes, g = cluster_index(clusters, d.shape[0])
    m, se, df = mean_se(d, codes, g)
    return {"mean_diff": m, "se": se, "df": float(df), "n": d.shape[0], "n_clusters": g}
