from posinterp.analysis.probing import ProbeConfig  # noqa: F401
from posinterp.experiments.zuo2024 import ReproConfig, run_zuo2024
from tests.viz.test_report import external_refs

SMOKE = ReproConfig(model_preset="tiny", train_steps=3, n_samples=300, init_seeds=(0, 1), probe_seeds=(0,),
                    n_sequences=6, n_tokens=10, init_means=(0.0, 4.0), init_stds=(0.02, 0.2),
                    depths=(1, 2), widths=(32, 64),
                    task_lengths={"addition": (1, 2), "reversal": (5, 5),
                                  "indexing": (1, 9), "ordering": (2, 5)})


def test_reproduction_pipeline_writes_claims_and_resumes(tmp_path, monkeypatch):
    import posinterp.experiments.zuo2024 as z

    monkeypatch.setattr(z, "ProbeConfig", lambda: ProbeConfig(hidden=8, max_epochs=3))
    claims = run_zuo2024(SMOKE, tmp_path, progress=False)
    assert len(claims) == 9 and set(claims.columns) == {"claim", "our_figure", "holds", "detail"}
    assert claims.holds.map(lambda v: isinstance(v, bool)).all()
    html = (tmp_path / "report.html").read_text()
    assert external_refs(html) == []
    cells = sorted(p.name for p in (tmp_path / "cells").iterdir())
    assert "init_mean_std.csv" in cells and "probes_reversal.csv" in cells
    # Resume: every cell is read back, nothing is recomputed, same table.
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "cells").iterdir()}
    again = run_zuo2024(SMOKE, tmp_path, progress=False)
    assert again.equals(claims)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cells").iterdir()} == stamp


def test_full_preset_is_the_paper_protocol():
    full = ReproConfig.full()
    assert full.model_preset == "paper" and len(full.train_seeds) == 5
    assert full.task_lengths["reversal"] == (1, 16)
