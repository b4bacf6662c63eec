"""Tests for evalharness.stats against textbook / hand-computed values and scipy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sst

from evalharness import stats
from evalharness.stats import (benjamini_hochberg, binomial_ci, bootstrap_ci, flip_rates, holm,
                               mcnemar_exact, mde_mean_diff, mde_paired_proportions, mean_ci,
                               noninferiority, paired_bootstrap_delta, paired_test, ppl_ci,
                               ppl_ratio_ci, quantile_ci, required_n_mean_diff,
                               required_n_paired_proportions, tost_equivalence)

Z975 = 1.959963984540054  # norm.ppf(0.975)
Z80 = 0.8416212335729143  # norm.ppf(0.80)


def assert_plain(obj):
    """Recursively assert only plain Python JSON types (no numpy scalars)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str)
            assert_plain(v)
    elif isinstance(obj, list):
        for v in obj:
            assert_plain(v)
    else:
        assert obj is None or type(obj) in (bool, int, float, str), (obj, type(obj))


def table(n11, n10, n01, n00):
    """Per-item correctness arrays (a, b) realising a paired 2x2 table."""
    a = [1] * n11 + [1] * n10 + [0] * n01 + [0] * n00
    b = [1] * n11 + [0] * n10 + [1] * n01 + [0] * n00
    return np.array(a, bool), np.array(b, bool)


# ------------------------------------------------------------------ binomial

def test_wilson_k8_n10():
    r = binomial_ci(8, 10)
    # known: 0.4902 .. 0.9433
    assert r["lo"] == pytest.approx(0.4902, abs=5e-4)
    assert r["hi"] == pytest.approx(0.9433, abs=5e-4)
    # hand formula: centre = (p + z^2/2n)/(1 + z^2/n), half = z/(1+z^2/n) sqrt(p(1-p)/n + z^2/4n^2)
    p, n, z = 0.8, 10, Z975
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z / den * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert r["lo"] == pytest.approx(centre - half, rel=1e-10)
    assert r["hi"] == pytest.approx(centre + half, rel=1e-10)
    assert r["p"] == 0.8
    assert_plain(r)


def test_clopper_pearson_k0_n10():
    r = binomial_ci(0, 10, method="clopper-pearson")
    assert r["lo"] == 0.0
    # closed form for k=0: hi = 1 - (alpha/2)^(1/n) = 1 - 0.025^0.1 = 0.3085
    assert r["hi"] == pytest.approx(1 - 0.025 ** 0.1, rel=1e-9)
    assert r["hi"] == pytest.approx(0.3085, abs=1e-4)
    r = binomial_ci(10, 10, method="exact")
    assert r["hi"] == 1.0 and r["lo"] == pytest.approx(0.025 ** 0.1, rel=1e-9)


def test_binomial_edges_and_errors():
    w = binomial_ci(0, 10)
    assert w["lo"] == 0.0 and 0 < w["hi"] < 0.31
    with pytest.raises(ValueError):
        binomial_ci(11, 10)
    with pytest.raises(ValueError):
        binomial_ci(1, 0)
    with pytest.raises(ValueError):
        binomial_ci(1, 10, method="agresti")


# ------------------------------------------------------------------ mean_ci

def test_mean_ci_t_interval_by_hand():
    x = [2.1, 3.4, 1.9, 5.6, 4.0]
    # mean = 17/5 = 3.4; sum of squared deviations = 1.69+0+2.25+4.84+0.36 = 9.14
    # s^2 = 9.14/4 = 2.285, se = sqrt(2.285/5) = 0.676018; t_{0.975,4} = 2.776445
    se = math.sqrt(2.285 / 5)
    q = sst.t.ppf(0.975, 4)
    r = mean_ci(x)
    assert r["mean"] == pytest.approx(3.4)
    assert r["se"] == pytest.approx(se, rel=1e-12)
    assert r["lo"] == pytest.approx(3.4 - q * se, rel=1e-12)
    assert r["hi"] == pytest.approx(3.4 + q * se, rel=1e-12)
    assert r["lo"] == pytest.approx(1.523072, abs=1e-5)
    assert r["hi"] == pytest.approx(5.276928, abs=1e-5)
    assert (r["n"], r["n_clusters"], r["df"]) == (5, 5, 4)
    assert_plain(r)


def test_mean_ci_lower_bound_cuts_the_interval_at_what_the_mean_can_be():
    """A KL divergence is >= 0: all windows 0 but one gives a t-interval reaching below 0, which `lower=0` cuts
    there; the mean, se and an upper end above the bound are unchanged, and a not estimable interval stays NaN."""
    x = [0.0] * 255 + [3e-4]
    free, cut = mean_ci(x), mean_ci(x, lower=0.0)
    assert free["lo"] < 0 and cut["lo"] == 0.0
    assert (cut["mean"], cut["se"], cut["hi"]) == (free["mean"], free["se"], free["hi"])
    inside = mean_ci([2.1, 3.4, 1.9, 5.6, 4.0], lower=0.0)
    assert inside["lo"] == mean_ci([2.1, 3.4, 1.9, 5.6, 4.0])["lo"] > 0
    assert math.isnan(mean_ci([1.0], lower=0.0)["lo"])
    assert_plain(cut)


def test_mean_ci_cluster_singletons_equals_iid():
    x = np.random.default_rng(3).normal(size=57)
    iid = mean_ci(x)
    cl = mean_ci(x, clusters=np.arange(57)[::-1])  # any labelling, one obs each
    for key in ("mean", "se", "lo", "hi"):
        assert cl[key] == pytest.approx(iid[key], rel=1e-12)
    assert cl["n_clusters"] == 57


def test_mean_ci_perfectly_correlated_clusters():
    g, k = 12, 8
    vals = np.random.default_rng(4).normal(size=g)
    x = np.repeat(vals, k)  # every token in a window has the same value
    ids = np.repeat(np.arange(g), k)
    iid = mean_ci(x)
    cl = mean_ci(x, clusters=ids)
    # design effect 1 + (k-1)*rho with rho = 1: se_cl^2 / se_iid^2 = (G k - 1)/(G - 1) ~ k
    assert (cl["se"] / iid["se"]) ** 2 == pytest.approx((g * k - 1) / (g - 1), rel=1e-10)
    # equals the iid SE of the G cluster means
    assert cl["se"] == pytest.approx(np.std(vals, ddof=1) / math.sqrt(g), rel=1e-10)
    assert cl["df"] == g - 1 and cl["n_clusters"] == g and cl["n"] == g * k
    assert cl["hi"] - cl["lo"] > 2.5 * (iid["hi"] - iid["lo"])


def test_mean_ci_degenerate():
    r = mean_ci([1.5, 1.5, 1.5])
    assert r["se"] == 0.0 and r["lo"] == r["hi"] == 1.5
    r = mean_ci([2.0])
    assert r["mean"] == 2.0 and math.isnan(r["se"]) and math.isnan(r["lo"])
    with pytest.raises(ValueError):
        mean_ci([1.0, float("nan")])
    with pytest.raises(ValueError):
        mean_ci([1.0, 2.0], clusters=[0])


# ------------------------------------------------------------------ quantile

def test_quantile_ci_median_n10_textbook():
    x = np.arange(10.0) * 2  # sorted: 0,2,...,18
    r = quantile_ci(x, 0.5, 0.05)
    # textbook: median CI for n=10 is [x_(2), x_(9)], coverage 1 - 2*(1+10)/1024 = 0.978515625
    assert (r["lo_rank"], r["hi_rank"]) == (2, 9)
    assert (r["lo"], r["hi"]) == (2.0, 16.0)
    assert r["coverage"] == pytest.approx(1 - 2 * 11 / 1024)
    assert r["value"] == 9.0
    assert_plain(r)
    # n = 100: F(39) = 0.0176 <= 0.025 < F(40) = 0.0284 -> l = 40;
    # F(59) = 0.9716 < 0.975 <= F(60) = 0.9824 -> u = 61; coverage F(60) - F(39) = 0.9648
    r = quantile_ci(np.arange(1.0, 101.0), 0.5)
    assert (r["lo"], r["hi"]) == (40.0, 61.0)
    assert r["coverage"] == pytest.approx(0.9648, abs=1e-4)


def test_quantile_ci_unbounded_and_coverage():
    r = quantile_ci(np.arange(10.0), 0.99)
    assert r["hi"] == math.inf  # n = 10 cannot bound the 99th percentile from above
    rng = np.random.default_rng(5)
    true_q = sst.expon.ppf(0.9)
    hits = 0
    for _ in range(400):
        s = rng.exponential(size=60)
        c = quantile_ci(s, 0.9)
        hits += c["lo"] <= true_q <= c["hi"]
    assert hits / 400 >= 0.92  # guaranteed >= 0.95 in expectation


# ------------------------------------------------------------------ bootstrap

def test_bootstrap_deterministic_and_seeded():
    x = np.random.default_rng(6).normal(size=100)
    a = bootstrap_ci(x, "mean", n_boot=500, seed=42)
    b = bootstrap_ci(x, "mean", n_boot=500, seed=42)
    c = bootstrap_ci(x, "mean", n_boot=500, seed=43)
    assert a == b and a != c
    g = bootstrap_ci(x, "mean", n_boot=500, seed=np.random.default_rng(42))
    assert g == a
    f = bootstrap_ci(x, np.mean, n_boot=500, seed=42)  # callable draws the same resamples
    assert f["lo"] == pytest.approx(a["lo"], rel=1e-12) and f["hi"] == pytest.approx(a["hi"], rel=1e-12)
    assert_plain(a)


def test_bootstrap_covers_true_mean():
    x = np.random.default_rng(1).normal(5.0, 1.0, size=400)
    big = bootstrap_ci(x, "mean", seed=0)
    assert big["lo"] < 5.0 < big["hi"]
    # for normal data the percentile interval is close to the t interval
    t = mean_ci(x)
    width = t["hi"] - t["lo"]
    assert abs(big["lo"] - t["lo"]) < 0.1 * width and abs(big["hi"] - t["hi"]) < 0.1 * width
    # a fixed sample can miss (5 % of the time); coverage over many samples is the real check
    rng = np.random.default_rng(7)
    cover = 0
    for i in range(200):
        r = bootstrap_ci(rng.normal(5.0, 1.0, size=50), "mean", n_boot=400, seed=i)
        cover += r["lo"] < 5.0 < r["hi"]
    assert 0.88 <= cover / 200 <= 0.99


def test_bootstrap_paired_vs_unpaired_and_clusters():
    x = np.random.default_rng(8).normal(size=80)
    p = bootstrap_ci((x, x + 1.0), "mean_diff", n_boot=300)
    assert p["paired"] is True and p["estimate"] == pytest.approx(1.0)
    assert p["hi"] - p["lo"] < 1e-9  # pairs resampled together: no variability
    u = bootstrap_ci((x, x + 1.0), "mean_diff", n_boot=300, paired=False)
    assert u["hi"] - u["lo"] > 0.3
    two = bootstrap_ci((x, x[:50]), lambda a, b: np.median(b) - np.median(a), n_boot=200)
    assert two["paired"] is False and two["n_clusters"] is None
    ids = np.arange(80) // 8
    cv = bootstrap_ci(x, "mean", n_boot=300, clusters=ids, seed=1)
    cc = bootstrap_ci(x, lambda s: float(np.mean(s)), n_boot=300, clusters=ids, seed=1)
    assert cv["n_clusters"] == 10
    assert cv["lo"] == pytest.approx(cc["lo"], rel=1e-10) and cv["hi"] == pytest.approx(cc["hi"], rel=1e-10)
    pc = bootstrap_ci((x, 2 * x), lambda a, b: np.mean(b - a), n_boot=200, clusters=ids)
    assert pc["lo"] <= pc["estimate"] <= pc["hi"]
    with pytest.raises(ValueError):
        bootstrap_ci(x, "mode")


# ------------------------------------------------------------------ perplexity

def test_ppl_ci_is_exp_of_mean_interval():
    nll = np.random.default_rng(9).gamma(2.0, 1.0, size=300)
    m = mean_ci(nll)
    r = ppl_ci(nll)
    assert r["ppl"] == pytest.approx(math.exp(nll.mean()))
    assert r["lo"] == pytest.approx(math.exp(m["lo"])) and r["hi"] == pytest.approx(math.exp(m["hi"]))
    assert r["mean_nll"] == pytest.approx(m["mean"]) and r["se"] == m["se"]
    assert_plain(r)


def test_ppl_ratio_identical_is_exactly_one():
    a = np.random.default_rng(10).gamma(2.0, 1.0, size=500)
    r = ppl_ratio_ci(a, a.copy())
    assert r["ratio"] == 1.0 and r["lo"] == 1.0 and r["hi"] == 1.0
    assert r["se"] == 0.0 and r["log_ratio"] == 0.0
    r = ppl_ratio_ci(a, a.copy(), clusters=np.arange(500) // 50)
    assert r["ratio"] == 1.0 and r["lo"] == r["hi"] == 1.0
    assert_plain(r)


def test_ppl_ratio_constant_shift_is_tight():
    a = np.random.default_rng(11).gamma(2.0, 1.0, size=1000)
    c = 0.03
    r = ppl_ratio_ci(a, a + c)
    assert r["ratio"] == pytest.approx(math.exp(c), rel=1e-12)
    assert r["lo"] == pytest.approx(math.exp(c), rel=1e-9) and r["hi"] == pytest.approx(math.exp(c), rel=1e-9)
    # an unpaired interval (treating a and b as independent samples) is much wider
    ma, mb = mean_ci(a), mean_ci(a + c)
    se_unp = math.sqrt(ma["se"] ** 2 + mb["se"] ** 2)
    q = sst.t.ppf(0.975, 999)
    unpaired_width = math.exp(c + q * se_unp) - math.exp(c - q * se_unp)
    assert r["se_unpaired"] == pytest.approx(se_unp)
    assert r["hi"] - r["lo"] < 1e-6 * unpaired_width
    assert r["corr"] == pytest.approx(1.0)


def test_ppl_ratio_variance_identity_and_clusters():
    rng = np.random.default_rng(12)
    window = np.repeat(rng.normal(0, 0.5, size=40), 25)  # shared per-window difficulty
    a = 2.0 + window + rng.normal(0, 0.3, size=1000)
    b = a + 0.02 + rng.normal(0, 0.05, size=1000)
    ids = np.repeat(np.arange(40), 25)
    for cl in (None, ids):
        r = ppl_ratio_ci(a, b, clusters=cl)
        # var(d) = var(a) + var(b) - 2 cov(a, b), in SE form with the reported corr
        lhs = r["se"] ** 2
        rhs = r["se_a"] ** 2 + r["se_b"] ** 2 - 2 * r["corr"] * r["se_a"] * r["se_b"]
        assert lhs == pytest.approx(rhs, rel=1e-8)
        assert r["corr"] > 0.9
        assert r["log_ratio"] == pytest.approx(b.mean() - a.mean())
        assert r["lo"] < r["ratio"] < r["hi"]
        assert r["se"] < 0.2 * r["se_unpaired"]
    assert ppl_ratio_ci(a, b, clusters=ids)["n_clusters"] == 40
    with pytest.raises(ValueError):
        ppl_ratio_ci(a, b[:-1])


# ------------------------------------------------------------------ McNemar / flips

def test_mcnemar_textbook():
    a, b = table(n11=30, n10=8, n01=2, n00=10)
    r = mcnemar_exact(a, b)
    # P = 2 * P(X <= 2), X ~ Bin(10, 1/2) = 2 * (1 + 10 + 45)/1024 = 0.109375
    assert (r["n01"], r["n10"]) == (2, 8)
    assert r["p_value"] == pytest.approx(0.109375, abs=1e-12)
    assert r["p_value"] == pytest.approx(0.1094, abs=1e-4)
    assert r["statistic"] == 2
    assert r["delta"] == pytest.approx((2 - 8) / 50)
    assert_plain(r)
    a, b = table(n11=10, n10=5, n01=0, n00=3)
    assert mcnemar_exact(a, b)["p_value"] == pytest.approx(2 / 32)  # 2 * 0.5^5


def test_mcnemar_no_discordance():
    a, b = table(n11=20, n10=0, n01=0, n00=5)
    r = mcnemar_exact(a, b)
    assert r["p_value"] == 1.0 and r["n01"] == 0 and r["n10"] == 0
    with pytest.raises(ValueError):
        mcnemar_exact([1, 0, 2], [1, 0, 1])


def test_flip_rates():
    a, b = table(n11=70, n10=6, n01=4, n00=20)
    r = flip_rates(a, b)
    assert r["n"] == 100
    assert r["correct_to_wrong"]["k"] == 6 and r["correct_to_wrong"]["rate"] == 0.06
    assert r["wrong_to_correct"]["k"] == 4 and r["wrong_to_correct"]["rate"] == 0.04
    w = binomial_ci(6, 100)
    assert (r["correct_to_wrong"]["lo"], r["correct_to_wrong"]["hi"]) == (w["lo"], w["hi"])
    assert r["net"] == pytest.approx(-0.02)
    assert_plain(r)


def test_paired_bootstrap_delta():
    a, b = table(n11=60, n10=5, n01=15, n00=20)
    r = paired_bootstrap_delta(a, b, n_boot=1000, seed=1)
    assert r["delta"] == pytest.approx(0.10)
    assert r["lo"] < 0.10 < r["hi"]
    # normal check: sd of d in {-1,0,1}: var = 0.2 - 0.01 = 0.19 ->  se ~ sqrt(0.19/100) = 0.0436
    assert r["se"] == pytest.approx(math.sqrt(0.19 / 100), rel=0.15)
    assert r == paired_bootstrap_delta(a, b, n_boot=1000, seed=1)
    assert_plain(r)


# ------------------------------------------------------------------ paired tests

@pytest.mark.parametrize("method", ["wilcoxon", "t", "sign"])
def test_paired_test_all_zero_and_tiny(method):
    x = [1.0, 2.0, 3.0]
    r = paired_test(x, x, method=method)
    assert r["p_value"] == 1.0 and r["statistic"] == 0.0 and r["n_nonzero"] == 0
    r = paired_test([1.0], [1.5], method=method)
    assert 0.0 <= r["p_value"] <= 1.0
    r = paired_test([1.0, 2.0], [1.5, 2.5], method=method, alternative="less")
    assert 0.0 <= r["p_value"] <= 1.0
    assert_plain(r)


def test_paired_test_matches_scipy_and_direction():
    rng = np.random.default_rng(13)
    x = rng.normal(size=40)
    y = x + 0.4 + rng.normal(0, 0.5, size=40)
    d = y - x
    t = paired_test(x, y, "t", "greater")
    assert t["p_value"] == pytest.approx(sst.ttest_1samp(d, 0, alternative="greater").pvalue)
    w = paired_test(x, y, "wilcoxon", "two-sided")
    assert w["p_value"] == pytest.approx(sst.wilcoxon(d).pvalue)
    s = paired_test(x, y, "sign", "greater")
    k = int((d > 0).sum())
    assert s["statistic"] == k
    assert s["p_value"] == pytest.approx(sst.binomtest(k, 40, 0.5, "greater").pvalue)
    assert t["p_value"] < 0.01 and paired_test(x, y, "t", "less")["p_value"] > 0.99
    assert t["mean_diff"] == pytest.approx(d.mean())


# ------------------------------------------------------------------ TOST / NI

def test_tost_inside_and_outside():
    rng = np.random.default_rng(14)
    x = rng.normal(size=200)
    inside = x + 0.01 + rng.normal(0, 0.05, size=200)
    r = tost_equivalence(x, inside, margin=0.1)
    assert r["equivalent"] is True and r["p_value"] < 1e-6
    assert -0.1 < r["lo"] < r["hi"] < 0.1
    # cross-check the two one-sided tests against scipy
    d = inside - x
    assert r["p_lower"] == pytest.approx(sst.ttest_1samp(d, -0.1, alternative="greater").pvalue)
    assert r["p_upper"] == pytest.approx(sst.ttest_1samp(d, 0.1, alternative="less").pvalue)
    outside = x + 0.5 + rng.normal(0, 0.05, size=200)
    r2 = tost_equivalence(x, outside, margin=0.1)
    assert r2["equivalent"] is False and r2["p_value"] > 0.5
    # one-sample form and asymmetric margins
    assert tost_equivalence(rng.normal(0.0, 0.01, size=50), margin=(-0.02, 0.05))["equivalent"]
    # unpaired (Welch): noisy independent samples cannot show equivalence at 0.1
    assert tost_equivalence(x, inside, margin=0.1, paired=False)["equivalent"] is False
    assert tost_equivalence([0.0], margin=1.0)["equivalent"] is False
    assert_plain(r)


def test_noninferiority():
    rng = np.random.default_rng(15)
    x = rng.normal(2.0, 1.0, size=300)
    y = x + 0.005 + rng.normal(0, 0.02, size=300)  # candidate NLL slightly higher
    r = noninferiority(x, y, margin=0.02, higher_is_better=False)
    d = y - x
    assert r["noninferior"] is True
    assert r["p_value"] == pytest.approx(sst.ttest_1samp(d, 0.02, alternative="less").pvalue)
    q = sst.t.ppf(0.95, 299)
    assert r["bound"] == pytest.approx(d.mean() + q * d.std(ddof=1) / math.sqrt(300))
    assert noninferiority(x, y, margin=0.001, higher_is_better=False)["noninferior"] is False
    acc = noninferiority(x, x - 0.005 + rng.normal(0, 0.02, size=300), margin=0.02)
    assert acc["noninferior"] is True and acc["bound"] > -0.02
    assert noninferiority(x, x - 0.05, margin=0.02)["noninferior"] is False
    assert_plain(r)


# ------------------------------------------------------------------ multiple testing

def test_holm_standard_example():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted: 0.005, 0.01, 0.03, 0.04; multipliers m-j+1 = 4, 3, 2, 1
    # 4*0.005 = 0.02, 3*0.01 = 0.03, 2*0.03 = 0.06, 1*0.04 = 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    # back in input order: [0.03, 0.06, 0.06, 0.02]
    r = holm(p, 0.05)
    assert r["adjusted"] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert r["reject"] == [True, False, False, True]
    assert_plain(r)


def test_bh_standard_example():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted: 0.005, 0.01, 0.03, 0.04; m*p/j = 0.02, 0.02, 0.04, 0.04 -> running min from the
    # top keeps 0.02, 0.02, 0.04, 0.04; input order: [0.02, 0.04, 0.04, 0.02]
    r = benjamini_hochberg(p, 0.05)
    assert r["adjusted"] == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert r["reject"] == [True, True, True, True]
    assert benjamini_hochberg(p, 0.03)["reject"] == [True, False, False, True]
    assert holm([], 0.05)["adjusted"] == [] and benjamini_hochberg([])["reject"] == []
    with pytest.raises(ValueError):
        holm([0.5, 1.2])


def _holm_stepdown(p, alpha):
    """Reference: Holm's sequential rejection rule."""
    order = np.argsort(p, kind="stable")
    rej = np.zeros(len(p), bool)
    for i, j in enumerate(order):
        if p[j] <= alpha / (len(p) - i):
            rej[j] = True
        else:
            break
    return rej.tolist()


def _bh_stepup(p, alpha):
    """Reference: BH step-up rule: reject the k smallest, k = max{i: p_(i) <= i alpha/m}."""
    m = len(p)
    order = np.argsort(p, kind="stable")
    ok = [i + 1 for i in range(m) if p[order[i]] <= (i + 1) * alpha / m]
    rej = np.zeros(m, bool)
    if ok:
        rej[order[:max(ok)]] = True
    return rej.tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=25),
       st.sampled_from([0.01, 0.05, 0.1]))
def test_adjustments_properties(p, alpha):
    for fn, ref in ((holm, _holm_stepdown), (benjamini_hochberg, _bh_stepup)):
        r = fn(p, alpha)
        adj = np.array(r["adjusted"])
        assert len(adj) == len(p)
        assert np.all(adj >= np.array(p) - 1e-12) and np.all(adj <= 1.0)
        order = np.argsort(p, kind="stable")
        assert np.all(np.diff(adj[order]) >= -1e-12)  # monotone in the raw p-values
        assert r["reject"] == ref(np.array(p), alpha)
    assert np.all(np.array(benjamini_hochberg(p)["adjusted"]) <= np.array(holm(p)["adjusted"]) + 1e-12)


# ------------------------------------------------------------------ power / MDE

def test_mde_hand_computation_n1000():
    # Connor (1987): sqrt(n) d = z_a sqrt(psi) + z_b sqrt(psi - d^2), solved for d:
    #   d = sqrt(psi) (z_a sqrt(n) + z_b sqrt(n - z_a^2 + z_b^2)) / (n + z_b^2)
    # z_a = 1.959964, z_b = 0.841621, n = 1000, psi = 0.1
    #   n - z_a^2 + z_b^2 = 1000 - 3.841459 + 0.708326 = 996.866867, sqrt = 31.573199
    #   z_a sqrt(n) = 1.959964 * 31.622777 = 61.979503
    #   z_b sqrt(.)  = 0.841621 * 31.573199 = 26.572674           sum = 88.552177
    #   / (1000 + 0.708326) = 0.0884895;  * sqrt(0.1) = 0.316228 -> 0.027983
    # (simple approximation (z_a + z_b) sqrt(psi/n) = 2.801585 * 0.0100000 = 0.028016)
    mde = mde_paired_proportions(1000, alpha=0.05, power=0.8, discordance=0.1)
    assert mde == pytest.approx(0.027983, abs=2e-6)
    assert mde == pytest.approx((Z975 + Z80) * math.sqrt(0.1 / 1000), rel=0.005)
    assert required_n_paired_proportions(mde, 0.05, 0.8, 0.1) == 1000


def test_mde_monotone_and_inverse():
    ns = [20, 50, 100, 300, 1000, 5000, 20000]
    vals = [mde_paired_proportions(n, discordance=0.2) for n in ns]
    assert all(a > b for a, b in zip(vals, vals[1:]))
    for n in (50, 400, 2500):
        assert required_n_paired_proportions(mde_paired_proportions(n, discordance=0.2),
                                             discordance=0.2) == n
    # default discordance is the documented conservative 0.5 and is larger than typical
    assert mde_paired_proportions(500) == mde_paired_proportions(500, discordance=0.5)
    assert mde_paired_proportions(500) > mde_paired_proportions(500, discordance=0.05)
    assert mde_paired_proportions(500, alternative="greater") < mde_paired_proportions(500)
    assert mde_paired_proportions(2) == math.inf
    with pytest.raises(ValueError):
        required_n_paired_proportions(0.3, discordance=0.1)  # |delta| > psi impossible


def test_mde_simulated_power():
    # exact McNemar at the MDE should have power close to 0.8 (normal approx, exact test
    # slightly conservative)
    n, psi = 1000, 0.1
    d = mde_paired_proportions(n, discordance=psi)
    p01 = (psi + d) / 2
    rng = np.random.default_rng(16)
    nd = rng.binomial(n, psi, size=4000)
    k = rng.binomial(nd, p01 / psi)
    lo = np.minimum(k, nd - k)
    pval = np.minimum(1.0, 2 * sst.binom.cdf(lo, nd, 0.5))
    power = float(np.mean(pval <= 0.05))
    assert 0.74 <= power <= 0.84


def test_mde_mean_diff():
    assert mde_mean_diff(2.0, 100, method="normal") == pytest.approx((Z975 + Z80) * 2.0 / 10)
    t_small = mde_mean_diff(1.0, 10)
    assert t_small > mde_mean_diff(1.0, 10, method="normal")
    assert mde_mean_diff(1.0, 5000) == pytest.approx(mde_mean_diff(1.0, 5000, method="normal"),
                                                     rel=1e-3)
    # power of the paired t test at the t-MDE is exactly 0.8
    ncp = t_small * math.sqrt(10)
    tc = sst.t.ppf(0.975, 9)
    assert sst.nct.sf(tc, 9, ncp) + sst.nct.cdf(-tc, 9, ncp) == pytest.approx(0.8, abs=1e-8)
    n = required_n_mean_diff(0.5, 1.0)
    assert mde_mean_diff(1.0, n) <= 0.5 < mde_mean_diff(1.0, n - 1)
    assert required_n_mean_diff(0.5, 1.0, method="normal") == math.ceil(((Z975 + Z80) / 0.5) ** 2)


# ------------------------------------------------------------------ API surface

def test_outputs_are_plain_json():
    rng = np.random.default_rng(17)
    x = rng.normal(size=30)
    y = x + rng.normal(0, 0.1, size=30)
    a, b = table(10, 3, 2, 5)
    outs = [mean_ci(x, clusters=np.arange(30) // 3), binomial_ci(3, 9), quantile_ci(x, 0.9),
            bootstrap_ci((x, y), "mean_diff", n_boot=50), ppl_ci(x + 3),
            ppl_ratio_ci(x + 3, y + 3), mcnemar_exact(a, b), flip_rates(a, b),
            paired_bootstrap_delta(a, b, n_boot=50), paired_test(x, y),
            tost_equivalence(x, y, margin=0.5), noninferiority(x, y, margin=0.5),
            holm([0.1, 0.2]), benjamini_hochberg([0.1, 0.2]),
            mde_paired_proportions(100), required_n_paired_proportions(0.05),
            mde_mean_diff(1.0, 30), required_n_mean_diff(0.2, 1.0),
            stats.discordance_rate(a, b)]
    for o in outs:
        assert_plain(o)
        json.dumps(o)
    assert type(outs[-1]) is float and type(outs[15]) is int
