"""posinterp.stats against closed forms and independent implementations (issue 35)."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from posinterp.stats import (
    bh_qvalues,
    bootstrap_percentile_ci,
    mean_t_interval,
    percentile_interval,
    permutation_p_floor,
    stratified_bootstrap_means,
    t_critical,
)


def test_t_critical_is_the_two_sided_quantile():
    for level, df in ((0.95, 1), (0.9, 4), (0.99, 30)):
        assert t_critical(level, df) == pytest.approx(stats.t.interval(level, df)[1], rel=1e-14)
        assert stats.t.cdf(t_critical(level, df), df) == pytest.approx((1 + level) / 2)
    np.testing.assert_array_equal(t_critical(0.95, np.array([2, 5])),
                                  [t_critical(0.95, 2), t_critical(0.95, 5)])


def test_mean_t_interval_is_scipys_t_interval_bit_for_bit():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 15))
        v = rng.normal(size=n) * rng.uniform(0.01, 100)
        m, lo, hi, k = mean_t_interval(v.tolist())
        want = stats.t.interval(0.95, n - 1, loc=v.mean(), scale=stats.sem(v))
        assert k == n and m == v.mean() and (lo, hi) == (float(want[0]), float(want[1]))
    # and ttest_1samp's interval, to rounding
    ci = stats.ttest_1samp(v, 0.0).confidence_interval(0.95)
    assert (lo, hi) == pytest.approx((ci.low, ci.high), rel=1e-13)


def test_mean_t_interval_edge_cases():
    assert mean_t_interval([float("nan"), 1.0, 3.0])[3] == 2  # NaN dropped, not counted
    m, lo, hi, n = mean_t_interval([])
    assert n == 0 and all(math.isnan(x) for x in (m, lo, hi))
    assert math.isnan(mean_t_interval([2.0])[1]) and mean_t_interval([2.0])[0] == 2.0
    assert mean_t_interval([0.5, 0.5])[1:3] == (0.5, 0.5)  # zero spread: exact bounds


def test_bh_matches_scipy_and_a_direct_step_up():
    rng = np.random.default_rng(1)
    p = rng.uniform(size=12) ** 3
    q = bh_qvalues(p)
    np.testing.assert_array_equal(q, stats.false_discovery_control(p, method="bh"))
    # Benjamini-Hochberg (1995) step-up, written out: q_(i) = min_{j >= i} m p_(j) / j
    m, order = len(p), np.argsort(p)
    direct = np.minimum.accumulate((m * p[order] / np.arange(1, m + 1))[::-1])[::-1]
    np.testing.assert_allclose(q[order], np.minimum(direct, 1), rtol=1e-12)


def test_bh_skips_nan():
    p = np.array([0.01, np.nan, 0.04, 0.03])
    q = bh_qvalues(p)
    assert math.isnan(q[1])
    np.testing.assert_array_equal(q[[0, 2, 3]], stats.false_discovery_control(p[[0, 2, 3]]))
    assert np.isnan(bh_qvalues([np.nan, np.nan])).all()


def test_permutation_floor_is_one_labelling_in_all():
    for n_a, n_b in ((1, 1), (2, 2), (3, 2), (1, 4), (5, 5)):
        # brute force: the observed labelling is one of the enumerated relabellings
        n_labellings = sum(1 for _ in itertools.combinations(range(n_a + n_b), n_a))
        assert permutation_p_floor(n_a, n_b) == 1 / n_labellings
        # and it is the exact one-sided Mann-Whitney p of perfectly separated groups
        slow = np.arange(n_a, dtype=float) + n_b
        p = stats.mannwhitneyu(slow, np.arange(n_b, dtype=float), alternative="greater",
                               method="exact").pvalue
        assert permutation_p_floor(n_a, n_b) == p
    assert permutation_p_floor(10, 10, n_resamples=999) == 1 / 1000
    with pytest.raises(ValueError):
        permutation_p_floor(0, 3)
    with pytest.raises(ValueError):
        permutation_p_floor(2, 3, n_resamples=0)


def test_stratified_bootstrap_keeps_strata_sizes_and_pools():
    sums = np.array([[1.0], [2.0], [10.0]])
    counts = np.array([[1.0], [1.0], [2.0]])
    draws = stratified_bootstrap_means(sums, counts, ["a", "a", "b"], n_boot=500, seed=0)[:, 0]
    # stratum b (one unit) is always drawn once; stratum a contributes 2 units of 1 or 2
    possible = {(x + y + 10) / 4 for x in (1, 2) for y in (1, 2)}
    assert set(np.round(draws, 12)) <= {round(v, 12) for v in possible}
    with pytest.raises(ValueError):
        stratified_bootstrap_means(sums, counts, ["a"], 5, 0)
    with pytest.raises(ValueError):
        stratified_bootstrap_means(sums, counts, ["a", "a", "b"], 0, 0)


def test_percentile_interval_is_numpys_quantiles_of_finite_draws():
    d = np.array([np.nan, 3.0, 1.0, np.inf, 2.0, 4.0])
    lo, hi, n = percentile_interval(d, 0.9)
    ok = np.array([3.0, 1.0, 2.0, 4.0])
    assert n == 4 and (lo, hi) == (np.quantile(ok, 0.05), np.quantile(ok, 0.95))
    assert all(math.isnan(x) for x in percentile_interval([np.nan])[:2])


def test_bootstrap_percentile_ci_is_scipys():
    a, b = np.array([3.0, 5.0, 4.0, 6.0]), np.array([1.0, 2.0, 2.5])
    def ratio(x, y):
        return np.median(x) / np.median(y)
    lo, hi = bootstrap_percentile_ci((a, b), ratio, seed=3, n_resamples=300)
    want = stats.bootstrap((a, b), ratio, vectorized=False, n_resamples=300, method="percentile",
                           random_state=np.random.default_rng(3)).confidence_interval
    assert (lo, hi) == (want.low, want.high) and lo <= ratio(a, b) <= hi


# --- power (issue 37 item 5) ---------------------------------------------------------------

def test_t_detectable_shift_has_the_stated_power_and_the_normal_limit():
    from scipy import stats as sps

    from posinterp.stats import t_detectable_shift

    for n, sd, level in ((3, 0.03, 0.025), (10, 1.0, 0.05), (30, 2.5, 0.01)):
        d = t_detectable_shift(n, sd, power=0.8, level=level)
        crit = sps.t.ppf(1 - level, n - 1)
        assert abs(sps.nct.sf(crit, n - 1, d * np.sqrt(n) / sd) - 0.8) < 1e-9
    z = sps.norm.ppf(0.95) + sps.norm.ppf(0.8)  # large n: the z-test's (z_a + z_b) sd / sqrt(n)
    assert abs(t_detectable_shift(2000, 1.0) / (z / np.sqrt(2000)) - 1) < 2e-3
    assert t_detectable_shift(5, 0.0) == 0.0
    with pytest.raises(ValueError, match="n must be"):
        t_detectable_shift(1, 1.0)


def test_permutation_power_matches_scipys_permutation_test_and_its_size():
    """Each simulated design's decision equals scipy's exact permutation test's; at shift 0
    the rejection rate is at most the level (an exact test), and power grows with the shift."""
    from scipy import stats as sps

    from posinterp.stats import permutation_power

    n_a, n_b, sd, shift = 4, 5, 1.0, 1.5
    rng = np.random.default_rng(0)  # the function's own draws, reproduced
    x = rng.normal(0.0, sd, (40, n_a + n_b))
    x[:, :n_a] += shift
    want = np.mean([sps.permutation_test(
        (row[:n_a], row[n_a:]), lambda a, b, axis: a.mean(axis) - b.mean(axis), vectorized=True,
        permutation_type="independent", alternative="greater", n_resamples=np.inf).pvalue <= 0.05
        for row in x])
    assert permutation_power(n_a, n_b, shift, sd, n_sims=40, seed=0) == want
    assert permutation_power(5, 6, 0.0, 1.0, n_sims=4000) <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 4000)
    powers = [permutation_power(5, 6, s, 1.0, n_sims=1000) for s in (0.5, 1.0, 2.0)]
    assert powers == sorted(powers) and powers[-1] > 0.8


def test_permutation_detectable_shift_is_where_the_power_crosses():
    from posinterp.stats import permutation_detectable_shift, permutation_power

    d = permutation_detectable_shift(5, 6, 1.0, n_sims=1000)
    assert permutation_power(5, 6, d, 1.0, n_sims=1000) >= 0.8
    assert permutation_power(5, 6, d - 0.02, 1.0, n_sims=1000) < 0.8
    assert permutation_detectable_shift(2, 2, 1.0, n_sims=200) == np.inf  # floor 1/6 > 0.05


def test_ratio_equivalence_is_tost_on_paired_log_ratios():
    """Against an independent TOST: scipy's one-sample t-tests of the log ratios at each
    margin edge; the interval is the (1 - 2 alpha) t-interval of the geometric mean."""
    from posinterp.stats import ratio_equivalence

    rng = np.random.default_rng(0)
    b = rng.uniform(100, 140, 10)
    for true, want in ((2.9, "equivalent"), (1.9, "not equivalent")):
        a = b * true * np.exp(rng.normal(0, 0.05, 10))
        r = ratio_equivalence(a, b, 2.9, 1.25)
        d = np.log(a / b)
        p_low = stats.ttest_1samp(d, np.log(2.9 / 1.25), alternative="greater").pvalue
        p_high = stats.ttest_1samp(d, np.log(2.9 * 1.25), alternative="less").pvalue
        assert math.isclose(r["p_tost"], max(p_low, p_high), rel_tol=1e-10)
        lo, hi = stats.t.interval(0.9, 9, loc=d.mean(), scale=stats.sem(d))
        assert math.isclose(r["ci_low"], math.exp(lo)) and math.isclose(r["ci_high"], math.exp(hi))
        assert math.isclose(r["ratio"], stats.gmean(a / b)) and r["verdict"] == want
    noisy = ratio_equivalence(b * 2.9 * np.exp(rng.normal(0, 0.6, 10)), b, 2.9, 1.25)
    assert noisy["verdict"] == "inconclusive"  # too noisy to show either
    with pytest.raises(ValueError, match="positive"):
        ratio_equivalence([1.0, -1.0], [1.0, 1.0], 2.9, 1.25)


def test_mannwhitney_power_is_scipys_test_on_the_rounded_capped_draws():
    """Each simulated design's decision equals a per-design scipy call on lognormal draws fitted
    to the control, rounded up to the resolution and capped; at ratio 1 the rejection rate is
    near the level, and power grows with the ratio."""
    from posinterp.stats import mannwhitney_power

    control = np.array([110., 120, 110, 130, 120, 110, 150, 120, 110, 140])
    mu, sd = np.log(control).mean(), np.log(control).std(ddof=1)
    rng = np.random.default_rng(3)
    t = np.exp(mu + sd * rng.standard_normal((50, 18)))
    t[:, 10:] *= 1.2
    t = np.minimum(np.ceil(t / 10 - 1e-9) * 10, 200)
    want = np.mean([stats.mannwhitneyu(row[10:], row[:10], alternative="greater").pvalue <= 0.05
                    for row in t])
    assert mannwhitney_power(control, 8, 1.2, resolution=10, cap=200, n_sims=50, seed=3) == want
    size = mannwhitney_power(control, 10, 1.0, n_sims=4000)
    assert size <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 4000)
    powers = [mannwhitney_power(control, 10, r, n_sims=1000) for r in (1.05, 1.15, 1.4)]
    assert powers == sorted(powers) and powers[-1] > 0.8
    with pytest.raises(ValueError, match="ratio"):
        mannwhitney_power(control, 10, 0.0)


def test_mannwhitney_detectable_ratio_is_where_the_power_crosses():
    from posinterp.stats import mannwhitney_detectable_ratio, mannwhitney_power

    control = np.array([150., 160, 130, 170, 140, 150, 160, 180, 150, 140])
    r = mannwhitney_detectable_ratio(control, 10, n_sims=1000)
    assert mannwhitney_power(control, 10, r, n_sims=1000) >= 0.8
    assert mannwhitney_power(control, 10, r / 1.02, n_sims=1000) < 0.8
    # two runs a side: the smallest one-sided p is 1/6 > 0.05, whatever the slowdown
    assert mannwhitney_detectable_ratio(control[:2], 2, n_sims=200, cap=3000) == np.inf
    # a stricter level needs a larger slowdown
    assert mannwhitney_detectable_ratio(control, 10, level=0.002, n_sims=1000) > r


def test_tost_power_is_ratio_equivalence_on_simulated_pairs():
    """The share of simulated designs that ratio_equivalence calls equivalent (an independent
    route: its own t statistics), at and beside the claim; 0 beyond the margin as sd -> 0."""
    from posinterp.stats import ratio_equivalence, tost_power

    n, sd, margin = 6, 0.15, 1.25
    rng = np.random.default_rng(0)
    d = 0.05 + sd * rng.standard_normal((300, n))
    want = np.mean([ratio_equivalence(np.exp(row) * 2.9, np.ones(n), 2.9, margin)["verdict"]
                    == "equivalent" for row in d])
    assert tost_power(n, sd, margin, log_offset=0.05, n_sims=300, seed=0) == pytest.approx(want)
    assert tost_power(n, 0.0, margin) == 1.0 and tost_power(n, 0.0, margin, 0.3) == 0.0
    assert tost_power(10, 0.1, margin) > tost_power(10, 0.3, margin)
    with pytest.raises(ValueError, match="margin"):
        tost_power(n, sd, 1.0)
