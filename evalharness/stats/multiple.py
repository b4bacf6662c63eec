"""Multiple-testing corrections: Holm (FWER) and Benjamini-Hochberg (FDR)."""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats as _st

from ._util import check_alpha

__all__ = ["holm", "benjamini_hochberg"]


def _pvals(pvalues: Any) -> np.ndarray:
    """Validate p-values: 1-D, finite, each in [0, 1]."""
    p = np.asarray(pvalues, dtype=float).reshape(-1) if np.ndim(pvalues) <= 1 else None
    if p is None:
        raise ValueError("pvalues must be 1-D")
    if not np.all(np.isfinite(p)) or np.any((p < 0) | (p > 1)):
        raise ValueError("p-values must be finite and in [0, 1]")
    return p


def holm(pvalues: Any, alpha: float = 0.05) -> dict:
    """Holm step-down adjusted p-values (controls the family-wise error rate).

    With p sorted ascending ``p_(1) <= ... <= p_(m)``::

        adj_(i) = max_{j <= i} min(1, (m - j + 1) * p_(j))

    returned in the input order; ``reject_i = adj_i <= alpha`` (identical to Holm's
    sequential procedure). Adjusted values are >= the raw ones, <= 1 and monotone in the
    raw ones. Returns ``{adjusted: [...], reject: [...], alpha, method}``.
    """
    alpha = check_alpha(alpha)
    p = _pvals(pvalues)
    m = p.shape[0]
    if m == 0:
        return {"adjusted": [], "reject": [], "alpha": alpha, "method": "holm"}
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adj_sorted = np.maximum.accumulate(scaled)
    adj = np.empty(m)
    adj[order] = adj_sorted
    return {"adjusted": [float(v) for v in adj], "reject": [bool(v <= alpha) for v in adj],
            "alpha": alpha, "method": "holm"}


def benjamini_hochberg(pvalues: Any, alpha: float = 0.05) -> dict:
    """Benjamini-Hochberg step-up adjusted p-values (controls the false discovery rate
    under independence / positive dependence).

    With p sorted ascending ``p_(1) <= ... <= p_(m)``::

        adj_(i) = min_{j >= i} min(1, m * p_(j) / j)

    (computed by ``scipy.stats.false_discovery_control(p, method='bh')``), returned in the
    input order; ``reject_i = adj_i <= alpha`` (identical to the BH step-up rule).
    Returns ``{adjusted: [...], reject: [...], alpha, method}``.
    """
    alpha = check_alpha(alpha)
    p = _pvals(pvalues)
    if p.shape[0] == 0:
        return {"adjusted": [], "reject": [], "alpha": alpha, "method": "bh"}
    adj = np.minimum(1.0, np.asarray(_st.false_discovery_control(p, method="bh"), dtype=float))
    return {"adjusted": [float(v) for v in adj], "reject": [bool(v <= alpha) for v in adj],
            "alpha": alpha, "method": "bh"}
