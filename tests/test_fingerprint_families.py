import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from posinterp.experiments import fingerprint_families as ff
from posinterp.experiments import zoo
from posinterp.experiments.spectrum import render_markdown
from posinterp.experiments.zoo import FamilySet, ZooConfig, ZooFamily, train_zoo
from tests.test_zoo import TINY, corpus  # noqa: F401

DATA = Path(__file__).parent.parent / "docs" / "reproductions" / "data" / "fingerprints"


def test_families_run_lists_pending_units_and_renders_the_page(tmp_path, corpus, monkeypatch):  # noqa: F811
    cfg = ZooConfig(**{**TINY.__dict__, "max_steps": 2, "n_snapshots": 2})
    tiny = {"fa": ZooFamily("fa", cfg, 7, "reference"),
            "fb": ZooFamily("fb", ZooConfig(**{**cfg.__dict__, "n_heads": 4}), 8, "heads")}
    monkeypatch.setitem(zoo.FAMILY_SETS, "design1", FamilySet("design1", tiny, "families", "t"))
    root = tmp_path / "families"
    for fam in tiny.values():
        train_zoo(fam.config, home=fam.home(root), first_seed=fam.seed, progress=False,
                  corpus=corpus)
    out = tmp_path / "spectrum"
    shutil.copytree(DATA, out, ignore=shutil.ignore_patterns("families"))
    tests = ff.run_families(out / "families", root, progress=False, command="posinterp zoo ...",
                            resume_command="posinterp zoo train ...", corpus=corpus)
    run = json.loads((out / "families" / "run.json").read_text())
    assert sorted(run["done"]) == ["fa/absolute", "fa/rotary", "fb/absolute", "fb/rotary"]
    assert sorted(run["pending"]) == ["fa/alibi", "fa/nope", "fb/alibi", "fb/nope"]
    heads = pd.read_csv(out / "families" / "heads.csv")
    assert len(heads) == 2 * 2 + 2 * 4  # every head of every finished model, once
    assert list(tests.analysis) == [a[0] for a in ff.ANALYSES]
    # the threshold decides who is tested; the floor follows the units that entered
    units = pd.read_csv(out / "families" / "units.csv")
    prim = units[units.analysis == "primary"]
    n_r = int((prim.value.notna() & (prim.group == "rope")).sum())
    n_o = int((prim.value.notna() & (prim.group == "other")).sum())
    row = tests.iloc[0]
    assert (row.n_rope, row.n_other) == (n_r, n_o)
    if n_r and n_o:
        assert row.min_possible_p == pytest.approx(1 / math.comb(n_r + n_o, n_r))
    page = render_markdown(out)
    assert "## Design (fixed before the families were trained)" in page
    assert "**Pending** (4 of 8 units" in page and "posinterp zoo train ..." in page
    assert "## Observational: real models available offline" in page
    # a rerun reuses every model's table (cells keyed by the card) and gives the same page
    again = ff.run_families(out / "families", root, progress=False, command="posinterp zoo ...",
                            resume_command="posinterp zoo train ...", corpus=corpus)
    pd.testing.assert_frame_equal(again, tests)
    with pytest.raises(ValueError, match="family must be one of"):
        ff.run_families(out / "families", root, families=("zz",), progress=False)


def test_design2_runs_from_the_cli_into_its_own_folder_and_renders_its_section(
        tmp_path, corpus, monkeypatch, capsys):  # noqa: F811
    from dataclasses import replace

    from posinterp.cli import main

    cfg = ZooConfig(**{**TINY.__dict__, "max_steps": 2, "n_snapshots": 2})
    short = {"fa": ZooFamily("fa", cfg, 7, "reference"),
             "fb": ZooFamily("fb", replace(cfg, n_heads=4), 8, "heads")}
    # design 2 built as the real one is: the same families, only max_steps changed
    long = {n: replace(f, config=replace(f.config, max_steps=6)) for n, f in short.items()}
    monkeypatch.setitem(zoo.FAMILY_SETS, "design1", FamilySet("design1", short, "families", "d1"))
    monkeypatch.setitem(zoo.FAMILY_SETS, "design2",
                        FamilySet("design2", long, "families-design2", "only longer"))
    out = tmp_path / "spectrum"
    shutil.copytree(DATA, out, ignore=shutil.ignore_patterns("families*"))
    for name, fams in (("families", short), ("families-design2", long)):
        for fam in fams.values():
            train_zoo(fam.config, home=fam.home(tmp_path / name), first_seed=fam.seed,
                      progress=False, corpus=corpus)
    ff.run_families(out / "families", tmp_path / "families", progress=False, command="c1",
                    resume_command="r1", corpus=corpus)
    page = tmp_path / "page.md"
    assert main(["zoo", "fingerprint", "--family-set", "design2", "--home",
                 str(tmp_path / "families-design2"), "--out", str(out), "--markdown", str(page),
                 "--no-progress"]) == 0
    run = json.loads((out / "families-design2" / "run.json").read_text())
    assert run["family_set"] == "design2" and run["family_set_why"] == "only longer"
    assert {n: f["config"]["max_steps"] for n, f in run["families"].items()} == {"fa": 6, "fb": 6}
    assert sorted(run["pending"]) == ["fa/alibi", "fa/nope", "fb/alibi", "fb/nope"]
    assert "--family-set design2" in run["resume_command"]
    # design 1's tables stay where they were
    assert json.loads((out / "families" / "run.json").read_text())["command"] == "c1"
    text = page.read_text()
    assert text == render_markdown(out)
    assert text.index("## Design (fixed before") < text.index("## Design 2: the same families") \
        < text.index("## Observational")
    sec = text[text.index("## Design 2"):text.index("## Observational")]
    assert "`max_steps` 2 -> 6." in sec  # the only recorded change, read from both runs
    assert "fa/alibi, fa/nope, fb/alibi, fb/nope" in sec and "smallest reachable p" in sec
    tests = pd.read_csv(out / "families-design2" / "tests.csv")
    prim = tests[tests.analysis == "primary"].iloc[0]
    if prim.n_rope and prim.n_other:
        assert f"p = {prim.p_permutation:.3g} (smallest reachable {prim.min_possible_p:.3g})" in sec
    # an unknown design is refused by name, by the CLI and by the library
    with pytest.raises(SystemExit):
        main(["zoo", "fingerprint", "--family-set", "design9", "--out", str(out)])
    assert "invalid choice: 'design9'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="family_set must be one of"):
        ff.run_families(out / "x", tmp_path, family_set_name="design9", progress=False)


def test_ranking_tokens_are_held_out_text(corpus):  # noqa: F811
    toks = ff.ranking_tokens(16, n=3, corpus=corpus)
    assert toks.shape == (3, 16)
    val = bytes(corpus.val.numpy())
    assert all(bytes(row.tolist()) in val for row in toks)
    with pytest.raises(ValueError, match="n and n_ctx"):
        ff.ranking_tokens(0, corpus=corpus)


@pytest.mark.parametrize("n", [2, 32, 64])
def test_the_page_s_uniform_baseline_is_the_score_of_uniform_causal_attention(n):
    import torch

    from posinterp.analysis.heads import previous_token_score
    from posinterp.experiments.spectrum import _uniform_prev_score

    pattern = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
    measured = previous_token_score(pattern[None, None]).item()
    assert _uniform_prev_score(n) == pytest.approx(measured, rel=1e-6)


def test_observational_intro_counts_previous_token_heads_and_names_dequantized_and_gqa():
    from posinterp.experiments.spectrum import _observational_intro

    run = json.loads((DATA / "run.json").read_text())
    heads = pd.read_csv(DATA / "heads.csv")
    best = heads.groupby("model").previous_token_score.max()
    n_prev = int((best >= run["min_prev_score"]).sum())
    text = "".join(_observational_intro(run, heads))
    assert f"({n_prev} of {len(run['models'])} have a previous-token head" in text
    for spec, info in run["models"].items():
        name = spec.rsplit("/", 1)[-1]
        assert (f"{name}: weights dequantized" in text) == bool(
            (info.get("weights") or {}).get("dequantized"))
        assert (f"{name}: grouped-query attention" in text) == (info["n_kv_heads"] < info["n_heads"])
    # a model without a previous-token head lowers the count
    weak = heads.assign(previous_token_score=0.0)
    assert f"(0 of {len(run['models'])} have" in "".join(_observational_intro(run, weak))


def _design2_from(tmp_path, values: dict[str, float], pending: list[str]) -> Path:
    """A families-design2 folder whose primary units take ``values`` (unit -> null
    percentile; absent units have no previous-token head), tests recomputed exactly."""
    from posinterp.analysis.fingerprint import unit_test

    out = tmp_path / "spectrum"
    shutil.copytree(DATA, out, ignore=shutil.ignore_patterns("families-design2", "cells"))
    fam = out / "families-design2"
    shutil.copytree(out / "families", fam)
    run = json.loads((fam / "run.json").read_text())
    run["pending"] = pending
    run["done"] = [u for u in run["done"] if u not in pending]
    run["family_set_why"] = "only longer"
    for f in run["families"].values():
        f["config"]["max_steps"] *= 3
    (fam / "run.json").write_text(json.dumps(run))
    units = pd.read_csv(fam / "units.csv")
    units["value"] = units.unit.map(values)
    units["best_prev_score"] = [0.5 if u in values else 0.1 for u in units.unit]
    units = units[~units.unit.isin(pending)]
    units.to_csv(fam / "units.csv", index=False)
    rows = [{"analysis": a[0], "changes": a[1], "column": a[2], "k": a[3], "nope": a[4],
             **unit_test(units[units.analysis == a[0]])} for a in run["analyses"]]
    pd.DataFrame(rows).to_csv(fam / "tests.csv", index=False)
    return out


def test_design2_reading_follows_its_test_and_its_floor(tmp_path):
    fams = ["base", "heads8", "deep", "wide"]
    sep = {**{f"{f}/rotary": 90.0 + i for i, f in enumerate(fams)},
           **{f"{f}/absolute": 5.0 + i for i, f in enumerate(fams)}}
    page = render_markdown(_design2_from(tmp_path / "a", sep, []))
    sec = page[page.index("## Design 2"):page.index("## Observational")]
    # 4 vs 4 separated: p = 1 / C(8, 4) = 0.0143, doubled 0.0286, both <= 0.05
    assert "4 RoPE vs 4 other units" in sec and "target: met" in sec
    assert f"p = {1 / 70:.3g} (smallest reachable {1 / 70:.3g}); doubled for the two " \
           f"designs, {2 / 70:.3g}" in sec
    assert "more rotational than the other units', also after doubling p" in sec
    assert "Interim" not in sec and "`max_steps` 800 -> 2400" in sec
    # the same units with two RoPE units pending: the floor 1/15 > 0.05, no verdict either way
    few = {u: v for u, v in sep.items() if u not in ("wide/rotary", "deep/rotary")}
    page = render_markdown(_design2_from(tmp_path / "b", few, ["wide/rotary", "deep/rotary"]))
    sec = page[page.index("## Design 2"):page.index("## Observational")]
    assert "Interim, 2 of 20 units pending" in sec and "cannot reach p <= 0.05" in sec
    assert "not supported" not in sec and "Every RoPE unit lies above every other" in sec
    # reversed groups: not supported
    rev = {u: 100.0 - v for u, v in sep.items()}
    page = render_markdown(_design2_from(tmp_path / "c", rev, []))
    assert "**not supported**" in page[page.index("## Design 2"):page.index("## Observational")]


def test_verify_retrains_committed_units_and_names_a_difference(tmp_path, corpus, monkeypatch):  # noqa: F811
    """--verify re-trains units of a committed design and compares them at the page's
    precision: an untouched run reproduces; an edited committed score or loss is reported."""
    cfg = ZooConfig(**{**TINY.__dict__, "max_steps": 2, "n_snapshots": 2})
    tiny = {"fa": ZooFamily("fa", cfg, 7, "reference")}
    monkeypatch.setitem(zoo.FAMILY_SETS, "design1", FamilySet("design1", tiny, "families", "t"))
    root = tmp_path / "families"
    train_zoo(cfg, home=tiny["fa"].home(root), first_seed=7, progress=False, corpus=corpus,
              only=("rotary", "absolute"))
    data = tmp_path / "data"
    ff.run_families(data, root, progress=False, corpus=corpus)
    table = ff.verify_units(data, 2, progress=False, corpus=corpus, work_dir=tmp_path / "again")
    assert table.within.all()
    assert table.attrs["summary"] == "2 of 2 units reproduce within the page's precision"
    assert set(table.cell) == {"fa/rotary", "fa/absolute"}
    assert {"steps", "val_loss"} <= set(table.field)
    assert table.field.str.endswith("rotational_mass_null_percentile").any()
    # a design committed against an earlier null draw: its percentiles are re-derived from
    # its R against today's null (as the page's null-shift section prints them), not
    # compared with the old draw's; a wrong old percentile does not count against it
    run = json.loads((data / "run.json").read_text())
    old = pd.read_csv(data / "heads.csv")
    shifted = old.assign(rotational_mass_null_percentile=old.rotational_mass_null_percentile + 7.0)
    shifted.to_csv(data / "heads.csv", index=False)
    (data / "run.json").write_text(json.dumps({**run, "null_version": 1}))
    assert ff.verify_units(data, 2, progress=False, corpus=corpus,
                           work_dir=tmp_path / "renulled").within.all()
    (data / "run.json").write_text(json.dumps(run))
    old.to_csv(data / "heads.csv", index=False)
    heads = pd.read_csv(data / "heads.csv")
    heads.loc[heads.unit == "fa/rotary", "previous_token_score"] += 0.01
    heads.to_csv(data / "heads.csv", index=False)
    table = ff.verify_units(data, 2, progress=False, corpus=corpus, work_dir=tmp_path / "third")
    bad = table[~table.within]
    assert set(bad.cell) == {"fa/rotary"} and bad.field.str.endswith("previous_token_score").all()
    assert table.attrs["summary"].startswith("1 of 2 units")
    with pytest.raises(ValueError, match="k must be in"):
        ff.verify_units(data, 3, progress=False, corpus=corpus)
