"""Power analysis for paired designs: minimum detectable effects and required sample
sizes for paired proportions (McNemar) and paired continuous metrics."""

from __future__ import annotations

import math
from typing import Any

from scipy import optimize as _opt
from scipy import stats as _st

from ._util import check_alpha, check_alternative

__all__ = ["mde_paired_proportions", "required_n_paired_proportions", "mde_mean_diff",
           "required_n_mean_diff", "DEFAULT_DISCORDANCE"]

#: Discordant-pair rate assumed when none is given. psi = 2 p (1 - p) at p = 0.5 is the
#: discordance of two *independent* systems at 50 % accuracy, the largest discordance
#: one gets without negative correlation; positively correlated systems (an FP8 engine
#: vs its FP32 reference) have far smaller psi, so this default is conservative (the
#: paired design then has the power of an unpaired comparison at worst-case variance).
DEFAULT_DISCORDANCE = 0.5


def _z(alpha: float, power: float, alternative: str) -> tuple[float, float]:
    """``z_a = z_{1-alpha/2}`` (two-sided) or ``z_{1-alpha}`` (one-sided); ``z_b = z_{power}``."""
    alpha = check_alpha(alpha)
    check_alpha(power, "power")
    check_alternative(alternative)
    za = _st.norm.ppf(1.0 - alpha / 2.0) if alternative == "two-sided" else _st.norm.ppf(1.0 - alpha)
    return float(za), float(_st.norm.ppf(power))


def _psi(discordance: Any) -> float:
    """Validated discordance in (0, 1]; None -> :data:`DEFAULT_DISCORDANCE`."""
    psi = DEFAULT_DISCORDANCE if discordance is None else float(discordance)
    if not (0.0 < psi <= 1.0):
        raise ValueError(f"discordance must be in (0, 1], got {discordance!r}")
    return psi


def mde_paired_proportions(n: int, alpha: float = 0.05, power: float = 0.8,
                           discordance: float | None = None,
                           alternative: str = "two-sided") -> float:
    """Minimum detectable ``|acc_b - acc_a|`` for a paired design of ``n`` items (McNemar).

    Normal approximation to McNemar's test (Connor 1987). With discordant-pair rate
    ``psi = p01 + p10`` and effect ``delta = p01 - p10`` (= acc_b - acc_a), the per-item
    difference has variance ``psi`` under H0 and ``psi - delta^2`` under H1, and

        sqrt(n) * delta = z_a * sqrt(psi) + z_b * sqrt(psi - delta^2)

    (z_a = z_{1-alpha/2} two-sided, z_{1-alpha} one-sided; z_b = z_{power}). Squaring
    gives a quadratic in delta whose relevant root is

        delta = sqrt(psi) * (z_a sqrt(n) + z_b sqrt(n - z_a^2 + z_b^2)) / (n + z_b^2)

    (~ (z_a + z_b) sqrt(psi / n) for large n). ``discordance`` is the expected or
    observed psi (see ``discordance_rate``); None uses the conservative
    :data:`DEFAULT_DISCORDANCE` = 0.5. Returns ``inf`` when n is too small for any
    effect (n <= z_a^2). A result larger than psi means no effect realisable at that
    discordance can be detected with this n.
    """
    za, zb = _z(alpha, power, alternative)
    psi = _psi(discordance)
    n = float(n)
    if not n >= 1:
        raise ValueError("n must be >= 1")
    disc = n - za * za + zb * zb
    if disc < 0 or (zb >= 0 and n <= za * za):
        return math.inf
    return float(math.sqrt(psi) * (za * math.sqrt(n) + zb * math.sqrt(disc)) / (n + zb * zb))


def required_n_paired_proportions(delta: float, alpha: float = 0.05, power: float = 0.8,
                                  discordance: float | None = None,
                                  alternative: str = "two-sided") -> int:
    """Items needed to detect ``|acc_b - acc_a| = delta`` with McNemar's test (inverse of
    :func:`mde_paired_proportions`).

    Connor (1987) normal approximation::

        n = ceil( (z_a sqrt(psi) + z_b sqrt(psi - delta^2))^2 / delta^2 )

    ``discordance`` psi (None -> :data:`DEFAULT_DISCORDANCE`) must be >= |delta|
    (``|p01 - p10| <= p01 + p10``).
    """
    za, zb = _z(alpha, power, alternative)
    psi = _psi(discordance)
    d = abs(float(delta))
    if not d > 0:
        raise ValueError("delta must be non-zero")
    if d > psi:
        raise ValueError(f"|delta| = {d} cannot exceed the discordance psi = {psi}")
    n = (za * math.sqrt(psi) + zb * math.sqrt(psi - d * d)) ** 2 / (d * d)
    return int(math.ceil(n - 1e-9))


def _t_power(ncp: float, df: float, alpha: float, alternative: str) -> float:
    """Power of the one-sample t test at noncentrality ``ncp = delta sqrt(n)/sd``.

    two-sided: ``P(T' > t_{1-alpha/2}) + P(T' < -t_{1-alpha/2})``; one-sided:
    ``P(T' > t_{1-alpha})``, ``T' ~ noncentral t(df, ncp)`` (``scipy.stats.nct``).
    """
    if alternative == "two-sided":
        tc = _st.t.ppf(1.0 - alpha / 2.0, df)
        return float(_st.nct.sf(tc, df, ncp) + _st.nct.cdf(-tc, df, ncp))
    tc = _st.t.ppf(1.0 - alpha, df)
    return float(_st.nct.sf(tc, df, ncp))


def mde_mean_diff(sd: float, n: int, alpha: float = 0.05, power: float = 0.8,
                  alternative: str = "two-sided", method: str = "t") -> float:
    """Minimum detectable mean difference for a paired continuous metric.

    ``sd`` is the standard deviation of the per-pair differences ``y_i - x_i``.

    * ``method='normal'``: ``delta = (z_a + z_b) * sd / sqrt(n)``.
    * ``method='t'`` (default, exact for normal data): the ``delta`` at which the paired
      t test (df = n - 1) reaches ``power``, i.e. ``_t_power(delta sqrt(n)/sd) = power``
      solved with Brent's method; slightly above the normal value for small n.
    """
    za, zb = _z(alpha, power, alternative)
    sd = float(sd)
    if not sd >= 0:
        raise ValueError("sd must be >= 0")
    n_i = int(n)
    if method == "normal":
        if n_i < 1:
            raise ValueError("n must be >= 1")
        return float((za + zb) * sd / math.sqrt(n_i))
    if method != "t":
        raise ValueError("method must be 't' or 'normal'")
    if n_i < 2:
        raise ValueError("n must be >= 2 for the t method")
    if sd == 0.0:
        return 0.0
    df = n_i - 1
    f = lambda ncp: _t_power(ncp, df, alpha, alternative) - power  # noqa: E731
    hi = max(1.0, 2.0 * (za + zb))
    while f(hi) < 0:
        hi *= 2.0
    ncp = _opt.brentq(f, 0.0, hi, xtol=1e-12)
    return float(ncp * sd / math.sqrt(n_i))


def required_n_mean_diff(delta: float, sd: float, alpha: float = 0.05, power: float = 0.8,
                         alternative: str = "two-sided", method: str = "t") -> int:
    """Pairs needed to detect a mean difference ``delta`` (inverse of :func:`mde_mean_diff`).

    ``normal``: ``n = ceil(((z_a + z_b) sd / delta)^2)``; ``t``: the smallest n >= 2 whose
    paired t test power (noncentral t, df = n - 1) is >= ``power``.
    """
    za, zb = _z(alpha, power, alternative)
    d, sd = abs(float(delta)), float(sd)
    if not d > 0 or not sd > 0:
        raise ValueError("delta and sd must be > 0")
    n0 = int(math.ceil(((za + zb) * sd / d) ** 2 - 1e-9))
    if method == "normal":
        return max(1, n0)
    if method != "t":
        raise ValueError("method must be 't' or 'normal'")
    n = max(2, n0)
    pw = lambda k: _t_power(d * math.sqrt(k) / sd, k - 1, alpha, alternative)  # noqa: E731
    while pw(n) < power:
        n += 1
    while n > 2 and pw(n - 1) >= power:
        n -= 1
    return int(n)
