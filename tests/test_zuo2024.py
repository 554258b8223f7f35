import json
from dataclasses import replace

import pandas as pd
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
                    long_train_steps=4, train_depths=(2,), depth_train_steps=3,
                    depth_tasks=("reversal", "addition"), depth_task_steps={"addition": 4},
                    task_steps={},
                    long_train_tasks=("addition",),
                    init_seeds=(0, 1), grid_seeds=(0, 1), n_sequences=6, n_tokens=10,
                    n_probe_sequences=8, init_means=(0.0, 4.0), init_stds=(0.002, 0.02, 0.2),
                    depths=(1, 2), widths=(32, 64),
                    task_lengths={"addition": (1, 2), "reversal": (5, 6),
                                  "indexing": (1, 9), "ordering": (2, 5)})


def _stamps(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix == ".csv"}


def test_reproduction_pipeline_writes_claims_page_and_resumes(tmp_path, monkeypatch):
    import posinterp.experiments.zuo2024 as z

    monkeypatch.setattr(z, "ProbeConfig", lambda: ProbeConfig(hidden=8, max_epochs=3))
    page = tmp_path / "page.md"
    claims = run_zuo2024(SMOKE, tmp_path / "run", progress=False, markdown=page)
    assert set(claims.point) == {"embedding", "attn_out", "resid_mid", "resid_post", "probe"}
    # every after-attention claim is reported at all three points
    after = claims[claims.point.isin(["attn_out", "resid_mid", "resid_post"])]
    assert (after.groupby("claim").point.nunique() == 3).all()
    assert set(claims.holds) <= {"yes", "no", "CI spans", "not tested", "not run"}
    # 3 (and 4) training steps never reach the target: no task is scored as trained
    trained = claims[claims.claim.str.contains("after training")]
    # 4 tasks, reversal L2, addition L2, addition's long run
    assert len(trained) == 3 * 7 and (trained.holds == "not tested").all()
    assert trained.claim.str.endswith("after training: addition L2").sum() == 3
    assert trained.claim.str.contains("addition (long run, <= 4 steps)", regex=False).sum() == 3
    # the probe claims come in both families, the count-matched variance probe among them
    probe = claims[claims.point == "probe"]
    assert set(probe.probe) == {"ridge", "mlp"}
    assert probe.claim.str.contains("variance_matched (primary)", regex=False).sum() == 4
    # C1 on each task's strings too (a control that can fail), one value per init seed
    c1 = claims[claims.claim.str.contains(" strings, init seeds")]
    assert len(c1) == len(SMOKE.task_lengths) and (c1.n == len(SMOKE.task_string_seeds)).all()
    strings = pd.read_csv(tmp_path / "run" / "init_task_strings.csv")
    assert set(strings.task) == set(SMOKE.task_lengths) and (strings.layer == -1).all()
    # per-seed rows behind the summaries: the init claim's mean is their mean
    init = pd.read_csv(tmp_path / "run" / "init_per_seed.csv.gz")
    emb = init[init.hook == "blocks.0.hook_resid_pre"].value
    row = claims[claims.claim.str.startswith("embedding score ~0.5 (chance), random tokens")]
    assert len(emb) == len(SMOKE.init_seeds) and abs(emb.mean() - row["mean"].iloc[0]) < 1e-12
    for name in ("init_grid", "depth_width", "probes"):
        assert len(pd.read_csv(tmp_path / "run" / f"{name}_per_seed.csv.gz"))
    # every cell says where it ran (threads, CPU, versions)
    env = json.loads((tmp_path / "run" / "run.json").read_text())["cell_environments"]
    assert env["environments"] and all(v is not None for v in env["cells"].values())
    assert {e["torch_threads"] for e in env["environments"]} == {1}
    # BH q-values exactly where there is a p, never below it
    assert claims.q.notna().equals(claims.p.notna())
    assert (claims.q.dropna() >= claims.p.dropna() - 1e-12).all()
    html = (tmp_path / "run" / "report.html").read_text()
    assert external_refs(html) == []
    text = page.read_text()
    assert text == render_markdown(tmp_path / "run")
    assert "attn_out (primary)" in text and "Benjamini-Hochberg" in text
    # each task no seed trained is named with its budget and accuracies, and why
    why = next(line for line in text.splitlines() if "could not be trained here" in line)
    for task in ("addition", "reversal", "indexing", "ordering"):
        assert f"{task} (" in why
    assert "whole budget of 3 steps" in why and "untested here" in why
    probes = z.pd.read_csv(tmp_path / "run" / "probes.csv")
    assert -1 in set(probes.layer)  # the embedding baseline row
    # Resume: every cell is read back, nothing is recomputed, same table.
    cells = tmp_path / "run" / "cells"
    stamp = _stamps(cells)
    again = run_zuo2024(SMOKE, tmp_path / "run", progress=False)
    z.pd.testing.assert_frame_equal(again, claims)
    assert _stamps(cells) == stamp
    # --full's trained depths: a model per depth, with its own rows
    training = z.pd.read_csv(tmp_path / "run" / "training.csv")
    assert (training.task == "reversal L2").sum() == len(SMOKE.train_seeds)
    # Cells are reused under their keys: another train_steps recomputes exactly the
    # trainings it sets (not the depth runs, which have their own budget, nor the long
    # run) and the probes that read the retrained reversal models; nothing else.
    run_zuo2024(replace(SMOKE, train_steps=4), tmp_path / "run", progress=False)
    changed = {n for n, t in _stamps(cells).items() if stamp.get(n) != t}
    assert changed == ({f"train_{t}_seed{s}.csv" for t in ("addition", "reversal", "indexing",
                                                           "ordering") for s in (0, 1)}
                       | {f"probe_{d}_trained_seed{s}.csv" for d in ("random_tokens",
                                                                     "reversal_strings")
                          for s in (0, 1)})
    # probe lengths are checked before any cell runs, like the task lengths
    stamp = _stamps(cells)
    with pytest.raises(ValueError, match="max_digits=17"):
        run_zuo2024(replace(SMOKE, probe_lengths=(4, 17)), tmp_path / "other", progress=False)
    assert not (tmp_path / "other").exists()  # nothing made on bad input
    assert _stamps(cells) == stamp


def test_stale_cells_are_recomputed_and_unfinished_ones_pending(tmp_path, monkeypatch):
    """A stored cell computed under another architecture (its key) is redone, never read
    back; with compute=False an unfinished training is *pending* on the page, while an
    unfinished core cell is refused."""
    import json

    import posinterp.experiments.zuo2024 as z

    monkeypatch.setattr(z, "ProbeConfig", lambda: ProbeConfig(hidden=8, max_epochs=3))
    cfg = replace(SMOKE, train_seeds=(0,), task_lengths={"reversal": (5, 6),
                                                         "addition": (1, 2)},
                  long_train_tasks=(), train_depths=())
    run_zuo2024(cfg, tmp_path / "run", progress=False)
    cells = tmp_path / "run" / "cells"
    # the depth x width cell as the old preset() made it: d_head 32 at every width
    key_file = cells / "depth_width_init.csv.key.json"
    key = json.loads(key_file.read_text())
    assert {m["d_head"] for m in key["models"]} == {32, 64}  # widths 32 and 64, n_heads 1
    for m in key["models"]:
        m["d_head"] = 32
    key_file.write_text(json.dumps(key, sort_keys=True))
    stamp = _stamps(cells)
    run_zuo2024(cfg, tmp_path / "run", progress=False)
    assert {n for n, t in _stamps(cells).items() if stamp[n] != t} == {"depth_width_init.csv"}
    dw = z.pd.read_csv(tmp_path / "run" / "depth_width.csv")
    assert (dw.d_head == 64).sum() and (dw.d_mlp == 4 * dw.width).all()
    # an unfinished training is pending, claimed as such, and named on the page
    (cells / "train_addition_seed0.csv").unlink()
    page = tmp_path / "page.md"
    claims = run_zuo2024(cfg, tmp_path / "run", progress=False, markdown=page, compute=False)
    assert not (cells / "train_addition_seed0.csv").exists()
    rows = claims[claims.claim.str.endswith("after training: addition")]
    assert len(rows) == 3 and (rows.holds == "pending").all()
    assert "**Pending: 1 cells are not computed yet**" in page.read_text()
    assert page.read_text() == render_markdown(tmp_path / "run")
    # unfinished probes are pending too (their claims say so); unfinished core cells are not
    for cell in cells.glob("probe_random_tokens_trained_seed*.csv"):
        cell.unlink()
    claims = run_zuo2024(cfg, tmp_path / "run", progress=False, markdown=page, compute=False)
    rows = claims[claims.claim.str.contains("trained model")]
    assert len(rows) == 2 and (rows.holds == "pending").all()  # one per probe family
    assert not claims.claim.str.contains("after training: probe").any()
    assert page.read_text() == render_markdown(tmp_path / "run")
    (cells / "train_reversal_seed0.csv").unlink()
    with pytest.raises(ValueError, match="train_reversal_seed0"):
        run_zuo2024(cfg, tmp_path / "run", progress=False, compute=False)


def test_depth_width_grid_runs_the_architectures_it_names():
    """d_head = width / n_heads = 64 and d_mlp = 4 x width in every cell (the grid once
    ran the small preset's d_head 32 and d_mlp 768 at every width)."""
    for depth, width, _, mc in depth_width_configs(ReproConfig()):
        assert mc.n_layers == depth and mc.d_model == width
        assert mc.d_head == 64 and mc.d_mlp == 4 * width and mc.n_heads * mc.d_head == width


def test_verdicts_and_p_values_agree():
    """yes <=> p_holds < 0.025 and no <=> p_fails < 0.025 (the 95% interval and the
    one-sided t-tests are the same statement), for every kind of threshold."""
    import numpy as np

    from posinterp.experiments.zuo2024 import _p, _sem, _Test, _verdict

    rng = np.random.default_rng(0)
    tests = [_Test("ge", 0.8), _Test("le", 0.6), _Test("within", 0.5, 0.05)]
    seen = set()
    for _ in range(400):
        v = rng.normal(rng.uniform(0.3, 1.0), rng.uniform(0.001, 0.2), size=int(rng.integers(3, 6)))
        m, lo, hi, n = mean_ci(v.tolist())
        assert abs(_sem(m, lo, hi, n) - v.std(ddof=1) / np.sqrt(n)) < 1e-9
        for t in tests:
            ph, pf = t.p_values(m, _sem(m, lo, hi, n), n)
            verdict = _verdict(lo, hi, t)
            seen.add((t.kind, verdict))
            assert (verdict == "yes") == (ph < 0.025)
            assert (verdict == "no") == (pf < 0.025)
            assert (verdict in ("yes", "no")) == (_p(ph, pf) < 0.05)
    assert {v for _, v in seen} == {"yes", "no", "CI spans"}


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
    assert set(ReproConfig().train_depths) >= {6, 12}  # depth after training, in --quick too
    with pytest.raises(ValueError, match="grid_dtype"):
        run_zuo2024(replace(SMOKE, grid_dtype="float16"), "unused-folder", progress=False)


def test_cli_table_accepts_pandas_display_options():
    """``posinterp reproduce`` prints its claims with a display option: the call that
    crashed after every finished run (keywords passed to pandas.option_context)."""
    import pandas as pd

    from posinterp.cli import _table

    text = _table(pd.DataFrame({"claim": ["x" * 120], "n": [3]}), **{"display.max_colwidth": 90})
    assert "claim" in text and text.rstrip().endswith("3")


def test_verify_retrains_committed_trainings_and_reports_differences(tmp_path, monkeypatch, capsys):
    """reproduce --verify K re-trains K seeded-random trainings of committed outputs and
    compares steps exactly and scores at the page's precision: a fresh run's own outputs
    reproduce; an edited accuracy is reported (exit 1)."""
    import shutil

    import posinterp.experiments.zuo2024 as z
    from posinterp.cli import main

    monkeypatch.setattr(z, "ProbeConfig", lambda: ProbeConfig(hidden=8, max_epochs=3))
    run_zuo2024(SMOKE, tmp_path / "run", progress=False)
    table = z.verify_trainings(tmp_path / "run", 2, progress=False)
    assert table.within.all() and table.cell.nunique() == 2
    assert {"steps", "accuracy"} <= set(table.field)
    data = tmp_path / "data"
    data.mkdir()
    for name in ("training.csv", "run.json"):
        shutil.copyfile(tmp_path / "run" / name, data / name)
    t = pd.read_csv(data / "training.csv")
    t["accuracy"] += 0.01
    t.to_csv(data / "training.csv", index=False)
    assert main(["reproduce", "zuo2024", "--verify", "1", "--verify-data", str(data),
                 "--no-progress"]) == 1
    assert "0 of 1 trainings reproduce" in capsys.readouterr().out


def test_a_choice_is_listed_only_on_pages_of_runs_that_have_it():
    """The addition budget was chosen after the budget exploration: a page rendered from
    a run with that budget lists it among the choices made after seeing results; the
    committed page of an earlier run (addition at 500 steps) does not."""
    from dataclasses import asdict

    from posinterp.experiments._disclosure import disclosure_section
    from posinterp.experiments.zuo2024 import CHOICES_AFTER_RESULTS

    budget = [c for c in CHOICES_AFTER_RESULTS if c.what.startswith("Addition's --quick budget")]
    assert len(budget) == 2  # 5,000 steps, then 8,000
    now = json.loads(json.dumps(asdict(ReproConfig())))
    before = {**now, "task_steps": {}}
    listed = [line for line in disclosure_section(budget, "", now)
              if "Addition's --quick budget" in line]
    assert len(listed) == 1 and "8,000 steps (was 5,000)" in listed[0]
    at_5000 = {**now, "task_steps": {**now["task_steps"], "addition": 5000}}
    assert any("budget is 5,000 steps" in line for line in disclosure_section(budget, "", at_5000))
    assert not any("Addition's --quick budget" in line
                   for line in disclosure_section(budget, "", before))


def test_task_layouts_enter_the_keys_of_the_cells_they_change():
    """A task's input layout is part of what its cells compute from: the indexing cells'
    keys name it; cells of tasks in their default layout keep the key they had before
    layouts existed (so their stored results stay valid), and validation names the field."""
    from posinterp.experiments.zuo2024 import _key, _train_spec
    from posinterp.tasks import TaskConfig

    cfg = ReproConfig()
    idx = _train_spec(cfg, "indexing", 0)
    assert idx.task.format == cfg.task_formats["indexing"] == "query_first"
    assert idx.key["task"]["format"] == "query_first"
    default = replace(cfg, task_formats={})
    assert _train_spec(default, "indexing", 0).key != idx.key
    rev = _train_spec(cfg, "reversal", 0)
    lo, hi = cfg.task_lengths["reversal"]
    as_before = {k: v for k, v in TaskConfig("reversal", lo, hi, n_train=cfg.n_samples,
                                             n_test=cfg.n_samples, seed=0).to_dict().items()
                 if k != "format"}
    assert rev.key == _key("train", model=rev.key["model"], task=as_before,
                           train=rev.key["train"], n_sequences=cfg.n_sequences)
    with pytest.raises(ValueError, match="task_formats names tasks not in task_lengths"):
        run_zuo2024(replace(SMOKE, task_formats={"sorting": "x"}), "unused", progress=False)
    with pytest.raises(ValueError, match="format for task 'ordering' must be one of"):
        run_zuo2024(replace(SMOKE, task_formats={"ordering": "query_first"}), "unused",
                    progress=False)


def test_per_task_defaults_follow_task_lengths_and_hand_set_ones_are_checked(tmp_path):
    only = ReproConfig(task_lengths={"reversal": (4, 8)})
    assert only.depth_tasks == ("reversal",)
    assert set(only.task_steps) == set(only.depth_task_steps) == {"reversal"}
    assert only.task_formats == {}
    assert ReproConfig().depth_tasks == ("reversal", "addition", "indexing", "ordering")
    by_hand = ReproConfig(task_lengths={"reversal": (4, 8)},
                          task_formats={"ordering": "reordered_first"})
    with pytest.raises(ValueError, match="task_formats names tasks not in task_lengths"):
        run_zuo2024(by_hand, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_task_with_seeds_pending_shows_its_finished_seeds_without_a_verdict(
        tmp_path, monkeypatch):
    """While some of a task's seeds are pending, its claims give the finished seeds' figure
    but verdict *pending*, no p and no q (outside the BH family); once every seed is in, the
    same rows get a verdict and a p over all seeds."""
    import numpy as np

    import posinterp.experiments.zuo2024 as z

    monkeypatch.setattr(z, "ProbeConfig", lambda: ProbeConfig(hidden=8, max_epochs=3))
    cfg = replace(SMOKE, train_seeds=(0, 1), task_lengths={"reversal": (5, 6),
                                                            "addition": (1, 2)},
                  long_train_tasks=(), train_depths=())
    run = tmp_path / "run"
    run_zuo2024(cfg, run, progress=False)
    # every stored training marked at target (3 steps reach nothing), so that the rule under
    # test, not the accuracy gate, decides the rows; the cells are read back as stored
    for cell in (run / "cells").glob("train_*.csv"):
        pd.read_csv(cell).assign(reached_target=True).to_csv(cell, index=False)
    full = run_zuo2024(cfg, run, progress=False, compute=False)
    training = pd.read_csv(run / "training.csv")
    claim = "after the first attention >= 0.8 after training: addition"
    done = full[full.claim == claim]
    assert len(done) == 3 and not (done.holds == "pending").any()
    assert done.p.notna().all() and done.q.notna().all() and (done.n == 2).all()
    (run / "cells" / "train_addition_seed1.csv").unlink()
    part = run_zuo2024(cfg, run, progress=False, compute=False)
    rows = part[part.claim == claim]
    assert len(rows) == 3 and (rows.holds == "pending").all()
    assert rows.p.isna().all() and rows.q.isna().all()
    assert rows.detail.str.contains(r"pending \(not computed yet\): seeds \[1\]").all()
    seed0 = training[(training.task == "addition") & (training.seed == 0)].iloc[0]
    for _, r in rows.iterrows():
        assert r.n == 1
        assert np.isclose(r["mean"], seed0[f"trained:{z.POINTS[r.point]}"])
    # the rows left out of BH do not change the other rows' q-values' family size
    others = part[part.p.notna()]
    assert np.allclose(others.q, z.bh_qvalues(others.p), equal_nan=True)
