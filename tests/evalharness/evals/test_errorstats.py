"""Streaming per-tap error statistics (evalharness.evals.errorstats) against direct float64 formulas and exact
order statistics; the runner's per-eval-part timing."""

from __future__ import annotations

import math

import pytest
import torch

from evalharness.evals.errorstats import BIN_RATIO, ERROR_STATS, ErrorAccumulator, fold_reference


def _pair(n: int, seed: int, rel: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine, reference) fp32 (n,): reference magnitudes spread over 9 decades, engine = reference + rel noise."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 9 - 6)
    e = r + rel * r.abs() * torch.randn(n, generator=g)
    return e.float(), r.float()


def _direct(e: torch.Tensor, r: torch.Tensor) -> dict[str, float]:
    """The statistics straight from their definitions, float64."""
    e, r = e.double(), r.double()
    d = e - r
    return {"rel_l2": float(d.norm() / r.norm()), "cosine": float(e.dot(r) / (e.norm() * r.norm())),
            "sqnr_db": float(10 * torch.log10(r.dot(r) / d.dot(d))), "max_abs": float(d.abs().max()),
            "mean_abs": float(d.abs().mean()), "ref_amax": float(r.abs().max())}


def test_stats_match_direct_formulas():
    e, r = _pair(50_000, seed=1)
    acc = ErrorAccumulator()
    acc.update(e.view(50, 1000), r.view(50, 1000))
    res, want = acc.result(), _direct(e, r)
    for k, v in want.items():
        assert res[k] == pytest.approx(v, rel=1e-12), k
    assert res["nonfinite_frac"] == 0.0 and acc.count == 50_000
    assert 1e-4 < res["rel_l2"] < 1e-2  # the planted 1e-3 relative noise


def test_streaming_equals_one_update():
    """Three updates of parts == one update of the whole (sums to rounding, histogram exactly)."""
    e, r = _pair(30_000, seed=2)
    whole, parts = ErrorAccumulator(), ErrorAccumulator()
    whole.update(e, r)
    for a, b in ((0, 7_000), (7_000, 7_001), (7_001, 30_000)):
        parts.update(e[a:b], r[a:b])
    assert torch.equal(whole.hist, parts.hist)
    torch.testing.assert_close(parts.state, whole.state, rtol=1e-12, atol=0.0)
    assert parts.result()["p99_abs"] == whole.result()["p99_abs"]


@pytest.mark.parametrize("seed,rel", [(3, 1e-3), (4, 1e-1), (5, 1e-6)])
def test_quantiles_within_one_bin_above_the_exact_order_statistic(seed, rel):
    """p = upper edge of the bin of x_(k), k = ceil(q n): x_(k) <= p <= x_(k) * BIN_RATIO (5.9 %)."""
    e, r = _pair(20_000, seed=seed, rel=rel)
    acc = ErrorAccumulator()
    acc.update(e, r)
    res = acc.result()
    d = (e.double() - r.double()).abs()
    for q, key in ((0.5, "p50_abs"), (0.99, "p99_abs"), (0.999, "p999_abs")):
        exact = float(torch.kthvalue(d, math.ceil(q * d.numel())).values)
        assert exact <= res[key] <= exact * BIN_RATIO * (1 + 1e-9), (key, exact, res[key])
    assert res["p50_abs"] < res["p99_abs"] < res["p999_abs"] <= res["max_abs"] * BIN_RATIO


def test_nonfinite_engine_entries_make_the_error_statistics_nan():
    """inf / NaN engine entries: reported as nonfinite_frac, and every error statistic is NaN (never "exact");
    `finite_result` gives the statistics over the finite entries as if the others were absent."""
    e, r = _pair(10_000, seed=6)
    bad = torch.zeros(10_000, dtype=torch.bool)
    bad[::97] = True
    e_bad = e.clone()
    e_bad[bad] = torch.tensor([float("inf"), float("nan"), -float("inf")]).repeat(200)[: int(bad.sum())]
    with_bad, clean = ErrorAccumulator(), ErrorAccumulator()
    with_bad.update(e_bad, r)
    clean.update(e[~bad], r[~bad])
    nan = with_bad.result()
    assert nan["nonfinite_frac"] == pytest.approx(int(bad.sum()) / 10_000)
    assert all(math.isnan(nan[k]) for k in ERROR_STATS) and nan["ref_amax"] == clean.result()["ref_amax"]
    a, b = with_bad.finite_result(), clean.result()
    assert a.pop("nonfinite_frac") == pytest.approx(int(bad.sum()) / 10_000) and b.pop("nonfinite_frac") == 0.0
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-12), k
    assert with_bad.count == clean.count == 10_000 - int(bad.sum()) and with_bad.nonfinite == int(bad.sum())


def test_identical_and_out_of_range_errors():
    """Identical tensors are exact (0 error, 300 dB); errors below 1e-12 read 0, above 1e6 read the top edge."""
    r = torch.randn(1000).double() * 1e9
    acc = ErrorAccumulator()
    acc.update(r.clone(), r)
    res = acc.result()
    assert (res["rel_l2"], res["sqnr_db"], res["p99_abs"], res["max_abs"], res["cosine"]) == (0.0, 300.0, 0.0, 0.0,
                                                                                              1.0)
    tiny, huge = ErrorAccumulator(), ErrorAccumulator()
    x = torch.ones(1000, dtype=torch.float64)
    tiny.update(x + 1e-13, x)
    huge.update(x + 1e8, x)
    assert tiny.result()["rel_l2"] > 0 and tiny.result()["p50_abs"] == 0.0
    assert huge.result()["p50_abs"] == pytest.approx(1e6) and huge.result()["max_abs"] == pytest.approx(1e8)


def test_update_checks_shapes_and_empty_tensors():
    acc = ErrorAccumulator()
    with pytest.raises(ValueError, match=r"engine \(2, 3\) vs reference \(3, 2\)"):
        acc.update(torch.zeros(2, 3), torch.zeros(3, 2))
    acc.update(torch.zeros(0), torch.zeros(0))
    assert acc.count == 0 and math.isnan(acc.quantile(0.5)) and acc.result()["rel_l2"] == 0.0


def test_fold_reference_accepts_mixed_dtypes():
    """bf16 engine taps against an fp32 reference: the same state as both in float64."""
    e, r = _pair(4096, seed=7, rel=1e-2)
    eb = e.bfloat16()
    s1, h1 = torch.zeros(8, dtype=torch.float64), torch.zeros(720, dtype=torch.float64)
    s2, h2 = s1.clone(), h1.clone()
    fold_reference(eb, r, s1, h1)
    fold_reference(eb.double(), r.double(), s2, h2)
    assert torch.equal(s1, s2) and torch.equal(h1, h2) and float(h1.sum()) == 4096


def test_runner_adds_eval_part_timings(tmp_path, monkeypatch):
    """What an eval puts in ctx.timing ('<eval>.<part>_s') reaches the result's timing, next to '<eval>_s'."""
    import evalharness.runner as runner
    from evalharness.results import load_result
    from evalharness.suite import load_suite

    (tmp_path / "s.yaml").write_text(
        "name: t\nmodels: [{name: tiny, path: 'builtin:tiny-llama'}]\ncorpus: 'builtin:tiny-llama'\n"
        "recipes: [fp32]\nevals: {layer_error: {windows: 1, seq_len: 16}}\n")
    real = runner.run_eval

    def timed(name, ctx, cfg):
        ctx.timing[f"{name}.part_a_s"] = 1.25
        return real(name, ctx, cfg)

    monkeypatch.setattr(runner, "run_eval", timed)
    (outcome,) = runner.run_suite(load_suite(tmp_path / "s.yaml"), tmp_path / "out", log=lambda s: None)
    timing = load_result(outcome.path)["timing"]
    assert outcome.status == "ok" and timing["layer_error.part_a_s"] == 1.25
    assert timing["layer_error_s"] >= 0 and timing["total_s"] >= timing["layer_error_s"]
