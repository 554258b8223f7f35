"""RoPE frequency profile and positional/symbolic score: closed forms, invariances, and an
independent dense computation (docs/frequencies.md)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.analysis.frequencies import (
    _check_logits,
    _rotated_logits,
    pair_energy_shares,
    pair_indices,
    positional_symbolic_score,
    rope_frequency_profile,
)
from posinterp.analysis.spectral import effective_weights, rotary_matrix
from posinterp.models import build_model, preset
from posinterp.models.toy import toy_state_dict
from tests.helpers import random_tokens, tiny_model


def _toy(edit=None, **overrides):
    """A toy RoPE model (HookedTransformer on TL 3.9, bridge on TL 4) whose TL-named
    weights ``edit(sd)`` changed before loading, the same on either line."""
    from posinterp.models.backend import TL_MAJOR

    config = preset("tiny", pe="rotary", **overrides)
    model = build_model(config)
    if edit is not None:
        sd = toy_state_dict(config)
        with torch.no_grad():
            edit(sd)
        if TL_MAJOR >= 4:
            from posinterp.models.native import load_tl_state_dict

            class Unwrapped:  # the native model's parameter names, without the bridge's wrappers
                pos = model.original_model.pos

                def named_parameters(self):
                    return ((n.replace("._original_component", ""), p)
                            for n, p in model.original_model.named_parameters())

            with torch.no_grad():
                load_tl_state_dict(Unwrapped(), sd, config.n_layers)
        else:
            model.load_state_dict(sd, strict=False)
    return model


def _dense_shares(W_Q, W_K, R, first, second, unrot):
    """||W_Q D_p R D_p W_K^T||_F^2 shares with d_model x d_model matrices (D_p: projector)."""
    d_head = W_Q.shape[-1]
    blocks = [[int(a), int(b)] for a, b in zip(first, second, strict=True)]
    if len(unrot):
        blocks.append([int(u) for u in unrot])
    energies, parts = [], []
    for dims in blocks:
        D = torch.zeros(d_head, d_head, dtype=torch.float64)
        D[dims, dims] = 1.0
        M_p = W_Q @ D @ R @ D @ W_K.mT
        parts.append(M_p)
        energies.append(M_p.square().sum((-2, -1)))
    e = torch.stack(energies, -1)
    return e / e.sum(-1, keepdim=True), sum(parts)


def _values(df, metric, head, offset=None):
    sub = df[(df.metric == metric) & (df["head"] == head)]
    sub = sub[sub.offset.isna()] if offset is None else sub[sub.offset == offset]
    return sub.sort_values("pair", na_position="last").value.to_numpy()


def _weights(n_heads=3, d_model=16, d_head=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_heads, d_model, d_head, generator=gen, dtype=torch.float64),
            torch.randn(n_heads, d_model, d_head, generator=gen, dtype=torch.float64))


INV = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)


@pytest.mark.parametrize("adjacent", [False, True])
def test_head_living_in_one_pair_reports_all_its_energy_there(adjacent):
    first, second, unrot = pair_indices(8, 8, adjacent)
    W_Q, W_K = _weights(n_heads=2)
    for W in (W_Q, W_K):
        for h, p in ((0, 1), (1, 3)):
            keep = W[h][:, [first[p], second[p]]].clone()
            W[h].zero_()
            W[h][:, [first[p], second[p]]] = keep
    out = pair_energy_shares(W_Q, W_K, first, second, unrot, INV, offsets=(0, -1, 5))
    for h, p in ((0, 1), (1, 3)):
        expected = torch.eye(5, dtype=torch.float64)[p]  # 4 pairs + the (empty) unrotated block
        torch.testing.assert_close(out["W_Q"][h], expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(out["W_K"][h], expected, atol=1e-12, rtol=0)
        for t in range(3):
            torch.testing.assert_close(out["qk"][h, t], expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("adjacent, rotary_dim", [(False, 8), (True, 8), (False, 4), (True, 6)])
def test_shares_sum_to_one_and_match_the_dense_form(adjacent, rotary_dim):
    first, second, unrot = pair_indices(8, rotary_dim, adjacent)
    inv = 500.0 ** (-torch.arange(rotary_dim // 2, dtype=torch.float64) / (rotary_dim // 2))
    W_Q, W_K = _weights(seed=rotary_dim + adjacent)
    offsets = (0, -1, 3)
    out = pair_energy_shares(W_Q, W_K, first, second, unrot, inv, offsets)
    for key in ("W_Q", "W_K", "qk"):
        torch.testing.assert_close(out[key].sum(-1), torch.ones_like(out[key].sum(-1)))
    for t, off in enumerate(offsets):
        R = rotary_matrix(8, rotary_dim, -off, adjacent_pairs=adjacent, inv_freq=inv)
        dense, M_sum = _dense_shares(W_Q, W_K, R, first, second, unrot)
        torch.testing.assert_close(M_sum, W_Q @ R @ W_K.mT)  # the pairs add up to M(Δ)
        n = len(first) + (1 if len(unrot) else 0)
        torch.testing.assert_close(out["qk"][:, t, :n], dense, atol=1e-12, rtol=1e-10)
    # W_Q shares are column-energy shares
    col = W_Q.square().sum(-2)
    torch.testing.assert_close(out["W_Q"][..., 0], (col[..., first[0]] + col[..., second[0]]) / col.sum(-1))


def test_shares_do_not_depend_on_the_pairing_convention():
    W_Q, W_K = _weights(seed=7)
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # adjacent dim 2p <- split p, 2p+1 <- p + 4
    split = pair_energy_shares(W_Q, W_K, *pair_indices(8, 8, False), INV, (0, -1, 2))
    adj = pair_energy_shares(W_Q[..., perm], W_K[..., perm], *pair_indices(8, 8, True), INV, (0, -1, 2))
    for key in split:
        torch.testing.assert_close(split[key], adj[key], atol=1e-14, rtol=0)
    # ... and the permuted weights are the same head: same scores at every offset
    for off in (0, -1, 2):
        R_s = rotary_matrix(8, 8, -off, adjacent_pairs=False, inv_freq=INV)
        R_a = rotary_matrix(8, 8, -off, adjacent_pairs=True, inv_freq=INV)
        torch.testing.assert_close(W_Q @ R_s @ W_K.mT, W_Q[..., perm] @ R_a @ W_K[..., perm].mT)


def test_partial_rotary_row_and_frequencies():
    first, second, unrot = pair_indices(8, 4, False)
    assert unrot.tolist() == [4, 5, 6, 7]
    W_Q, W_K = _weights(n_heads=1)
    W_Q[..., :4], W_K[..., :4] = 0.0, 0.0  # the head lives in the unrotated dims
    out = pair_energy_shares(W_Q, W_K, first, second, unrot, INV[:2], (0, -1))
    for key in ("W_Q", "W_K"):
        torch.testing.assert_close(out[key][0], torch.tensor([0.0, 0, 1], dtype=torch.float64))
    torch.testing.assert_close(out["qk"][0], torch.tensor([[0.0, 0, 1]] * 2, dtype=torch.float64))
    zero = pair_energy_shares(0 * W_Q, 0 * W_K, first, second, unrot, INV[:2])
    assert (zero["qk"] == 0).all() and (zero["W_Q"] == 0).all()  # 0, not NaN


def test_profile_table_rows_frequencies_and_periods():
    model = _toy()
    df = rope_frequency_profile(model, offsets=(0, -1))
    cfg = model.cfg
    assert set(df.metric) == {"W_Q", "W_K", "qk"}
    assert df[df.metric != "qk"].offset.isna().all() and set(df[df.metric == "qk"].offset) == {0, -1}
    assert df.pair.notna().all()  # full rotary: no unrotated row
    assert len(df) == cfg.n_layers * cfg.n_heads * (cfg.d_head // 2) * 4
    sums = df.groupby(["layer", "head", "metric", "offset"], dropna=False).value.sum()
    np.testing.assert_allclose(sums.to_numpy(), 1.0, atol=1e-12)
    one = df[(df.layer == 0) & (df["head"] == 0) & (df.metric == "W_Q")].sort_values("pair")
    half = cfg.d_head // 2
    theta = np.array([10000.0 ** (-p / half) for p in range(half)])
    np.testing.assert_allclose(one.frequency.to_numpy(), theta, rtol=1e-6)
    np.testing.assert_allclose(one.period.to_numpy(), 2 * math.pi / theta, rtol=1e-6)


def test_grouped_query_heads_share_the_key_profile(tmp_path):
    import transformers

    import posinterp as pi
    from tests.helpers import save_tiny_checkpoint, tiny_hf_configs

    save_tiny_checkpoint("LlamaForCausalLM", tiny_hf_configs()["llama-gqa"], tmp_path / "ck")
    model, info = pi.load_model(tmp_path / "ck", fold_ln=False, center_writing_weights=False,
                                center_unembed=False, fold_value_biases=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ck"), local_files_only=True)
    df = rope_frequency_profile(model, layers=0)
    H, kv, dh = info.n_heads, info.n_kv_heads, info.d_head
    attn = hf.model.layers[0].self_attn
    g = hf.model.layers[0].input_layernorm.weight.detach().double()
    inv = hf.model.rotary_emb.inv_freq.double()
    first, second, unrot = pair_indices(dh, dh, False)  # HF Llama: split halves
    for h in range(H):
        grp = h // (H // kv)
        W_Q = attn.q_proj.weight.detach().double()[h * dh:(h + 1) * dh].T * g[:, None]
        W_K = attn.k_proj.weight.detach().double()[grp * dh:(grp + 1) * dh].T * g[:, None]
        ref = pair_energy_shares(W_Q, W_K, first, second, unrot, inv, (0, -1))
        np.testing.assert_allclose(_values(df, "W_K", h), ref["W_K"][:-1].numpy(), atol=1e-6)
        np.testing.assert_allclose(_values(df, "qk", h, -1), ref["qk"][1, :-1].numpy(), atol=1e-6)
    toks = random_tokens(model, 3, 10)
    s = positional_symbolic_score(model, toks, layers=0)  # hook_k holds the KV heads only
    assert s[s.metric == "positional_score"].value.between(0, 1).all()


def test_toy_profile_equals_the_pure_weights_on_either_transformerlens():
    """build_model gives a HookedTransformer (TL 3.9) or a bridge (TL 4) with the weights of
    toy_state_dict: the profile must be the one computed from those weights directly."""
    config = preset("tiny", pe="rotary")
    df = rope_frequency_profile(build_model(config), offsets=(0, -1))
    sd = toy_state_dict(config)
    d_head = config.d_head
    first, second, unrot = pair_indices(d_head, d_head, False)
    for layer in range(config.n_layers):
        g = sd[f"blocks.{layer}.ln1.w"]
        W_Q = effective_weights(sd[f"blocks.{layer}.attn.W_Q"], g, center=True)
        W_K = effective_weights(sd[f"blocks.{layer}.attn.W_K"], g, center=True)
        for off in (0, -1):
            R = rotary_matrix(d_head, d_head, -off, base=config.rotary_base)
            dense, _ = _dense_shares(W_Q, W_K, R, first, second, unrot)
            sub = df[(df.layer == layer) & (df.metric == "qk") & (df.offset == off)]
            got = sub.sort_values(["head", "pair"]).value.to_numpy().reshape(config.n_heads, -1)
            np.testing.assert_allclose(got, dense.numpy(), atol=1e-10)


@pytest.mark.parametrize("pe", ["absolute", "alibi", "nope"])
def test_non_rotary_models_are_refused_by_scheme(pe):
    model = tiny_model(pe)
    with pytest.raises(ValueError, match="rotary.*positional scheme is '(standard|alibi)'"):
        rope_frequency_profile(model)
    with pytest.raises(ValueError, match="positional scheme is"):
        positional_symbolic_score(model, random_tokens(model, 2, 8))


def test_bad_arguments_name_the_parameter():
    model = tiny_model("rotary")
    with pytest.raises(ValueError, match="offsets"):
        rope_frequency_profile(model, offsets=(0.5,))
    with pytest.raises(ValueError, match="layers"):
        rope_frequency_profile(model, layers=[7])
    with pytest.raises(ValueError, match="weights"):
        rope_frequency_profile(model, weights="raw")
    toks = random_tokens(model, 2, 8)
    with pytest.raises(ValueError, match="min_keys"):
        positional_symbolic_score(model, toks, min_keys=1)
    with pytest.raises(ValueError, match="key_start"):
        positional_symbolic_score(model, toks, key_start=-1)
    with pytest.raises(ValueError, match="min_keys=2"):
        positional_symbolic_score(model, toks[:, :3], key_start=2)


# --- positional vs symbolic ---------------------------------------------------------------------

TARGET = 7


def _constructed_heads():
    """Toy, 1 layer, 4 heads of d_head 8 (split halves), base 1e12 so θ = 1, 1e-3, 1e-6, 1e-9.
    Head 0 attends to offset -1 whatever the tokens (constant q, k in the fastest pair);
    head 1 attends to token TARGET wherever it is (weights in the slowest pair, which turns
    by at most 2e-8 rad in 16 tokens); heads 2, 3 keep their random initial weights."""
    def edit(sd):
        W_Q, W_K = sd["blocks.0.attn.W_Q"], sd["blocks.0.attn.W_K"]
        b_Q, b_K = sd["blocks.0.attn.b_Q"], sd["blocks.0.attn.b_K"]
        for t in (W_Q, W_K, b_Q, b_K):
            t[:2] = 0.0
        b_Q[0, 0] = 4.0  # pair 0 = dims (0, 4)
        # k = b_Q R(1) (row vectors): q_i R(i) · k R(j) = 16 cos(i - j - 1), largest at j = i - 1.
        b_K[0, 0], b_K[0, 4] = 4.0 * math.cos(1.0), 4.0 * math.sin(1.0)
        e = sd["embed.W_E"][TARGET].double()
        u = (e - e.mean()) / e.var(unbiased=False).add(1e-5).sqrt()  # ln1's output for TARGET
        W_K[1][:, 3] = (6.0 * u / u.square().sum()).float()  # pair 3 = dims (3, 7)
        b_Q[1, 3] = 4.0
        gen = torch.Generator().manual_seed(5)
        W_Q[1][:, 7] = 0.1 * torch.randn(32, generator=gen)
        W_K[1][:, 7] = 0.1 * torch.randn(32, generator=gen)

    return _toy(edit, n_layers=1, rotary_base=10**12)


def test_constructed_heads_attend_as_built():
    model = _constructed_heads()
    toks = random_tokens(model, 4, 16, seed=2)
    toks[:, 5] = TARGET
    from posinterp.models.backend import run_cached

    pattern = run_cached(model, toks, None, lambda n: n == "blocks.0.attn.hook_pattern")[
        "blocks.0.attn.hook_pattern"]  # [batch, head, query, key]
    i = torch.arange(1, 16)
    assert (pattern[:, 0, i].argmax(-1) == i - 1).all()
    hit = pattern[:, 1, 6:].argmax(-1)  # queries after the TARGET
    assert (toks.gather(1, hit) == TARGET).all()


def test_positional_and_symbolic_heads_separate():
    model = _constructed_heads()
    toks = random_tokens(model, 12, 16, seed=3)
    df = positional_symbolic_score(model, toks, seed=0)
    score = df[df.metric == "positional_score"].set_index("head")
    res = df.set_index(["metric", "head"]).value
    assert score.value[0] > 1 - 1e-6
    assert res["positional_residual", 0] < 1e-6 * res["symbolic_residual", 0]
    assert score.value[1] < 1e-6
    assert res["symbolic_residual", 1] < 1e-6 * res["positional_residual", 1]
    for h in (2, 3):  # random heads are neither
        assert 0.01 < score.value[h] < 0.99
    assert (score.n_sequences == 12).all()
    assert (score.ci_low <= score.value).all() and (score.value <= score.ci_high).all()


def test_score_is_seeded_and_checked_against_the_model_on_the_toy():
    model = build_model(preset("tiny", pe="rotary"))  # a bridge on TransformerLens 4
    toks = random_tokens(model, 4, 12)
    a = positional_symbolic_score(model, toks, seed=1, key_start=1)
    b = positional_symbolic_score(model, toks, seed=1, key_start=1)
    pd.testing.assert_frame_equal(a, b)
    s = a[a.metric == "positional_score"].value
    assert ((s >= 0) & (s <= 1)).all() and len(s) == 2 * 4


def test_reconstruction_check_catches_scores_it_cannot_reproduce():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 2, 4, generator=gen), torch.randn(1, 6, 2, 4, generator=gen)
    first, second, _ = pair_indices(4, 4, False)
    inv = torch.tensor([1.0, 0.01], dtype=torch.float64)
    pos = torch.arange(6)
    from posinterp.analysis.frequencies import rotate

    scores = torch.einsum("bihd,bjhd->bhij", rotate(q, pos[None, :, None], first, second, inv),
                          rotate(k, pos[None, :, None], first, second, inv)) / 2.0
    _check_rotated(q, k, scores, first, second, inv, 2.0, 1e-9, 0, ValueError)
    unrotated = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / 2.0
    with pytest.raises(ValueError, match="do not reproduce"):
        _check_rotated(q, k, unrotated, first, second, inv, 2.0, 1e-3, 0, ValueError)


def test_bfloat16_model_passes_the_check_and_agrees_with_float32():
    config = preset("tiny", pe="rotary", init_std=0.3)
    low, full = build_model(config, dtype=torch.bfloat16), build_model(config)
    toks = random_tokens(full, 4, 24)
    a = positional_symbolic_score(low, toks)
    b = positional_symbolic_score(full, toks)
    score = a.metric == "positional_score"
    np.testing.assert_allclose(a[score].value, b[score].value, atol=0.05)


@pytest.mark.parametrize("adjacent, rotary_dim, key_start", [(False, 8, 0), (True, 8, 1),
                                                             (False, 6, 0), (True, 4, 2)])
def test_permuted_logits_equal_rotating_each_permuted_key(adjacent, rotary_dim, key_start):
    """The pair-product form of the permuted logits equals the definition: each permuted
    key rotated to its new position j, dotted with the rotated query (partial rotary too)."""
    from posinterp.analysis.frequencies import pair_indices, positional_symbolic_from_qk, rotate

    g = torch.Generator().manual_seed(1)
    H, n, d = 3, 11, 8
    q = torch.randn(H, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(H, n, d, generator=g, dtype=torch.float64)
    first, second, _ = pair_indices(d, rotary_dim, adjacent)
    inv_freq = 10000.0 ** (-torch.arange(len(first), dtype=torch.float64) * 2 / rotary_dim)
    got = positional_symbolic_from_qk(q, k, first, second, inv_freq, 2.0,
                                      torch.Generator().manual_seed(5), key_start)
    # the definition, with the same permutations (same generator draws)
    pos = torch.arange(n)
    i, j = pos[:, None], pos[None, :]
    window = (j >= key_start) & (j <= i)
    r = torch.rand(n, n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    order = torch.argsort(torch.where(window, r, 2.0 + j.double()), dim=-1)
    sigma = torch.where(window, order.gather(-1, (j - key_start).clamp(0, n - 1).expand(n, n)),
                        j.expand(n, n))
    q_rot = rotate(q, pos[None], first, second, inv_freq)
    logits = torch.einsum("hid,hjd->hij", q_rot, rotate(k, pos[None], first, second, inv_freq)) / 2.0
    l_perm = torch.einsum("hid,hijd->hij", q_rot,
                          rotate(k[:, sigma], pos[None, None, :], first, second, inv_freq)) / 2.0
    keep = (window & (window.sum(-1) >= 2)[:, None]).expand(H, n, n)

    def rms(x):
        return torch.sqrt(torch.where(keep, x, 0.0).square().sum((-2, -1)) / keep[0].sum())

    d_pos, d_sym = rms(l_perm - logits), rms(l_perm - logits.gather(-1, sigma.expand(H, n, n)))
    torch.testing.assert_close(got["positional_residual"], d_pos, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["symbolic_residual"], d_sym, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["positional_score"], d_sym / (d_pos + d_sym), rtol=1e-12,
                               atol=1e-12)


@pytest.mark.parametrize("d, rotary_dim, adjacent", [(64, 64, False), (64, 64, True), (16, 8, False)])
def test_rotate_is_the_pairwise_formula_bit_for_bit_at_any_size(d, rotary_dim, adjacent):
    """rotate's one-pass form (large inputs) equals a c - b s, b c + a s written pair by
    pair, exactly: the positional score and the model check compare logits built from it."""
    from posinterp.analysis.frequencies import pair_indices, rotate

    g = torch.Generator().manual_seed(0)
    first, second, _ = pair_indices(d, rotary_dim, adjacent)
    inv = 1e4 ** (-torch.arange(len(first), dtype=torch.float64) * 2 / rotary_dim)
    for shape in ((2, 5, d), (4, 9, 64, d)):  # below and above the one-pass threshold
        x = torch.randn(*shape, generator=g)
        pos = torch.arange(shape[-2])
        xx = x.double()
        ang = pos.double()[..., None] * inv
        c, s = torch.cos(ang), torch.sin(ang)
        want = xx.clone()
        want[..., first] = xx[..., first] * c - xx[..., second] * s
        want[..., second] = xx[..., second] * c + xx[..., first] * s
        assert torch.equal(rotate(x, pos, first, second, inv), want)


def _check_rotated(q, k, scores, first, second, inv, scale, tol, layer, error, is_pattern=False):
    """The model check of positional_symbolic_score on ``[batch, pos, head, d_head]`` q, k."""
    logits = _rotated_logits(q.transpose(1, 2), k.transpose(1, 2), first, second, inv, scale)[2]
    _check_logits(logits, scores, tol, layer, error, is_pattern=is_pattern)
