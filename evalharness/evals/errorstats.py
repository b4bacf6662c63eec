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
        self.sum_rr = 0.0
        self.sum_ee = 0.0
        self.sum_er = 0.0
        self.sum_dd = 0.0
        self.sum_abs = 0.0
        self.max_abs = 0.0
        self.ref_amax = 0.0
        self.count = 0
        self.nonfinite = 0
        self.hist: torch.Tensor | None = None

    def update(self, engine: torch.Tensor, reference: torch.Tensor) -> None:
        """Fold one batch in (shapes must match; float64 sums for stability)."""
        if engine.shape != reference.shape:
            raise ValueError(f"tap shapes differ: engine {tuple(engine.shape)} vs reference {tuple(reference.shape)}")
        e = engine.detach().double().flatten()
        r = reference.detach().double().flatten().to(e.device)
        finite = torch.isfinite(e)
        bad = int((~finite).sum())
        if bad:
            self.nonfinite += bad
            e, r = e[finite], r[finite]
        d = e - r
        ad = d.abs()
        self.sum_rr += float(r.dot(r))
        self.sum_ee += float(e.dot(e))
        self.sum_er += float(e.dot(r))
        self.sum_dd += float(d.dot(d))
        self.sum_abs += float(ad.sum())
        if ad.numel():
            self.max_abs = max(self.max_abs, float(ad.max()))
            self.ref_amax = max(self.ref_amax, float(r.abs().max()))
        self.count += int(ad.numel())
        logs = torch.log10(ad.clamp_min(10 ** _LOG_LO))
        idx = ((logs - _LOG_LO) / (_LOG_HI - _LOG_LO) * _BINS).long().clamp(0, _BINS - 1)
        h = torch.bincount(idx, minlength=_BINS).cpu()
        self.hist = h if self.hist is None else self.hist + h

    def quantile(self, q: float) -> float:
        """Approximate q-quantile of |error| (upper edge of the bin holding it)."""
        if self.hist is None or self.count == 0:
            return float("nan")
        cdf = torch.cumsum(self.hist, 0).double() / self.count
        i = int(torch.searchsorted(cdf, torch.tensor([q], dtype=torch.float64)).clamp(max=_BINS - 1))
        if i == 0:
            return 0.0  # the quantile lies among errors <= 1e-12 (bin 0 also holds exact zeros)
        return 10 ** (_LOG_LO + (i + 1) * (_LOG_HI - _LOG_LO) / _BINS)

    def result(self) -> dict[str, float]:
        """The statistics as a flat dict of floats (NaN where undefined)."""
        n = max(self.count, 1)
        rel = math.sqrt(self.sum_dd / self.sum_rr) if self.sum_rr > 0 else (0.0 if self.sum_dd == 0 else math.inf)
        denom = math.sqrt(self.sum_ee * self.sum_rr)
        cos = self.sum_er / denom if denom > 0 else (1.0 if self.sum_dd == 0 else 0.0)
        sqnr = 10 * math.log10(self.sum_rr / self.sum_dd) if self.sum_dd > 0 else math.inf
        exact = self.sum_dd == 0
        return {
            "rel_l2": rel,
            "cosine": cos,
            "sqnr_db": min(sqnr, 300.0),  # identical tensors: report a capped 300 dB, not Inf
            "max_abs": self.max_abs,
            "mean_abs": self.sum_abs / n,
            "p50_abs": 0.0 if exact else self.quantile(0.5),
            "p99_abs": 0.0 if exact else self.quantile(0.99),
            "p999_abs": 0.0 if exact else self.quantile(0.999),
            "ref_amax": self.ref_amax,
            "nonfinite_frac": self.nonfinite / max(self.count + self.nonfinite, 1),
        }
