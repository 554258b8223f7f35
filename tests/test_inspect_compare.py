"""`posinterp inspect A --compare B`: two checkpoints of one run, one offline page."""

import html
import json
import re

import numpy as np
import pandas as pd
import pytest

from posinterp.cli import main
from posinterp.dashboard.export import load_inspection
from posinterp.models import preset
from posinterp.training import TrainConfig, train
from tests.helpers import tiny_task
from tests.viz.test_report import external_refs


def _train(folder, steps, every, **overrides):
    cfg = TrainConfig(max_steps=steps, batch_size=8, eval_every=every, n_eval=16, checkpoint_every=every,
                      warmup_steps=1, target_accuracy=None, seed=3)
    train(preset("tiny", pe="rotary", **overrides), tiny_task("reversal", n=40, max_digits=6), cfg,
          checkpoint_dir=folder / "checkpoints", progress=False)
    return sorted((folder / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("series"), 4, 2)


def test_two_checkpoints_give_one_offline_page_and_tables(steps, tmp_path, capsys):
    a, b = steps
    out = tmp_path / "cmp"
    assert main(["inspect", str(a), "--compare", str(b), "--tokens", "10", "--batch", "3",
                 "--out", str(out), "--no-progress"]) == 0
    assert "heads that changed most" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"compare.html", "changes.csv", "formed.csv", "kernels.csv",
                                               "inspection-a.json", "inspection-b.json", "run.json",
                                               ".lock"}  # the run's folder lock (docs/faults.md)
    page = (out / "compare.html").read_text()
    assert external_refs(page) == []
    data = json.loads(re.search(r'<script type="application/json" id="compare-data">(.*?)</script>',
                                page, re.S).group(1))
    changes = pd.read_csv(out / "changes.csv")  # long form: one row per head and metric
    change = changes[changes.metric == "change"]
    assert [r[:2] for r in data["heads"]["rows"]] == change[["layer", "head"]].values.tolist()
    assert list(change.value) == sorted(change.value, reverse=True)
    prev = changes[changes.metric == "previous_token_score"]
    assert np.allclose(prev.value, prev.b - prev.a)
    # the saved inspections are the two models on one input
    ia, ib = (load_inspection(out / f"inspection-{w}.json") for w in "ab")
    assert ia.meta["input_digest"] == ib.meta["input_digest"]
    assert set(ia.table.model) == {str(a)} and set(ib.table.model) == {str(b)}


def test_models_of_another_shape_are_refused_before_any_output(steps, tmp_path, capsys):
    (other,) = _train(tmp_path / "other", 1, 1, n_layers=1)
    out = tmp_path / "cmp"
    assert main(["inspect", str(steps[0]), "--compare", str(other), "--tokens", "10", "--batch", "2",
                 "--out", str(out), "--no-progress"]) == 2
    assert "n_layers x n_heads" in capsys.readouterr().err
    assert not out.exists()
    assert main(["inspect", str(steps[0]), "--compare", str(tmp_path / "missing"),
                 "--out", str(out), "--no-progress"]) == 2
    assert "no such folder or file" in capsys.readouterr().err


def test_a_single_inspection_also_writes_its_json(steps, tmp_path):
    out = tmp_path / "one"
    assert main(["inspect", str(steps[1]), "--tokens", "10", "--batch", "2", "--out", str(out),
                 "--no-progress"]) == 0
    res = load_inspection(out / "inspection.json")
    csv = pd.read_csv(out / "heads.csv")
    assert list(res.table.metric) == list(csv.metric)
    assert np.allclose(res.table.value.to_numpy(float), csv.value.to_numpy(float), equal_nan=True, rtol=1e-15)


def test_a_rotary_and_an_absolute_run_compare_at_delta_0_and_say_what_was_skipped(tmp_path, capsys):
    cfg = TrainConfig(max_steps=1, batch_size=8, eval_every=1, n_eval=16, checkpoint_every=1,
                      warmup_steps=1, target_accuracy=None, seed=3)
    folders = []
    for pe in ("rotary", "absolute"):  # one shape, two schemes
        train(preset("tiny", pe=pe), tiny_task("reversal", n=40, max_digits=6), cfg,
              checkpoint_dir=tmp_path / pe, progress=False)
        (step,) = sorted((tmp_path / pe).glob("step_*"))
        folders.append(str(step))
    out = tmp_path / "cmp"
    assert main(["inspect", *folders[:1], "--compare", folders[1], "--tokens", "10", "--batch", "3",
                 "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    changes = pd.read_csv(out / "changes.csv")
    spectrum = changes[changes.metric == "spectrum_change"]
    assert len(spectrum) == 8 and np.isfinite(spectrum.value).all() and (spectrum.value > 0).all()
    # the same sentence in the CLI output, on the page and in run.json
    (note,) = [n for n in json.loads((out / "run.json").read_text())["notes"] if n.startswith("Not compared")]
    assert f"only {folders[0]} defines them: " in note and "at Δ = -1: " in note
    assert "notes:" in printed and note in printed
    assert html.escape(note) in (out / "compare.html").read_text()
