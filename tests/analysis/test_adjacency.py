import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posinterp.analysis import adjacency_by_layer, adjacency_row, adjacency_score, similarity_by_layer
from tests.helpers import random_tokens, tiny_model


def brute_force_row(v, strict=False):
    """The literal O(k^2) pair loop of docs/concepts.md, independent of the fast path."""
    k = len(v)
    total = 0.0
    for i, j in itertools.combinations(range(k), 2):
        total += float(v[i] < v[j]) + (0.0 if strict else 0.5 * float(v[i] == v[j]))
    return total / math.comb(k, 2)


def brute_force_matrix(c, strict=False):
    n = c.shape[0]
    return float(np.mean([brute_force_row(c[k, :k], strict) for k in range(2, n)]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=40), st.booleans())
def test_row_matches_brute_force_with_ties(values, strict):
    v = np.array(values, dtype=float)
    expected = brute_force_row(v, strict)
    assert adjacency_row(v, "strict" if strict else "half") == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("strict", [False, True])
def test_matrix_matches_brute_force_on_random_matrices(strict):
    gen = torch.Generator().manual_seed(0)
    sims = torch.randint(0, 6, (3, 25, 25), generator=gen).double() / 5  # many ties
    res = adjacency_score(sims, ties="strict" if strict else "half")
    for b in range(3):
        assert res.per_sequence[b].item() == pytest.approx(
            brute_force_matrix(sims[b].numpy(), strict), abs=1e-12)
    assert res.score == pytest.approx(res.per_sequence.mean().item())


def test_constructed_matrices_of_known_score():
    n = 12
    i = torch.arange(n, dtype=torch.float64)
    nearer_is_closer = -(i[:, None] - i[None, :]).abs()  # C_kj increases with j < k
    assert adjacency_score(nearer_is_closer).score == 1.0
    assert adjacency_score(-nearer_is_closer).score == 0.0
    assert adjacency_score(torch.ones(n, n)).score == 0.5
    assert adjacency_score(torch.ones(n, n), ties="strict").score == 0.0
    # One step pattern per row: values 0 for j < k-1 and 1 for j = k-1. Among C(k,2)
    # pairs, (k-1) are increasing and the rest tie: P_k = ((k-1) + (C(k,2)-(k-1))/2)/C(k,2).
    step = torch.zeros(n, n, dtype=torch.float64)
    for k in range(1, n):
        step[k, k - 1] = 1.0
    res = adjacency_score(step)
    for k in range(2, n):
        c = math.comb(k, 2)
        assert res.per_row[0, k].item() == pytest.approx(((k - 1) + (c - (k - 1)) / 2) / c)
    assert torch.isnan(res.per_row[0, :2]).all()


def test_equals_kendall_tau_a_identity():
    """P_k = (1 + tau_a) / 2 on tie-free rows, with tau_a from scipy (tau_b = tau_a there)."""
    from scipy.stats import kendalltau

    rng = np.random.default_rng(1)
    v = rng.normal(size=30)
    tau = kendalltau(np.arange(30), v).statistic
    assert adjacency_row(v) == pytest.approx((1 + tau) / 2, abs=1e-12)


def test_lengths_restrict_rows():
    gen = torch.Generator().manual_seed(2)
    sims = torch.rand(2, 10, 10, generator=gen, dtype=torch.float64)
    res = adjacency_score(sims, lengths=torch.tensor([10, 6]))
    assert res.per_sequence[1].item() == pytest.approx(brute_force_matrix(sims[1, :6, :6].numpy()))
    assert torch.isnan(res.per_row[1, 6:]).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(similarity=torch.rand(4, 5)), "shape"),
        (dict(similarity=torch.rand(1, 2, 2)), "at least 3 real tokens"),
        (dict(similarity=torch.rand(2, 5, 5), lengths=torch.tensor([5, 2])), "at least 3"),
        (dict(similarity=torch.rand(2, 5, 5), lengths=torch.tensor([5])), "lengths"),
        (dict(similarity=torch.rand(5, 5), ties="bogus"), "ties"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adjacency_score(**kwargs)


@pytest.mark.parametrize("pe", ["nope", "absolute", "rotary", "alibi"])
def test_left_padding_leaves_scores_unchanged(pe):
    model = tiny_model(pe)
    toks = random_tokens(model, 3, 12, seed=3)
    lengths = [12, 9, 6]
    padded = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for b, n in enumerate(lengths):
        padded[b, 12 - n:] = toks[b, :n]
        mask[b, 12 - n:] = 1
    df = adjacency_by_layer(model, padded, attention_mask=mask, per_position=True)
    # Reference: each sequence alone, unpadded.
    for hook in df.hook.unique():
        got = df[(df.hook == hook) & (df.metric == "adjacency_score")].value.item()
        want = np.mean([
            adjacency_by_layer(model, toks[b:b + 1, :n]).set_index("hook").value[hook]
            for b, n in enumerate(lengths)])
        assert got == pytest.approx(want, abs=1e-6), hook


def test_by_layer_table_shape_and_labels():
    model = tiny_model("nope")
    df = adjacency_by_layer(model, random_tokens(model, 2, 10))
    assert list(df.columns) == ["hook", "layer", "head", "position", "metric", "value",
                                "n_sequences"]
    assert df.layer.tolist() == [-1, 0, 0, 0, 0, 1, 1, 1, 1]
    assert df.hook.tolist()[:5] == ["blocks.0.hook_resid_pre", "blocks.0.hook_attn_out",
                                    "blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out",
                                    "blocks.0.hook_resid_post"]
    only = adjacency_by_layer(model, random_tokens(model, 2, 10), sites=("attn_out",))
    assert only.hook.tolist() == ["blocks.0.hook_resid_pre", "blocks.0.hook_attn_out",
                                  "blocks.1.hook_attn_out"]
    # the attention output alone, scored through the pure functions
    sims = similarity_by_layer(model, random_tokens(model, 2, 10),
                               hooks=[("blocks.1.hook_attn_out", 1)])
    assert only.value.iloc[-1] == adjacency_score(sims["blocks.1.hook_attn_out"]).score
    one = adjacency_by_layer(model, random_tokens(model, 2, 10), sites="attn_out")
    pd.testing.assert_frame_equal(one, only)  # one site as a string, as TL's names_filter
    with pytest.raises(ValueError, match="sites must be among"):
        adjacency_by_layer(model, random_tokens(model, 2, 10), sites=("attn",))
    assert df.value.between(0, 1).all() and (df.n_sequences == 2).all()


def test_by_layer_bad_input():
    model = tiny_model("nope")
    toks = random_tokens(model, 2, 10)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        adjacency_by_layer(model, toks, attention_mask=torch.ones(2, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="n_ctx"):
        adjacency_by_layer(model, random_tokens(model, 1, model.cfg.n_ctx + 1))
    with pytest.raises(ValueError, match="at least 3 real tokens"):
        adjacency_by_layer(model, toks[:, :2])


def test_token_and_mask_validation():
    model = tiny_model("nope")
    toks = random_tokens(model, 2, 10)
    ref = adjacency_by_layer(model, toks)
    bool_mask = adjacency_by_layer(model, toks, attention_mask=torch.ones(2, 10, dtype=torch.bool))
    assert bool_mask.value.tolist() == ref.value.tolist()
    with pytest.raises(ValueError, match="integer token ids"):
        adjacency_by_layer(model, toks.float() + 0.5)
    with pytest.raises(ValueError, match="d_vocab"):
        adjacency_by_layer(model, toks + model.cfg.d_vocab)
    with pytest.raises(ValueError, match="empty"):
        adjacency_by_layer(model, toks[:0])


def vectorized_pair_count_row(v, strict=False):
    """O(k^2) per-row pair count with numpy: a second oracle, fast enough for long rows."""
    less = v[:, None] < v[None, :]
    tie = v[:, None] == v[None, :]
    upper = np.triu(np.ones((len(v), len(v)), dtype=bool), 1)  # pairs i < j
    total = less[upper].sum() + (0.0 if strict else 0.5 * tie[upper].sum())
    return total / math.comb(len(v), 2)


@st.composite
def padded_batches(draw):
    """Matrices of few distinct values (heavy ties) with NaN padding past random lengths."""
    batch = draw(st.integers(1, 4))
    pos = draw(st.integers(3, 48))
    levels = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    lengths = draw(st.lists(st.integers(3, pos), min_size=batch, max_size=batch))
    rng = np.random.default_rng(seed)
    steps = rng.integers(0, levels, size=(batch, pos, pos))
    if draw(st.booleans()):  # a few distinct values: heavy ties
        sims = steps.astype(float) / max(levels - 1, 1)
    else:  # values a few ulps apart, and -0.0 next to 0.0: exact comparison matters
        sims = np.where(steps == 0, -0.0, 0.5 + steps * np.spacing(0.5))
        sims[:, ::3] = 0.0
    for b, n in enumerate(lengths):
        sims[b, n:, :] = np.nan
        sims[b, :, n:] = np.nan
    return sims, np.array(lengths)


@settings(max_examples=120, deadline=None)
@given(padded_batches(), st.booleans())
def test_batched_kernel_matches_oracle_with_ties_and_padding(data, strict):
    sims, lengths = data
    res = adjacency_score(torch.from_numpy(sims), torch.from_numpy(lengths),
                          ties="strict" if strict else "half")
    for b, n in enumerate(lengths):
        for k in range(sims.shape[1]):
            got = res.per_row[b, k].item()
            if 2 <= k < n:
                assert got == pytest.approx(brute_force_row(sims[b, k, :k], strict), abs=1e-12)
            else:
                assert math.isnan(got)
        assert res.per_sequence[b].item() == pytest.approx(
            brute_force_matrix(sims[b, :n, :n], strict), abs=1e-12)


@pytest.mark.parametrize("kind", ["3 levels", "50 levels", "normal", "ulps apart"])
def test_long_rows_match_pair_count(kind):
    """Long rows with many ties, or with distinct values closer than the kernel's key bits."""
    rng = np.random.default_rng(4)
    n = 300
    sim = {"3 levels": lambda: rng.integers(0, 3, (n, n)) * 0.1,
           "50 levels": lambda: rng.integers(0, 50, (n, n)) * 0.1,
           "normal": lambda: rng.normal(size=(n, n)),
           "ulps apart": lambda: 0.5 + rng.integers(0, 1000, (n, n)) * np.spacing(0.5)}[kind]()
    for ties in ("half", "strict"):
        res = adjacency_score(torch.from_numpy(sim), ties=ties)
        for k in [2, 3, 16, 17, 31, 32, 33, 64, 65, 200, n - 1]:
            assert res.per_row[0, k].item() == pytest.approx(
                vectorized_pair_count_row(sim[k, :k], ties == "strict"), abs=1e-12), (ties, k)


def test_signed_zero_ties_and_infinities():
    v = np.array([0.0, -0.0, np.inf, -np.inf, 0.0, np.inf])
    for strict in (False, True):
        ties = "strict" if strict else "half"
        assert adjacency_row(v, ties) == pytest.approx(brute_force_row(v, strict), abs=1e-12)


def test_nan_in_a_used_entry_is_an_error_but_padding_is_not():
    sim = torch.rand(2, 6, 6, dtype=torch.float64)
    sim[1, 4:, :] = float("nan")
    adjacency_score(sim, lengths=torch.tensor([6, 4]))  # NaN only past the length
    with pytest.raises(ValueError, match=r"NaN.*sequence 1, row 4"):
        adjacency_score(sim)
    with pytest.raises(ValueError, match="NaN"):
        adjacency_row(np.array([0.1, np.nan, 0.3]))
    with pytest.raises(ValueError, match="lengths must be integer"):
        adjacency_score(sim, lengths=torch.tensor([6.0, 4.0]))


def test_repeated_tokens_at_the_embedding_tie_exactly():
    """At a NoPE embedding, equal tokens are equal vectors: their cosines tie exactly, so
    "half" counts each tie 1/2 and "strict" 0 (a row whose earlier tokens are all one token
    scores exactly 0.5 and 0)."""
    model = tiny_model("nope")
    toks = torch.tensor([[1, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7]])
    sim = similarity_by_layer(model, toks)["blocks.0.hook_resid_pre"]
    half = adjacency_score(sim, ties="half").per_row[0]
    strict = adjacency_score(sim, ties="strict").per_row[0]
    # rows 2..8 see [1, 5, ..., 5] before them: pair (0, j) decided by C_k0 vs C_kj, pairs
    # among the 5s are ties. Independent count from the token ids and exact cosines:
    C = sim[0]
    for k in range(2, 14):
        pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
        conc = sum(float(C[k, i]) < float(C[k, j]) for i, j in pairs)
        tie = sum(int(toks[0, i]) == int(toks[0, j]) for i, j in pairs)
        assert half[k].item() == (conc + tie / 2) / len(pairs)
        assert strict[k].item() == conc / len(pairs)


def test_by_layer_holds_one_similarity_matrix_at_a_time(monkeypatch):
    """Peak memory does not grow with the number of hooks: each [batch, pos, pos] matrix is
    scored and dropped before the next exists (it held all of them before)."""
    import weakref

    from posinterp.analysis import adjacency as adj
    from posinterp.analysis import similarity as simmod

    live, peak = set(), [0]
    real = simmod.cosine_self_similarity

    def tracked(*args, **kwargs):
        out = real(*args, **kwargs)
        live.add(id(out))
        weakref.finalize(out, live.discard, id(out))
        peak[0] = max(peak[0], len(live))
        return out

    monkeypatch.setattr(simmod, "cosine_self_similarity", tracked)
    if hasattr(adj, "cosine_self_similarity"):
        monkeypatch.setattr(adj, "cosine_self_similarity", tracked)
    for n_layers in (1, 4):
        model = tiny_model("rotary", n_layers=n_layers)
        toks = random_tokens(model, 2, 12)
        df = adjacency_by_layer(model, toks)
        assert len(df) == 1 + 4 * n_layers
    assert peak[0] == 1


def test_by_layer_equals_the_pure_functions_at_every_hook_with_padding():
    model = tiny_model("rotary", n_layers=2)
    toks = random_tokens(model, 3, 12)
    mask = torch.ones_like(toks)
    mask[0, :4] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    df = adjacency_by_layer(model, toks, attention_mask=mask)
    sims = similarity_by_layer(model, toks, mask, hooks=list(zip(df.hook, df.layer, strict=True)))
    lengths = mask.sum(-1)
    for hook, value in zip(df.hook, df.value, strict=True):
        assert value == adjacency_score(sims[hook], lengths).score, hook


def test_analysis_forward_passes_build_no_autograd_graph():
    """Every analysis forward goes through backend.run_cached, which reads activations and
    never differentiates them: with a graph, peak memory held every layer's intermediates."""
    from posinterp.analysis._checks import run_cached

    model = tiny_model("rotary", n_layers=2)
    toks = random_tokens(model, 2, 12)
    seen = []
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_post",
                                 lambda act, hook: seen.append(torch.is_grad_enabled()))]):
        logits, _ = run_cached(model, toks, None, lambda n: False, return_logits=True)
        adjacency_by_layer(model, toks)
    assert seen == [False, False] and not logits.requires_grad
