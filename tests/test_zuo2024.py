from dataclasses import replace

import pytest
import torch

from posinterp.analysis.probing import ProbeConfig
from posinterp.experiments.zuo2024 import (
    ReproConfig,
    depth_width_configs,
    mean_ci,
    render_markdown,
    run_zuo2024,
)
from posinterp.models import build_model
from tests.viz.test_report import external_refs

SMOKE = ReproConfig(model_preset="tiny", train_steps=3, n_samples=300, train_seeds=(0, 1),
                    long_train_steps=4, train_depths=(2,),
                    init_seeds=(0, 1), grid_seeds=(0, 1), n_sequences=6, n_tokens=10,
                    n_probe_sequences=8, init_means=(0.0, 4.0), init_stds=(0.002, 0.02, 0.2),
                    depths=(1, 2), widths=(32, 64),
                    task_lengths={"addition": (1, 2), "reversal": (5, 6),
                                  "indexing": (1, 9), "ordering": (2, 5)})


def test_reproduction_pipeline_writes_claims_page_and_resumes(tmp_path, monkeypatch):
    import posinterp.experiments.zuo2024 as z

    monkeypatch.setattr(z, "ProbeConfig", lambda: ProbeConfig(hidden=8, max_epochs=3))
    page = tmp_path / "page.md"
    claims = run_zuo2024(SMOKE, tmp_path / "run", progress=False, markdown=page)
    assert set(claims.point) == {"embedding", "attn_out", "resid_mid", "probe"}
    # every after-attention claim is reported at both points
    after = claims[claims.point.isin(["attn_out", "resid_mid"])]
    assert (after.groupby("claim").point.nunique() == 2).all()
    assert set(claims.holds) <= {"yes", "no", "CI spans", "not tested", "not run"}
    # 3 (and 4) training steps never reach the target: no task is scored as trained
    trained = claims[claims.claim.str.contains("after training")]
    assert len(trained) == 2 * 6 and (trained.holds == "not tested").all()  # 4 tasks, L2, long
    assert trained.claim.str.contains("addition (long run, <= 4 steps)", regex=False).sum() == 2
    html = (tmp_path / "run" / "report.html").read_text()
    assert external_refs(html) == []
    assert page.read_text() == render_markdown(tmp_path / "run")
    probes = z.pd.read_csv(tmp_path / "run" / "probes.csv")
    assert -1 in set(probes.layer)  # the embedding baseline row
    # Resume: every cell is read back, nothing is recomputed, same table.
    cells = tmp_path / "run" / "cells"
    stamp = {p: p.stat().st_mtime_ns for p in cells.iterdir()}
    again = run_zuo2024(SMOKE, tmp_path / "run", progress=False)
    assert again.equals(claims)
    assert {p: p.stat().st_mtime_ns for p in cells.iterdir()} == stamp
    # --full's trained depths: a model per depth, with its own rows
    training = z.pd.read_csv(tmp_path / "run" / "training.csv")
    assert (training.task == "reversal L2").sum() == len(SMOKE.train_seeds)
    # Cells are reused by name, so a folder of another configuration is refused, by field.
    with pytest.raises(ValueError, match="train_steps"):
        run_zuo2024(replace(SMOKE, train_steps=4), tmp_path / "run", progress=False)
    # probe lengths are checked before any cell runs, like the task lengths
    with pytest.raises(ValueError, match="max_digits=17"):
        run_zuo2024(replace(SMOKE, probe_lengths=(4, 17)), tmp_path / "other", progress=False)
    assert not (tmp_path / "other").exists()  # nothing made on bad input
    assert {p: p.stat().st_mtime_ns for p in cells.iterdir()} == stamp


def test_depth_grid_has_independent_layer0_weights_per_depth():
    """Weights are seeded per parameter name: one seed gives one layer 0 at every depth.
    The grid's seeds must make layer 0 differ across depths (and replicates)."""
    cfg = ReproConfig(model_preset="tiny", depths=(1, 2, 3), widths=(32,), grid_seeds=(0, 1))
    w = [build_model(mc).blocks[0].attn.W_Q.detach() for *_, mc in depth_width_configs(cfg)]
    assert len(w) == 6
    for a in range(len(w)):
        for b in range(a + 1, len(w)):
            assert not torch.equal(w[a], w[b])


def test_mean_ci_is_the_t_interval():
    from scipy import stats

    m, lo, hi, n = mean_ci([1.0, 2.0, 4.0])
    want = stats.t.interval(0.95, 2, loc=7 / 3, scale=stats.sem([1.0, 2.0, 4.0]))
    assert n == 3 and abs(m - 7 / 3) < 1e-12 and abs(lo - want[0]) < 1e-12 and abs(hi - want[1]) < 1e-12
    assert mean_ci([0.5, 0.5])[1:3] == (0.5, 0.5)


def test_full_preset_is_the_paper_protocol():
    full = ReproConfig.full()
    assert full.model_preset == "paper" and len(full.train_seeds) == 5
    assert full.task_lengths["reversal"] == (1, 16) and full.train_depths == (6, 12, 24)
    assert len(ReproConfig().train_seeds) >= 3


def test_cli_table_accepts_pandas_display_options():
    """``posinterp reproduce`` prints its claims with a display option: the call that
    crashed after every finished run (keywords passed to pandas.option_context)."""
    import pandas as pd

    from posinterp.cli import _table

    text = _table(pd.DataFrame({"claim": ["x" * 120], "n": [3]}), **{"display.max_colwidth": 90})
    assert "claim" in text and text.rstrip().endswith("3")
