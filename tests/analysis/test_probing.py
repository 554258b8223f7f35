import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.analysis.probing import (
    ProbeConfig,
    fit_probe,
    position_features,
    probe_positions,
    sequence_split,
)
from posinterp.analysis.variance import position_variance, variance_by_layer
from tests.helpers import random_tokens, tiny_model

FAST = ProbeConfig(hidden=32, max_epochs=150, patience=15)
N_SEQ, N_POS = 40, 24


def _positions():
    y = torch.arange(N_POS).repeat(N_SEQ)
    groups = torch.arange(N_SEQ).repeat_interleave(N_POS)
    return y, groups


def test_one_hot_position_is_recovered():
    y, groups = _positions()
    X = torch.nn.functional.one_hot(y, N_POS).float()
    res = fit_probe(X, y, groups, seed=0, config=FAST)
    assert res.pearson_r > 0.99 and res.nrmse < 0.05


def test_noise_stays_at_chance():
    y, groups = _positions()
    X = torch.randn(len(y), 8, generator=torch.Generator().manual_seed(0))
    res = fit_probe(X, y, groups, seed=0, config=FAST)
    chance = y.float().std(unbiased=False).item() / (N_POS - 1)  # NRMSE of predicting the mean
    assert abs(res.pearson_r) < 0.25 and res.nrmse > 0.9 * chance


def test_mask_only_control_reaches_only_what_the_mask_reveals():
    """On fixed-length sequences the mask encodes min(k, w) and nothing more: the probe's
    error is bounded below by the best predictor E[k | min(k, w)] (closed form), and for
    positions k >= w it cannot beat the mean."""
    w = 4
    resid = torch.randn(N_SEQ, N_POS, 16, generator=torch.Generator().manual_seed(1))
    X, y, groups = position_features(resid, kind="mask_only", window=w)
    assert X.shape == (N_SEQ * N_POS, w)
    res = fit_probe(X, y, groups, seed=0, config=FAST)
    yk = np.arange(N_POS, dtype=float)
    best = np.where(yk < w, yk, yk[w:].mean())
    oracle = np.sqrt(np.mean((best - yk) ** 2)) / (N_POS - 1)
    assert res.nrmse >= oracle - 0.01
    assert res.nrmse <= oracle + 0.05  # and it does learn what the mask allows


def test_split_keeps_each_sequence_in_one_part():
    _, groups = _positions()
    tr, va, te = sequence_split(groups, seed=3)
    assert (tr.int() + va.int() + te.int() == 1).all()
    for part in (tr, va, te):
        inside = set(groups[part].tolist())
        others = set(groups[~part].tolist())
        assert inside and not inside & others


def test_cosine_window_features_match_direct_similarities():
    resid = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(2))
    X, y, groups = position_features(resid, kind="cosine", window=3)
    assert X.shape == (12, 6)
    C = torch.nn.functional.cosine_similarity(resid[0, :, None], resid[0, None, :], dim=-1)
    row = X[4]  # sequence 0, position 4: C[4,3], C[4,2], C[4,1], then mask 1,1,1
    torch.testing.assert_close(row[:3], torch.stack([C[4, 3], C[4, 2], C[4, 1]]).float())
    assert row[3:].tolist() == [1, 1, 1]
    assert X[1].tolist()[1:] == [0, 0, 1, 0, 0]  # position 1: one valid offset


def test_left_padding_does_not_change_features():
    resid = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(3))
    padded = torch.cat([torch.randn(1, 3, 4), resid], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    for kind in ("cosine", "variance", "raw", "variance_window", "cosine_shuffled"):
        a, ya, _ = position_features(resid, kind=kind, window=2)
        b, yb, _ = position_features(padded, mask, kind=kind, window=2)
        torch.testing.assert_close(a, b)
        assert torch.equal(ya, yb)


def test_bad_inputs():
    with pytest.raises(ValueError, match="kind must be one of"):
        position_features(torch.zeros(1, 3, 2), kind="sinusoid")
    with pytest.raises(ValueError, match="at least 4 sequences"):
        sequence_split(torch.tensor([0, 0, 1]))


def test_variance_closed_form_and_model_table():
    act = torch.tensor([[[1.0, 3.0], [2.0, 2.0], [0.0, 4.0]]])
    torch.testing.assert_close(position_variance(act), torch.tensor([[1.0, 0.0, 4.0]],
                                                                    dtype=torch.float64))
    model = tiny_model("nope")
    df = variance_by_layer(model, random_tokens(model, 3, 10))
    assert set(df.layer) == {-1, 0, 1} and (df.value >= 0).all()
    assert df[df.hook == "blocks.0.hook_attn_out"].position.tolist() == list(range(10))


def test_probe_positions_table():
    model = tiny_model("nope")
    df = probe_positions(model, random_tokens(model, 9, 12), layers=[0],
                         features=("cosine", "mask_only"), seeds=(0,),
                         config=ProbeConfig(hidden=8, max_epochs=5))
    assert set(df.feature) == {"cosine", "mask_only"} and set(df.metric) == {"nrmse", "pearson_r"}


def _min_sequences(fractions):
    """Smallest n whose rounded split leaves every part non-empty (independent of the code)."""
    n = 1
    while True:
        sizes = [max(1, round(f * n)) for f in fractions[:2]]
        if n - sum(sizes) >= 1:
            return n
        n += 1


@pytest.mark.parametrize("fractions", [(0.6, 0.2, 0.2), (0.8, 0.1, 0.1), (0.34, 0.33, 0.33)])
def test_every_split_is_non_empty_or_refused(fractions):
    """Issue 11 case 11: 3 sequences gave a 0-sequence test split, then nrmse=nan, r=0.0."""
    need = _min_sequences(fractions)
    for n in range(1, need + 6):
        groups = torch.arange(n).repeat_interleave(4)
        if n < need:
            with pytest.raises(ValueError, match=f"at least {need} sequences"):
                sequence_split(groups, fractions=fractions)
        else:
            assert all(part.any() for part in sequence_split(groups, fractions=fractions))


def test_fit_probe_refuses_too_few_sequences():
    y = torch.arange(5).repeat(3)
    groups = torch.arange(3).repeat_interleave(5)
    with pytest.raises(ValueError, match="at least 4 sequences"):
        fit_probe(y[:, None].float(), y, groups, config=FAST)


def test_bad_fractions_and_constant_targets():
    groups = torch.arange(10).repeat_interleave(3)
    with pytest.raises(ValueError, match="fractions must be 3 positive numbers"):
        sequence_split(groups, fractions=(0.8, 0.2, 0.0))
    y = torch.zeros(30, dtype=torch.long)  # every token at position 0: NRMSE undefined
    with pytest.raises(ValueError, match="positions are all equal"):
        fit_probe(torch.randn(30, 2), y, groups, config=FAST)
    with pytest.raises(ValueError, match="X must be finite"):
        fit_probe(torch.full((30, 2), float("nan")), torch.arange(3).repeat(10), groups,
                  config=FAST)


def test_constant_prediction_gives_nan_r_not_zero():
    """r is undefined for a constant prediction; 0.0 would read as 'no position signal'."""
    y = torch.arange(N_POS).repeat(N_SEQ)
    groups = torch.arange(N_SEQ).repeat_interleave(N_POS)
    X = torch.zeros(len(y), 3)  # constant features: the probe can only predict a constant
    res = fit_probe(X, y, groups, seed=0, config=FAST)
    assert np.isnan(res.pearson_r) and np.isfinite(res.nrmse)


def test_feature_count_controls():
    """variance_window holds Var(x_{k-l}) at lag l (0 before the start) and the mask;
    cosine_shuffled is the cosine window's rows permuted among tokens, mask kept."""
    resid = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = 3
    X, y, _ = position_features(resid, kind="variance_window", window=w)
    var = resid.var(-1, unbiased=False).float()
    for n, k in enumerate(y.tolist()):
        b = n // 7
        want = [var[b, k - lag] if k - lag >= 0 else 0.0 for lag in range(w + 1)]
        torch.testing.assert_close(X[n, : w + 1], torch.tensor(want, dtype=torch.float32))
        assert X[n, w + 1:].tolist() == [float(k - o >= 0) for o in range(1, w + 1)]
    cos, _, _ = position_features(resid, kind="cosine", window=w)
    shuf, _, _ = position_features(resid, kind="cosine_shuffled", window=w)
    assert shuf.shape == cos.shape and torch.equal(shuf[:, w:], cos[:, w:])
    assert not torch.equal(shuf[:, :w], cos[:, :w])
    assert sorted(map(tuple, shuf[:, :w].tolist())) == sorted(map(tuple, cos[:, :w].tolist()))


def test_feature_constant_on_train_does_not_blow_up_test():
    """A column that is 0 on every train item but not on test items must not be divided
    by ~0: the probe's error stays on the scale of the positions."""
    y = torch.arange(10).repeat(6)
    groups = torch.arange(6).repeat_interleave(10)
    X = torch.stack([y.float(), torch.zeros(60)], 1)
    tr, _, te = sequence_split(groups, seed=0)
    X[te, 1] = 5.0  # only test sequences have it
    res = fit_probe(X, y, groups, seed=0, config=ProbeConfig(hidden=8, max_epochs=50))
    assert res.nrmse < 1.0


def test_variance_matched_has_the_cosine_windows_count_and_lagged_variances():
    """2w features, like the cosine window: Var(x_{k-l}) for l < w (0 before the start),
    then the same validity mask as the cosine window."""
    resid = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    w = 3
    X, y, _ = position_features(resid, kind="variance_matched", window=w)
    cos, _, _ = position_features(resid, kind="cosine", window=w)
    assert X.shape == cos.shape == (14, 2 * w)
    var = resid.var(-1, unbiased=False).float()
    for n, k in enumerate(y.tolist()):
        b = n // 7
        want = [var[b, k - lag] if k - lag >= 0 else 0.0 for lag in range(w)]
        torch.testing.assert_close(X[n, :w], torch.tensor(want, dtype=torch.float32))
    assert torch.equal(X[:, w:], cos[:, w:])


def test_ridge_probe_is_the_augmented_least_squares_solution():
    """Against an independent solution: ridge = least squares on [Z; sqrt(a) I] with the
    intercept unpenalized (centred target), one alpha given."""
    from posinterp.analysis.probing import fit_ridge_probe

    y, groups = _positions()
    gen = torch.Generator().manual_seed(3)
    X = torch.stack([y.float() + torch.randn(len(y), generator=gen) * 3,
                     torch.randn(len(y), generator=gen)], 1)
    alpha = 10.0
    res = fit_ridge_probe(X, y, groups, seed=1, alphas=(alpha,))
    tr, _, te = (m.numpy() for m in sequence_split(groups, 1))
    Xd, yd = X.double().numpy(), y.double().numpy()
    mu, sd = Xd[tr].mean(0), Xd[tr].std(0)
    Z = (Xd - mu) / sd
    A = np.vstack([Z[tr], np.sqrt(alpha) * np.eye(2)])
    b = np.concatenate([yd[tr] - yd[tr].mean(), np.zeros(2)])
    w = np.linalg.lstsq(A, b, rcond=None)[0]
    pred = Z[te] @ w + yd[tr].mean()
    want = np.sqrt(np.mean((pred - yd[te]) ** 2)) / (yd.max() - yd.min())
    assert abs(res.nrmse - want) < 1e-9 and res.epochs == 0
    with pytest.raises(ValueError, match="alphas must be positive"):
        fit_ridge_probe(X, y, groups, alphas=(0.0,))


def test_null_nrmse_is_the_train_mean_predictor():
    from posinterp.analysis.probing import null_nrmse

    y, groups = _positions()
    tr, _, te = sequence_split(groups, 0)
    want = float(((y[te].double() - y[tr].double().mean()) ** 2).mean().sqrt()) / (N_POS - 1)
    assert abs(null_nrmse(y, groups, 0) - want) < 1e-12
    # a probe that reads the position itself beats it; one that reads noise does not by much
    ridge = __import__("posinterp.analysis.probing", fromlist=["x"]).fit_ridge_probe
    assert ridge(y[:, None].float(), y, groups).nrmse < 1e-6 < want


def test_probe_positions_families_and_null_rows():
    model = tiny_model("nope")
    df = probe_positions(model, random_tokens(model, 9, 12), layers=[-1, 0],
                         features=("cosine",), seeds=(0,), families=("ridge", "mlp"),
                         config=ProbeConfig(hidden=8, max_epochs=5), null=True)
    assert set(df.probe) == {"ridge", "mlp", "constant"}
    null = df[df.feature == "no_feature"]
    assert len(null) == 1 and null.layer.tolist() == [-1] and null.metric.tolist() == ["nrmse"]
    with pytest.raises(ValueError, match="families must be"):
        probe_positions(model, random_tokens(model, 9, 12), families=("svm",))


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_probe_positions_inside_no_grad_and_inference_mode(context):
    """Notebook users wrap analysis code in these; the probe's training enables gradients
    locally and gives the same numbers as outside them."""
    model = tiny_model("nope")
    toks = random_tokens(model, 9, 12)
    kw = dict(layers=[0], features=("cosine",), seeds=(0,), config=ProbeConfig(hidden=8, max_epochs=5))
    outside = probe_positions(model, toks, **kw)
    with getattr(torch, context)():
        inside = probe_positions(model, toks, **kw)
        assert not torch.is_grad_enabled()  # the caller's context is left as it was
    pd.testing.assert_frame_equal(inside, outside)
