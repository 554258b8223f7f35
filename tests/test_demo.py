import json

import pytest
import torch

from posinterp.cli import main
from posinterp.experiments import DemoConfig, run_demo
from tests.viz.test_report import external_refs


def test_demo_pipeline_on_tiny_model_and_resume(tmp_path):
    cfg = DemoConfig(preset="tiny", digits=5, max_steps=4, n_analysis=4, init_seeds=2, n_test=50)
    threads_before = torch.get_num_threads()
    res = run_demo(cfg, tmp_path, progress=False)
    assert torch.get_num_threads() == threads_before  # the run's thread count is scoped
    for name in ("report.html", "adjacency.csv", "history.csv", "run.json",
                 "figures/accuracy.png", "figures/accuracy.svg", "figures/similarity_init.svg"):
        assert (tmp_path / name).exists()
    html = res.report_path.read_text()
    assert html.count("var CircuitsVis=") == 1 and external_refs(html) == []
    assert html.count("CircuitsVis.render(") == 2  # one view per layer of the tiny model
    assert res.table.shape[0] == 1 + 4 * 2 and res.steps == 4  # embedding + 4 sites x 2 layers
    assert {"init / random tokens", "trained / task samples"} <= set(res.table.columns)
    assert res.adjacency.value.between(0, 1).all()
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["model"]["pe"] == "nope" and meta["task"]["min_digits"] == 5
    assert meta["threads"] == 1 and meta["n_test"] == 50
    assert "on 50 held-out samples (of " in html
    # A rerun resumes from the final checkpoint instead of training again.
    again = run_demo(cfg, tmp_path, progress=False)
    assert again.steps == 4
    assert again.adjacency.equals(res.adjacency)


def test_cli_rejects_bad_digits(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--digits", "3", "--out", "unused"])
    assert exit_.value.code == 2
    assert "--digits: invalid choice: 3 (choose from 5, 6," in capsys.readouterr().err


def test_demo_input_errors(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["demo", "--threads", "-1", "--out", str(tmp_path)])
    assert "--threads: must be >= 1, got -1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="threads must be >= 1"):
        DemoConfig(threads=0)
    cfg = DemoConfig(preset="tiny", digits=5, max_steps=2, n_analysis=3, init_seeds=1)
    run_demo(cfg, tmp_path, progress=False)
    other = DemoConfig(preset="tiny", digits=6, max_steps=2, n_analysis=3, init_seeds=1)
    with pytest.raises(ValueError, match="choose another --out folder"):
        run_demo(other, tmp_path, progress=False)
    # The thread count changes the numbers: a resume with another one is refused by name,
    # before anything is written (run.json still says what produced the folder's numbers).
    before = (tmp_path / "run.json").read_text()
    with pytest.raises(ValueError, match="--threads: the folder has 1, this run 2"):
        run_demo(DemoConfig(preset="tiny", digits=5, max_steps=2, n_analysis=3, init_seeds=1,
                            threads=2), tmp_path, progress=False)
    assert (tmp_path / "run.json").read_text() == before


def test_demo_config_defaults_and_errors():
    assert DemoConfig().threads == 1 and DemoConfig().n_test is None
    assert DemoConfig(quick=True).n_test == 5000
    for bad in (dict(threads=0), dict(threads=None), dict(threads=True), dict(n_test=0),
                dict(n_test=2.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DemoConfig(**bad)
