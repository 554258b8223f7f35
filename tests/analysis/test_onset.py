"""Onset times (posinterp.analysis.onset): closed forms on synthetic trajectories."""

import numpy as np
import pandas as pd
import pytest

from posinterp.analysis.onset import (
    check_distinct_snapshots,
    head_onsets,
    onset_summary,
    persistent_onset,
    run_bootstrap,
)

STEPS = np.arange(0, 205, 5)


def test_persistent_onset_is_the_first_step_of_the_final_run_of_trues():
    holds = STEPS >= 60
    assert persistent_onset(STEPS, holds) == 60
    # a True that does not last to the end is not an onset; the last run of Trues is
    flicker = holds.copy()
    flicker[STEPS == 20] = True
    flicker[STEPS == 120] = False
    assert persistent_onset(STEPS, flicker) == 125
    assert persistent_onset(STEPS, ~(STEPS >= 0)) is None
    assert persistent_onset(STEPS, STEPS >= 0) == 0
    # false at the last snapshot: never onset under "to the end"
    assert persistent_onset(STEPS, STEPS < 100) is None


def test_window_rule_ignores_a_late_flicker_but_not_an_early_blip():
    holds = STEPS >= 60
    holds[STEPS == 120] = False  # one snapshot back inside, 60 steps after the onset
    assert persistent_onset(STEPS, holds, window=50) == 60  # [60, 110] all True
    assert persistent_onset(STEPS, holds, window=60) == 125  # [60, 120] holds the False
    blip = np.zeros(len(STEPS), bool)
    blip[(STEPS >= 20) & (STEPS <= 40)] = True  # 20 steps of True, then gone
    assert persistent_onset(STEPS, blip, window=50) is None
    assert persistent_onset(STEPS, blip, window=20) == 20
    # the window is cut at the last snapshot: a run of Trues to the end counts
    assert persistent_onset(STEPS, STEPS >= 190, window=50) == 190
    # with uneven spacing the window is in steps, not snapshots
    uneven = np.array([0, 10, 20, 100, 200])
    assert persistent_onset(uneven, [False, True, True, False, True], window=50) == 10
    assert persistent_onset(uneven, [False, True, True, False, True], window=90) == 200


def test_persistent_onset_refuses_bad_input():
    with pytest.raises(ValueError, match="strictly increasing"):
        persistent_onset([0, 5, 5], [True, True, True])
    with pytest.raises(ValueError, match="same|length"):
        persistent_onset([0, 5], [True])
    with pytest.raises(ValueError, match="window"):
        persistent_onset([0, 5], [True, True], window=-1)


def _head(run, layer, head, score_onset, sig_onset, *, side="below", family="f",
          score_hi=0.5, score_lo=0.1):
    """A head whose score steps to ``score_hi`` at ``score_onset`` (None: never) and whose
    null percentile leaves the band to ``side`` at ``sig_onset`` (None: never)."""
    score = np.where(STEPS >= (score_onset if score_onset is not None else 10**9),
                     score_hi, score_lo)
    out = 2.0 if side == "below" else 99.0
    pct = np.where(STEPS >= (sig_onset if sig_onset is not None else 10**9), out, 50.0)
    return pd.DataFrame({"run": run, "family": family, "seed": run, "layer": layer,
                         "head": head, "step": STEPS, "previous_token_score": score,
                         "rotational_mass_null_percentile": pct})


def test_head_onsets_recovers_known_onsets_classes_and_lags():
    traj = pd.concat([_head(0, 0, 0, 100, 40), _head(0, 0, 1, None, 30, side="above"),
                      _head(0, 1, 0, 50, None),
                      _head(0, 1, 1, 50, 120, score_hi=0.5).assign(
                          previous_token_score=lambda d: np.where(d.step > 150, 0.2,
                                                                  d.previous_token_score))])
    on = head_onsets(traj, threshold=0.3).set_index(["layer", "head"])
    assert on.loc[(0, 0), "class"] == "forming"
    assert (on.loc[(0, 0), "behaviour_onset"], on.loc[(0, 0), "signature_onset"]) == (100, 40)
    assert on.loc[(0, 0), "lag"] == -60 and on.loc[(0, 0), "signature_side"] == "below"
    assert np.isnan(on.loc[(0, 0), "rotational_onset"])
    assert on.loc[(0, 1), "class"] == "control" and on.loc[(0, 1), "signature_side"] == "above"
    assert on.loc[(0, 1), "rotational_onset"] == 30 and np.isnan(on.loc[(0, 1), "lag"])
    assert on.loc[(1, 0), "class"] == "forming" and np.isnan(on.loc[(1, 0), "signature_onset"])
    assert on.loc[(1, 1), "class"] == "transient"  # crossed, fell back below by the end
    assert set(on.family) == {"f"} and set(on.seed) == {0}  # per-run columns carried


def test_head_onsets_refuses_missing_columns_and_a_bad_band():
    traj = _head(0, 0, 0, 100, 40)
    with pytest.raises(ValueError, match="lacks columns"):
        head_onsets(traj.drop(columns="run"), 0.3)
    with pytest.raises(ValueError, match="band"):
        head_onsets(traj, 0.3, band=(95, 5))


def _runs(values_per_run):
    """One forming head (behaviour onset b, signature onset s) and one control head
    (signature onset c) per run; runs alternate between two families."""
    parts = []
    for r, (b, s, c) in enumerate(values_per_run):
        fam = "ab"[r % 2]
        parts += [_head(r, 0, 0, b, s, family=fam), _head(r, 0, 1, None, c, family=fam)]
    return head_onsets(pd.concat(parts), 0.3)


def test_summary_estimates_are_pooled_means_over_heads():
    on = _runs([(100, 40, 20), (150, 60, 30), (80, 80, 10), (120, 20, 50)])
    s = onset_summary(on, n_boot=200, seed=0).set_index("statistic")
    assert s.loc["behaviour onset, forming heads", "estimate"] == np.mean([100, 150, 80, 120])
    assert s.loc["lag, forming heads", "estimate"] == np.mean([-60, -90, 0, -100])
    diff = s.loc["signature onset, forming - control"]
    assert diff.estimate == np.mean([40, 60, 80, 20]) - np.mean([20, 30, 10, 50])
    assert diff.n_heads == "4 / 4" and diff.n_units == 4
    assert s.loc["share with signature before behaviour, forming heads", "estimate"] == 0.75
    assert (s.ci_low <= s.estimate + 1e-12).all() and (s.estimate <= s.ci_high + 1e-12).all()


def test_ci_collapses_to_a_point_when_every_run_is_the_same():
    on = _runs([(100, 40, 20)] * 6)
    s = onset_summary(on, n_boot=500, seed=1)
    np.testing.assert_allclose(s.ci_low, s.estimate)
    np.testing.assert_allclose(s.ci_high, s.estimate)


def test_bootstrap_resamples_runs_within_strata_not_heads():
    # two runs in one stratum; run 0 has 1 head of value 0, run 1 has 3 heads of value 1.
    # Resampling runs, a draw's pooled mean is 0 (both run 0), 3/4 (one each) or 1; a
    # head-level bootstrap would give other values (e.g. 1/4, 1/2).
    sums, counts = np.array([[0.0], [3.0]]), np.array([[1.0], [3.0]])
    draws = run_bootstrap(sums, counts, ["x", "x"], n_boot=2000, seed=0)[:, 0]
    assert set(np.round(draws, 12)) == {0.0, 0.75, 1.0}
    # with each run its own stratum every draw keeps both: no sampling variance
    one = run_bootstrap(sums, counts, ["x", "y"], n_boot=100, seed=0)[:, 0]
    np.testing.assert_allclose(one, 0.75)
    # a stratum keeps its size: 3 runs of one stratum, each draw uses 3 runs' counts
    c3 = np.ones((3, 1))
    assert (run_bootstrap(c3, c3, ["s"] * 3, 50, 0) == 1).all()
    np.testing.assert_array_equal(run_bootstrap(sums, counts, ["x", "x"], 50, 7),
                                  run_bootstrap(sums, counts, ["x", "x"], 50, 7))


def test_bootstrap_refuses_bad_shapes():
    with pytest.raises(ValueError, match="same runs"):
        run_bootstrap(np.zeros((2, 1)), np.zeros((3, 1)), ["a", "b"], 10, 0)
    with pytest.raises(ValueError, match="n_boot"):
        run_bootstrap(np.zeros((2, 1)), np.ones((2, 1)), ["a", "b"], 0, 0)


def test_identical_snapshots_are_refused_by_both_steps():
    check_distinct_snapshots({0: "aa", 5: "bb", 10: "cc"})
    with pytest.raises(ValueError, match="steps 5 and 20 have identical weights"):
        check_distinct_snapshots({0: "aa", 5: "bb", 10: "cc", 20: "bb"})


def test_top_head_is_each_run_s_strongest_forming_head():
    # run 0: a strong head (final 0.6, onsets 100/40) and a weak one (0.35, 150/20);
    # run 1: only a weak forming head (0.4, 50/None) and a control head
    traj = pd.concat([_head(0, 0, 0, 100, 40, score_hi=0.6), _head(0, 0, 1, 150, 20,
                                                                    score_hi=0.35),
                      _head(1, 0, 0, 50, None, score_hi=0.4), _head(1, 0, 1, None, 30)])
    s = onset_summary(head_onsets(traj, 0.3), n_boot=50, seed=0).set_index("statistic")
    assert s.loc["behaviour onset, top head", "estimate"] == np.mean([100, 50])
    assert s.loc["signature onset, top head", "estimate"] == 40  # run 1's top head has none
    assert s.loc["lag, top head", "n_heads"] == "1"
    assert s.loc["behaviour onset, forming heads", "estimate"] == np.mean([100, 150, 50])
    # shares count every forming head: 2 of 3 leave below, none stays above the band
    assert s.loc["share leaving below the band, forming heads", "estimate"] == pytest.approx(2 / 3)
    assert s.loc["share with a rotational onset, forming heads", "estimate"] == 0
    assert s.loc["share with a rotational onset, control heads", "estimate"] == 0
