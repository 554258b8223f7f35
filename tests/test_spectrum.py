import pandas as pd

from posinterp.cli import main
from posinterp.experiments.spectrum import run_spectrum
from posinterp.experiments.zoo import ZooConfig, train_zoo
from tests.test_zoo import TINY, corpus  # noqa: F401  (fixture)
from tests.viz.test_report import external_refs


def test_spectrum_on_a_tiny_zoo(tmp_path, corpus, monkeypatch):  # noqa: F811
    cfg = ZooConfig(**{**TINY.__dict__, "schemes": ("rotary", "absolute")})
    train_zoo(cfg, seeds=2, home=tmp_path / "zoo", progress=False, corpus=corpus)
    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path))
    specs = ["zoo:rotary:0", "zoo:rotary:1", "zoo:absolute:0", "zoo:absolute:1"]
    # 6-step models have no previous-token head: count every seed and flag none, to
    # exercise the test's machinery (the defaults pool seeds and leave them out, below)
    res = run_spectrum(specs, tmp_path / "out", K=2, dynamics=True, progress=False,
                       units="model", min_prev_score=0.0, markdown=tmp_path / "page.md")
    for name in ("heads.csv", "spectrum.csv", "fingerprint.csv", "fingerprint_test.csv",
                 "dynamics.csv", "dynamics_correlation.csv", "dynamics_summary.csv",
                 "convention.csv", "run.json", "report.html"):
        assert (tmp_path / "out" / name).exists(), name
    from posinterp.experiments.spectrum import render_markdown

    assert (tmp_path / "page.md").read_text() == render_markdown(tmp_path / "out")
    conv = pd.read_csv(tmp_path / "out" / "convention.csv")
    assert set(conv.model) == set(specs)  # zoo weights are raw: posinterp folds the gains
    assert list(res.tests.k) == [1, 2]
    assert (res.tests.min_possible_p == 1 / 6).all()  # 2 vs 2 models: 1 / C(4, 2)
    assert res.tests.p_permutation.between(1 / 6, 1).all()
    dyn = pd.read_csv(tmp_path / "out" / "dynamics.csv")
    assert set(dyn.step) == {0, 1, 2, 6}
    html = res.report_path.read_text()
    assert external_refs(html) == [] and "offset" in html
    # null percentiles print to a tenth of a point with their Monte Carlo SE, not 3 decimals
    import re

    assert re.search(r"<td>\d{1,3}\.\d ± \d+\.\d</td>", html)
    assert "rotational_mass_null_percentile" not in html
    pooled = run_spectrum(specs, tmp_path / "pooled", K=2, progress=False)
    assert len(pooled.tests) == 0 and "left out" in pooled.tests.attrs["note"]
    # a rerun reuses each model's cell, and gives the same tables as the first run
    cells = sorted((tmp_path / "out" / "cells").glob("*.pkl"))
    assert len(cells) == 4
    before = {p.name: p.stat().st_mtime_ns for p in cells}
    heads = pd.read_csv(tmp_path / "out" / "heads.csv")
    run_spectrum(specs, tmp_path / "out", K=2, dynamics=True, progress=False, units="model",
                 min_prev_score=0.0)
    assert {p.name: p.stat().st_mtime_ns for p in cells} == before
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "out" / "heads.csv"), heads)
    # ... until a model is retrained: its card changes, so its cell is computed anew
    card = tmp_path / "zoo" / "rotary-seed0" / "card.json"
    card.write_text(card.read_text() + " ")
    run_spectrum(specs, tmp_path / "out", K=2, dynamics=True, progress=False, units="model",
                 min_prev_score=0.0)
    assert len(list((tmp_path / "out" / "cells").glob("*.pkl"))) == 5


def test_spectrum_cli_bad_spec(capsys, tmp_path):
    assert main(["spectrum", str(tmp_path / "missing.bin"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # refused before any cell starts (posinterp.specs), naming the spec
    assert "no such folder or file" in err and "missing.bin" in err


def test_spectrum_dynamics_refuses_two_identical_snapshots(tmp_path, corpus, monkeypatch):  # noqa: F811
    import shutil

    import pytest

    from posinterp.executors import CellsFailed

    cfg = ZooConfig(**{**TINY.__dict__, "schemes": ("rotary",)})
    train_zoo(cfg, home=tmp_path / "zoo", progress=False, corpus=corpus)
    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path))
    snaps = tmp_path / "zoo" / "rotary-seed0" / "checkpoints" / "snapshots"
    for suffix in ("", ".sha256"):  # step 2 overwritten by step 1: a frozen stretch
        shutil.copy(snaps / f"step_0000001.safetensors{suffix}",
                    snaps / f"step_0000002.safetensors{suffix}")
    with pytest.raises(CellsFailed, match="steps 1 and 2 have identical weights"):
        run_spectrum(["zoo:rotary:0"], tmp_path / "out", K=1, dynamics=True, progress=False)
