"""Streaming error statistics between an engine tensor and a reference tensor.

Nothing holds all activations: each update folds one batch into running sums
and a fixed log-spaced histogram of absolute errors (for quantiles), on the
tensors' own device.
"""

from __future__ import annotations

import math

import torch

# Histogram of |error| on log10 scale: bins cover 1e-12 .. 1e6; zeros go to bin 0.
_LOG_LO, _LOG_HI, _BINS = -12.0, 6.0, 720


class ErrorAccumulator:
    """Running error statistics of `engine` vs `reference` tensors of one tap.

    Stats: rel_l2 = ||e - r|| / ||r||, cosine = <e, r> / (||e|| ||r||),
    sqnr_db = 10 log10(||r||^2 / ||e - r||^2), max_abs, mean_abs, p50/p99/p999_abs
    (from the histogram, relative bin width 5.9%), ref_amax and nonfinite count.
    """

    def __init__(self) -> None:
        # Running sums live on the tensors' device as 0-d tensors: an update never synchronizes a GPU
        # (the capture overhead of a whole forward's taps); `result` reads them once at the end.
        self._acc: dict[str, torch.Tensor] | None = None
        self.hist: torch.Tensor | None = None

    def update(self, engine: torch.Tensor, reference: torch.Tensor) -> None:
        """Fold one batch in (shapes must match; float64 sums for stability; no host sync)."""
        if engine.shape != reference.shape:
            raise ValueError(f"tap shapes differ: engine {tuple(engine.shape)} vs reference {tuple(reference.shape)}")
        e = engine.detach().double().flatten()
        r = reference.detach().double().flatten().to(e.device)
        finite = torch.isfinite(e)
        zero = torch.zeros((), dtype=torch.float64, device=e.device)
        e, r = torch.where(finite, e, zero), torch.where(finite, r, zero)  # non-finite entries count as no error
        d = e - r
        ad = d.abs()
        ok = finite.sum()
        upd = {"rr": r.dot(r), "ee": e.dot(e), "er": e.dot(r), "dd": d.dot(d), "abs": ad.sum(),
               "max_abs": ad.max() if ad.numel() else zero, "ref_amax": r.abs().max() if r.numel() else zero,
               "count": ok, "nonfinite": finite.numel() - ok}
        if self._acc is None:
            self._acc = upd
        else:
            for k, v in upd.items():
                self._acc[k] = torch.maximum(self._acc[k], v) if k in ("max_abs", "ref_amax") else self._acc[k] + v
        logs = torch.log10(ad.clamp_min(10 ** _LOG_LO))
        idx = ((logs - _LOG_LO) / (_LOG_HI - _LOG_LO) * _BINS).long().clamp(0, _BINS - 1)
        h = torch.zeros(_BINS, dtype=torch.int64, device=e.device).index_add_(0, idx, finite.long())
        self.hist = h if self.hist is None else self.hist + h

    def _get(self, key: str) -> float:
        """One running sum as a Python number (a host sync on a GPU; only `result` and friends call it)."""
        return 0.0 if self._acc is None else float(self._acc[key])

    @property
    def count(self) -> int:
        """Finite elements folded in so far."""
        return int(self._get("count"))

    @property
    def nonfinite(self) -> int:
        """Non-finite engine elements seen so far."""
        return int(self._get("nonfinite"))

    def quantile(self, q: float) -> float:
        """Approximate q-quantile of |error| (upper edge of the bin holding it)."""
        count = self.count
        if self.hist is None or count == 0:
            return float("nan")
        cdf = torch.cumsum(self.hist.cpu(), 0).double() / count
        i = int(torch.searchsorted(cdf, torch.tensor([q], dtype=torch.float64)).clamp(max=_BINS - 1))
        if i == 0:
            return 0.0  # the quantile lies among errors <= 1e-12 (bin 0 also holds exact zeros)
        return 10 ** (_LOG_LO + (i + 1) * (_LOG_HI - _LOG_LO) / _BINS)

    def result(self) -> dict[str, float]:
        """The statistics as a flat dict of floats (NaN where undefined)."""
        count, nonfinite = self.count, self.nonfinite
        n = max(count, 1)
        rr, ee, er, dd = (self._get(k) for k in ("rr", "ee", "er", "dd"))
        rel = math.sqrt(dd / rr) if rr > 0 else (0.0 if dd == 0 else math.inf)
        denom = math.sqrt(ee * rr)
        cos = er / denom if denom > 0 else (1.0 if dd == 0 else 0.0)
        sqnr = 10 * math.log10(rr / dd) if dd > 0 else math.inf
        exact = dd == 0
        return {
            "rel_l2": rel,
            "cosine": cos,
            "sqnr_db": min(sqnr, 300.0),  # identical tensors: report a capped 300 dB, not Inf
            "max_abs": self._get("max_abs"),
            "mean_abs": self._get("abs") / n,
            "p50_abs": 0.0 if exact else self.quantile(0.5),
            "p99_abs": 0.0 if exact else self.quantile(0.99),
            "p999_abs": 0.0 if exact else self.quantile(0.999),
            "ref_amax": self._get("ref_amax"),
            "nonfinite_frac": nonfinite / max(count + nonfinite, 1),
        }
