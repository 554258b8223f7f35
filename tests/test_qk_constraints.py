import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.experiments.qk_constraints import (
    ConstraintGrid,
    claims_table,
    induction_batch,
    induction_ceiling,
    induction_scores,
    render_markdown,
    run_qk_constraints,
)
from tests.helpers import tiny_model

TINY = dict(pes=("absolute",), constraints=("none", "tied", "symmetric"), seeds=2,
            max_steps=4, eval_every=2, d_model=16, n_heads=2, n_ctx=12)


def test_induction_batches_are_periodic_with_random_periods():
    toks, mask = induction_batch(torch.Generator().manual_seed(0), 64, 32, 16)
    periods = set()
    for b in range(64):
        p = int(mask[b].argmax()) - 1  # the first repeat (token p) is not scored
        periods.add(p)
        assert 8 <= p <= 16 and (mask[b, : p + 1] == 0).all() and (mask[b, p + 1:] == 1).all()
        assert torch.equal(toks[b, p:], toks[b, : 32 - p])
        assert len(set(toks[b, :p].tolist())) == p  # distinct within a period
    assert len(periods) > 3  # random offsets, not a fixed repeat
    # plain induction is right on every scored token: the task's ceiling is 1
    assert induction_ceiling(toks, mask) == 1.0
    with pytest.raises(ValueError, match="d_vocab"):
        induction_batch(torch.Generator(), 2, 32, 8)


def test_induction_ceiling_in_closed_form():
    # period 4 with a repeat inside it: 1 2 1 3 | 1 2 1 3. Scored t >= 5: at t = 5 the
    # most recent 1 before position 4 is at 2, followed by 3, not 2 (a miss); t = 6
    # (after 2: 1) hits; t = 7 (after 1 at 6? no: x6 = 1, last 1 before 6 is at 4,
    # followed by 2, not 3) misses. 1 of 3.
    toks = torch.tensor([[1, 2, 1, 3, 1, 2, 1, 3]])
    mask = (torch.arange(8) >= 5).long()[None]
    assert induction_ceiling(toks, mask) == pytest.approx(1 / 3)


def test_induction_score_of_an_exact_induction_pattern_is_one():
    model = tiny_model("nope", n_ctx=32)
    toks, mask = induction_batch(torch.Generator().manual_seed(1), 4, 32, 16)
    periods = mask.argmax(-1) - 1

    def perfect(pattern, hook):  # attend from t to t - p + 1 once the token repeats
        out = torch.zeros_like(pattern)
        for b, p in enumerate(periods.tolist()):
            for t in range(32):
                out[b, :, t, t - p + 1 if t >= p else t] = 1.0
        return out

    model.add_hook("blocks.1.attn.hook_pattern", perfect)
    try:
        scores = induction_scores(model, toks + 4, mask)  # ids >= 4 skip special tokens
    finally:
        model.reset_hooks()
    assert scores[scores.layer == 1].value.tolist() == pytest.approx([1.0] * model.cfg.n_heads)
    assert (scores[scores.layer == 0].value < 1).all()


def test_grid_runs_resumes_and_summarizes(tmp_path):
    grid = ConstraintGrid(**TINY, workers=1)
    summary = run_qk_constraints(grid, tmp_path, progress=False, markdown=tmp_path / "page.md",
                                 command="posinterp experiment qk-constraints --tiny")
    page = (tmp_path / "page.md").read_text()
    assert page == render_markdown(tmp_path) and "--tiny" in page
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["induction_ceiling"] == 1.0 and run["calls"][0]["cells_run"] == 6
    assert list(zip(summary.constraint, summary.control, strict=True)) == [
        ("none", ""), ("tied", "none"), ("symmetric", "tied"), ("symmetric", "none")]
    assert (summary.censored == 2).all()  # 4 steps cannot reach 90%: censored, not dropped
    # every run is censored at the cap on both sides, so every ratio is exactly 1
    assert (summary.ratio.dropna() == 1.0).all()
    assert (tmp_path / "report.html").exists() and len(list((tmp_path / "cells").glob("*-seed*.json"))) == 6
    # the cells' compute seconds are recorded outside runs.csv, one per cell
    assert set(json.loads((tmp_path / "cells" / "_seconds.json").read_text())) == {
        p.stem for p in (tmp_path / "cells").glob("*-seed*.json")}
    assert run["cell_seconds"] >= 0 and "cell_seconds" not in pd.read_csv(tmp_path / "runs.csv")
    claims = pd.read_csv(tmp_path / "claims.csv")
    assert (claims.loc[claims.claim.str.contains("2.9x"), "verdict"] == "undetermined").all()
    first_runs = (tmp_path / "runs.csv").read_bytes()
    again = run_qk_constraints(grid, tmp_path, progress=False)
    assert again.equals(summary)
    assert (tmp_path / "runs.csv").read_bytes() == first_runs  # same columns, same order


def test_cells_record_the_previous_token_head_and_its_symmetry(tmp_path):
    grid = ConstraintGrid(**{**TINY, "pes": ("rotary",), "seeds": 1}, workers=1)
    run_qk_constraints(grid, tmp_path, progress=False)
    runs = pd.read_csv(tmp_path / "runs.csv").set_index("constraint")
    assert runs.prev_score.between(0, 1).all()
    # a symmetric X makes M(0) exactly symmetric; RoPE's rotation one step back does not
    assert runs.loc["symmetric", "prev_head_antisymmetric_energy_offset0"] < 1e-12
    assert runs.loc["symmetric", "prev_head_antisymmetric_energy_offset-1"] > 1e-6
    assert runs.loc["none", "prev_head_antisymmetric_energy_offset0"] > 1e-3
    heads = pd.read_csv(tmp_path / "heads.csv")
    assert list(heads.constraint) == ["none", "tied", "symmetric"]


def test_workers_do_not_change_the_numbers(tmp_path):
    grid = ConstraintGrid(**{**TINY, "constraints": ("none", "tied")})
    one = run_qk_constraints(grid, tmp_path / "one", progress=False)
    two = run_qk_constraints(dataclasses.replace(grid, workers=2), tmp_path / "two",
                             progress=False)
    pd.testing.assert_frame_equal(one, two)
    cells = list((tmp_path / "one" / "cells").glob("*-seed*.json"))
    assert len(cells) == 4
    for cell in cells:
        a, b = (json.loads(p.read_text()) for p in (cell, tmp_path / "two" / "cells" / cell.name))
        assert a == b
    assert (tmp_path / "one" / "runs.csv").read_bytes() == (tmp_path / "two" / "runs.csv").read_bytes()


def test_resuming_with_another_budget_is_refused_and_keeps_the_cells(tmp_path):
    grid = ConstraintGrid(**{**TINY, "seeds": 1, "constraints": ("none",)}, workers=1)
    run_qk_constraints(grid, tmp_path, progress=False)
    before = sorted(p.name for p in (tmp_path / "cells").iterdir())
    with pytest.raises(ValueError, match="out_dir"):
        run_qk_constraints(dataclasses.replace(grid, max_steps=6), tmp_path, progress=False)
    assert sorted(p.name for p in (tmp_path / "cells").iterdir()) == before


@pytest.mark.parametrize("bad, match", [({"seeds": 0}, "seeds"), ({"workers": 0}, "workers"),
                                        ({"target": 1.5}, "target"),
                                        ({"constraints": ("none", "sym")}, "constraints"),
                                        ({"constraints": ("none", "none")}, "repeats"),
                                        ({"constraints": ()}, "constraints"),
                                        ({"pes": ("Absolute",)}, "pes"), ({"pes": ()}, "pes"),
                                        ({"init_scale": 0.0}, "init_scale"),
                                        ({"d_vocab": 8}, "d_vocab")])
def test_bad_grid_names_the_parameter(bad, match):
    with pytest.raises(ValueError, match=match):
        ConstraintGrid(**bad)


def _row(pe, constraint, control, ratio, lo, hi, q, censored=0, control_censored=0, n=5):
    return dict(pe=pe, constraint=constraint, control=control, n=n, censored=censored,
                control_censored=control_censored, median_steps=100.0, ratio=ratio,
                ci_low=lo, ci_high=hi, p_one_sided=q, q_bh=q)


def test_claims_verdicts_follow_the_definitions():
    grid = ConstraintGrid()
    summary = pd.DataFrame([
        _row("absolute", "symmetric", "tied", 3.1, 2.0, 4.0, 0.01),       # 2.9 inside the CI
        _row("absolute", "symmetric", "none", 1.2, 1.0, 1.5, 0.2),        # 2.9 outside
        _row("rotary", "ban_positive_real", "none", 2.0, 1.5, 3.0, 0.03, censored=1),
        _row("rotary", "ban_negative_real", "none", 1.0, 0.8, 1.2, 0.6),
    ])
    c = claims_table(summary, grid).set_index("claim").verdict
    assert c["symmetric M slows absolute PE ~2.9x (vs tied)"] == "holds"
    assert c["symmetric M slows absolute PE ~2.9x (vs none)"] == "fails"
    assert c["rotary: ban_positive_real slows learning (q <= 0.05 vs none)"] == "holds"
    assert c["rotary: ban_positive_real never prevents learning"] == "fails"  # one censored
    assert c["rotary: ban_negative_real slows learning (q <= 0.05 vs none)"] == "fails"
    assert c["rotary: ban_negative_real never prevents learning"] == "holds"
    blind = claims_table(summary.iloc[[2]].assign(censored=5, control_censored=5, q_bh=1.0),
                         grid)
    assert (blind.verdict == "undetermined").all()  # the control never learned either
    heads = pd.DataFrame([dict(pe="rotary", constraint="symmetric", median_prev_score=0.8,
                               max_antisymmetric_energy_offset0=1e-15, max_banned_mass=np.nan),
                          dict(pe="rotary", constraint="ban_complex", median_prev_score=0.8,
                               max_antisymmetric_energy_offset0=0.3, max_banned_mass=3e-7)])
    routes = claims_table(summary, grid, heads).set_index("claim").verdict
    assert routes["rotary: a head with symmetric M(0) still routes by position"] == "holds"
    assert routes["rotary: ban_complex leaves its channel empty after training"] == "holds"
    leaky = claims_table(summary, grid, heads.assign(max_banned_mass=1e-3)).set_index("claim")
    assert leaky.verdict["rotary: ban_complex leaves its channel empty after training"] == "fails"
    weak = claims_table(summary, grid, heads.assign(median_prev_score=0.2))
    assert weak.verdict.iloc[-1] == "fails"
    both_censored = summary.iloc[[0]].assign(censored=5, control_censored=5)
    assert claims_table(both_censored, grid).verdict.iloc[0] == "undetermined"
    # every symmetric run censored: the ratio is a lower bound, which cannot confirm ~2.9x
    # and refutes it only once it exceeds 2.9
    lower = summary.iloc[[0]].assign(censored=5, ratio=2.9, ci_low=2.4, ci_high=4.4)
    assert claims_table(lower, grid).verdict.iloc[0] == "undetermined"
    # a bound is printed as one, without the bootstrap interval of a capped median
    measured = claims_table(lower, grid).measured.iloc[0]
    assert measured.startswith(">= 2.90x (bound set by the cap)") and "[2.40" not in measured
    assert claims_table(lower.assign(ci_low=3.5), grid).verdict.iloc[0] == "fails"
    upper = summary.iloc[[0]].assign(control_censored=5, ratio=1.5, ci_low=1.0, ci_high=2.0)
    assert claims_table(upper, grid).verdict.iloc[0] == "fails"


def test_bans_start_matched_and_end_empty(tmp_path):
    grid = ConstraintGrid(**{**TINY, "constraints": ("none", "ban_complex", "tied"), "seeds": 1,
                             "d_model": 64, "n_heads": 4}, workers=1)  # the grid's heads
    run_qk_constraints(grid, tmp_path, progress=False)
    runs = pd.read_csv(tmp_path / "runs.csv").set_index("constraint")
    np.testing.assert_allclose(runs.init_norm_M, runs.init_norm_M["none"], rtol=1e-5)
    assert runs.init_mass_complex["ban_complex"] < 1e-5 < runs.init_mass_complex["none"]
    assert runs.final_max_banned_mass["ban_complex"] < 1e-5
    assert runs.induction_score.between(0, 1).all()
    summary = pd.read_csv(tmp_path / "summary.csv", keep_default_na=False, na_values=[""])
    assert summary.set_index("constraint").control["ban_complex"] == "none"


def test_a_grid_without_its_controls_still_writes_its_tables(tmp_path):
    grid = ConstraintGrid(**{**TINY, "constraints": ("symmetric",), "seeds": 1}, workers=1)
    summary = run_qk_constraints(grid, tmp_path, progress=False)
    assert summary.ratio.isna().all() and (tmp_path / "claims.csv").exists()


def test_uniform_previous_token_score_is_the_closed_form():
    from posinterp.experiments.qk_constraints import uniform_previous_token_score

    assert uniform_previous_token_score(3) == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert uniform_previous_token_score(2) == pytest.approx(1 / 2)


def test_phase_ablation_rescores_the_grids_rotary_symmetric_heads(tmp_path):
    from posinterp.experiments.qk_constraints import run_phase_ablation

    grid = ConstraintGrid(**{**TINY, "pes": ("rotary",), "constraints": ("none", "symmetric")},
                          workers=1)
    run_qk_constraints(grid, tmp_path, progress=False, markdown=tmp_path / "page.md")
    runs = pd.read_csv(tmp_path / "runs.csv")
    phase = pd.read_csv(tmp_path / "phase.csv")  # written by the experiment itself
    sym = runs[runs.constraint == "symmetric"].set_index("seed")
    assert sorted(phase.seed) == sorted(sym.index)
    for r in phase.itertuples():  # the same run, retrained from its seed
        assert r.prev_head == sym.prev_head[r.seed] and r.steps == sym.steps[r.seed]
        assert r.prev_score == pytest.approx(sym.prev_score[r.seed], abs=1e-6)
    assert phase.prev_score_without_rope.between(0, 1).all()
    assert "## Phase ablation" in (tmp_path / "page.md").read_text()
    assert (tmp_path / "img" / "qk-constraints-km.png").is_file()
    # a finished folder whose runs.csv another run wrote is refused by name
    runs.loc[runs.constraint == "symmetric", "steps"] += 1
    runs.to_csv(tmp_path / "runs.csv", index=False)
    with pytest.raises(ValueError, match="differs from runs.csv"):
        run_phase_ablation(tmp_path, progress=False)


def test_band_ban_cells_keep_their_band_empty_on_a_tiny_grid(tmp_path):
    """A frequency-band ban is a grid constraint like a channel ban (issue 28): its cells
    start matched, compare with the untied model, and their banned band's QK-energy share
    is 0 at init and after training (the full grid is not rerun here)."""
    grid = ConstraintGrid(**{**TINY, "pes": ("rotary",), "constraints": ("none", "ban_band_p0"),
                             "seeds": 1}, workers=1)
    summary = run_qk_constraints(grid, tmp_path, progress=False)
    runs = pd.read_csv(tmp_path / "runs.csv").set_index("constraint")
    np.testing.assert_allclose(runs.init_norm_M, runs.init_norm_M["none"], rtol=1e-5)
    assert runs.init_max_banned_band_share["ban_band_p0"] <= 1e-12
    assert runs.final_max_banned_band_share["ban_band_p0"] <= 1e-12
    assert np.isnan(runs.final_max_banned_band_share["none"])
    assert summary.set_index("constraint").control["ban_band_p0"] == "none"
    claims = pd.read_csv(tmp_path / "claims.csv")
    row = claims[claims.claim.str.contains("ban_band_p0 leaves its band empty")]
    assert list(row.verdict) == ["holds"]
    assert (tmp_path / "cells" / "rotary-ban_band_p0-seed0.json").exists()


def test_band_ban_shares_are_measured_on_the_trained_weights():
    """_band_summary reads the model's own weights: an unconstrained toy has energy in every
    pair, and the same toy under ban_band has none in the banned pairs."""
    from posinterp.experiments.qk_constraints import _band_summary
    from posinterp.interventions import constrain_qk

    free = tiny_model("rotary")
    assert _band_summary(free, "x", (0, 1))["x_max_banned_band_share"] > 1e-3
    banned = tiny_model("rotary")
    constrain_qk(banned, "ban_band", band=(0, 1))
    assert _band_summary(banned, "x", (0, 1))["x_max_banned_band_share"] <= 1e-12
    assert _band_summary(banned, "x", (2,))["x_max_banned_band_share"] > 1e-3


@pytest.mark.parametrize("bad, match", [
    ({"constraints": ("none", "ban_band_q1")}, "constraints: a band is written"),
    ({"constraints": ("none", "ban_band_p4")}, r"rotary pairs 0\.\.3"),
    ({"constraints": ("none", "ban_band_p0"), "pes": ("absolute", "rotary")}, "pes must be"),
    ({"constraints": ("none", "ban_bands")}, "ban_band_<band> on RoPE")])
def test_bad_band_bans_name_the_allowed_values(bad, match):
    with pytest.raises(ValueError, match=match):
        ConstraintGrid(**{**TINY, "pes": ("rotary",), **bad})


def test_cli_takes_band_bans_and_names_the_allowed_constraints(tmp_path, capsys):
    from posinterp.cli import main

    out = tmp_path / "grid"
    assert main(["experiment", "qk-constraints", "--pes", "absolute", "--constraints", "none",
                 "ban_band_p0", "--out", str(out), "--no-progress"]) == 2
    assert "exist only with pe 'rotary'" in capsys.readouterr().err
    assert main(["experiment", "qk-constraints", "--constraints", "none", "sym",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "'ban_complex'" in err and "ban_band_p0" in err
    assert not out.exists()


def test_claims_a_small_grid_cannot_test_are_not_scored_as_failing():
    from posinterp.experiments.qk_constraints import UNTESTABLE

    quick = ConstraintGrid.quick()  # 2 seeds, 200 steps
    none = dict(pe="rotary", constraint="none", control="", n=2, censored=0, control_censored=np.nan,
                median_steps=120.0, ratio=np.nan, ci_low=np.nan, ci_high=np.nan,
                p_one_sided=np.nan, q_bh=np.nan)
    # the best a 2-vs-2 comparison can do: both ban runs slower than both controls
    ban = _row("rotary", "ban_complex", "none", 1.5, 1.2, 1.8, 1 / 6, censored=1, n=2)
    c = claims_table(pd.DataFrame([none, ban]), quick).set_index("claim").verdict
    assert c["rotary: ban_complex slows learning (q <= 0.05 vs none)"] == UNTESTABLE
    # a censored run at 200 steps when a run slowed 2.9x from 120 would need 348
    assert c["rotary: ban_complex never prevents learning"] == UNTESTABLE
    # the same numbers from the full grid's budget are a test, and fail
    full = ConstraintGrid()
    five = pd.DataFrame([{**none, "n": 5}, {**ban, "n": 5, "q_bh": 0.2}])
    c = claims_table(five, full).set_index("claim").verdict
    assert c["rotary: ban_complex slows learning (q <= 0.05 vs none)"] == "fails"
    assert c["rotary: ban_complex never prevents learning"] == "fails"
    # routing by position read off models most of which never learned the task
    heads = pd.DataFrame([dict(pe="rotary", constraint="symmetric", median_prev_score=0.2, n=3,
                               censored=2, max_antisymmetric_energy_offset0=1e-15)])  # 2 of 3
    routes = claims_table(pd.DataFrame([none, ban]), quick, heads).verdict.iloc[-1]
    assert routes == UNTESTABLE
    heads.loc[0, "censored"] = 1  # 1 of 3: the models learned, and the score is low
    assert claims_table(pd.DataFrame([none, ban]), quick, heads).verdict.iloc[-1] == "fails"


def test_rank_matched_controls_remove_the_bans_rank_and_are_compared(tmp_path):
    """A ban and its rank-matched control start from the same untied model and remove
    the same rank (one read off the ban's projector, one off the control's fixed
    subspace); the control's subspace stays empty; the ban is compared with both."""
    grid = ConstraintGrid(**{**TINY, "pes": ("rotary",), "constraints": (
        "none", "ban_complex", "rank_matched_complex")}, workers=1)
    summary = run_qk_constraints(grid, tmp_path, progress=False, markdown=tmp_path / "page.md")
    runs = pd.read_csv(tmp_path / "runs.csv")
    ban = runs[runs.constraint == "ban_complex"].set_index("seed")
    ctrl = runs[runs.constraint == "rank_matched_complex"].set_index("seed")
    assert (ban.init_removed_rank == ctrl.init_removed_rank).all()
    assert (ctrl.init_removed_rank == ctrl.final_removed_rank).all()  # fixed subspace
    assert (ctrl.init_removed_rank > 0).all() and (ctrl.final_max_removed_energy < 1e-10).all()
    assert ban.final_removed_rank.notna().all()
    assert runs[runs.constraint == "none"].init_removed_rank.isna().all()
    assert list(zip(summary.constraint, summary.control, strict=True)) == [
        ("none", ""), ("ban_complex", "none"), ("ban_complex", "rank_matched_complex"),
        ("rank_matched_complex", "none")]
    claims = pd.read_csv(tmp_path / "claims.csv")
    row = claims[claims.claim.str.contains("random subspace of the same rank")]
    assert len(row) == 1 and row.verdict.iloc[0] == "undetermined"  # all censored at 4 steps
    page = (tmp_path / "page.md").read_text()
    assert page == render_markdown(tmp_path) and "## Rank-matched controls of the bans" in page
    # the removed rank through training (issue 37 item 6): per head at init and at each
    # change (ranks.csv); its totals bound the row's and end at the final rank
    ranks = pd.read_csv(tmp_path / "ranks.csv.gz")
    assert set(ranks.constraint) == {"ban_complex", "rank_matched_complex"}
    for (c, seed), g in ranks.groupby(["constraint", "seed"]):
        row = runs[(runs.constraint == c) & (runs.seed == seed)].iloc[0]
        at_init = g[g.step == 0]
        assert len(at_init) == grid.n_layers * grid.n_heads
        assert at_init.removed_rank.sum() == row.init_removed_rank
        last = g.sort_values("step").groupby(["layer", "head"]).removed_rank.last()
        assert last.sum() == row.final_removed_rank
        assert row.removed_rank_min <= min(row.init_removed_rank, row.final_removed_rank)
        assert row.removed_rank_max >= max(row.init_removed_rank, row.final_removed_rank)
    assert (ranks[ranks.constraint == "rank_matched_complex"].step == 0).all()  # fixed subspace
    assert (runs.init_emptied_heads >= 0).all()  # counted by each cell
    # every cell says where it ran
    env = json.loads((tmp_path / "run.json").read_text())["cell_environments"]
    assert len(env["environments"]) == 1 and set(env["cells"].values()) == {0}
    assert env["environments"][0]["torch_threads"] == 1


def test_committed_outputs_are_restored_as_finished_cells(tmp_path):
    """restore_run turns a grid's committed CSVs and run.json (no cells/) back into a run
    folder: the same grid then runs nothing and writes the same tables; a larger one runs
    only its new cells. A grid.json written before a field existed resumes."""
    import shutil

    from posinterp.experiments.qk_constraints import restore_run

    grid = ConstraintGrid(**{**TINY, "constraints": ("none", "ban_complex", "symmetric")}, workers=1)
    run_qk_constraints(grid, tmp_path / "first", progress=False)
    assert len(pd.read_csv(tmp_path / "first" / "ranks.csv.gz"))  # the ban's trace comes back too
    data = tmp_path / "data"
    data.mkdir()
    for name in ("runs.csv", "summary.csv", "heads.csv", "claims.csv", "run.json", "ranks.csv.gz"):
        shutil.copyfile(tmp_path / "first" / name, data / name)
    assert len(restore_run(data, tmp_path / "again")) == 6
    run_qk_constraints(grid, tmp_path / "again", progress=False)
    first_env = json.loads((tmp_path / "first" / "run.json").read_text())["cell_environments"]
    again_env = json.loads((tmp_path / "again" / "run.json").read_text())["cell_environments"]
    assert again_env == first_env  # restored with the cells
    for name in ("runs.csv", "summary.csv", "heads.csv", "claims.csv", "ranks.csv.gz"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "first" / name).read_bytes()
    run = json.loads((tmp_path / "again" / "run.json").read_text())
    assert [c["cells_run"] for c in run["calls"]] == [6, 0]
    assert restore_run(data, tmp_path / "again") == []  # nothing overwritten
    budget = json.loads((tmp_path / "again" / "grid.json").read_text())
    del budget["n_layers"]  # as written before the field existed (its default then: 2)
    (tmp_path / "again" / "grid.json").write_text(json.dumps(budget))
    run_qk_constraints(dataclasses.replace(grid, constraints=("none", "tied", "symmetric")),
                       tmp_path / "again", progress=False)
    run = json.loads((tmp_path / "again" / "run.json").read_text())
    assert run["calls"][-1]["cells_run"] == 2
    # each call names the TransformerLens line its cells ran on, and the page says it
    from importlib.metadata import version

    assert run["calls"][-1]["transformer_lens"] == version("transformer-lens")
    page = render_markdown(tmp_path / "again")
    assert f"2 cells in one process with one torch thread on TransformerLens " \
           f"{version('transformer-lens')}" in page


def test_sensitivity_grids_are_their_own_grids_on_the_page(tmp_path):
    from posinterp.experiments.qk_constraints import SENSITIVITY, run_sensitivity, write_page

    grid = ConstraintGrid(**{**TINY, "constraints": ("none", "symmetric")}, workers=1)
    run_qk_constraints(grid, tmp_path, progress=False)
    with pytest.raises(ValueError, match="variants must be among"):
        run_sensitivity(tmp_path, grid, variants=["lr-1"])
    out = run_sensitivity(tmp_path, grid, variants=["lr-0.01"], progress=False)
    sub = json.loads((tmp_path / "sensitivity" / "lr-0.01" / "run.json").read_text())["grid"]
    assert sub["lr"] == 0.01 and sub["pes"] == ["absolute"] and sub["max_steps"] == grid.max_steps
    assert list(out["lr-0.01"].constraint) == ["none", "symmetric"]
    page = write_page(tmp_path, tmp_path / "page.md").read_text()
    assert page == render_markdown(tmp_path)
    section = page.split("## Sensitivity")[1].split("\n## ")[0]
    assert "| lr 0.01 |" in section and "default grid (this page)" in section
    pending = section.split("**Pending**")[1]
    assert all(f"`{n}`" in pending for n in SENSITIVITY if n != "lr-0.01")


def test_workers_1_runs_the_cells_in_process():
    """--workers 1 picks the in-process executor for qk-constraints (it used to be refused:
    'workers applies to executor process only')."""
    import argparse

    from posinterp.cli import _executor
    from posinterp.executors import LocalExecutor

    args = argparse.Namespace(executor=None, workers=1, address=None)
    with _executor(args, "local", 1) as ex:
        assert isinstance(ex, LocalExecutor)
    with pytest.raises(ValueError, match="workers applies"):  # asked for explicitly: refused
        _executor(argparse.Namespace(executor="local", workers=2, address=None))


def test_tables_of_the_finished_cells_name_the_pending_ones(tmp_path):
    """only_finished trains nothing: the tables hold the finished cells, run.json and the
    page name the others with the command that resumes them, and that command runs them."""
    small = ConstraintGrid(**{**TINY, "constraints": ("none", "symmetric")}, workers=1)
    run_qk_constraints(small, tmp_path, progress=False)
    grid = dataclasses.replace(small, constraints=("none", "tied", "symmetric"))
    with pytest.raises(ValueError, match="none of the grid"):
        run_qk_constraints(dataclasses.replace(grid, pes=("rotary",)), tmp_path / "empty",
                           progress=False, only_finished=True)
    run_qk_constraints(grid, tmp_path, progress=False, only_finished=True,
                       markdown=tmp_path / "page.md",
                       command="posinterp experiment qk-constraints --tables-only --out x")
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["pending"] == ["absolute-tied-seed0", "absolute-tied-seed1"]
    assert run["calls"][-1]["cells_run"] == 0 and len(pd.read_csv(tmp_path / "runs.csv")) == 4
    page = (tmp_path / "page.md").read_text()
    assert page == render_markdown(tmp_path)
    assert "**Pending: 2 cells have not run yet** (absolute tied: 2 of 2 seeds)" in page
    assert "```bash\nposinterp experiment qk-constraints --out x\n```" in page
    run_qk_constraints(grid, tmp_path, progress=False)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["pending"] == [] and run["calls"][-1]["cells_run"] == 2
    assert "Pending" not in render_markdown(tmp_path)


def test_rank_tracked_controls_follow_their_bans_rank(tmp_path):
    """Issue 37 item 6: a rank-tracked control starts as the rank-matched control of its
    seed and removes, after each evaluation, a random subspace of the rank its ban (same pe
    and seed) removed at that step; its own logged trace is the ban's, and the ban is
    compared with it."""
    grid = ConstraintGrid(**{**TINY, "max_steps": 12, "constraints": (
        "none", "ban_complex", "rank_matched_complex", "rank_tracked_complex")}, workers=1)
    summary = run_qk_constraints(grid, tmp_path, progress=False)
    runs = pd.read_csv(tmp_path / "runs.csv").set_index(["constraint", "seed"])
    ranks = pd.read_csv(tmp_path / "ranks.csv.gz")
    for seed in range(grid.seeds):
        ban = ranks[(ranks.constraint == "ban_complex") & (ranks.seed == seed)]
        ctrl = ranks[(ranks.constraint == "rank_tracked_complex") & (ranks.seed == seed)]
        last = max(runs.loc[("rank_tracked_complex", seed), "steps"], 0)
        # the control's rank at each of its evaluations is the ban's at that step (the ban
        # stops at its own step count; the control keeps its last rank after that)
        for step in range(0, int(last) + 1, grid.eval_every):
            def at(trace, s=step):
                return (trace[trace.step <= s].sort_values("step")
                        .groupby(["layer", "head"]).removed_rank.last())
            assert at(ctrl).equals(at(ban)), (seed, step)
        assert (runs.loc[("rank_tracked_complex", seed), "init_removed_rank"]
                == runs.loc[("rank_matched_complex", seed), "init_removed_rank"])
        assert runs.loc[("rank_tracked_complex", seed), "final_max_removed_energy"] < 1e-10
    assert ("ban_complex", "rank_tracked_complex") in set(zip(summary.constraint, summary.control,
                                                              strict=True))
    with pytest.raises(ValueError, match="needs .*ban_complex"):
        ConstraintGrid(**{**TINY, "constraints": ("none", "rank_tracked_complex")})


def test_resized_subspaces_are_nested_and_follow_the_requested_ranks():
    from posinterp.experiments.qk_constraints import _cell_config
    from posinterp.interventions.constraints import (
        constrain_qk,
        removed_ranks,
        resize_removed_subspaces,
    )
    from posinterp.models import build_model
    from posinterp.models.backend import qk_slots

    model = build_model(_cell_config(ConstraintGrid(**TINY), "absolute", 0))
    constrain_qk(model, "ban_random_subspace", rank=3, generator=torch.Generator().manual_seed(0))
    q = qk_slots(model, 0)["W_Q"]

    def projector():
        return q.module.parametrizations[q.name][0].removed.double().clone()
    before = projector()
    ranks = torch.tensor([[5, 1], [3, 0]])
    gen = torch.Generator().manual_seed(1)
    assert resize_removed_subspaces(model, ranks, gen) == 3  # (1, 1) keeps its rank 3
    assert torch.equal(removed_ranks(model), ranks)
    after = projector()
    for h, grew in ((0, True), (1, False)):
        small, big = (before[h], after[h]) if grew else (after[h], before[h])
        assert torch.allclose(big @ small, small, atol=1e-12)  # nested: small inside big
        assert torch.allclose(after[h] @ after[h], after[h], atol=1e-12)  # still a projector
    with pytest.raises(ValueError, match="ranks must be"):
        resize_removed_subspaces(model, torch.tensor([[17, 0], [0, 0]]), gen)
    with pytest.raises(ValueError, match="no random-subspace ban"):
        resize_removed_subspaces(build_model(_cell_config(ConstraintGrid(**TINY), "absolute", 0)),
                                 ranks, gen)


def test_verify_reruns_committed_cells_and_reports_the_ones_that_differ(tmp_path, capsys):
    """--verify K re-runs K seeded-random cells of committed outputs and compares them with
    their rows at the page's precision: an untouched grid reproduces; a row whose steps were
    edited is reported as differing (exit 1)."""
    import shutil

    from posinterp.cli import main
    from posinterp.experiments.qk_constraints import verify_cells

    grid = ConstraintGrid(**{**TINY, "constraints": ("none", "symmetric")}, workers=1)
    run_qk_constraints(grid, tmp_path / "run", progress=False)
    table = verify_cells(tmp_path / "run", 2, progress=False)
    assert table.within.all() and table.cell.nunique() == 2
    assert table.attrs["summary"] == "2 of 2 cells reproduce within the page's precision"
    data = tmp_path / "data"
    data.mkdir()
    for name in ("runs.csv", "run.json"):
        shutil.copyfile(tmp_path / "run" / name, data / name)
    runs = pd.read_csv(data / "runs.csv")
    runs["steps"] += 2
    runs.to_csv(data / "runs.csv", index=False)
    assert main(["experiment", "qk-constraints", "--verify", "1", "--restore-from", str(data),
                 "--no-progress"]) == 1
    assert "0 of 1 cells reproduce" in capsys.readouterr().out
    with pytest.raises(ValueError, match="k must be in"):
        verify_cells(data, 99, progress=False)


def test_rerun_comparison_finds_the_changed_cells(tmp_path):
    """Against the committed runs with one cell's steps and another's accuracy moved, the
    comparison flags exactly those two, and the page section lists the moved steps."""
    from pathlib import Path

    from posinterp.experiments.qk_constraints import PREVIOUS_RUN, _rerun_section, rerun_comparison

    runs = pd.read_csv(Path(__file__).parents[1] / "docs/reproductions/data/qk-constraints/runs.csv")
    prev = runs.copy()
    prev.loc[0, "steps"] += 10
    prev.loc[1, "final_accuracy"] -= 0.01
    table = rerun_comparison(prev, runs)
    per = table.groupby("cell", sort=False).within.all()
    cell = lambda i: f"{runs.pe[i]}-{runs.constraint[i]}-seed{runs.seed[i]}"  # noqa: E731
    assert set(per.index[~per]) == {cell(0), cell(1)}
    assert table.attrs["summary"].startswith(f"{len(runs) - 2} of {len(runs)} cells")
    (tmp_path / PREVIOUS_RUN).mkdir()
    prev.to_csv(tmp_path / PREVIOUS_RUN / "runs.csv", index=False)
    text = "\n".join(_rerun_section(tmp_path, runs))
    assert f"Steps changed in 1 of {len(runs)} cells" in text and cell(0) in text
    assert f"another field beyond the precision: {cell(1)}" in text
    # the moved cell's family is named, and every other family counted as unmoved
    families = runs.groupby(["pe", "constraint"]).ngroups
    assert f"belong to 1 (pe, constraint) families: {runs.pe[0]} {runs.constraint[0]}; " \
        f"in the other {families - 1} (" in text
    # every family moved: no claim that the others kept their steps
    everywhere = runs.drop_duplicates(["pe", "constraint"]).index
    prev.loc[everywhere, "steps"] += 10
    prev.to_csv(tmp_path / PREVIOUS_RUN / "runs.csv", index=False)
    text = "\n".join(_rerun_section(tmp_path, runs))
    assert f"belong to {families} (pe, constraint) families" in text and "in the other" not in text
    assert _rerun_section(tmp_path / "none", runs) == []


def test_the_complex_ban_is_compared_with_the_full_rank_real_spectrum_control():
    """The complex ban leaves a real spectrum of reduced rank; the symmetric constraint is
    real at full rank. The summary compares the two (and only for the complex ban), and the
    claim's verdict follows q and the censoring like the rank controls' claims."""
    from posinterp.experiments.qk_constraints import REAL_SPECTRUM_CONTROL, _summarize

    rng = np.random.default_rng(0)
    runs = pd.DataFrame([dict(pe="absolute", constraint=c, seed=s, censored=False,
                              steps=float(base + rng.integers(0, 20)))
                         for c, base in (("none", 100), ("ban_complex", 900),
                                         ("ban_positive_real", 130), ("symmetric", 250),
                                         ("tied", 140))
                         for s in range(6)])
    summary = _summarize(runs)
    pairs = set(zip(summary.constraint, summary.control, strict=True))
    assert ("ban_complex", REAL_SPECTRUM_CONTROL) in pairs
    assert ("ban_positive_real", REAL_SPECTRUM_CONTROL) not in pairs
    claim = ("absolute: ban_complex slows learning more than a full-rank QK with an all-real "
             "spectrum (q <= 0.05 vs symmetric: a symmetric M(0))")
    verdicts = claims_table(summary, ConstraintGrid()).set_index("claim").verdict
    assert verdicts[claim] == "holds"
    # both sides at the cap: the order is unknown
    capped = summary.assign(censored=6, control_censored=6)
    assert claims_table(capped, ConstraintGrid()).set_index("claim").verdict[claim] == "undetermined"


def test_capped_medians_and_their_ratios_print_as_bounds_on_the_page_and_the_cli(
        tmp_path, monkeypatch, capsys):
    """More than half a side's runs at the cap makes its median the cap and the ratio of
    medians a bound: both print with >= (a censored control: <=), never as an estimate
    with an interval, in the page's table and in the CLI's."""
    import posinterp.experiments.qk_constraints as q
    from posinterp.cli import main

    row = dict(pe="absolute", n=10, median_steps=3000.0, ratio=20.0, ci_low=18.0,
               ci_high=22.0, p_one_sided=1e-4, q_bh=2e-4)
    summary = pd.DataFrame([
        {**row, "constraint": "ban_complex", "control": "none", "censored": 6,
         "control_censored": 0},
        {**row, "constraint": "ban_complex", "control": "tied", "censored": 5,
         "control_censored": 0},  # half: the median is not the cap
        {**row, "constraint": "none", "control": "tied", "censored": 0, "median_steps": 100.0,
         "ratio": 0.05, "ci_low": 0.04, "ci_high": 0.06, "control_censored": 6}])
    shown = q.display_summary(summary)
    assert shown["median steps"].tolist() == [">= 3000 (cap)", "3000", "100"]
    assert shown["ratio [95% CI]"].tolist() == [">= 20.00 (bound set by the cap)",
                                                "20.00 [18.00, 22.00]",
                                                "<= 0.05 (bound set by the cap)"]
    assert shown.censored.tolist() == ["6/10", "5/10", "0/10"]

    def fake_run(grid, out, **kwargs):  # the CLI's table, without training a grid
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / "run.json").write_text(json.dumps({"induction_ceiling": 1.0}))
        return summary

    monkeypatch.setattr(q, "run_qk_constraints", fake_run)
    assert main(["experiment", "qk-constraints", "--quick", "--out", str(tmp_path / "out"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert ">= 3000 (cap)" in out and ">= 20.00 (bound set by the cap)" in out
    assert "20.00 [18.00, 22.00]" in out and "<= 0.05" in out
