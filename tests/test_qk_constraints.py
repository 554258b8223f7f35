import torch

from posinterp.experiments.qk_constraints import ConstraintGrid, induction_batch, run_qk_constraints


def test_induction_batches_are_periodic_with_random_periods():
    toks, mask = induction_batch(torch.Generator().manual_seed(0), 64, 32, 16)
    periods = set()
    for b in range(64):
        p = int(mask[b].argmax())
        periods.add(p)
        assert 8 <= p <= 16 and (mask[b, :p] == 0).all() and (mask[b, p:] == 1).all()
        assert torch.equal(toks[b, p:], toks[b, : 32 - p])
    assert len(periods) > 3  # random offsets, not a fixed repeat


def test_grid_runs_resumes_and_summarizes(tmp_path):
    grid = ConstraintGrid(pes=("absolute",), constraints=("none", "tied", "symmetric"), seeds=2,
                          max_steps=4, eval_every=2, d_model=16, n_heads=2, n_ctx=12)
    summary = run_qk_constraints(grid, tmp_path, progress=False)
    assert list(summary.constraint) == ["none", "tied", "symmetric"]
    assert (summary.censored == 2).all()  # 4 steps cannot reach 90%: censored, not dropped
    assert summary.loc[summary.constraint == "symmetric", "control"].item() == "tied"
    assert summary.loc[summary.constraint == "symmetric", "ratio"].item() == 1.0
    assert (tmp_path / "report.html").exists() and len(list((tmp_path / "cells").iterdir())) == 6
    again = run_qk_constraints(grid, tmp_path, progress=False)
    assert again.equals(summary)
