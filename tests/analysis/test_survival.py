"""Survival statistics of steps-to-target against closed forms and independent code."""

import itertools
import math

import numpy as np
import pytest

from posinterp.analysis import survival
from posinterp.analysis.survival import kaplan_meier, km_median, logrank_test


def product_limit(t, e, s):
    """Kaplan-Meier S(s) by its definition: prod over event times u <= s of (1 - d_u / n_u)."""
    out = 1.0
    for u in sorted(set(t[e])):
        if u <= s:
            out *= 1 - np.sum((t == u) & e) / np.sum(t >= u)
    return out


def mantel_z(ta, ea, tb, eb):
    """The log-rank Z by its definition: sum over event times of (O_a - E_a) / sqrt(sum V)."""
    t, e = np.r_[ta, tb], np.r_[ea, eb]
    ga = np.r_[np.ones(len(ta), bool), np.zeros(len(tb), bool)]
    o_minus_e = var = 0.0
    for u in sorted(set(t[e])):
        risk = t >= u
        n, na = risk.sum(), (risk & ga).sum()
        d, da = ((t == u) & e).sum(), ((t == u) & e & ga).sum()
        o_minus_e += da - d * na / n
        if n > 1:
            var += d * (na / n) * (1 - na / n) * (n - d) / (n - 1)
    return o_minus_e / math.sqrt(var)


def test_kaplan_meier_is_the_product_limit_estimate():
    t = np.array([3, 5, 5, 8, 10, 10, 12, 15.0])
    e = np.array([1, 1, 0, 1, 1, 0, 0, 1], bool)
    km = kaplan_meier(t, e)
    assert km.step.iloc[0] == 0 and km.survival.iloc[0] == 1
    for s, v in zip(km.step, km.survival, strict=True):
        assert v == pytest.approx(product_limit(t, e, s), abs=1e-12)
    assert (km.ci_low <= km.survival + 1e-12).all() and (km.survival <= km.ci_high + 1e-12).all()
    assert km.at_risk.tolist() == [8, 8, 7, 5, 4, 2, 1]


def test_uncensored_median_and_never_reached():
    t = np.array([10, 20, 30, 40.0])
    med, lo, hi = km_median(t, np.ones(4, bool))
    assert med == 20  # first step at which half the runs have reached the target
    assert lo <= med <= hi
    # three of four runs censored at the cap: the median is not reached
    assert km_median([10, 3000, 3000, 3000], [True, False, False, False])[0] == math.inf
    km = kaplan_meier([3000, 3000], [False, False])
    assert km.survival.tolist() == [1.0, 1.0]


def test_logrank_statistic_matches_the_definition_and_scipy_sign():
    ta, ea = np.array([30, 40, 55, 3000, 3000.0]), np.array([1, 1, 1, 0, 0], bool)
    tb, eb = np.array([10, 12, 20, 25, 3000.0]), np.array([1, 1, 1, 1, 0], bool)
    res = logrank_test(ta, ea, tb, eb)
    assert res.statistic == pytest.approx(mantel_z(ta, ea, tb, eb), rel=1e-9)
    assert res.statistic < 0  # a is slower: fewer events than expected
    # the exact p by brute force over all C(10, 5) labellings, with the independent Z
    t, e = np.r_[ta, tb], np.r_[ea, eb]
    zs = []
    for c in itertools.combinations(range(10), 5):
        m = np.zeros(10, bool)
        m[list(c)] = True
        zs.append(mantel_z(t[m], e[m], t[~m], e[~m]))
    assert res.exact and res.p_exact == pytest.approx(np.mean(np.array(zs) <= res.statistic + 1e-9))
    assert res.min_p == pytest.approx(1 / 252)
    flipped = logrank_test(tb, eb, ta, ea, alternative="faster")
    assert flipped.p_exact == pytest.approx(res.p_exact)


def test_perfect_separation_reaches_the_design_floor_and_no_lower():
    slow, fast = np.arange(100, 105.0), np.arange(10, 15.0)
    res = logrank_test(slow, np.ones(5, bool), fast, np.ones(5, bool))
    assert res.p_exact == pytest.approx(1 / math.comb(10, 5))
    assert logrank_test(fast, np.ones(5, bool), slow, np.ones(5, bool)).p_exact == pytest.approx(1.0)


def test_sampled_permutations_are_seeded_and_close_to_exact(monkeypatch):
    rng = np.random.default_rng(1)
    ta, tb = rng.integers(10, 60, 6).astype(float), rng.integers(20, 90, 6).astype(float)
    ea, eb = np.ones(6, bool), np.r_[np.ones(5, bool), False]
    exact = logrank_test(ta, ea, tb, eb)
    monkeypatch.setattr(survival, "EXACT_LIMIT", 10)
    a = logrank_test(ta, ea, tb, eb, n_resamples=4000, seed=3)
    b = logrank_test(ta, ea, tb, eb, n_resamples=4000, seed=3)
    assert not a.exact and a.p_exact == b.p_exact
    assert abs(a.p_exact - exact.p_exact) < 0.03


@pytest.mark.parametrize("args, match", [
    (([1, 2], [True]), "same length"),
    (([], []), "at least one run"),
    (([1, -2], [True, True]), "finite and >= 0"),
    (([1, 2], [2, 1]), "booleans"),
])
def test_bad_input_names_the_parameter(args, match):
    with pytest.raises(ValueError, match=match):
        kaplan_meier(*args)


def test_unknown_alternative():
    with pytest.raises(ValueError, match="alternative must be one of"):
        logrank_test([1], [True], [2], [True], alternative="greater")


def test_min_p_is_the_floor_of_the_test_as_run():
    """Enumerated: one relabelling of C(n, n_a); sampled: the observed one among the draws,
    so a fully separated sample never reports a p below what its draws can give."""
    import math

    from posinterp.analysis.survival import logrank_test

    slow, fast = [300] * 5, [100] * 5
    exact = logrank_test(slow, [True] * 5, fast, [True] * 5)
    assert exact.exact and exact.min_p == pytest.approx(1 / math.comb(10, 5))
    assert exact.p_exact == pytest.approx(exact.min_p)
    slow, fast = [300 + i for i in range(10)], [100 + i for i in range(10)]
    sampled = logrank_test(slow, [True] * 10, fast, [True] * 10, n_resamples=999)
    assert not sampled.exact and sampled.min_p == pytest.approx(1 / 1000)
    assert sampled.p_exact >= sampled.min_p - 1e-12


def test_batched_statistic_equals_scipy_for_every_relabelling():
    """The one-pass statistic behind the permutation test against one scipy call per
    relabelling, with tied times, censoring at and below the cap, and a last event time
    with a single run at risk (scipy drops its 0/0 variance term)."""
    from scipy import stats

    t = np.array([10, 10, 25, 40, 40, 55, 70, 3000, 3000, 3100.0])
    e = np.array([1, 1, 1, 0, 1, 1, 0, 0, 0, 1], bool)
    combos = list(itertools.combinations(range(10), 4))
    masks = np.zeros((len(combos), 10), bool)
    for i, c in enumerate(combos):
        masks[i, list(c)] = True
    got = survival._logrank_z(t, e, masks)
    want = [stats.logrank(stats.CensoredData.right_censored(t[m], ~e[m]),
                          stats.CensoredData.right_censored(t[~m], ~e[~m])).statistic
            for m in masks]
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)

