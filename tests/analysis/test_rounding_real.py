"""A real eigenvalue pair that rounding splits is still real (issue 22, item 4).

B = S J S^-1 with J holding a defective real block [[a, 1], [0, a]], a true rotation
block, and two simple real eigenvalues; S is a random conjugation. In exact arithmetic
B has exactly one complex pair; in float64 the defective block's double eigenvalue a
often comes out as a +- i*delta with delta near sqrt(machine eps). Every measure and
every channel must still see one complex pair, in every conjugation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posinterp.analysis.channels import channel_projectors
from posinterp.analysis.spectral import channel_masses, eigenvalues, rotational_measures

A, R, THETA, SIMPLE = 1.3, 0.9, 0.7, (-0.6, 0.4)
D_MODEL = 12


def _jordan(a=A, r=R, theta=THETA):
    J = np.zeros((6, 6))
    J[:2, :2] = [[a, 1.0], [0.0, a]]  # defective: one eigenvector for the double eigenvalue a
    J[2:4, 2:4] = r * np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    J[4, 4], J[5, 5] = SIMPLE
    return J


def _weights(J, seed):
    """W_Q, W_K ([d_model, d_head]) with W_K^T W_Q = S J S^-1 for a random S."""
    rng = np.random.default_rng(seed)
    S = rng.standard_normal(J.shape)
    B = S @ J @ np.linalg.inv(S)
    U, _ = np.linalg.qr(rng.standard_normal((D_MODEL, J.shape[0])))  # orthonormal columns
    return torch.from_numpy(U @ B), torch.from_numpy(U), B


def _closed_form_mass(r=R, a=A):
    return 2 * r / (2 * abs(a) + 2 * r + sum(abs(s) for s in SIMPLE))


SEEDS = range(50)


def test_rounding_splits_the_defective_pair_in_some_conjugations():
    """The fault is real: raw float64 eig gives a complex pair above eps * max|λ|."""
    split = 0
    for seed in SEEDS:
        _, _, B = _weights(_jordan(), seed)
        lam = np.linalg.eigvals(B)
        near_a = lam[np.abs(lam.real - A) < 1e-3]
        split += bool((np.abs(near_a.imag) > 1e-8 * np.abs(lam).max()).any())
    assert split >= 1


@pytest.mark.parametrize("seed", SEEDS)
def test_one_complex_pair_under_every_conjugation(seed):
    W_Q, W_K, B = _weights(_jordan(), seed)
    lam = eigenvalues(W_Q, W_K)
    m = rotational_measures(lam)
    assert m["n_complex_pairs"].item() == 1
    assert m["rotational_mass"].item() == pytest.approx(_closed_form_mass(), rel=1e-6)
    masses = channel_masses(lam)
    assert masses["complex"].item() == pytest.approx(_closed_form_mass(), rel=1e-6)
    P = channel_projectors(torch.from_numpy(B))
    # trace of a spectral projector = number of eigenvalues in its channel
    assert round(float(torch.trace(P["complex"]))) == 2
    assert round(float(torch.trace(P["positive_real"]))) == 3  # a, a, 0.4
    assert round(float(torch.trace(P["negative_real"]))) == 1


@pytest.mark.parametrize("theta", [1e-5, 1e-6])
def test_a_true_rotation_by_a_small_angle_stays_complex(theta):
    """The tolerance is a backward error, not a wider eps: a pair that no nearby real
    matrix explains stays complex, however small its angle (|Im λ| = r sin θ >> eps)."""
    for seed in range(5):
        W_Q, W_K, _ = _weights(_jordan(theta=theta), seed)
        assert rotational_measures(eigenvalues(W_Q, W_K))["n_complex_pairs"].item() == 1
