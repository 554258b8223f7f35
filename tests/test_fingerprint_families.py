import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from posinterp.experiments import fingerprint_families as ff
from posinterp.experiments import zoo
from posinterp.experiments.spectrum import render_markdown
from posinterp.experiments.zoo import ZooConfig, ZooFamily, train_zoo
from tests.test_zoo import TINY, corpus  # noqa: F401

DATA = Path(__file__).parent.parent / "docs" / "reproductions" / "data" / "fingerprints"


def test_families_run_lists_pending_units_and_renders_the_page(tmp_path, corpus, monkeypatch):  # noqa: F811
    cfg = ZooConfig(**{**TINY.__dict__, "max_steps": 2, "n_snapshots": 2})
    tiny = {"fa": ZooFamily("fa", cfg, 7, "reference"),
            "fb": ZooFamily("fb", ZooConfig(**{**cfg.__dict__, "n_heads": 4}), 8, "heads")}
    monkeypatch.setattr(zoo, "FAMILIES", tiny)
    monkeypatch.setattr(ff, "FAMILIES", tiny)
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
