"""The statistics posinterp's analyses and experiments share: one home each.

* Student-t intervals: :func:`t_critical` (the two-sided critical value) and
  :func:`mean_t_interval` (mean and interval of one sample).
* Multiple testing: :func:`bh_qvalues` (Benjamini-Hochberg, NaN-aware).
* Bootstrap: :func:`stratified_bootstrap_means` (resample units within strata, pooled
  means), :func:`percentile_interval` (the percentile CI of finite draws) and
  :func:`bootstrap_percentile_ci` (scipy's percentile bootstrap of a statistic of samples).
* Permutation tests: :func:`permutation_p_floor`, the smallest p a two-group design can
  reach (exact enumeration or sampled relabellings).
* Equivalence: :func:`ratio_equivalence` (TOST on paired log ratios).
* Power: :func:`t_detectable_shift` (noncentral t), :func:`permutation_power` and
  :func:`permutation_detectable_shift` (the exact permutation test, simulated),
  :func:`mannwhitney_power` and :func:`mannwhitney_detectable_ratio` (a slowdown ratio of
  rounded, capped run times, simulated) and :func:`tost_power` (equivalence, simulated).

A foundation: numpy, scipy and pandas only, no other posinterp module, so every layer may
import it. Each function reproduces, operation for operation, the copy it replaced
(issue 35), so no caller's number changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
from scipy import stats as _sps

__all__ = ["bh_qvalues", "bootstrap_percentile_ci", "mean_t_interval", "percentile_interval",
           "mannwhitney_detectable_ratio", "mannwhitney_power", "permutation_detectable_shift",
           "permutation_p_floor", "permutation_power", "ratio_equivalence",
           "stratified_bootstrap_means", "t_critical", "t_detectable_shift", "tost_power"]


# --- Student-t ------------------------------------------------------------------------------

def t_critical(level: float, df):
    """The two-sided Student-t critical value t_{(1 + level) / 2, df}.

    A 100·level % interval of a mean is mean ± t_critical(level, n - 1) · SE.

    Args:
        level: confidence level in (0, 1), e.g. 0.95.
        df: degrees of freedom (> 0); a scalar or an array (one value per entry).

    Returns:
        A numpy float (scalar ``df``) or an array of ``df``'s shape.

    Source: Student (1908); ``scipy.stats.t.ppf``. Raises nothing: a level outside (0, 1)
    or df <= 0 gives NaN (scipy's convention).
    """
    return _sps.t.ppf(0.5 + level / 2, df)


def mean_t_interval(values: Sequence[float], level: float = 0.95
                    ) -> tuple[float, float, float, int]:
    """Mean of one sample with its two-sided Student-t interval: ``(mean, low, high, n)``.

    NaNs are dropped (and not counted). SE = sd / sqrt(n) with the sample sd (ddof 1);
    the bounds are mean ∓ :func:`t_critical` (level, n - 1) · SE, bit for bit what
    ``scipy.stats.t.interval(level, n - 1, loc=mean, scale=SE)`` gives.

    Args:
        values: ``[n]`` numbers (a list, array or Series), any unit; the bounds share it.
        level: confidence level in (0, 1).

    Returns:
        ``(mean, low, high, n)``: NaN everything with n = 0; NaN bounds for n = 1; exact
        bounds ``(mean, mean)`` for zero spread (SE = 0, where scipy would give NaN).

    Source: Student's t interval of a mean (e.g. Casella & Berger, Statistical Inference,
    §9.2). Raises nothing.
    """
    v = np.asarray([x for x in values if not (isinstance(x, float) and math.isnan(x))], float)
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), float("nan"), 0
    m = float(v.mean())
    if n < 2:
        return m, float("nan"), float("nan"), n
    sem = float(v.std(ddof=1)) / math.sqrt(n)
    if sem == 0:
        return m, m, m, n
    q = float(t_critical(level, n - 1))
    return m, m - q * sem, m + q * sem, n


# --- multiple testing -----------------------------------------------------------------------

def bh_qvalues(p) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values) across the finite entries of ``p``.

    Args:
        p: ``[m]`` p-values in [0, 1] (list, array or Series); NaN marks "no test".

    Returns:
        float64 ``[m]``: the BH q of each p over the non-NaN ones
        (``scipy.stats.false_discovery_control(..., method="bh")``), NaN where ``p`` is NaN
        (all NaN when none is finite). Positional: a Series' index is not kept.

    Raises:
        ValueError: (scipy's) for a finite p outside [0, 1].

    Source: Benjamini & Hochberg (1995), J. R. Stat. Soc. B 57, 289-300.
    """
    p = np.asarray(p, float)
    q = np.full(p.shape, np.nan)
    ok = ~np.isnan(p)
    if ok.any():
        q[ok] = _sps.false_discovery_control(p[ok], method="bh")
    return q


# --- bootstrap ------------------------------------------------------------------------------

def stratified_bootstrap_means(sums: np.ndarray, counts: np.ndarray, strata, n_boot: int,
                               seed: int) -> np.ndarray:
    """Resampled pooled means: each draw resamples units with replacement within each stratum.

    Args:
        sums: ``[n_units, n_stats]`` per-unit sums of a value over the items a statistic
            uses (e.g. per training run, over its heads).
        counts: ``[n_units, n_stats]`` how many items each sum covers.
        strata: ``[n_units]`` labels; each draw takes as many units from a stratum as it has.
        n_boot: number of draws (>= 1).
        seed: the generator's seed (``numpy.random.default_rng``; strata in order of first
            appearance, one ``integers`` call each).

    Returns:
        ``[n_boot, n_stats]`` pooled means sum(w * sums) / sum(w * counts) over the drawn
        units (multiplicities w); NaN where a draw has no item for a statistic.

    Raises:
        ValueError: for mismatched shapes or ``n_boot < 1``.

    Source: the stratified nonparametric bootstrap, Efron & Tibshirani (1993),
    An Introduction to the Bootstrap, §6 and §8.
    """
    sums, counts = np.atleast_2d(np.asarray(sums, float)), np.atleast_2d(np.asarray(counts, float))
    strata = np.asarray(strata)
    if sums.shape != counts.shape or strata.shape != (sums.shape[0],) or not len(strata):
        raise ValueError(f"sums {sums.shape}, counts {counts.shape} and strata {strata.shape} "
                         "must describe the same runs")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    weights = np.zeros((n_boot, len(strata)))
    for label in pd.unique(strata):
        idx = np.flatnonzero(strata == label)
        draws = rng.integers(0, len(idx), size=(n_boot, len(idx)))
        for j, i in enumerate(idx):
            weights[:, i] = (draws == j).sum(axis=1)
    num, den = weights @ sums, weights @ counts
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def percentile_interval(draws, level: float = 0.95) -> tuple[float, float, int]:
    """The percentile bootstrap interval of ``draws``, ignoring non-finite ones.

    Args:
        draws: ``[n_boot]`` bootstrap replicates of a statistic (NaN/inf: a draw where it
            was undefined).
        level: confidence level in (0, 1).

    Returns:
        ``(low, high, n_used)``: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles
        (``numpy.percentile``, linear interpolation) of the finite draws, and how many
        there were; NaN bounds when none is finite.

    Source: Efron & Tibshirani (1993), §13.3 (percentile interval). Raises nothing.
    """
    d = np.asarray(draws, float)
    ok = d[np.isfinite(d)]
    a = (1 - level) / 2 * 100
    lo, hi = (np.percentile(ok, [a, 100 - a]) if len(ok) else (np.nan, np.nan))
    return float(lo), float(hi), len(ok)


def bootstrap_percentile_ci(samples: tuple[np.ndarray, ...], statistic: Callable[..., float],
                            seed: int, n_resamples: int = 2000, level: float = 0.95
                            ) -> tuple[float, float]:
    """Percentile bootstrap CI of ``statistic(*samples)``, each sample resampled on its own.

    Args:
        samples: independent 1-D samples (each of length >= 2), e.g. two groups' steps.
        statistic: takes one resample of each sample and returns a float (not vectorized).
        seed: seed of the ``numpy.random.default_rng`` scipy draws from.
        n_resamples: bootstrap draws.
        level: confidence level in (0, 1).

    Returns:
        ``(low, high)``.

    Raises:
        ValueError: (scipy's) for a sample too short to resample.

    Source: ``scipy.stats.bootstrap(method="percentile")``; Efron & Tibshirani (1993), §13.3.
    """
    ci = _sps.bootstrap(samples, statistic, vectorized=False, n_resamples=n_resamples,
                        confidence_level=level, method="percentile",
                        random_state=np.random.default_rng(seed)).confidence_interval
    return ci.low, ci.high


# --- permutation tests ----------------------------------------------------------------------

def permutation_p_floor(n_a: int, n_b: int, n_resamples: int | None = None) -> float:
    """The smallest p a two-group permutation (or rank) test of ``n_a`` vs ``n_b`` can give.

    Exact enumeration: the observed labelling is one of C(n_a + n_b, n_a), so p >=
    1 / C(n_a + n_b, n_a) (the one-sided exact Mann-Whitney p of perfectly separated
    groups without ties). Sampled: the observed labelling counted among ``n_resamples``
    random ones, p >= 1 / (n_resamples + 1).

    Args:
        n_a: units in the first group (>= 1).
        n_b: units in the second group (>= 1).
        n_resamples: None for exact enumeration, else the number of sampled relabellings.

    Returns:
        The floor, in (0, 1].

    Raises:
        ValueError: for an empty group or ``n_resamples < 1``.

    Source: Fisher's exact randomization argument; Phipson & Smyth (2010), Stat. Appl.
    Genet. Mol. Biol. 9(1), for the sampled +1.
    """
    if n_a < 1 or n_b < 1:
        raise ValueError(f"both groups need a unit, got {n_a} and {n_b}")
    if n_resamples is not None:
        if n_resamples < 1:
            raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
        return 1.0 / (n_resamples + 1)
    return 1 / math.comb(n_a + n_b, n_a)


# --- Power ----------------------------------------------------------------------------------

def t_detectable_shift(n: int, sd: float, power: float = 0.8, level: float = 0.05) -> float:
    """The smallest distance |mean − threshold| a one-sided one-sample t-test of ``n`` values
    with standard deviation ``sd`` detects at ``level`` with probability ``power``: δ with
    P(T > t_{1−level, n−1}) = power for T ~ noncentral t(n − 1, δ √n / sd). In the units of
    the values.

    For a verdict that needs the two-sided 95% interval wholly on one side of a threshold,
    pass ``level=0.025``.

    Raises:
        ValueError: for ``n < 2``, ``sd < 0`` or ``power``/``level`` outside (0, 1).

    Source: the noncentral-t power of Student's test (e.g. Cohen 1988, §2.3; scipy.stats.nct).
    """
    from scipy.optimize import brentq

    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    if not sd >= 0:
        raise ValueError(f"sd must be >= 0, got {sd}")
    for name, v in (("power", power), ("level", level)):
        if not 0 < v < 1:
            raise ValueError(f"{name} must be in (0, 1), got {v}")
    if sd == 0:
        return 0.0
    df = n - 1
    crit = _sps.t.ppf(1 - level, df)

    def gap(nc):
        return _sps.nct.sf(crit, df, nc) - power
    nc = brentq(gap, 0.0, 100.0 + 10 * crit)
    return float(nc * sd / math.sqrt(n))


def permutation_power(n_a: int, n_b: int, shift: float, sd: float, level: float = 0.05,
                      n_sims: int = 2000, seed: int = 0) -> float:
    """Power of the exact one-sided permutation test of "mean of a > mean of b" (difference
    of means, every relabelling enumerated: :func:`posinterp.analysis.fingerprint_test`'s
    test) when a ~ N(``shift``, ``sd``²) and b ~ N(0, ``sd``²): the share of ``n_sims``
    seeded simulated designs with p ≤ ``level``. Monte Carlo error about
    sqrt(P (1 − P) / n_sims).

    Raises:
        ValueError: for a group of fewer than 2 units, ``sd <= 0``, ``n_sims < 1``, or more
            than 20,000 relabellings (use a sampled test's power there).

    Source: Fisher's randomization test; power by simulation (e.g. Good 2005, "Permutation,
    Parametric and Bootstrap Tests of Hypotheses", §3.5).
    """
    import itertools

    if n_a < 2 or n_b < 2:
        raise ValueError(f"each group needs >= 2 units, got {n_a} and {n_b}")
    if not sd > 0 or n_sims < 1:
        raise ValueError(f"sd must be > 0 and n_sims >= 1, got sd={sd}, n_sims={n_sims}")
    n = n_a + n_b
    if math.comb(n, n_a) > 20_000:
        raise ValueError(f"C({n}, {n_a}) = {math.comb(n, n_a)} relabellings: too many to enumerate")
    groups = np.zeros((math.comb(n, n_a), n), dtype=bool)
    for i, idx in enumerate(itertools.combinations(range(n), n_a)):
        groups[i, list(idx)] = True
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, sd, (n_sims, n))
    x[:, :n_a] += shift
    total = x.sum(1, keepdims=True)
    sum_a = x @ groups.T.astype(float)  # [sims, relabellings]
    stat = sum_a / n_a - (total - sum_a) / n_b
    observed = x[:, :n_a].mean(1) - x[:, n_a:].mean(1)
    p = (stat >= observed[:, None] - 1e-12 * np.abs(observed[:, None])).mean(1)
    return float((p <= level).mean())


def permutation_detectable_shift(n_a: int, n_b: int, sd: float, power: float = 0.8,
                                 level: float = 0.05, n_sims: int = 2000, seed: int = 0) -> float:
    """The smallest mean shift (in units of the values) that :func:`permutation_power` finds
    with probability ≥ ``power``, to 1% of ``sd`` by bisection on the seeded power; inf if
    even 20 sd falls short (a design whose p floor is above ``level``).

    Raises:
        ValueError: as :func:`permutation_power`.
    """
    if permutation_power(n_a, n_b, 20 * sd, sd, level, n_sims, seed) < power:
        return math.inf
    lo, hi = 0.0, 20 * sd
    while hi - lo > 0.01 * sd:
        mid = (lo + hi) / 2
        if permutation_power(n_a, n_b, mid, sd, level, n_sims, seed) >= power:
            hi = mid
        else:
            lo = mid
    return float(hi)


# --- Equivalence ------------------------------------------------------------------------------

def ratio_equivalence(a, b, claimed: float, margin: float, level: float = 0.05) -> dict:
    """Is the paired ratio a / b equivalent to ``claimed`` within ×/÷ ``margin``? Two one-sided
    t-tests (TOST) on the paired log ratios log(a_i / b_i), whose mean is the log of the
    paired geometric-mean ratio.

    Returns a dict: ``ratio`` (the geometric mean), ``ci_low``/``ci_high`` (its 100(1 − 2
    level)% interval, the one TOST reads), ``p_tost`` (the larger one-sided p: equivalence is
    shown at ``level`` when it is ≤ ``level``), ``p_outside`` (the smaller one-sided p of
    "the ratio is beyond a margin edge", against inside), ``n`` and ``verdict``:
    ``"equivalent"`` (p_tost ≤ level), ``"not equivalent"`` (the interval lies wholly
    outside [claimed / margin, claimed × margin]) or ``"inconclusive"``.

    Args:
        a, b: paired positive values (e.g. steps to target of two constraints, one pair
            per seed), equal lengths ≥ 2.
        claimed: the ratio claimed (> 0). margin: > 1.

    Raises:
        ValueError: for unpaired, non-positive or too few values, or a bad claimed/margin.

    Source: Schuirmann (1987), J. Pharmacokinet. Biopharm. 15(6), the TOST procedure; on
    log ratios as for average bioequivalence (FDA guidance, 2001).
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(f"a and b must be paired 1-D samples of >= 2 values, got {a.shape} and {b.shape}")
    if not (np.all(a > 0) and np.all(b > 0)):
        raise ValueError("a and b must be positive (ratios are taken on the log scale)")
    if not (claimed > 0 and margin > 1):
        raise ValueError(f"need claimed > 0 and margin > 1, got {claimed} and {margin}")
    d = np.log(a) - np.log(b)
    n = len(d)
    m, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))
    lo_edge, hi_edge = math.log(claimed / margin), math.log(claimed * margin)
    crit = float(_sps.t.ppf(1 - level, n - 1))
    if se == 0:
        p_low = 0.0 if m > lo_edge else 1.0
        p_high = 0.0 if m < hi_edge else 1.0
    else:
        p_low = float(_sps.t.sf((m - lo_edge) / se, n - 1))  # H0: ratio <= claimed / margin
        p_high = float(_sps.t.cdf((m - hi_edge) / se, n - 1))  # H0: ratio >= claimed * margin
    ci = (m - crit * se, m + crit * se)
    p_tost = max(p_low, p_high)
    verdict = ("equivalent" if p_tost <= level else
               "not equivalent" if ci[1] < lo_edge or ci[0] > hi_edge else "inconclusive")
    return {"ratio": math.exp(m), "ci_low": math.exp(ci[0]), "ci_high": math.exp(ci[1]),
            "p_tost": p_tost, "p_outside": min(1 - p_low, 1 - p_high), "n": n,
            "verdict": verdict}


def mannwhitney_power(control, n_slow: int, ratio: float, level: float = 0.05,
                      resolution: float | None = None, cap: float | None = None,
                      n_sims: int = 2000, seed: int = 0) -> float:
    """Power of the one-sided Mann-Whitney test "the slow group takes longer" (scipy's
    ``mannwhitneyu(slow, control, alternative="greater")``) when the slow group's times are
    the control's multiplied by ``ratio``: the share of ``n_sims`` seeded simulated designs
    with p ≤ ``level``.

    Times are drawn lognormal with the log-mean and log-sd of ``control`` (one value per
    independent run, e.g. steps to target); as in the runs, each draw is rounded up to a
    multiple of ``resolution`` (the evaluation interval) and clipped at ``cap`` (the step cap:
    a censored run counts at the cap). ``len(control)`` controls and ``n_slow`` slow runs per
    design. Monte Carlo error about sqrt(P (1 − P) / n_sims).

    Raises:
        ValueError: for fewer than 2 controls or slow runs, non-positive times, ``ratio <= 0``,
            ``level`` outside (0, 1) or ``n_sims < 1``.

    Source: Mann & Whitney (1947), Ann. Math. Statist. 18(1); power by simulation under a
    scale shift of a lognormal fitted to the control (e.g. Lehmann 1975, "Nonparametrics",
    §2.3 on the test's power against shifts).
    """
    control = np.asarray(control, float)
    if control.ndim != 1 or len(control) < 2 or n_slow < 2:
        raise ValueError(f"need >= 2 controls and n_slow >= 2, got {control.shape} and {n_slow}")
    if not np.all(control > 0) or not ratio > 0:
        raise ValueError(f"control times and ratio must be > 0, got ratio={ratio}")
    if not 0 < level < 1 or n_sims < 1:
        raise ValueError(f"level must be in (0, 1) and n_sims >= 1, got {level} and {n_sims}")
    logs = np.log(control)
    mu, sd = float(logs.mean()), float(logs.std(ddof=1))
    rng = np.random.default_rng(seed)
    n_c = len(control)
    z = rng.standard_normal((n_sims, n_c + n_slow))
    t = np.exp(mu + sd * z)
    t[:, n_c:] *= ratio
    if resolution is not None:
        t = np.ceil(t / resolution - 1e-9) * resolution
    if cap is not None:
        t = np.minimum(t, cap)
    slow, ctrl = t[:, n_c:], t[:, :n_c]
    # a design whose every value ties has no test (scipy returns NaN): it cannot reject
    p = _sps.mannwhitneyu(slow, ctrl, alternative="greater", axis=1).pvalue
    return float(np.mean(np.nan_to_num(p, nan=1.0) <= level))


def mannwhitney_detectable_ratio(control, n_slow: int, power: float = 0.8, level: float = 0.05,
                                 resolution: float | None = None, cap: float | None = None,
                                 n_sims: int = 2000, seed: int = 0) -> float:
    """The smallest slowdown ratio (≥ 1, dimensionless) that :func:`mannwhitney_power`
    detects with probability ≥ ``power``, to 1% by bisection on the log ratio with the same
    seeded draws at every ratio; inf if even the ratio that puts every slow run at ``cap``
    (or 1,000x without a cap) falls short (a design whose p floor is above ``level``).

    Raises:
        ValueError: as :func:`mannwhitney_power`, and for ``power`` outside (0, 1).
    """
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power}")
    control = np.asarray(control, float)

    def pw(r):
        return mannwhitney_power(control, n_slow, r, level, resolution, cap, n_sims, seed)

    top = 1000.0 if cap is None else max(cap / float(np.min(control)), 1.0) * 1.01
    if pw(top) < power:
        return math.inf
    lo, hi = 0.0, math.log(top)
    if pw(1.0) >= power:
        return 1.0
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        if pw(math.exp(mid)) >= power:
            hi = mid
        else:
            lo = mid
    return float(math.exp(hi))


def tost_power(n: int, sd_log: float, margin: float, log_offset: float = 0.0,
               level: float = 0.05, n_sims: int = 20_000, seed: int = 0) -> float:
    """Power of :func:`ratio_equivalence`'s TOST (``n`` pairs, margin ×/÷ ``margin``) to show
    equivalence when the true paired log ratio sits ``log_offset`` from the claimed one's log
    (0: the claim is exactly true) and the paired log ratios have sd ``sd_log`` (natural-log
    units): the share of ``n_sims`` seeded simulated designs with p_tost ≤ ``level``.

    Raises:
        ValueError: for ``n < 2``, ``sd_log < 0``, ``margin <= 1``, ``level`` outside (0, 1) or
            ``n_sims < 1``.

    Source: Schuirmann (1987), J. Pharmacokinet. Biopharm. 15(6), §3 (the TOST's power);
    computed by simulation of the t statistics.
    """
    if n < 2 or not sd_log >= 0 or not margin > 1 or not 0 < level < 1 or n_sims < 1:
        raise ValueError(f"need n >= 2, sd_log >= 0, margin > 1, level in (0, 1), n_sims >= 1; "
                         f"got n={n}, sd_log={sd_log}, margin={margin}, level={level}, "
                         f"n_sims={n_sims}")
    edge = math.log(margin)
    if sd_log == 0:
        return float(abs(log_offset) < edge)
    rng = np.random.default_rng(seed)
    d = log_offset + sd_log * rng.standard_normal((n_sims, n))
    m, se = d.mean(1), d.std(1, ddof=1) / math.sqrt(n)
    crit = float(_sps.t.ppf(1 - level, n - 1))
    return float(np.mean((m - crit * se > -edge) & (m + crit * se < edge)))
