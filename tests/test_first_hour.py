"""The first hour of a new user (issue 15): each fault found in the trial, as a test."""

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from posinterp.cli import _interrupted, build_parser, main
from posinterp.io import check_out_dir
from posinterp.models import preset
from posinterp.training import TrainConfig, TrainingInterrupted, latest_checkpoint, load_checkpoint, train
from tests.helpers import random_tokens, tiny_model, tiny_task

ROOT = Path(__file__).resolve().parents[1]


def _cfg(**kw):
    base = dict(max_steps=6, batch_size=8, eval_every=3, n_eval=16, checkpoint_every=1000,
                warmup_steps=2, target_accuracy=None, seed=3)
    return TrainConfig(**{**base, **kw})


# 1. Ctrl-C: checkpoints by wall time, and a truthful message -----------------------------------

def test_wall_time_checkpoints_come_before_the_step_cadence(tmp_path):
    data = tiny_task("reversal", n=40, max_digits=6)
    train(preset("tiny"), data, _cfg(max_steps=3, checkpoint_seconds=0, keep_checkpoints=5),
          checkpoint_dir=tmp_path, progress=False)
    # checkpoint_every=1000, yet every step was saved because the wall-time budget (0 s) passed.
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_0000001", "step_0000002", "step_0000003"]


def test_interrupt_reports_the_last_checkpoint_truthfully(tmp_path):
    def evaluate_then_stop(model):  # runs at step 3 (eval_every=3), after its checkpoint check
        raise KeyboardInterrupt

    from posinterp.models import build_model
    from posinterp.training import fit

    model = build_model(preset("tiny"))
    with pytest.raises(TrainingInterrupted) as info:
        fit(model, lambda g: None, lambda m, b: m.W_E.sum() * 0, evaluate_then_stop,
            _cfg(checkpoint_seconds=None, checkpoint_every=2), {"x": 1}, checkpoint_dir=tmp_path,
            progress=False)
    assert info.value.saved == tmp_path / "step_0000002" and info.value.step == 2
    msg = _interrupted(info.value, argparse.Namespace(resumable="checkpoints"))
    assert "step_0000002" in msg and "resume" in msg
    # Nothing saved yet: say so instead of "finished work is saved".
    with pytest.raises(TrainingInterrupted) as none:
        fit(build_model(preset("tiny")), lambda g: None, lambda m, b: m.W_E.sum() * 0,
            evaluate_then_stop, _cfg(checkpoint_seconds=None), {"x": 1},
            checkpoint_dir=tmp_path / "other", progress=False)
    assert none.value.saved is None
    assert "nothing was saved" in _interrupted(none.value, argparse.Namespace(resumable="checkpoints"))
    # In a grid the interrupted training is one cell: the finished cells are kept.
    grid = _interrupted(none.value, argparse.Namespace(resumable="finished cells"))
    assert "finished cells are kept" in grid and "nothing was saved" not in grid
    assert "no partial output" in _interrupted(KeyboardInterrupt(), argparse.Namespace(resumable=""))


# 2. --out that is a file; no folder left by bad arguments --------------------------------------

@pytest.mark.parametrize("argv", [["demo"], ["inspect", "zoo:nope"], ["spectrum", "x.bin"],
                                  ["reproduce", "zuo2024"], ["experiment", "qk-constraints"]])
def test_out_that_is_a_file_is_an_argument_error(tmp_path, capsys, argv):
    f = tmp_path / "F"
    f.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(f)])
    assert exit_.value.code == 2
    assert f"--out: {f} is a file" in capsys.readouterr().err


def test_out_inside_a_file_and_api_folders(tmp_path):
    f = tmp_path / "F"
    f.write_text("")
    with pytest.raises(ValueError, match="is inside .*F, which is a file"):
        check_out_dir(f / "sub", "out_dir")
    from posinterp.experiments import DemoConfig, run_demo
    from posinterp.experiments.inspect import run_inspect

    with pytest.raises(ValueError, match="out_dir .* is a file"):
        run_demo(DemoConfig(preset="tiny", digits=5, max_steps=1), f, progress=False)
    with pytest.raises(ValueError, match="out_dir .* is a file"):
        run_inspect("zoo:nope", f, progress=False)


def test_bad_arguments_leave_no_folder(tmp_path, capsys):
    out = tmp_path / "new"
    with pytest.raises(SystemExit):
        main(["demo", "--max-steps", "-5", "--out", str(out)])
    assert "--max-steps: must be >= 1, got -5" in capsys.readouterr().err
    assert not out.exists()
    from posinterp.experiments.inspect import run_inspect

    with pytest.raises(ValueError, match="--batch must be >= 1"):
        run_inspect("zoo:nope", out, batch=0, progress=False)
    assert not out.exists()


# 3. A truncated model.safetensors -------------------------------------------------------------

def test_truncated_checkpoint_is_named_and_skipped(tmp_path):
    data = tiny_task("reversal", n=40, max_digits=6)
    cfg = _cfg(max_steps=4, checkpoint_every=2, checkpoint_seconds=None)
    full = train(preset("tiny"), data, cfg, checkpoint_dir=tmp_path, progress=False)
    broken = latest_checkpoint(tmp_path) / "model.safetensors"
    assert broken.parent.name == "step_0000004"
    broken.write_bytes(broken.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"step_0000004/model\.safetensors is unreadable"):
        load_checkpoint(broken.parent)
    with pytest.warns(UserWarning, match=r"step_0000004/model\.safetensors"):
        resumed = train(preset("tiny"), data, cfg, checkpoint_dir=tmp_path, progress=False)
    assert (tmp_path / "broken-step_0000004").is_dir()  # kept aside, not deleted
    load_checkpoint(tmp_path / "step_0000004")  # written again, readable
    # Resumed from step 2, it ends exactly where an uninterrupted run ends.
    for (name, a), (_, b) in zip(full.model.state_dict().items(),
                                 resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


# 4. Mistyped local paths and an offline hub ---------------------------------------------------

def test_mistyped_local_path_is_short(tmp_path, monkeypatch):
    from posinterp import load_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck2").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        load_model("ck2/tiny-gpt3")
    assert str(err.value) == "no such folder or file: ck2/tiny-gpt3"


def test_unknown_hub_name_is_short():
    from posinterp import load_model

    with pytest.raises(FileNotFoundError, match="no such folder or file: elsewhere/tiny-gpt3") as err:
        load_model("elsewhere/tiny-gpt3")  # not local, and not a name TL knows
    assert len(str(err.value)) < 400


def test_offline_hub_says_so_at_once(monkeypatch):
    import time

    from posinterp import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        load_model("gpt2")
    assert time.perf_counter() - t < 10  # not the client's ~23 s of retries
    monkeypatch.delenv("HF_HUB_OFFLINE")
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(*a, **k):  # what snapshot_download raises on a connection error
        raise LocalEntryNotFoundError("Got: ConnectError: no route")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(FileNotFoundError, match="hub cannot be reached"):
        load_model("gpt2")


# 5. A rerun with other options fails first, naming the option ----------------------------------

def test_demo_rerun_with_other_digits_names_the_option_before_any_work(tmp_path, monkeypatch):
    from posinterp.experiments import DemoConfig, demo, run_demo

    run_demo(DemoConfig(quick=True, preset="tiny", max_steps=2, n_analysis=3, init_seeds=1),
             tmp_path, progress=False)

    def no_work(*a, **k):
        raise AssertionError("the analysis started before the options were checked")
    monkeypatch.setattr(demo, "make_task_data", no_work)
    with pytest.raises(ValueError, match="--digits: the folder has 6, this run 7"):
        run_demo(DemoConfig(quick=True, digits=7, preset="tiny", max_steps=2), tmp_path,
                 progress=False)


# 6. ablation_effect has a column for every field of the intervention ---------------------------

def test_ablation_rows_of_rope_variants_differ():
    from posinterp.interventions import QKIntervention
    from posinterp.interventions.effects import ablation_effect

    model = tiny_model("rotary")
    toks = random_tokens(model, 2, 8)
    df = ablation_effect(model, toks, [QKIntervention("symmetric", 0, rope_variant="content"),
                                       QKIntervention("symmetric", 0, rope_variant="offset"),
                                       QKIntervention("keep_top_k", 1, heads=(0, 2), k=2)])
    fields = ["kind", "layer", "heads", "k", "rope_variant", "metric"]
    assert not df.duplicated(subset=fields).any()
    assert set(df.rope_variant.dropna()) == {"content", "offset"}
    top = df[df.kind == "keep_top_k"]
    assert (top.k == 2).all() and (top.heads == "0,2").all() and top.rope_variant.isna().all()


# 7. No noise about what posinterp handles ----------------------------------------------------

def test_bloom_and_bf16_loads_are_quiet(tmp_path, caplog):
    from posinterp import load_model
    from tests.helpers import parity_cases, save_tiny_checkpoint

    arch, make, _ = parity_cases()["bloom-12-heads"]
    save_tiny_checkpoint(arch, make(), tmp_path / "bloom")
    with caplog.at_level(logging.WARNING):
        load_model(tmp_path / "bloom")
        load_model(tmp_path / "bloom", dtype=torch.bfloat16)
    assert not [r for r in caplog.records if "W_pos" in r.getMessage()
                or "reduced precision" in r.getMessage()]
    # The filter is gone afterwards: other warnings still reach the user.
    with caplog.at_level(logging.WARNING):
        logging.getLogger().warning("Missing key for a weight matrix in pretrained, filled in with "
                                    "an empty tensor: pos_embed.W_pos")
    assert any("W_pos" in r.getMessage() for r in caplog.records)


# 8. Fast, complete help ---------------------------------------------------------------------

def test_help_does_not_import_torch():
    code = ("import sys, posinterp.cli as c; c.build_parser(); "
            "print(sorted(m for m in ('torch', 'pandas', 'transformer_lens', 'matplotlib') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _all_parsers(parser, name="posinterp"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{name} {sub_name}")


def test_every_command_and_option_is_described():
    assert "The ``posinterp`` command" not in (build_parser().description or "")
    missing = []
    for name, parser in _all_parsers(build_parser()):
        if not (parser.description or "").strip():
            missing.append(f"{name}: no description")
        for a in parser._actions:
            if isinstance(a, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
                continue
            label = f"{name} {'/'.join(a.option_strings) or a.dest}"
            if not (a.help or "").strip():
                missing.append(f"{label}: no help")
            elif a.default not in (None, False) and "default" not in a.help:
                missing.append(f"{label}: default {a.default!r} not stated")
            elif a.choices is not None and a.metavar is None and "choices" not in a.help \
                    and not isinstance(a.choices, range):
                pass  # argparse prints {a,b,c} itself
    assert missing == []


# 9. Reports say what to look at, with readable numbers ----------------------------------------

def test_demo_banner_example_has_the_run_s_digits():
    from posinterp.experiments.demo import _example

    for d in (5, 6, 8, 16):
        ex = _example(d)
        inside = ex[ex.index("(") + 1: ex.index(")")]
        assert len(inside) == d and ex.endswith("=" + inside[::-1])


def test_demo_reading_explains_a_falling_score_and_the_template():
    from posinterp.experiments.demo import _reading

    table = pd.DataFrame({"hook": ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_mid"],
                          "layer": [-1, 0], "init / random tokens": [0.5, 0.93],
                          "trained / random tokens": [0.5, 0.7], "init / task samples": [0.62, 0.9]})
    text = _reading(table)
    assert "0.930 at init and 0.700 trained, so it falls" in text
    assert "template" in text and "0.620" in text


def test_integer_columns_print_as_integers():
    from posinterp.viz.report import Report, integer_columns

    df = pd.DataFrame({"k": [1.0, 2.0, None], "score": [0.5, 0.25, 1.0], "n": [3.0, 4.0, 5.0]})
    out = integer_columns(df)
    assert str(out.k.dtype) == "Int64" and str(out.n.dtype) == "Int64" and out.score.dtype == float
    html = Report("t").table(df).html()
    assert "2.000" not in html and "0.250" in html


def test_fingerprint_summary_reads_an_untestable_design():
    from posinterp.viz.report import fingerprint_summary

    tests = pd.DataFrame([dict(k=1, n_rope=1, n_other=2, mean_rope=0.9, mean_other=0.1,
                               p_permutation=float("nan"), p_mannwhitney=1 / 3, min_possible_p=1 / 3,
                               separated=True, q_bh=float("nan"), note="n")])
    row = fingerprint_summary(tests).iloc[0]
    assert "no permutation test" in row.reading and "0.333" in row.reading
    assert row.separated == "yes"


def test_eigenvalue_planes_wrap_twelve_heads_and_have_a_colour_bar():
    from posinterp.analysis import head_table, qk_spectrum
    from posinterp.models import ToyModelConfig, build_model
    from posinterp.viz import eigenvalue_planes

    model = build_model(ToyModelConfig(n_layers=2, d_model=48, n_heads=12, d_head=4, n_ctx=16,
                                       tokenizer=None, d_vocab=20, attn_only=True))
    fig = eigenvalue_planes(qk_spectrum(model), head_table(model, n_sequences=2, n_tokens=8, n_null=20))
    panels = [ax for ax in fig.axes if ax.get_title().startswith("L")]
    assert len(panels) == 24
    columns = {round(ax.get_position().x0, 3) for ax in panels}
    assert len(columns) == 8  # 8 to a row, not 12 squeezed in
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)


def test_similarity_ticks_are_integer_positions_or_tokens():
    from posinterp.viz import similarity_grid

    sims = {"a": torch.eye(30, dtype=torch.float64)}
    fig = similarity_grid(sims)
    ticks = fig.axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)
    fig = similarity_grid({"a": torch.eye(4, dtype=torch.float64)}, tokens=["<bos>", "r", "e", "v"])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["<bos>", "r", "e", "v"]


# 10. Docs -------------------------------------------------------------------------------------

def test_docs_do_not_cite_missing_documents_or_claim_missing_modules():
    pages = {p: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]}
    for path, text in pages.items():
        assert "DESIGN" not in text, path
        assert "Not built yet" not in text, path
    readme = pages[ROOT / "README.md"]
    assert "padded batch needs its `attention_mask`" in readme


def test_docstrings_cite_only_existing_doc_sections():
    import re

    concepts = (ROOT / "docs" / "concepts.md").read_text()
    headings = set(re.findall(r"^#+ (.+)$", concepts, re.M))
    bad = []
    for py in (ROOT / "posinterp").rglob("*.py"):
        text = py.read_text()
        if re.search(r"concepts\.md,? §", text):
            bad.append(f"{py}: numbered section")
        for ref in re.findall(r'concepts\.md,?\s*\(?"([^"]+)"', text):
            if not any(ref in h for h in headings):
                bad.append(f"{py}: {ref}")
    assert bad == []


def test_run_json_and_table_agree(tmp_path):
    """`posinterp inspect` on a toy checkpoint folder: files, table and page are one story."""
    from posinterp.experiments.inspect import run_inspect

    data = tiny_task("reversal", n=40, max_digits=6)
    train(preset("tiny", pe="alibi"), data, _cfg(max_steps=2), checkpoint_dir=tmp_path / "ck" / "checkpoints",
          progress=False)
    text = tmp_path / "t.txt"
    text.write_text("rev(123456)=654321\n\nrev(98765)=56789\n\n1\n")
    res = run_inspect(str(tmp_path / "ck"), tmp_path / "out", text=text, progress=False)
    meta = json.loads((tmp_path / "out" / "run.json").read_text())
    assert meta["model"]["pe"] == "alibi" and meta["model"]["source"] == "toy"
    assert "2 paragraph(s)" in meta["input"]
    assert any("fewer than 3 tokens were skipped" in n for n in meta["notes"])
    csv = pd.read_csv(tmp_path / "out" / "heads.csv")
    assert len(csv) == len(res.table)
    # The first paragraph's tokens, BOS first, label the pattern views (JSON-escaped).
    assert '"tokens": ["\\u003cbos\\u003e", "r", "e", "v", "(", "1"' in res.report_path.read_text()
