"""Induction heads on the inspect dashboard (issue 39, item 5): the induction score, the
selection of layers and heads, the sequence picker's views and their export.

The score (Olsson et al. 2022, §2): attention from a token to the token after its earlier
occurrence, averaged over the queries that have one; on [BOS, r, r] the second copy's
A[i, i - n + 1]. Checked in closed form on hand-built patterns, against an independent
numpy loop on random patterns with padding, and on SmolLM2 against the heads the issue
names (skipped when the shared file is absent).
"""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.analysis.heads import (
    induction_score,
    induction_scores,
    induction_targets,
    repeated_random_tokens,
)
from posinterp.dashboard.export import export_inspection, inspection_from_dict, load_inspection
from posinterp.dashboard.inspect import INDUCTION_BATCH, inspect_heads
from posinterp.io import json_value
from posinterp.models.backend import run_cached
from tests.helpers import random_tokens, tiny_model

N_NULL = 20


def _causal_softmax(batch: int, heads: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(batch, heads, n, n, generator=gen, dtype=torch.float64) * 2
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return s.softmax(-1)


def _numpy_induction(pattern: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Independent: per sequence, its real positions in order; for every real query i and
    every earlier real position k holding the same token, add A[i, the real position after k];
    mean over the queries with at least one such k (NaN if none)."""
    b, h = pattern.shape[:2]
    out = np.full((b, h), np.nan)
    for s in range(b):
        real = [p for p in range(tokens.shape[1]) if mask[s, p]]
        for head in range(h):
            per_query = []
            for a, i in enumerate(real):
                keys = [real[c + 1] for c in range(a) if tokens[s, real[c]] == tokens[s, i]]
                if keys:
                    per_query.append(sum(pattern[s, head, i, j] for j in keys))
            if per_query:
                out[s, head] = np.mean(per_query)
    return out


# --- the pure function -----------------------------------------------------------------------

def test_hand_built_pattern_gives_its_induction_mass():
    # [BOS, a, b, c, a, b, c]: queries 4, 5, 6 have targets 2, 3, 4 (i - n + 1, n = 3)
    toks = torch.tensor([[1, 5, 6, 7, 5, 6, 7]])
    n = toks.shape[1]
    w = torch.tensor([0.7, 0.4])  # two heads: weight w on the target, the rest on the BOS
    p = torch.zeros(1, 2, n, n, dtype=torch.float64)
    p[..., 0] = 1.0
    for i, j in ((4, 2), (5, 3), (6, 4)):
        p[0, :, i, j] = w
        p[0, :, i, 0] = 1 - w
    assert torch.allclose(p.sum(-1), torch.ones(1, 2, n, dtype=torch.float64))
    assert torch.allclose(induction_score(p, toks)[0], w.double())
    T = induction_targets(toks)[0]
    assert {tuple(x) for x in T.nonzero().tolist()} == {(4, 2), (5, 3), (6, 4)}
    # a token seen twice before has two targets, and its mass is their sum:
    # [a, b, a, b, a]: query 4 (a) -> keys 1 and 3; query 2 (a) -> key 1; query 3 (b) -> key 2
    toks = torch.tensor([[5, 6, 5, 6, 5]])
    p = torch.zeros(1, 1, 5, 5, dtype=torch.float64)
    p[0, 0, :, 0] = 1.0
    p[0, 0, 4] = torch.tensor([0.1, 0.3, 0.0, 0.6, 0.0])
    p[0, 0, 2] = torch.tensor([0.5, 0.5, 0.0, 0, 0])
    p[0, 0, 3] = torch.tensor([0.8, 0.0, 0.2, 0, 0])
    assert float(induction_score(p, toks)) == pytest.approx((0.9 + 0.5 + 0.2) / 3)
    # the previous token repeating token i makes j = i (TransformerLens's detect_head target too)
    assert induction_targets(torch.tensor([[5, 5]]))[0].tolist() == [[False, False], [False, True]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_random_patterns_match_an_independent_numpy_loop(side):
    gen = torch.Generator().manual_seed(1)
    b, h, n = 4, 3, 14
    toks = torch.randint(0, 5, (b, n), generator=gen)  # 5 ids: many repeats
    mask = torch.ones(b, n, dtype=torch.long)
    cut = (slice(None, 4) if side == "left" else slice(n - 4, None))
    mask[1, cut] = 0
    mask[3, cut] = 0
    p = _causal_softmax(b, h, n)
    got = induction_score(p, toks, mask).numpy()
    ref = _numpy_induction(p.numpy(), toks.numpy(), mask.numpy())
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
    assert ((0 <= got) & (got <= 1)).all()
    # a pad is never a position: the padded sequences score as their real tokens alone
    for s in (1, 3):
        real = mask[s].bool()
        alone = induction_score(p[s:s + 1][:, :, real][..., real], toks[s:s + 1, real])
        np.testing.assert_allclose(got[s], alone[0].numpy(), atol=1e-12)


def test_no_repeat_is_nan_and_bad_shapes_are_named():
    p = _causal_softmax(2, 2, 5)
    toks = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 2, 9]])
    got = induction_score(p, toks)
    assert torch.isnan(got[0]).all() and not torch.isnan(got[1]).any()
    with pytest.raises(ValueError, match="pattern must have shape"):
        induction_score(p[0], toks)
    with pytest.raises(ValueError, match=r"tokens must have the pattern's \[batch, pos\]"):
        induction_score(p, toks[:, :4])


def test_repeated_random_tokens_put_one_target_at_i_minus_n_plus_1():
    model = tiny_model("nope")  # d_vocab 27, BOS 1, n_ctx 48
    n = 9
    toks = repeated_random_tokens(model, 3, n, seed=2)
    assert toks.shape == (3, 2 * n + 1) and (toks[:, 0] == 1).all()
    first, second = toks[:, 1:n + 1], toks[:, n + 1:]
    assert torch.equal(first, second) and (first != 1).all()
    assert all(len(set(r.tolist())) == n for r in first)  # distinct within a copy
    assert torch.equal(toks, repeated_random_tokens(model, 3, n, seed=2))  # seeded
    # the targets are exactly the stripe of TransformerLens's induction demo, second copy only
    T = induction_targets(toks)
    stripe = torch.zeros_like(T[0])
    for i in range(n + 1, 2 * n + 1):
        stripe[i, i - n + 1] = True
    assert all(torch.equal(t, stripe) for t in T)
    p = _causal_softmax(3, 2, 2 * n + 1, seed=3)
    ref = torch.stack([p[..., i, i - n + 1] for i in range(n + 1, 2 * n + 1)], -1).mean(-1)
    assert torch.allclose(induction_score(p, toks), ref, atol=1e-12)
    nobos = repeated_random_tokens(model, 2, n, bos=False)
    assert nobos.shape == (2, 2 * n) and torch.equal(nobos[:, :n], nobos[:, n:])


def test_repeated_random_tokens_refuse_what_cannot_be_built():
    model = tiny_model("nope")
    with pytest.raises(ValueError, match="n must be a positive integer"):
        repeated_random_tokens(model, 2, 0)
    with pytest.raises(ValueError, match="n_ctx=48"):
        repeated_random_tokens(model, 2, 24)  # 49 positions
    big = tiny_model("nope", n_ctx=128)
    with pytest.raises(ValueError, match="26 the vocabulary holds"):
        repeated_random_tokens(big, 2, 27)


# --- the inspection ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy():
    model = tiny_model("rotary", n_layers=2)
    toks = random_tokens(model, 3, 12, seed=5)
    toks[:, 6:] = toks[:, :6]  # each sequence repeats its first half
    mask = torch.ones_like(toks)
    mask[2, 10:] = 0
    return model, toks, mask, inspect_heads(model, toks, mask, n_null=N_NULL)


def test_inspection_rows_are_the_pure_functions_on_the_models_own_patterns(toy):
    model, toks, mask, res = toy
    t = res.table
    cache = run_cached(model, toks, mask, lambda n: n.endswith("hook_pattern"))
    rep = repeated_random_tokens(model, INDUCTION_BATCH, 23, seed=0)  # the toy's n_ctx cuts 32 to 23
    rcache = run_cached(model, rep, None, lambda n: n.endswith("hook_pattern"))
    for layer in range(model.cfg.n_layers):
        hook = f"blocks.{layer}.attn.hook_pattern"
        want = _numpy_induction(cache[hook].double().numpy(), toks.numpy(), mask.numpy()).mean(0)
        got = t[(t.metric == "induction_score_input") & (t.layer == layer)].sort_values("head")
        np.testing.assert_allclose(got.value, want, atol=1e-9)
        assert (got.n_sequences == 3).all()
        want = _numpy_induction(rcache[hook].double().numpy(), rep.numpy(), np.ones(rep.shape)).mean(0)
        got = t[(t.metric == "induction_score") & (t.layer == layer)].sort_values("head")
        np.testing.assert_allclose(got.value, want, atol=1e-9)
        assert ((got.ci_low <= got.value) & (got.value <= got.ci_high)).all()
    # the public one-call function gives the same numbers
    df = induction_scores(model, n=23, batch=INDUCTION_BATCH)
    merged = df.merge(t[t.metric == "induction_score"], on=["layer", "head"])
    np.testing.assert_allclose(merged.value_x, merged.value_y, atol=1e-12)
    assert any("Olsson et al. 2022" in n and "cut to 23" in n for n in res.notes)
    assert "induction_score" in res.head_view() and "induction_score_input" in res.head_view()


def test_input_without_repeats_says_na():
    model = tiny_model("nope", n_layers=1)
    toks = torch.stack([torch.randperm(23)[:8] + 4 for _ in range(2)])  # distinct ids
    res = inspect_heads(model, toks, n_null=N_NULL)
    rows = res.table[res.table.metric == "induction_score_input"]
    assert len(rows) == model.cfg.n_heads and rows.value.isna().all() and (rows.n_sequences == 0).all()
    assert any(n.startswith("induction_score_input is NA") for n in res.notes)
    assert not res.table[res.table.metric == "induction_score"].value.isna().any()
    off = inspect_heads(model, toks, n_null=N_NULL, induction_tokens=0)
    assert "induction_score" not in set(off.table.metric)
    assert [v.label for v in off.pattern_views] == ["sequence 1"]  # no induction view either


def test_a_selection_gives_the_full_inspections_rows_for_those_heads(toy):
    model, toks, mask, full = toy
    part = inspect_heads(model, toks, mask, n_null=N_NULL, layers=[1], heads=[3, 0])
    assert part.meta["layers"] == [1] and part.meta["heads"] == [0, 3]
    key = ["hook", "layer", "head", "offset", "rank", "ablation", "metric"]
    per_head = full.table[full.table.layer.eq(1) & full.table["head"].isin([0, 3])]
    got = part.table[part.table["head"].notna()]
    assert set(got.metric) == set(per_head.metric)
    m = per_head.merge(got, on=key, how="outer", indicator=True)
    assert (m["_merge"] == "both").all()
    # positional_score is a Monte Carlo estimate whose seeded permutations are drawn in turn
    # over the selected layers: another selection, another draw (docs/inspect.md)
    exact = m.metric != "positional_score"
    np.testing.assert_allclose(m.value_x[exact], m.value_y[exact], atol=1e-9, equal_nan=True)
    assert set(part.table.layer) == {-1, 1}  # adjacency: the embedding and layer 1 only
    assert part.patterns.keys() == {1} and part.patterns[1].shape[0] == 2
    assert torch.allclose(part.patterns[1], full.patterns[1][[0, 3]])
    assert set(part.score_parts.layer) == {1} and set(part.score_parts["head"]) == {0, 3}
    assert any(n.startswith("Selected heads only: layers 1 x heads 0, 3 (2 of 8)") for n in part.notes)


@pytest.mark.parametrize("kw, match", [({"layers": [2]}, r"layers must be integers in \[0, 1\]"),
                                       ({"heads": [-1]}, r"heads must be integers in \[0, 3\]"),
                                       ({"heads": [1, 1]}, "heads must not repeat"),
                                       ({"induction_tokens": -1}, "induction_tokens"),
                                       ({"pattern_sequences": 0}, "pattern_sequences")])
def test_bad_selections_are_named(kw, match):
    model = tiny_model("nope")
    with pytest.raises(ValueError, match=match):
        inspect_heads(model, random_tokens(model, 2, 6), n_null=N_NULL, **kw)


def test_picker_views_are_each_sequences_own_pattern(toy):
    model, toks, mask, res = toy
    labels = [v.label for v in res.pattern_views]
    assert labels[:2] == ["sequence 1", "sequence 2"] and labels[2].startswith("repeated random tokens")
    cache = run_cached(model, toks, mask, "blocks.1.attn.hook_pattern")
    p = cache["blocks.1.attn.hook_pattern"]
    v2 = res.pattern_views[1]
    assert v2.n_tokens == 10 and len(v2.str_tokens) == 10
    assert torch.allclose(v2.patterns[1], p[2, :, :10, :10].float())
    assert torch.allclose(res.pattern_views[0].patterns[1], p[1].float())
    fewer = inspect_heads(model, toks, mask, n_null=N_NULL, pattern_sequences=1)
    assert [v.label for v in fewer.pattern_views] == labels[2:]


def test_views_round_trip_and_a_version_1_file_still_loads(toy, tmp_path):
    *_, res = toy
    back = load_inspection(export_inspection(res, tmp_path / "i.json"))
    assert [(v.label, v.str_tokens, v.block, v.n_tokens) for v in back.pattern_views] == \
        [(v.label, v.str_tokens, v.block, v.n_tokens) for v in res.pattern_views]
    for a, b in zip(res.pattern_views, back.pattern_views, strict=True):
        assert a.patterns.keys() == b.patterns.keys()
        assert all(torch.equal(a.patterns[k], b.patterns[k]) for k in a.patterns)
    # a file written before the picker (schema_version 1: no pattern_views, a list per row,
    # patterns as whole squares) loads without views
    old = json.loads((tmp_path / "i.json").read_text())
    old["schema_version"] = 1
    del old["pattern_views"], old["table"]
    t = res.table
    old["columns"], old["dtypes"] = list(t.columns), {c: str(d) for c, d in t.dtypes.items()}
    old["rows"] = [[json_value(v) for v in r] for r in t.itertuples(index=False, name=None)]
    old["patterns"] = {str(k): {"shape": list(p.shape), "dtype": "float32", "base64":
                                base64.b64encode(p.numpy().astype("<f4").tobytes()).decode()}
                       for k, p in res.patterns.items()}
    v1 = inspection_from_dict(old)
    assert v1.pattern_views == []
    pd.testing.assert_frame_equal(v1.table, res.table)
    assert all(torch.equal(v1.patterns[k], res.patterns[k]) for k in res.patterns)


# --- the CLI ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.helpers import tiny_rotary_checkpoint

    return tiny_rotary_checkpoint(tmp_path_factory.mktemp("induction"))


def test_cli_layers_and_heads_select_and_out_of_range_names_the_flag(checkpoint, tmp_path, capsys):
    from posinterp.cli import main

    out = tmp_path / "sel"
    assert main(["inspect", str(checkpoint), "--tokens", "8", "--batch", "2", "--layers", "1",
                 "--heads", "0-1", "3", "--out", str(out), "--no-progress"]) == 0
    csv = pd.read_csv(out / "heads.csv")
    heads = csv[csv["head"].notna()]
    assert set(heads.layer) == {1} and set(heads["head"]) == {0, 1, 3}
    assert {"induction_score", "induction_score_input"} <= set(csv.metric)
    assert "top induction heads" in capsys.readouterr().out
    assert load_inspection(out / "inspection.json").meta["heads"] == [0, 1, 3]
    for flag, value, match in (("--layers", "2", r"--layers must be integers in \[0, 1\]"),
                               ("--heads", "2-4", r"--heads must be integers in \[0, 3\], got \[4\]")):
        bad = tmp_path / flag.strip("-")
        assert main(["inspect", str(checkpoint), "--tokens", "8", "--batch", "2", flag, value,
                     "--out", str(bad), "--no-progress"]) != 0
        assert re.search(match, capsys.readouterr().err)
        assert not bad.exists()  # refused before anything was written
    with pytest.raises(SystemExit):
        main(["inspect", str(checkpoint), "--layers", "3-1"])
    assert "must run upwards" in capsys.readouterr().err


# --- SmolLM2 (the issue's heads) --------------------------------------------------------------

SMOL = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not SMOL.is_file(), reason=f"{SMOL} not present (the shared test models are "
                    "only on the project's machines)")
def test_smollm2_induction_heads_are_the_issues(smol):
    """On two paragraphs, each a passage followed by its repetition, the four heads the issue
    found by their attention to the induction target (0.49-0.70) and by ablation (L18H6,
    L17H5, L20H6, L17H4) are the top four by induction_score on the text. One forward pass
    on the session's loaded SmolLM2 (tests/conftest.py, shared with tests/models/test_gguf.py);
    alone, the load costs 20-90 s here (a first run also converts the GGUF, about a minute)."""
    import importlib.util

    from posinterp.experiments.inspect import text_batch

    spec = importlib.util.spec_from_file_location(
        "induction_smollm2", Path(__file__).resolve().parents[2] / "benchmarks" / "induction_smollm2.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model, _ = smol
    tokens, mask, _ = text_batch(model, bench.text())
    df = induction_scores(model, tokens, mask)
    df = df.assign(name=[f"L{int(a)}H{int(b)}" for a, b in zip(df.layer, df["head"], strict=True)])
    top = df.sort_values("value", ascending=False).head(4)
    assert set(top.name) == set(bench.ISSUE_HEADS), top
    assert (top.value > 0.4).all() and (top.n_sequences == 2).all()



def test_a_bos_the_model_cannot_embed_is_no_bos():
    """A tokenizer from another vocabulary (BOS id >= d_vocab) gives no BOS, so inputs
    built with one (induction tokens, sampled text) never index past the embedding (TL 4's
    bridge gives a tokenizer without a BOS a stand-in one from its own vocabulary)."""
    from types import SimpleNamespace

    from posinterp.models.backend import bos_token_id
    from posinterp.tasks.tokenizer import build_byte_tokenizer

    foreign = build_byte_tokenizer()
    foreign.bos_token = max(foreign.get_vocab().items(), key=lambda kv: kv[1])[0]
    d_vocab = 27  # the tiny toys' char vocabulary
    assert foreign.bos_token_id >= d_vocab
    model = SimpleNamespace(cfg=SimpleNamespace(d_vocab=d_vocab), tokenizer=foreign)
    assert bos_token_id(model) is None
    model.cfg.d_vocab = foreign.bos_token_id + 1
    assert bos_token_id(model) == foreign.bos_token_id
