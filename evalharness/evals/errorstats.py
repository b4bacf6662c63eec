"""Streaming error statistics between an engine tensor and a reference tensor.

Nothing holds all activations: each update folds one batch into running sums
and a fixed log-spaced histogram of absolute errors (for quantiles), on the
tensors' own device, without synchronizing a GPU.

Two implementations fold a batch into the same state: `fold_reference`
(pure torch, any device) and, for CUDA tensors when Triton is installed,
`evalharness.evals.errorstats_triton.fold` (two kernel launches: one pass
over the data with per-program float64 partials and an in-register
histogram, then one program that adds them into the state). Per tap, a
forward's capture cost on a GPU is mostly the host overhead of launching
work (the engine's forward is itself hundreds of small kernels), hence two
launches instead of a chain of ~40 torch ops (benchmarks/bench_capture.py
measures capture on vs off).

State (float64, on the tensors' device): ``state`` (8,) = [<e,e>, <e,r>,
<r,r>, <d,d>, sum |d|, count of finite engine entries, max |d|, max |r|]
with d = e - r; ``hist`` (720,) = counts of |d| in log-spaced bins (exact
integers up to 2**53).
"""

from __future__ import annotations

import math

import torch

from evalharness.evals.errorlayout import BINS, LOG_HI, LOG_LO, N_SUMS, STATE_SIZE

# Each bin spans (HI - LO) / BINS = 0.025 decades: its upper edge is 10**0.025 = 1.0593x its lower edge.
BIN_RATIO = 10 ** ((LOG_HI - LOG_LO) / BINS)
# histc puts x == max into the last bin; clamping just below it keeps huge errors (and inf) there too.
_LOG_TOP = LOG_HI - 0.5 * (LOG_HI - LOG_LO) / BINS
# The statistics of `ErrorAccumulator.result` that measure the error (NaN when the engine had non-finite entries).
ERROR_STATS = ("rel_l2", "cosine", "sqnr_db", "max_abs", "mean_abs", "p50_abs", "p99_abs", "p999_abs")
EE, ER, RR, DD, ABS_D, COUNT, MAX_D, MAX_R = range(STATE_SIZE)


def fold_reference(e: torch.Tensor, r: torch.Tensor, state: torch.Tensor, hist: torch.Tensor) -> None:
    """Fold e, r (n,) (any float dtypes, one device) into `state` (8,) and `hist` (BINS,) float64, in place.

    Entries where e is not finite count as no error: e and r are zeroed there (d = 0 lands in bin 0;
    `ErrorAccumulator` removes them from it, knowing how many there were). On a CPU, a tensor whose
    sum is finite skips the masking (a branch on a value costs nothing there; on a GPU it would sync)."""
    e = e.to(torch.float64)
    r = r.to(torch.float64)
    if e.device.type == "cpu" and math.isfinite(float(e.sum())):
        count = torch.tensor(float(e.numel()), dtype=torch.float64)
    else:
        finite = torch.isfinite(e)  # (n,)
        e, r = torch.where(finite, e, 0.0), torch.where(finite, r, 0.0)
        count = finite.sum()
    d = e - r  # (n,)
    ad = d.abs()
    r_lo, r_hi = torch.aminmax(r)
    state[:N_SUMS].add_(torch.stack((e.dot(e), e.dot(r), r.dot(r), d.dot(d), ad.sum(), count.to(torch.float64))))
    torch.maximum(state[N_SUMS:], torch.stack((ad.max(), torch.maximum(-r_lo, r_hi))), out=state[N_SUMS:])
    log_err = torch.log10(ad).clamp_(LOG_LO, _LOG_TOP)  # (n,)
    hist += torch.histc(log_err, bins=BINS, min=LOG_LO, max=LOG_HI)  # NaN (a NaN reference) is left out


def _triton_fold():
    """The Triton `fold`, or None where Triton is not installed (CPU-only CI)."""
    try:
        from evalharness.evals.errorstats_triton import fold
    except ImportError:
        return None
    return fold


class ErrorAccumulator:
    """Running error statistics of `engine` vs `reference` tensors of one tap.

    Stats: rel_l2 = ||e - r|| / ||r||, cosine = <e, r> / (||e|| ||r||),
    sqnr_db = 10 log10(||r||^2 / ||e - r||^2), max_abs, mean_abs,
    p50/p99/p999_abs, ref_amax and the non-finite fraction.

    Quantiles come from the histogram of |e - r| (720 log-spaced bins over
    [1e-12, 1e6]) and report the upper edge of the bin that holds the
    ceil(q n)-th smallest error x_(k): ``x_(k) <= p <= x_(k) * BIN_RATIO``
    (BIN_RATIO = 1.0593: at most 5.9 % high) for errors inside that range;
    0 when x_(k) <= 1e-12 (exact zeros included), 1e6 when x_(k) > 1e6.

    Sums accumulate in float64; entries where the engine is not finite are
    left out of the sums (both sides zeroed) and counted: `result` reports
    their share as ``nonfinite_frac`` and, when there is any, every error
    statistic as NaN (a tap with NaN/Inf outputs is never "exact"), while
    `finite_result` gives the statistics over the finite entries alone.
    `kernel`: None (default) uses the Triton fold for CUDA tensors when Triton
    is installed, False always the torch one (`fold_reference`).
    """

    def __init__(self, kernel: bool | None = None) -> None:
        self.kernel = kernel
        self.state: torch.Tensor | None = None  # (8,) float64, layout in the module docstring
        self.hist: torch.Tensor | None = None  # (BINS,) float64 counts
        self._seen = 0  # entries folded in (finite or not): known on the host without a sync

    def update(self, engine: torch.Tensor, reference: torch.Tensor) -> None:
        """Fold one batch in: `engine` and `reference` of the same shape (any), float dtypes; no host sync."""
        if engine.shape != reference.shape:
            raise ValueError(f"tap shapes differ: engine {tuple(engine.shape)} vs reference {tuple(reference.shape)}")
        e = engine.detach().reshape(-1)  # (n,)
        r = reference.detach().reshape(-1).to(e.device)  # (n,)
        if self.state is None:
            self.state = torch.zeros(STATE_SIZE, dtype=torch.float64, device=e.device)
            self.hist = torch.zeros(BINS, dtype=torch.float64, device=e.device)
        elif self.state.device != e.device:
            raise ValueError(f"tap tensors moved from {self.state.device} to {e.device} between updates")
        if e.numel():
            fold = _triton_fold() if e.is_cuda and self.kernel is not False else None
            if fold is None and self.kernel:
                raise RuntimeError("ErrorAccumulator(kernel=True) needs CUDA tensors and Triton")
            (fold or fold_reference)(e.contiguous(), r.contiguous(), self.state, self.hist)
        self._seen += e.numel()

    @property
    def count(self) -> int:
        """Finite elements folded in so far."""
        return 0 if self.state is None else int(self.state[COUNT])

    @property
    def nonfinite(self) -> int:
        """Non-finite engine elements seen so far."""
        return self._seen - self.count

    def quantile(self, q: float) -> float:
        """q-quantile of |error| from the histogram: the upper edge of the bin holding the
        ceil(q n)-th smallest error (at most BIN_RATIO = 1.0593x the exact order statistic)."""
        count = self.count
        if self.hist is None or count == 0:
            return float("nan")
        h = self.hist.detach().cpu().clone()
        h[0] -= self.nonfinite  # the zeroed non-finite entries sit in bin 0
        cdf = torch.cumsum(h, 0) / count
        i = int(torch.searchsorted(cdf, torch.tensor([q], dtype=torch.float64)).clamp(max=BINS - 1))
        if i == 0:
            return 0.0  # the quantile lies among errors <= 1e-12 (bin 0 also holds exact zeros)
        return 10 ** (LOG_LO + (i + 1) * (LOG_HI - LOG_LO) / BINS)

    def result(self) -> dict[str, float]:
        """The statistics as a flat dict of floats: NaN where undefined, and every error statistic NaN when the
        engine had non-finite entries (``nonfinite_frac`` > 0), so that no rule on them can pass."""
        res = self.finite_result()
        if self.nonfinite:
            res.update({k: math.nan for k in ERROR_STATS})
        return res

    def finite_result(self) -> dict[str, float]:
        """The statistics over the finite engine entries alone (NaN where undefined), with ``nonfinite_frac``."""
        s = [0.0] * STATE_SIZE if self.state is None else self.state.detach().cpu().tolist()
        count, nonfinite = int(s[COUNT]), self._seen - int(s[COUNT])
        n = max(count, 1)
        ee, er, rr, dd = s[EE], s[ER], s[RR], s[DD]
        rel = math.sqrt(dd / rr) if rr > 0 else (0.0 if dd == 0 else math.inf)
        denom = math.sqrt(ee * rr)
        cos = er / denom if denom > 0 else (1.0 if dd == 0 else 0.0)
        sqnr = 10 * math.log10(rr / dd) if dd > 0 else math.inf
        exact = dd == 0
        return {
            "rel_l2": rel,
            "cosine": cos,
            "sqnr_db": min(sqnr, 300.0),  # identical tensors: report a capped 300 dB, not Inf
            "max_abs": s[MAX_D],
            "mean_abs": s[ABS_D] / n,
            "p50_abs": 0.0 if exact else self.quantile(0.5),
            "p99_abs": 0.0 if exact else self.quantile(0.99),
            "p999_abs": 0.0 if exact else self.quantile(0.999),
            "ref_amax": s[MAX_R],
            "nonfinite_frac": nonfinite / max(count + nonfinite, 1),
        }
