"""Explain one score: the parts of a pre-softmax score sum to the model's own score, and
closed forms put everything where the weights live (posinterp.analysis.explain)."""

import math

import numpy as np
import pytest
import torch

import posinterp as pi
from posinterp.analysis.explain import BIAS_PARTS, CHANNEL_PARTS, score_parts
from posinterp.models import alibi_slopes
from posinterp.models.backend import attn_scale, qk_slots, rotary_spec
from tests.helpers import random_tokens, tiny_model

SCHEMES = ("nope", "absolute", "rotary", "alibi")
CELL = ["layer", "head", "query", "key"]


def _write(model, layer: int, head: int, **tensors) -> None:
    """Write one head's W_Q/W_K/b_Q/b_K where the model stores them (either TL line)."""
    slots = qk_slots(model, layer)
    with torch.no_grad():
        for name, value in tensors.items():
            slot = slots[name]
            slot.to_tl(getattr(slot.module, slot.name))[head].copy_(value)


def _busy_model(pe: str):
    """A tiny toy with O(1) scores and every bias term nonzero (attention biases and the
    LayerNorm bias feeding attention), so no part is trivially 0."""
    model = tiny_model(pe, init_std=0.25)
    gen = torch.Generator().manual_seed(1)
    H, dh, D = model.cfg.n_heads, model.cfg.d_head, model.cfg.d_model
    for layer in range(model.cfg.n_layers):
        for head in range(H):
            _write(model, layer, head, b_Q=0.5 * torch.randn(dh, generator=gen),
                   b_K=0.5 * torch.randn(dh, generator=gen))
        with torch.no_grad():
            model.blocks[layer].ln1.b.copy_(0.3 * torch.randn(D, generator=gen))
    return model


def _by_cell(df, metric):
    return df[df.metric == metric].set_index(CELL).value.sort_index()


@pytest.mark.parametrize("pe", SCHEMES)
def test_parts_sum_to_the_models_own_score(pe):
    model = _busy_model(pe)
    tokens = random_tokens(model, 1, 14, seed=3)[0]
    df = score_parts(model, tokens)
    score = _by_cell(df, "model_score")
    assert score.notna().all() and score.abs().max() > 0.5  # scores of size 1: a real test
    assert len(score) == model.cfg.n_layers * model.cfg.n_heads * 14 * 15 // 2  # every causal cell
    np.testing.assert_allclose(_by_cell(df, "score_total"), score, rtol=0, atol=1e-5)
    views = {"channel", "rotary_pair"} if pe == "rotary" else {"channel"}
    assert set(df.view.dropna()) == views
    parts = df[df.metric == "score_part"]
    for view in views:
        summed = parts[parts.view == view].groupby(CELL).value.sum().sort_index()
        np.testing.assert_allclose(summed, score, rtol=0, atol=1e-5)
    # each bias part is there and nonzero; ALiBi's term only on ALiBi models
    for part in BIAS_PARTS:
        assert parts[parts.part == part].value.abs().max() > 1e-3
    assert ("alibi" in set(parts.part)) == (pe == "alibi")
    # the pattern row is the softmax of the totals (the score is pre-softmax and complete)
    cell = df[(df.metric == "score_total") & (df.layer == 1) & (df.head == 2) & (df["query"] == 13)]
    pat = df[(df.metric == "pattern") & (df.layer == 1) & (df.head == 2) & (df["query"] == 13)]
    np.testing.assert_allclose(torch.tensor(cell.value.to_numpy()).softmax(-1).numpy(),
                               pat.value.to_numpy(), atol=1e-6)


def test_padding_is_dropped_and_a_subset_is_the_same_numbers():
    model = _busy_model("rotary")
    tokens = random_tokens(model, 1, 9, seed=4)[0]
    full = score_parts(model, tokens, layers=1, heads=[0, 3])
    padded = torch.cat([tokens, torch.zeros(3, dtype=torch.long)])
    mask = torch.tensor([1] * 9 + [0] * 3)
    sub = score_parts(model, padded, layers=1, heads=[0, 3], queries=[8, 5], keys=[7, 2],
                      attention_mask=mask)
    assert set(zip(sub["query"], sub["key"], strict=True)) == {(8, 7), (8, 2), (5, 2)}
    key = [*CELL, "view", "part", "pair", "metric"]
    merged = sub.merge(full, on=key, suffixes=("", "_full"))
    assert len(merged) == len(sub)
    np.testing.assert_allclose(merged.value, merged.value_full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("channel,sign", [("positive_real", 1.0), ("negative_real", -1.0)])
def test_a_head_in_one_real_channel_puts_everything_there(channel, sign):
    model = tiny_model("nope", init_std=0.25)
    D, dh = model.cfg.d_model, model.cfg.d_head
    w = torch.zeros(D)
    w[:8] = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.5, -1.5])  # mean-free: LN's centring keeps it
    W_Q, W_K = torch.zeros(D, dh), torch.zeros(D, dh)
    W_Q[:, 0], W_K[:, 0] = w, sign * w  # B = W_K^T W_Q = diag(±|w|^2, 0, ...)
    _write(model, 0, 1, W_Q=W_Q, W_K=W_K, b_Q=torch.zeros(dh), b_K=torch.zeros(dh))
    df = score_parts(model, random_tokens(model, 1, 10, seed=5)[0], layers=0, heads=1)
    parts = df[df.metric == "score_part"].pivot_table(index=CELL, columns="part", values="value")
    score = _by_cell(df, "model_score")
    assert score.abs().max() > 0.1
    np.testing.assert_allclose(parts[channel], score, rtol=0, atol=1e-5)
    for other in (*CHANNEL_PARTS, *BIAS_PARTS):
        if other != channel:
            assert parts[other].abs().max() < 1e-9, other
    # the sign of the channel is the sign of the score: x M x^T = ±(x·w)^2 on the diagonal
    diag = parts[channel][parts.index.get_level_values("query") == parts.index.get_level_values("key")]
    assert (sign * diag >= 0).all()


def test_a_rotation_block_is_the_complex_channel():
    model = tiny_model("nope", init_std=0.25)
    D, dh = model.cfg.d_model, model.cfg.d_head
    w1, w2 = torch.zeros(D), torch.zeros(D)
    w1[0], w1[1], w2[2], w2[3] = 1.0, -1.0, 1.0, -1.0  # orthogonal, equal norms, mean-free
    phi = 0.7
    W_Q, W_K = torch.zeros(D, dh), torch.zeros(D, dh)
    W_Q[:, 0], W_Q[:, 1] = 2 * w1, 2 * w2
    # W_K = W_Q Rot(phi): B = Rot(phi)^T W_Q^T W_Q = 8 Rot(-phi), eigenvalues 8 e^{±i phi}
    W_K[:, 0] = 2 * (math.cos(phi) * w1 + math.sin(phi) * w2)
    W_K[:, 1] = 2 * (-math.sin(phi) * w1 + math.cos(phi) * w2)
    _write(model, 1, 0, W_Q=W_Q, W_K=W_K, b_Q=torch.zeros(dh), b_K=torch.zeros(dh))
    df = score_parts(model, random_tokens(model, 1, 10, seed=6)[0], layers=1, heads=0)
    parts = df[df.metric == "score_part"].pivot_table(index=CELL, columns="part", values="value")
    score = _by_cell(df, "model_score")
    assert score.abs().max() > 0.1
    np.testing.assert_allclose(parts["complex"], score, rtol=0, atol=1e-5)
    assert parts[["positive_real", "negative_real", "null"]].abs().max().max() < 1e-9


def test_a_head_in_one_rotary_pair_matches_the_closed_form():
    model = tiny_model("rotary", init_std=0.25)
    D, dh = model.cfg.d_model, model.cfg.d_head
    spec = rotary_spec(model, 0)
    p = 1
    a, b = (2 * p, 2 * p + 1) if spec.adjacent_pairs else (p, p + spec.rotary_dim // 2)
    gen = torch.Generator().manual_seed(7)
    W_Q, W_K = torch.zeros(D, dh), torch.zeros(D, dh)
    for W in (W_Q, W_K):
        W[:, [a, b]] = torch.randn(D, 2, generator=gen)
    b_Q, b_K = torch.zeros(dh), torch.zeros(dh)
    b_Q[[a, b]] = torch.tensor([0.8, -0.4])
    b_K[[a, b]] = torch.tensor([0.3, 0.9])
    _write(model, 0, 2, W_Q=W_Q, W_K=W_K, b_Q=b_Q, b_K=b_K)
    tokens = random_tokens(model, 1, 12, seed=8)[0]
    df = score_parts(model, tokens, layers=0, heads=2)
    rot = df[(df.metric == "score_part") & (df.view == "rotary_pair")]
    pairs = rot[rot.part == "pair"].pivot_table(index=CELL, columns="pair", values="value")
    weights = pairs[p]
    others = pairs.drop(columns=p)
    assert others.abs().max().max() < 1e-9
    # closed form (Su et al. 2021, eq. 34): with z = x_a + i x_b, the pair's term is
    # Re(z_u conj(z_v) e^{i (i - j) θ_p}) / s, u = q - b_Q, v = k - b_K the weight parts
    cache = model.run_with_cache(tokens[None])[1]
    q = cache["blocks.0.attn.hook_q"][0, :, 2].double() - b_Q.double()
    k = cache["blocks.0.attn.hook_k"][0, :, 2].double() - b_K.double()
    zq, zk = torch.complex(q[:, a], q[:, b]), torch.complex(k[:, a], k[:, b])
    theta = float(spec.inv_freq[p])
    s = attn_scale(model, 0)
    want = [float((zq[i] * zk[j].conj() * np.exp(1j * (i - j) * theta)).real) / s
            for (_, _, i, j) in weights.index]
    np.testing.assert_allclose(weights.to_numpy(), want, rtol=0, atol=1e-5)
    # the bias parts carry the rest; the parts sum to the model's score
    summed = rot.groupby(CELL).value.sum().sort_index()
    np.testing.assert_allclose(summed, _by_cell(df, "model_score"), rtol=0, atol=1e-5)
    assert rot[rot.part == "b_Q_dot_b_K"].value.abs().max() > 0.1


def test_alibi_part_is_the_slope_times_the_offset():
    model = _busy_model("alibi")
    df = score_parts(model, random_tokens(model, 1, 11, seed=9)[0], layers=0)
    al = df[(df.metric == "score_part") & (df.part == "alibi")]
    slopes = alibi_slopes(model.cfg.n_heads).numpy()
    np.testing.assert_allclose(al.value, slopes[al["head"]] * al.offset, rtol=1e-6, atol=1e-6)


def test_bias_only_head_is_the_bias_product():
    model = tiny_model("absolute", init_std=0.25)
    dh = model.cfg.d_head
    gen = torch.Generator().manual_seed(10)
    b_Q, b_K = torch.randn(dh, generator=gen), torch.randn(dh, generator=gen)
    _write(model, 0, 3, W_Q=torch.zeros(model.cfg.d_model, dh), W_K=torch.zeros(model.cfg.d_model, dh),
           b_Q=b_Q, b_K=b_K)
    df = score_parts(model, random_tokens(model, 1, 8, seed=11)[0], layers=0, heads=3)
    parts = df[df.metric == "score_part"].pivot_table(index=CELL, columns="part", values="value")
    want = float(b_Q.double() @ b_K.double()) / attn_scale(model, 0)
    np.testing.assert_allclose(parts["b_Q_dot_b_K"], want, rtol=1e-6)
    assert parts.drop(columns="b_Q_dot_b_K").abs().max().max() < 1e-9


def test_the_norm_bias_is_folded_into_the_bias_parts():
    # With b_Q = b_K = 0 and a LayerNorm bias b_ln, the query is (x̂ g + b_ln) W_Q: the
    # weight part must be x̂ W_Q^eff on the normalized residual (fold_ln's convention),
    # and b_ln W_Q a bias part. Checked against x̂ computed here from the embedding.
    model = tiny_model("nope", init_std=0.25)
    D, dh = model.cfg.d_model, model.cfg.d_head
    gen = torch.Generator().manual_seed(12)
    _write(model, 0, 0, b_Q=torch.zeros(dh), b_K=torch.zeros(dh))
    with torch.no_grad():
        model.blocks[0].ln1.b.copy_(0.5 * torch.randn(D, generator=gen))
        model.blocks[0].ln1.w.copy_(1 + 0.5 * torch.rand(D, generator=gen))
    tokens = random_tokens(model, 1, 9, seed=13)[0]
    df = score_parts(model, tokens, layers=0, heads=0)
    parts = df[df.metric == "score_part"].pivot_table(index=CELL, columns="part", values="value")
    content = parts[list(CHANNEL_PARTS)].sum(axis=1)
    x = model.W_E.detach().double()[tokens]  # NoPE: layer 0's input is the embedding
    centred = x - x.mean(-1, keepdim=True)
    xhat = centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + model.cfg.eps)
    g = model.blocks[0].ln1.w.detach().double()
    W_Q = model.blocks[0].attn.W_Q[0].detach().double()
    W_K = model.blocks[0].attn.W_K[0].detach().double()
    M = (g[:, None] * W_Q) @ (g[:, None] * W_K).T
    want = [float(xhat[i] @ M @ xhat[j]) / attn_scale(model, 0) for (_, _, i, j) in content.index]
    np.testing.assert_allclose(content.to_numpy(), want, rtol=0, atol=1e-5)
    assert parts["b_Q_dot_b_K"].abs().max() > 1e-3  # b_ln W_Q · b_ln W_K


def test_bad_input_names_the_parameter():
    model = tiny_model("nope")
    with pytest.raises(ValueError, match="one sequence"):
        score_parts(model, random_tokens(model, 2, 5))
    with pytest.raises(ValueError, match="layers must be integers"):
        score_parts(model, random_tokens(model, 1, 5)[0], layers=7)
    with pytest.raises(ValueError, match="queries must be integers"):
        score_parts(model, random_tokens(model, 1, 5)[0], queries=[5])


def test_exported_from_the_package():
    assert pi.score_parts is score_parts


@pytest.mark.parametrize("case", ["neox-pct-0.25-base-5e5", "llama-gqa", "opt"])
def test_loaded_checkpoints_partial_rotary_grouped_query_and_no_score_hook(case, tmp_path):
    # GPT-NeoX: partial rotary (an ``unrotated`` part) and attention biases; Llama: keys
    # shared by grouped-query heads; OPT on TL 4: no pre-softmax score hook, so the sums
    # are checked against the pattern instead (model_score NaN there).
    from tests.helpers import parity_cases, save_tiny_checkpoint, set_norm_gains

    arch, make, _ = parity_cases()[case]
    hf = set_norm_gains(save_tiny_checkpoint(arch, make(), tmp_path / "ck", sharpen=3.0))
    hf.save_pretrained(tmp_path / "ck")
    model, _ = pi.load_model(str(tmp_path / "ck"))
    df = score_parts(model, random_tokens(model, 1, 10, seed=14)[0])
    total, score = _by_cell(df, "score_total"), _by_cell(df, "model_score")
    parts = df[df.metric == "score_part"]
    for view in set(parts.view):
        np.testing.assert_allclose(parts[parts.view == view].groupby(CELL).value.sum().sort_index(),
                                   total, rtol=0, atol=1e-9)
    if score.notna().all():
        np.testing.assert_allclose(total, score, rtol=0, atol=1e-5)
    else:  # no score hook: softmax of each row of totals is the model's pattern
        pat = _by_cell(df, "pattern")
        rows = total.groupby(level=["layer", "head", "query"]).transform(
            lambda r: torch.tensor(r.to_numpy()).softmax(-1).numpy())
        np.testing.assert_allclose(rows, pat, rtol=0, atol=1e-5)
    assert ("unrotated" in set(parts.part)) == (case.startswith("neox"))


def test_dashboard_bound_shrinks_the_block_and_says_so():
    from posinterp.dashboard.explain import dashboard_score_parts

    model = tiny_model("alibi")
    tokens = random_tokens(model, 1, 12, seed=15)[0]
    rows = len(CHANNEL_PARTS) + len(BIAS_PARTS) + 3 + 1  # + alibi
    heads = model.cfg.n_layers * model.cfg.n_heads
    bound = heads * rows * 21  # room for 6 tokens (21 cells), not 7 (28)
    df, note = dashboard_score_parts(model, tokens, max_tokens=12, max_values=bound)
    assert df["query"].max() == 5 and df["key"].max() == 5
    assert "first 6 tokens" in note and f"{bound:,}" in note
    full, note = dashboard_score_parts(model, tokens, max_tokens=12)
    assert full["query"].max() == 11 and "bounded" not in note
    none, note = dashboard_score_parts(model, tokens, max_tokens=12, max_values=0)
    assert none is None and "no cell fits" in note


def test_inspect_heads_refuses_a_negative_bound_before_any_work():
    model = tiny_model("nope")
    with pytest.raises(ValueError, match="explain_values must be an integer >= 0"):
        pi.inspect_heads(model, random_tokens(model, 2, 6), explain_values=-1)
