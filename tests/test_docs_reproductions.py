"""The reproduction pages are the run outputs they cite, rendered by code: no hand-typed figure.

Each page under docs/reproductions is written by its experiment's ``render_markdown``
from the run's own CSVs and run.json, which are committed next to it
(docs/reproductions/data/...). Regenerating the page from the committed data must give
the committed page exactly.
"""

from pathlib import Path

import pandas as pd
import pytest

from posinterp.experiments import qk_constraints, spectrum, zuo2024

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reproductions"


@pytest.mark.parametrize("page, data, render", [
    ("qk-constraints.md", "qk-constraints", qk_constraints.render_markdown),
    ("fingerprints.md", "fingerprints", spectrum.render_markdown),
    ("zuo2024.md", "zuo2024", zuo2024.render_markdown),
])
def test_committed_page_is_its_committed_run_outputs(page, data, render):
    assert (DOCS / page).read_text() == render(DOCS / "data" / data)


def test_committed_qk_run_is_the_grid_the_page_claims():
    """The must-show figures come from a full grid: >= 5 seeds per cell, every cell there
    or named as pending in run.json (and then on the page)."""
    import json

    from posinterp.experiments.qk_constraints import _cell_config
    from posinterp.interventions import banned_ranks
    from posinterp.models.toy import build_model

    data = DOCS / "data" / "qk-constraints"
    runs = pd.read_csv(data / "runs.csv")
    run = json.loads((data / "run.json").read_text())
    grid = run["grid"]
    assert grid["seeds"] >= 5
    counts = runs.groupby(["pe", "constraint"]).size()
    pending = pd.Series([n.rsplit("-seed", 1)[0] for n in run.get("pending", [])],
                        dtype=object).value_counts()
    for pe in grid["pes"]:
        for constraint in grid["constraints"]:
            done = counts.get((pe, constraint), 0)
            assert done + pending.get(f"{pe}-{constraint}", 0) == grid["seeds"]
    if len(pending):
        assert "**Pending:" in (DOCS / "qk-constraints.md").read_text()
    summary = pd.read_csv(data / "summary.csv", keep_default_na=False, na_values=[""])
    assert set(zip(summary.pe, summary.constraint, strict=True)) == set(counts.index)
    # every ban's channel is empty after training (float32 weights: up to rounding)
    bans = runs[runs.constraint.str.startswith("ban_")]
    assert len(bans) and (bans.final_max_banned_mass <= qk_constraints.BANNED_MASS_TOL).all()
    # matched init: every family of a seed starts from the untied model's mean ||M||_F,
    # except models where a ban emptied a head (all its eigenvalues in the banned channel)
    alive = runs[[c for c in runs if c.startswith("init_mass_")]].sum(axis=1) > 1 - 1e-6
    for _, g in runs[alive].groupby(["pe", "seed"]):
        untied = runs[(runs.pe == g.pe.iloc[0]) & (runs.seed == g.seed.iloc[0])
                      & (runs.constraint == "none")].init_norm_M.iloc[0]
        assert (g.init_norm_M - untied).abs().max() <= 1e-5 * untied
    assert (runs[~alive].constraint.str.startswith(("ban_", "rank_matched_", "rank_tracked_"))).all()
    # a rank-matched control removed the rank its ban removes at init (recounted here from
    # the seed's untied model), and its subspace stayed empty
    from posinterp.experiments.qk_constraints import ConstraintGrid

    cfg = ConstraintGrid(**{k: tuple(v) if isinstance(v, list) else v for k, v in grid.items()})
    ctrl = runs[runs.constraint.str.startswith("rank_matched_")]
    assert not len(ctrl) or (ctrl.final_max_removed_energy <= 1e-10).all()
    for r in ctrl.itertuples():
        model = build_model(_cell_config(cfg, r.pe, int(r.seed)))
        want = banned_ranks(model, r.constraint.removeprefix("rank_matched_")).sum()
        assert r.init_removed_rank == want == r.final_removed_rank
    total = sum(f.stat().st_size for f in data.iterdir())
    assert total < 400_000  # small run outputs only


def test_committed_zuo_run_is_the_grid_the_page_claims():
    """>= 3 seeds per trained cell and per probe cell, every after-attention verdict at the
    three measurement points, the embedding row in every probe table, both probe families,
    only trained models (at the accuracy target) scored as trained, every training either
    done or named as pending, and the depth x width grid run at the architectures it names."""
    import json

    data = DOCS / "data" / "zuo2024"
    run = json.loads((data / "run.json").read_text())
    cfg = run["config"]
    training = pd.read_csv(data / "training.csv")
    pending = pd.DataFrame(run.get("pending", []), columns=["cell", "task", "seed"])
    for label in zuo2024._labels(cfg):
        done = set(training[training.task == label].seed)
        waiting = set(pending[pending.task == label].seed)
        assert not done & waiting
        assert done | waiting == set(cfg["task_seeds"].get(label.split()[0], cfg["train_seeds"]))
    assert len(training[training.task == "reversal"]) >= 3  # the probes' models
    assert (training.reached_target == (training.accuracy >= zuo2024.THRESHOLDS["target_accuracy"])).all()
    claims = pd.read_csv(data / "claims.csv", keep_default_na=False, na_values=[""])
    after = claims[claims.point.isin(["attn_out", "resid_mid", "resid_post"])]
    assert (after.groupby("claim").point.nunique() == 3).all()
    assert (claims[claims.holds.isin(["yes", "no", "CI spans"])].n >= 3).all()
    for task, g in training.groupby("task"):
        rows = claims[claims.claim.str.endswith(f"after training: {task}")]
        assert (rows.holds == "not tested").all() == (not g.reached_target.any())
    for task in set(pending.task) - set(training.task):
        rows = claims[claims.claim.str.endswith(f"after training: {task}")]
        assert len(rows) == 3 and (rows.holds == "pending").all()
    probes = pd.read_csv(data / "probes.csv")
    for (dataset, state), g in probes.groupby(["dataset", "state"]):
        waiting = pending.task.eq(f"probe {dataset}, {state}").sum()
        assert (g.n + waiting == len(cfg["train_seeds"])).all()  # every seed done or pending
    assert all(-1 in set(g.layer) for _, g in probes.groupby(["dataset", "state", "probe"]))
    assert {"ridge", "mlp"} <= set(probes.probe) and "variance_matched" in set(probes.feature)
    assert "random_tokens" in set(probes.dataset)
    dw = pd.read_csv(data / "depth_width.csv")
    assert (dw.d_mlp == 4 * dw.width).all() and (dw.d_head == 64).all()
    total = sum(f.stat().st_size for f in data.iterdir())
    assert total < 400_000  # small run outputs only


def test_qk_page_and_its_km_figure_come_from_write_page(tmp_path):
    """write_page writes the committed page text and the Kaplan-Meier figure it links."""
    data = DOCS / "data" / "qk-constraints"
    page = qk_constraints.write_page(data, tmp_path / "qk-constraints.md")
    assert page.read_text() == (DOCS / "qk-constraints.md").read_text()
    figure = tmp_path / qk_constraints.KM_FIGURE
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({qk_constraints.KM_FIGURE})" in page.read_text()
    assert (DOCS / qk_constraints.KM_FIGURE).is_file()  # committed beside the page
    surv = qk_constraints.survival_table(pd.read_csv(data / "runs.csv"),
                                         pd.read_csv(data / "summary.csv", keep_default_na=False,
                                                     na_values=[""]))
    assert (surv.p_exact >= surv.min_p - 1e-12).all() and (surv.q_bh >= surv.p_exact - 1e-12).all()


def test_committed_dynamics_run_is_the_design_the_page_claims():
    """The dynamics section's numbers follow from its committed trajectories under the
    design fixed in code: >= 2 families x >= 3 seeds, distinct snapshots, the onsets
    recomputed from trajectories.csv.gz, the summary recomputed from the onsets."""
    import json

    from posinterp.analysis.onset import head_onsets, onset_summary
    from posinterp.experiments.dynamics import DESIGN, RULES

    data = DOCS / "data" / "fingerprints" / "dynamics"
    run = json.loads((data / "run.json").read_text())
    design = run["design"]
    assert run["status"] == "done"
    assert len(design["families"]) >= 2 and design["n_seeds"] >= 3
    fixed = {k: v for k, v in DESIGN.to_dict().items()}
    assert {k: design[k] for k in fixed} == json.loads(json.dumps(fixed))
    runs = pd.read_csv(data / "runs.csv")
    assert len(runs) == len(design["families"]) * design["n_seeds"]
    assert (runs.n_distinct_weights == runs.n_snapshots).all()
    traj = pd.read_csv(data / "trajectories.csv.gz")
    traj["run"] = traj.family + "/" + traj.seed.astype(str)
    onsets = pd.read_csv(data / "onsets.csv", keep_default_na=False, na_values=[""])
    summary = pd.read_csv(data / "summary.csv", keep_default_na=False, na_values=[""])
    cols = ["class", "behaviour_onset", "signature_onset", "signature_side", "lag"]
    for rule, kind in RULES.items():
        again = head_onsets(traj, design["threshold"], design["band"],
                            window=design["window"] if kind == "window" else None)
        got = onsets[onsets.rule == rule].reset_index(drop=True)
        pd.testing.assert_frame_equal(got[cols], again[cols], check_dtype=False)
        s = onset_summary(again, design["n_boot"], design["boot_seed"], strata="family")
        want = summary[summary.rule == rule].reset_index(drop=True)
        assert list(s.statistic) == list(want.statistic)
        for c in ("estimate", "ci_low", "ci_high"):
            pd.testing.assert_series_equal(s[c], want[c], check_names=False, rtol=1e-5)
    total = sum(f.stat().st_size for f in data.iterdir())
    assert total < 600_000  # small run outputs only
