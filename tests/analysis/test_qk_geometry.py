"""Symmetry and directionality of M = W_Q W_K^T from d_head-sized products (Saponati et al. 2025):
closed forms, and equality with the dense d_model x d_model computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posinterp.analysis.spectral import (
    antisymmetric_energy,
    directionality_score,
    qk_geometry,
    qk_weights,
    symmetry_score,
)
from tests.helpers import tiny_model


def _gauss(n_heads, d_model, d_head, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_heads, d_model, d_head, generator=gen, dtype=torch.float64),
            torch.randn(n_heads, d_model, d_head, generator=gen, dtype=torch.float64))


def _dense_symmetry(M):
    return (M * M.mT).sum((-2, -1)) / M.square().sum((-2, -1))  # tr(M M) / tr(M M^T)


def _dense_directionality(A, num_std=2.0):
    """attention-geometry's directionality_score on the formed matrix, one head."""
    rows, cols = torch.norm(A, dim=1), torch.norm(A, dim=0)
    rt, ct = rows.mean() + num_std * rows.std(), cols.mean() + num_std * cols.std()
    re, ce = (rows[rows > rt] - rt).sum(), (cols[cols > ct] - ct).sum()
    return 0.0 if re + ce == 0 else float((ce - re) / (ce + re))


def test_symmetric_and_skew_forms():
    W_Q, _ = _gauss(4, 12, 6)
    A = torch.randn(6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sym = symmetry_score(W_Q, W_Q @ (A + A.T))  # M = Q S Q^T, symmetric
    torch.testing.assert_close(sym, torch.ones(4, dtype=torch.float64))
    skew = symmetry_score(W_Q, W_Q @ (A - A.T))  # M = Q N^T Q^T, skew
    torch.testing.assert_close(skew, -torch.ones(4, dtype=torch.float64))
    assert (symmetry_score(0 * W_Q, W_Q) == 0).all()  # M = 0: 0, not NaN
    assert (directionality_score(0 * W_Q, W_Q) == 0).all()


@pytest.mark.parametrize("d_model", [32, 256])
def test_random_gaussian_heads_are_near_zero_symmetry(d_model):
    W_Q, W_K = _gauss(400, d_model, 8, seed=2)
    s = symmetry_score(W_Q, W_K)
    # Independent Gaussian factors: E tr(M M) = d_model d_head, E ||M||^2 = d_model^2 d_head,
    # so s is near 1/d_model; the mean is within 4 standard errors of it.
    assert abs(float(s.mean()) - 1 / d_model) < 4 * float(s.std()) / 400 ** 0.5
    assert float(s.abs().mean()) < 4 / d_model ** 0.5


@pytest.mark.parametrize("d_model, d_head", [(8, 4), (16, 16), (24, 6)])
def test_equal_to_the_dense_computation(d_model, d_head):
    W_Q, W_K = _gauss(6, d_model, d_head, seed=d_model)
    with torch.no_grad():  # a few heavy key-side rows, so directionality is not 0
        W_K[:3, 0] *= 30.0
        W_Q[3:, 1] *= 30.0
    M = W_Q @ W_K.mT
    torch.testing.assert_close(symmetry_score(W_Q, W_K), _dense_symmetry(M))
    torch.testing.assert_close(symmetry_score(W_Q, W_K), 1 - 2 * antisymmetric_energy(W_Q, W_K))
    got = directionality_score(W_Q, W_K)
    want = torch.tensor([_dense_directionality(M[h]) for h in range(6)], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    assert (got[:3] > 0).all() and (got[3:] < 0).all()  # heavy key side: column dominance


def test_directionality_flips_with_the_transpose():
    W_Q, W_K = _gauss(50, 16, 4, seed=3)
    torch.testing.assert_close(directionality_score(W_K, W_Q), -directionality_score(W_Q, W_K))
    torch.testing.assert_close(symmetry_score(W_K, W_Q), symmetry_score(W_Q, W_K))


@pytest.mark.parametrize("pe", ["rotary", "absolute"])
def test_model_table_matches_the_pure_scores(pe):
    model = tiny_model(pe)
    df = qk_geometry(model)
    assert set(df.metric) == {"symmetry", "directionality"}
    offsets = [0, -1] if pe == "rotary" else [None]
    for off in offsets:
        for layer in range(model.cfg.n_layers):
            W_Q, W_K = qk_weights(model, layer, off)
            sub = df[(df.layer == layer) & ((df.offset == off) if off is not None else df.offset.isna())]
            for metric, fn in (("symmetry", symmetry_score), ("directionality", directionality_score)):
                got = sub[sub.metric == metric].sort_values("head").value.to_numpy()
                np.testing.assert_allclose(got, fn(W_Q, W_K).numpy(), atol=1e-12)
    with pytest.raises(ValueError, match="must both be"):
        symmetry_score(torch.zeros(3, 2), torch.zeros(3, 4))
