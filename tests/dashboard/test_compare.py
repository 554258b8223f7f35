"""compare_inspections / compare_models: invariances, a planted change, formation, refusals."""

import copy

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.dashboard.compare import compare_inspections, compare_models, spectrum_distance
from posinterp.dashboard.inspect import input_facts, inspect_heads
from tests.helpers import random_tokens, tiny_model

N_NULL = 50


def _perturbed(model, layer, head, scale=0.5, seed=1):
    """A copy of ``model`` with W_Q of one head moved by Gaussian noise."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        W_Q = other.blocks[layer].attn.W_Q
        W_Q[head] += scale * torch.randn(W_Q[head].shape, generator=gen)
    assert not torch.equal(other.blocks[layer].attn.W_Q, model.blocks[layer].attn.W_Q)
    return other


@pytest.mark.parametrize("pe", ["nope", "rotary"])
def test_comparing_a_model_with_itself_changes_nothing(pe):
    model = tiny_model(pe)
    cmp = compare_models(model, model, random_tokens(model, 3, 10), n_null=N_NULL)
    assert len(cmp.heads) == model.cfg.n_layers * model.cfg.n_heads
    changes = cmp.heads.drop(columns=["layer", "head"]).to_numpy(dtype=float)
    assert np.nanmax(np.abs(changes)) == 0.0
    assert (cmp.kernels["delta"].dropna() == 0).all()
    assert (cmp.layers["delta"] == 0).all()
    assert cmp.formed.empty


@pytest.mark.parametrize("pe", ["nope", "rotary"])
def test_the_head_whose_query_weights_moved_ranks_first(pe):
    model = tiny_model(pe)
    tokens = random_tokens(model, 3, 10)
    a = inspect_heads(model, tokens, n_null=N_NULL)
    for layer, head in ((0, 2), (model.cfg.n_layers - 1, 1)):
        cmp = compare_inspections(a, inspect_heads(_perturbed(model, layer, head), tokens, n_null=N_NULL))
        top = cmp.heads.iloc[0]
        assert (top.layer, top["head"]) == (layer, head)
        assert top.spectrum_change > 0 and top.kernel_attention_change > 0
        rest = cmp.heads.iloc[1:]
        # Only that head's weights moved: every other spectrum is the same.
        assert (rest.spectrum_change == 0).all()
        # Heads of earlier layers, and its own layer's other heads, see the same input.
        same_input = rest[rest.layer <= layer]
        assert (same_input.drop(columns=["layer", "head"]).abs().max(axis=None) == 0)
        assert list(cmp.heads.change) == sorted(cmp.heads.change, reverse=True)


def test_spectrum_distance_closed_forms():
    gen = np.random.default_rng(0)
    lam = gen.normal(size=6) + 1j * gen.normal(size=6)
    assert spectrum_distance(lam, lam) == 0
    assert spectrum_distance(lam, gen.permutation(lam)) == 0  # a multiset: order is no change
    for c in (0.5, 2.0, 3.0):  # B -> cB moves every eigenvalue to c·λ: |c − 1| / (1 + c)
        assert spectrum_distance(lam, c * lam) == pytest.approx(abs(c - 1) / (1 + c), rel=1e-12)
    assert spectrum_distance([1.0], [-1.0]) == pytest.approx(1.0)
    assert spectrum_distance(lam, np.zeros(6)) == pytest.approx(1.0)
    assert spectrum_distance(np.zeros(3), np.zeros(3)) == 0
    # zeros pad the shorter spectrum (the d_model form's extra eigenvalues)
    assert spectrum_distance(lam, np.concatenate([lam, [0, 0]])) == 0
    with pytest.raises(ValueError, match="lam and mu"):
        spectrum_distance([], [1.0])


def _set_qk(model, layer, head, rotate: bool):
    """W_K with orthonormal columns; W_Q = W_K (B = I: all real) or W_K J (B = J: all complex)."""
    attn = model.blocks[layer].attn
    d_model, d_head = attn.W_K.shape[-2:]
    gen = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(d_model, d_head, generator=gen))
    J = torch.zeros(d_head, d_head)
    for i in range(0, d_head, 2):
        J[i, i + 1], J[i + 1, i] = -1.0, 1.0
    with torch.no_grad():
        attn.W_K[head] = q
        attn.W_Q[head] = q @ J if rotate else q


def test_a_head_whose_rotational_mass_crosses_the_null_formed():
    model = tiny_model("nope")
    _set_qk(model, 1, 3, rotate=False)
    later = copy.deepcopy(model)
    _set_qk(later, 1, 3, rotate=True)
    tokens = random_tokens(model, 3, 10)
    a, b = (inspect_heads(m, tokens, n_null=N_NULL) for m in (model, later))
    wa, wb = a.head_view().set_index(["layer", "head"]), b.head_view().set_index(["layer", "head"])
    key = "rotational_mass_null_percentile"
    assert wa.loc[(1, 3), key] < 95 <= wb.loc[(1, 3), key]  # the planted crossing
    formed = compare_inspections(a, b).formed
    row = formed[(formed.criterion == key)]
    assert list(zip(row.layer, row["head"], row.event, strict=True)) == [(1, 3, "formed")]
    back = compare_inspections(b, a).formed
    assert list(back[back.criterion == key].event) == ["dissolved"]


def test_incomparable_models_and_inputs_are_refused_by_name():
    model = tiny_model("nope")
    tokens = random_tokens(model, 2, 8)
    with pytest.raises(ValueError, match="n_layers x n_heads"):
        compare_models(model, tiny_model("nope", n_layers=3), tokens, n_null=N_NULL)
    with pytest.raises(ValueError, match="n_layers x n_heads"):
        compare_models(model, tiny_model("nope", n_heads=2), tokens, n_null=N_NULL)
    with pytest.raises(ValueError, match="d_vocab"):
        compare_models(model, tiny_model("nope", tokenizer="byte"), tokens, n_null=N_NULL)
    with pytest.raises(ValueError, match="B: tokens has 8 positions but the model's n_ctx is 6"):
        compare_models(model, tiny_model("nope", n_ctx=6), tokens, n_null=N_NULL)
    a = inspect_heads(model, tokens, n_null=N_NULL)
    b = inspect_heads(model, random_tokens(model, 2, 8, seed=5), n_null=N_NULL)
    with pytest.raises(ValueError, match="different inputs"):
        compare_inspections(a, b)
    b = inspect_heads(model, tokens, n_null=N_NULL)
    b.meta["vocab_digest"] = "another vocabulary"
    with pytest.raises(ValueError, match="tokenizer vocabularies"):
        compare_inspections(a, b)


def test_input_facts_tell_vocabularies_and_inputs_apart():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    class Model:
        def __init__(self, vocab):
            self.tokenizer = Tok(vocab)
            self.cfg = type("cfg", (), {"d_vocab": 2})

    t = torch.tensor([[0, 1, 1]])
    f = input_facts(Model({"a": 0, "b": 1}), t, None)
    assert f == input_facts(Model({"b": 1, "a": 0}), t, torch.ones_like(t))  # order; all-ones mask
    assert f["vocab_digest"] != input_facts(Model({"a": 1, "b": 0}), t, None)["vocab_digest"]
    assert f["input_digest"] != input_facts(Model({"a": 0, "b": 1}), t.flip(-1), None)["input_digest"]
    assert f["input_digest"] != input_facts(Model({"a": 0, "b": 1}), t, torch.tensor([[0, 1, 1]]))[
        "input_digest"]
    assert f["input_digest"] == input_facts(Model({"a": 0, "b": 1}), t[0], None)["input_digest"]


def test_score_deltas_are_b_minus_a():
    model = tiny_model("rotary")
    tokens = random_tokens(model, 3, 10)
    a = inspect_heads(model, tokens, n_null=N_NULL)
    b = inspect_heads(_perturbed(model, 0, 1), tokens, n_null=N_NULL)
    cmp = compare_inspections(a, b)
    wa, wb = a.head_view(), b.head_view()
    merged = cmp.heads.merge(wa, on=["layer", "head"]).merge(wb, on=["layer", "head"], suffixes=("_A", "_B"))
    for col in ("previous_token_score", "rotational_mass@Δ=-1"):
        pd.testing.assert_series_equal(merged[f"delta_{col}"], merged[f"{col}_B"] - merged[f"{col}_A"],
                                       check_names=False)
    # the saved long form holds the same numbers, heads in the same order
    long = cmp.table
    for metric, col in (("change", "change"), ("spectrum_change", "spectrum_change"),
                        ("previous_token_score", "delta_previous_token_score")):
        rows = long[long.metric == metric]
        assert rows[["layer", "head"]].values.tolist() == cmp.heads[["layer", "head"]].values.tolist()
        assert np.array_equal(rows.value.to_numpy(float), cmp.heads[col].to_numpy(float), equal_nan=True)
    prev = long[long.metric == "previous_token_score"]
    assert np.array_equal(prev.value.to_numpy(float), (prev.b - prev.a).to_numpy(float))


def test_a_comparison_displays_its_page_inline():
    model = tiny_model("nope")
    cmp = compare_models(model, _perturbed(model, 1, 0), random_tokens(model, 2, 6), n_null=10)
    html = cmp._repr_html_()
    assert html.count("<iframe srcdoc=") == 1 and "compare-data" in html
