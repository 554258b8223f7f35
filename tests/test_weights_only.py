"""Weights-only spectra over a checkpoint series (posinterp.experiments.weights_only), on a
Hugging Face cache written here with several revisions: some with identical q/k bytes,
one damaged. Duplicates are refused by name, the damaged one reported, the rest run and
resume; local, process and Ray executors write the same bytes (issue 36 item 4)."""

import json

import pandas as pd
import pytest

from posinterp.experiments.weights_only import SERIES_COLUMNS, run_weights_only, series_revisions
from posinterp.models.qk_only import read_qk_weights
from tests.helpers import save_sharded, save_tiny_checkpoint, tiny_hf_configs, write_hub_cache

REPO = "org/tiny-series"


def _llama(folder, seed):
    return save_tiny_checkpoint("LlamaForCausalLM", tiny_hf_configs()["llama-gqa"], folder, seed=seed)


@pytest.fixture
def series_cache(tmp_path, monkeypatch, no_network):
    """step0, step1000 (distinct), step2000 (step1000's weights, sharded: same q/k bytes),
    step3000 (a truncated shard), step4000 (distinct), main (step4000 again)."""
    root = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _llama(tmp_path / "a", 0)
    b = _llama(tmp_path / "b", 1)
    save_sharded(b, tmp_path / "b-shards")
    _llama(tmp_path / "c", 2)
    _llama(tmp_path / "d", 3)
    write_hub_cache(root, REPO, tmp_path / "a", ref="step0")
    write_hub_cache(root, REPO, tmp_path / "b", ref="step1000")
    write_hub_cache(root, REPO, tmp_path / "b-shards", ref="step2000")
    snap = write_hub_cache(root, REPO, tmp_path / "c", ref="step3000")
    write_hub_cache(root, REPO, tmp_path / "d", ref="step4000")
    write_hub_cache(root, REPO, tmp_path / "d", ref="main")
    blob = (snap / "model.safetensors").resolve()
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    return root


def test_all_lists_the_cached_branches_by_step(series_cache):
    assert series_revisions(REPO, "all") == ["step0", "step1000", "step2000", "step3000",
                                             "step4000", "main"]
    assert series_revisions(REPO, "step1000, step0,step1000") == ["step1000", "step0"]
    with pytest.raises(ValueError, match="--revisions must list revisions"):
        series_revisions(REPO, " , ")


def test_duplicates_are_refused_by_name_the_damaged_reported_and_the_rest_run(series_cache,
                                                                              tmp_path):
    out = tmp_path / "out"
    heads = run_weights_only([REPO], out, revisions="all", progress=False)
    run = json.loads((out / "run.json").read_text())
    status = {r: e["status"] for r, e in run["revisions"][REPO].items()}
    assert status["step0"] == status["step1000"] == status["step4000"] == "ok"
    assert status["step2000"] == "duplicate of step1000"
    assert status["main"] == "duplicate of step4000"
    assert status["step3000"].startswith("damaged: ") and "model.safetensors" in status["step3000"]
    series = pd.read_parquet(out / "series.parquet")
    assert tuple(series.columns) == SERIES_COLUMNS
    assert list(dict.fromkeys(series.revision)) == ["step0", "step1000", "step4000"]
    assert sorted(series.step.unique()) == [0, 1000, 4000]
    assert {"rotational_mass", "rotational_mass_null_percentile", "abs_max"} <= set(series.metric)
    assert (out / "series.html").read_text().count("duplicate of") == 2
    # each revision's rows are a plain weights-only run of its snapshot folder
    snap = series_cache / ("models--" + REPO.replace("/", "--")) / "snapshots"
    commit = run["revisions"][REPO]["step1000"]["commit"]
    plain = run_weights_only([str(snap / commit)], tmp_path / "plain", progress=False)
    got = heads[heads.revision == "step1000"].drop(columns=["model", "revision", "step"])
    want = plain.drop(columns=["model"])
    pd.testing.assert_frame_equal(got.reset_index(drop=True), want[got.columns])
    assert len(read_qk_weights(snap / commit).W_Q) == 2


def test_a_rerun_resumes_and_a_repaired_revision_joins(series_cache, tmp_path):
    out = tmp_path / "out"
    run_weights_only([REPO], out, revisions="all", progress=False)
    cells = sorted((out / "cells").glob("*.pkl"))
    stamps = {p.name: p.stat().st_mtime_ns for p in cells}
    assert len(cells) == 3
    # repair step3000 with distinct weights: only its cell runs, the others are reused
    _llama(tmp_path / "e", 7)
    write_hub_cache(series_cache, REPO, tmp_path / "e", ref="step3000")
    run_weights_only([REPO], out, revisions="all", progress=False)
    run = json.loads((out / "run.json").read_text())
    assert run["revisions"][REPO]["step3000"]["status"] == "ok"
    after = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.pkl")}
    assert len(after) == 4 and all(after[n] == t for n, t in stamps.items())  # reused


@pytest.mark.parametrize("kind", ["process", "ray"])
def test_executors_write_the_same_bytes(series_cache, tmp_path, kind):
    from posinterp.executors import ProcessExecutor, RayExecutor

    if kind == "ray":
        ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray>=2.9')")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ex = ProcessExecutor(2) if kind == "process" else RayExecutor()
        run_weights_only([REPO], tmp_path / "local", revisions="all", progress=False)
        run_weights_only([REPO], tmp_path / kind, revisions="all", progress=False, executor=ex)
    finally:
        if kind == "ray":
            ray.shutdown()
    for name in ("series.parquet", "heads.csv", "series.html"):
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / kind / name).read_bytes()


def test_cli_series_exit_status_and_refusals(series_cache, tmp_path, capsys):
    from posinterp.cli import main

    out = tmp_path / "cli"
    assert main(["spectrum", REPO, "--weights-only", "--revisions", "step0,step1000,step2000",
                 "--out", str(out), "--no-progress"]) == 0
    assert "step2000: duplicate of step1000" in capsys.readouterr().out
    assert main(["spectrum", REPO, "--weights-only", "--revisions", "all", "--out",
                 str(tmp_path / "cli2"), "--no-progress"]) == 1  # step3000 is damaged
    assert "damaged" in capsys.readouterr().out
    # a revision the cache does not hold is missing, not damaged, and also exits 1
    assert main(["spectrum", REPO, "--weights-only", "--revisions", "step0,step9999", "--out",
                 str(tmp_path / "cli3"), "--no-progress"]) == 1
    said = capsys.readouterr().out
    assert f"{REPO}@step9999: missing: " in said and "damaged" not in said
    assert said.count("step9999: missing") == 1
    assert main(["spectrum", REPO, "--revisions", "all", "--out", str(tmp_path / "x")]) == 2
    assert "--revisions needs --weights-only" in capsys.readouterr().err
    _llama(tmp_path / "local", 0)
    assert main(["spectrum", str(tmp_path / "local"), "--weights-only", "--revisions", "all",
                 "--out", str(tmp_path / "y")]) == 2
    assert "is a local path" in capsys.readouterr().err
