"""The dynamics experiment (posinterp.experiments.dynamics) end to end on a tiny family."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from posinterp.analysis.onset import head_onsets
from posinterp.executors import CellsFailed
from posinterp.experiments import dynamics as dyn
from posinterp.experiments import zoo
from posinterp.experiments.spectrum import render_markdown
from posinterp.experiments.zoo import ZooConfig, ZooFamily
from tests.test_zoo import TINY, corpus  # noqa: F401

DATA = Path(__file__).parent.parent / "docs" / "reproductions" / "data" / "fingerprints"


@pytest.fixture
def tiny_families(monkeypatch):
    cfg = ZooConfig(**{**TINY.__dict__, "max_steps": 8, "warmup_steps": 2})
    tiny = {"ta": ZooFamily("ta", cfg, 1, "reference"),
            "tb": ZooFamily("tb", replace(cfg, n_heads=4), 2, "heads")}
    monkeypatch.setattr(zoo, "FAMILIES", tiny)
    monkeypatch.setitem(zoo.FAMILY_SETS, "design1",
                        zoo.FamilySet("design1", tiny, "families", "tiny families for tests"))
    return tiny


def test_dynamics_run_fixes_its_design_first_and_renders_the_page(tmp_path, corpus,  # noqa: F811
                                                                   tiny_families):
    design = dyn.DynamicsDesign(families=("ta", "tb"), n_seeds=2, snapshot_every=2, window=2,
                                threshold=0.2, n_boot=50)
    out = tmp_path / "spectrum"
    shutil.copytree(DATA, out, ignore=shutil.ignore_patterns("dynamics"))
    root = tmp_path / "runs"
    summary = dyn.run_dynamics(out / "dynamics", root, design, progress=False,
                               command="posinterp zoo dynamics ...", corpus=corpus)
    run = json.loads((out / "dynamics" / "run.json").read_text())
    assert run["status"] == "done" and run["design"]["window"] == 2
    assert run["runs"] == ["ta/10", "ta/11", "tb/20", "tb/21"]  # seeds 10 * F + i
    # every snapshot of the grid (0, 2, 4, 6, 8) of every head of every run
    traj = pd.read_csv(out / "dynamics" / "trajectories.csv.gz")
    assert sorted(traj.step.unique()) == [0, 2, 4, 6, 8]
    assert len(traj) == 5 * (2 * 2 + 2 * 4)
    # the committed onsets are the onsets of the committed trajectories
    onsets = pd.read_csv(out / "dynamics" / "onsets.csv")
    again = head_onsets(traj.assign(run=traj.family + "/" + traj.seed.astype(str)), 0.2,
                        window=2)
    prim = onsets[onsets.rule == "primary"].reset_index(drop=True)
    pd.testing.assert_series_equal(prim.signature_onset, again.signature_onset,
                                   check_names=False)
    pd.testing.assert_series_equal(prim.behaviour_onset, again.behaviour_onset,
                                   check_names=False)
    runs = pd.read_csv(out / "dynamics" / "runs.csv")
    assert (runs.n_distinct_weights == runs.n_snapshots).all()
    assert set(summary.rule) == {"primary", "to the end"}
    page = render_markdown(out)
    assert "## Dynamics" in page and "Not run" not in page.split("## Dynamics")[1]
    assert "posinterp zoo dynamics ..." in page and "n = 4 runs" in page
    assert "**Reading.**" in page and "persistence to the end" in page
    # a rerun reuses every run (cells keyed by card and design) and gives the same summary
    pd.testing.assert_frame_equal(
        dyn.run_dynamics(out / "dynamics", root, design, progress=False, corpus=corpus,
                         command="posinterp zoo dynamics ..."), summary)
    # another design into the same folder is refused
    with pytest.raises(ValueError, match="another design"):
        dyn.run_dynamics(out / "dynamics", root, replace(design, window=4), progress=False,
                         corpus=corpus)


def test_a_run_with_two_identical_snapshots_is_refused_by_both_steps(tmp_path, corpus,  # noqa: F811
                                                                       tiny_families):
    design = dyn.DynamicsDesign(families=("ta",), n_seeds=1, snapshot_every=2, n_boot=10)
    root = tmp_path / "runs"
    cfg = dyn.dynamics_config(tiny_families["ta"].config, 2)
    zoo.train_zoo(cfg, home=root / "ta", first_seed=10, progress=False, corpus=corpus)
    snaps = root / "ta" / "rotary-seed10" / "checkpoints" / "snapshots"
    for suffix in ("", ".sha256"):  # a frozen run: step 6's weights are step 4's
        shutil.copy(snaps / f"step_0000004.safetensors{suffix}",
                    snaps / f"step_0000006.safetensors{suffix}")
    with pytest.raises(CellsFailed, match="steps 4 and 6 have identical weights"):
        dyn.run_dynamics(tmp_path / "out", root, design, progress=False, corpus=corpus)


def test_design_refuses_bad_values():
    with pytest.raises(ValueError, match="n_seeds"):
        dyn.DynamicsDesign(n_seeds=11)
    with pytest.raises(ValueError, match="band"):
        dyn.DynamicsDesign(band=(50, 40))
    with pytest.raises(ValueError, match="snapshot_grid"):
        ZooConfig(max_steps=10, snapshot_grid=(0, 5, 5))
    assert dyn.dynamics_config(ZooConfig(max_steps=12), 5).snapshot_steps() == [0, 5, 10, 12]


def test_cli_parses_zoo_dynamics(tmp_path, capsys):
    from posinterp.cli import _zoo_dynamics, build_parser

    args = build_parser().parse_args(["zoo", "dynamics", "--out", str(tmp_path), "--family",
                                      "base", "wide", "--seeds", "3", "--home", str(tmp_path)])
    assert args.func is _zoo_dynamics and args.family == ["base", "wide"] and args.seeds == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["zoo", "dynamics", "--out", str(tmp_path), "--seeds", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["zoo", "dynamics", "--out", str(tmp_path), "--family", "zz"])
    capsys.readouterr()
