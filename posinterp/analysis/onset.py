"""Onset times over training: when a head's behaviour forms, and when its spectrum changes.

The claim under test (docs/reproductions/fingerprints.md, "Dynamics"): the rotational
signature of a previous-token head appears during training *with* the head's behaviour.
A within-head correlation of two trajectories cannot test it (any two quantities that
drift over training correlate); onset *times* can. Per head, over snapshot steps
``s_0 < s_1 < ... < s_{n-1}`` (units: optimizer steps):

* **behaviour onset**: the first snapshot step from which the head's previous-token score
  stays ``>= threshold``; None if it never does.
* **signature onset**: the first snapshot step from which the null percentile of the
  head's rotational mass R stays outside the null band ``[lo, hi]`` (default the central
  90% of the product-Ginibre null of the head's shape: below 5 or above 95); None if it
  never does. Its **side** is where it is at onset: ``above`` (more rotational than
  random heads: the claim's signature) or ``below`` (less rotational). The **rotational
  onset** is the same rule with the upper side only (percentile > hi).
* "stays" is a persistence rule (:func:`persistent_onset`): at every later snapshot (to
  the end), or at every snapshot of the next W steps (R, a share of eigenvalue mass, can
  jump when a pair of real eigenvalues turns complex, and flicker back for a snapshot).
* **lag** = signature onset - behaviour onset (steps; negative: the spectrum left the
  null band before the behaviour formed).

Heads are classed by their previous-token score: **forming** (a behaviour onset),
**control** (never reaches the threshold at any snapshot) or **transient** (reaches it,
but not to the last snapshot; neither group). If the signature is tied to the behaviour,
forming heads' signature onsets sit near their behaviour onsets and later than (or
unlike) control heads'; if control heads leave the band as early, the departure is a
property of training, not of the behaviour.

**Statistics** (:func:`onset_summary`): means over heads with a value, with percentile
bootstrap CIs that resample **training runs**, not heads (heads of one run share its
data order, initialization and optimizer trajectory), within strata (families), seeded.

Source: issue 25, item 2 (onset-time dynamics with bootstrap CIs over runs and a control
group of heads that never form); Efron & Tibshirani (1993) §6 (percentile interval) and
Davison & Hinkley (1997) §3.8 (resampling clusters, stratified).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from ..stats import percentile_interval
from ..stats import stratified_bootstrap_means as run_bootstrap  # runs are the units

__all__ = ["NULL_BAND", "check_distinct_snapshots", "head_onsets", "onset_summary",
           "persistent_onset", "run_bootstrap"]

# The central 90% of the null: a head of random weights is outside it at 10% of snapshots.
NULL_BAND = (5.0, 95.0)
CLASSES = ("forming", "control", "transient")


def persistent_onset(steps, holds, window: int | None = None) -> int | None:
    """The first snapshot step from which ``holds`` stays True.

    Persistence rule: with ``window`` None, True at that snapshot and at every later one
    (to the last snapshot); with ``window`` W (steps), True at every snapshot whose step
    lies in ``[s, s + W]`` (the window cut at the last snapshot), so a condition that
    flickers back for a snapshot or two long after it set in does not move the onset.

    Args:
        steps: ``[n]`` strictly increasing snapshot steps (optimizer steps).
        holds: ``[n]`` booleans, the condition at each snapshot.
        window: the persistence window in steps (>= 0), or None (to the end).

    Returns:
        That step (int), or None when no snapshot qualifies.

    Raises:
        ValueError: for empty, unequal-length or not strictly increasing ``steps``, or a
            negative ``window``.
    """
    s = np.asarray(steps)
    h = np.asarray(holds, dtype=bool)
    if s.ndim != 1 or h.shape != s.shape or len(s) == 0:
        raise ValueError(f"steps and holds must be 1-D of one nonzero length, got shapes "
                         f"{s.shape} and {h.shape}")
    if (np.diff(s) <= 0).any():
        raise ValueError(f"steps must be strictly increasing, got {s.tolist()}")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 steps or None, got {window}")
    # index of the first False at or after each snapshot (n when none)
    next_false = np.full(len(s), len(s))
    nxt = len(s)
    for i in range(len(s) - 1, -1, -1):
        if not h[i]:
            nxt = i
        next_false[i] = nxt
    for i in range(len(s)):
        if not h[i]:
            continue
        if next_false[i] == len(s) or (window is not None and s[next_false[i]] > s[i] + window):
            return int(s[i])
    return None


def _check_band(band) -> tuple[float, float]:
    lo, hi = (float(b) for b in band)
    if not 0 <= lo < hi <= 100:
        raise ValueError(f"band must be (lo, hi) percentiles with 0 <= lo < hi <= 100, got {band!r}")
    return lo, hi


def head_onsets(trajectories: pd.DataFrame, threshold: float, band=NULL_BAND,
                window: int | None = None, score: str = "previous_token_score",
                percentile: str = "rotational_mass_null_percentile") -> pd.DataFrame:
    """Per head: behaviour and signature onsets, the lag and the head's class.

    Args:
        trajectories: one row per head and snapshot, with ``run`` (the training run, the
            independent unit), ``layer``, ``head``, ``step`` (optimizer steps), ``score``
            and ``percentile`` (0-100); other per-run columns (``family``, ``seed``) are
            carried over when constant within a run.
        threshold: the previous-token score a formed head reaches (e.g. 0.3).
        band: the null band ``(lo, hi)`` in percentiles; outside it the spectrum is unlike
            random heads of its shape.
        window: the persistence rule of every onset (:func:`persistent_onset`): None, to
            the last snapshot; W, over the next W steps.

    Returns:
        One row per head: ``run``, carried columns, ``layer, head, n_snapshots,
        first_step, last_step, max_score, final_score, final_percentile, class``
        (forming/control/transient), ``behaviour_onset, signature_onset, signature_side``
        (above/below/None), ``rotational_onset`` (steps or NaN) and ``lag`` (signature -
        behaviour onset, steps; NaN unless both exist).

    Raises:
        ValueError: for missing columns, a bad band, a head with repeated steps.
    """
    lo, hi = _check_band(band)
    need = {"run", "layer", "head", "step", score, percentile}
    missing = need - set(trajectories.columns)
    if missing:
        raise ValueError(f"trajectories lacks columns {sorted(missing)}")
    carry = [c for c in trajectories.columns if c not in need
             and trajectories.groupby("run", sort=False)[c].nunique(dropna=False).max() == 1]
    rows = []
    for (run, layer, head), g in trajectories.groupby(["run", "layer", "head"], sort=False):
        g = g.sort_values("step")
        steps = g.step.to_numpy()
        if len(np.unique(steps)) != len(steps):
            raise ValueError(f"run {run!r} L{layer}H{head} has repeated snapshot steps")
        sc, pct = g[score].to_numpy(float), g[percentile].to_numpy(float)
        beh = persistent_onset(steps, sc >= threshold, window)
        sig = persistent_onset(steps, (pct < lo) | (pct > hi), window)
        rot = persistent_onset(steps, pct > hi, window)
        cls = "forming" if beh is not None else "control" if sc.max() < threshold else "transient"
        side = None if sig is None else ("above" if pct[steps == sig][0] > hi else "below")
        rows.append({"run": run, **{c: g[c].iloc[0] for c in carry}, "layer": int(layer),
                     "head": int(head), "n_snapshots": len(steps), "first_step": int(steps[0]),
                     "last_step": int(steps[-1]), "max_score": float(sc.max()),
                     "final_score": float(sc[-1]), "final_percentile": float(pct[-1]),
                     "class": cls, "behaviour_onset": beh, "signature_onset": sig,
                     "signature_side": side, "rotational_onset": rot,
                     "lag": (sig - beh) if beh is not None and sig is not None else None})
    out = pd.DataFrame(rows)
    for c in ("behaviour_onset", "signature_onset", "rotational_onset", "lag"):
        out[c] = pd.to_numeric(out[c], errors="coerce").astype(float)
    return out


# (statistic, heads it uses, their per-head column, what the mean means); heads: a class,
# or "top" (per run, the forming head with the highest final score: one head per run); a
# difference row names its two statistics instead and has no column
STATISTICS = (
    ("behaviour onset, forming heads", "forming", "behaviour_onset",
     "mean step from which forming heads' previous-token score stays above the threshold"),
    ("signature onset, forming heads", "forming", "signature_onset",
     "mean step from which forming heads' R stays outside the null band (heads that leave it)"),
    ("lag, forming heads", "forming", "lag",
     "mean signature onset - behaviour onset over forming heads with both (negative: "
     "signature first)"),
    ("signature onset, control heads", "control", "signature_onset",
     "mean step from which never-forming heads' R stays outside the null band"),
    ("signature onset, forming - control", ("signature onset, forming heads",
                                            "signature onset, control heads"), None,
     "difference of the two means above (near 0: leaving the band is not specific to "
     "forming heads)"),
    ("behaviour onset, top head", "top", "behaviour_onset",
     "as above for each run's strongest head (highest final score among its forming heads)"),
    ("signature onset, top head", "top", "signature_onset", "as above, strongest head"),
    ("lag, top head", "top", "lag", "as above, strongest head"),
    ("share with a signature onset, forming heads", "forming", "has_signature",
     "share of forming heads whose R leaves the null band for good"),
    ("share with a signature onset, control heads", "control", "has_signature",
     "share of control heads whose R leaves the null band for good"),
    ("share leaving below the band, forming heads", "forming", "below",
     "share of forming heads whose R leaves the band on the less-rotational side"),
    ("share with a rotational onset, forming heads", "forming", "has_rotational",
     "share of forming heads whose R ever stays above the band (the claim's signature)"),
    ("share with a rotational onset, control heads", "control", "has_rotational",
     "share of control heads whose R ever stays above the band"),
    ("share with signature before behaviour, forming heads", "forming", "sig_first",
     "share of forming heads whose signature onset precedes their behaviour onset"),
)
SHARES = ("has_signature", "below", "has_rotational", "sig_first")


def onset_summary(onsets: pd.DataFrame, n_boot: int, seed: int, strata: str | None = "family",
                  level: float = 0.95) -> pd.DataFrame:
    """Means of the onset statistics (:data:`STATISTICS`) with run-level bootstrap CIs.

    Each statistic is the mean of a per-head value over the heads of one class (or each
    run's top head: its forming head with the highest final score) that have it, pooled
    over runs; shares count every head of the class (a forming head without a signature
    onset is not "signature first"); its CI is the percentile interval of :func:`run_bootstrap`
    (runs resampled within ``strata``, the heads of a drawn run kept together). When every
    run has the same heads' values the CI is that value (a property tested).

    Args:
        onsets: :func:`head_onsets` rows (with ``run`` and, if ``strata``, that column).
        n_boot: bootstrap draws; seed: their seed.
        strata: column whose levels are resampled separately (None: all runs together).
        level: the CI's coverage.

    Returns:
        One row per statistic: ``statistic, meaning, unit`` (steps or share), ``estimate,
        ci_low, ci_high, n_heads`` (heads with a value; for a difference, ``a / b``),
        ``n_runs`` (runs contributing), ``n_units`` (runs resampled), ``n_boot_used``
        (draws with a value).

    Raises:
        ValueError: for missing columns or ``level`` outside (0, 1).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    need = {"run", "class", "behaviour_onset", "signature_onset", "lag", "signature_side",
            "rotational_onset", "final_score"}
    if strata is not None:
        need.add(strata)
    missing = need - set(onsets.columns)
    if missing:
        raise ValueError(f"onsets lacks columns {sorted(missing)}")
    forming = onsets["class"] == "forming"
    best = onsets[forming].groupby("run", sort=False).final_score.transform("max")
    top = pd.Series(False, index=onsets.index)
    top[forming] = onsets.loc[forming, "final_score"] == best
    top &= top.groupby(onsets.run).cumsum() <= 1  # one head per run on a tie
    o = onsets.assign(
        top=top,
        has_signature=onsets.signature_onset.notna().astype(float),
        below=(onsets.signature_side == "below").astype(float),
        has_rotational=onsets.rotational_onset.notna().astype(float),
        sig_first=np.where(onsets.lag.notna(), (onsets.lag < 0).astype(float), 0.0))
    runs = list(pd.unique(o.run))
    plain = [s for s in STATISTICS if s[2] is not None]
    sums = np.zeros((len(runs), len(plain)))
    counts = np.zeros_like(sums)
    for i, run in enumerate(runs):
        g = o[o.run == run]
        for j, (_, cls, col, _) in enumerate(plain):
            v = g.loc[g.top if cls == "top" else g["class"] == cls, col].dropna()
            sums[i, j], counts[i, j] = v.sum(), len(v)
    labels = o.groupby("run", sort=False)[strata].first().loc[runs].to_numpy() \
        if strata is not None else np.zeros(len(runs))
    draws = run_bootstrap(sums, counts, labels, n_boot, seed)
    tot_c = counts.sum(axis=0)
    est = np.where(tot_c > 0, sums.sum(axis=0) / np.where(tot_c > 0, tot_c, 1), np.nan)
    index = {s[0]: j for j, s in enumerate(plain)}
    rows = []
    for name, cls, col, meaning in STATISTICS:
        if col is None:
            first, second = (index[n] for n in cls)
            d = draws[:, first] - draws[:, second]
            value = est[first] - est[second]
            n_heads = f"{int(tot_c[first])} / {int(tot_c[second])}"
            n_runs = int(((counts[:, first] > 0) & (counts[:, second] > 0)).sum())
        else:
            j = index[name]
            d, value, n_heads = draws[:, j], est[j], str(int(tot_c[j]))
            n_runs = int((counts[:, j] > 0).sum())
        lo, hi, n_used = percentile_interval(d, level)
        rows.append({"statistic": name, "meaning": meaning,
                     "unit": "share" if col in SHARES else "steps",
                     "estimate": float(value), "ci_low": float(lo), "ci_high": float(hi),
                     "n_heads": n_heads, "n_runs": n_runs, "n_units": len(runs),
                     "n_boot_used": n_used})
    return pd.DataFrame(rows)


def check_distinct_snapshots(hashes: Mapping[int, str]) -> None:
    """Refuse snapshots with identical weights: a run whose weights did not change between
    two snapshots (a frozen run, or one file copied over another) is not dynamics.

    Args:
        hashes: snapshot step -> SHA-256 (hex) of its weights.

    Raises:
        ValueError: naming both steps (the first such pair, by step) and the hash.
    """
    seen: dict[str, int] = {}
    for step in sorted(hashes):
        h = hashes[step]
        if h in seen:
            raise ValueError(f"snapshots at steps {seen[h]} and {step} have identical weights "
                             f"(SHA-256 {h[:16]}...): a frozen or copied snapshot is not "
                             "training dynamics; retrain that run")
        seen[h] = step
