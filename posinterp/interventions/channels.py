"""Spectral channels of a QK circuit and their projectors (docs/concepts.md, "Spectral channels").

For head h, B = W_K^T W_Q (d_head x d_head) carries the nonzero spectrum of
M = W_Q W_K^T. Its eigenvalues fall into channels: ``positive_real``, ``negative_real``,
``complex`` (conjugate pairs, the rotational channel) and the null channel (|λ| ~ 0),
which belongs to none. Π_c is B's spectral projector onto channel c along the others:
real (pairs are kept together), Π_c B = B Π_c, Π_c^2 = Π_c and Σ_c Π_c = I - Π_null.
The channel's part of the circuit is M_c = W_Q Π_c W_K^T, whose content score is
q_i Π_c k_j^T, so removing c scores with q_i (I - Π_c) k_j^T and keeps every shape.

Projectors come from a sorted real Schur form (``scipy.linalg.schur``) and a Sylvester
equation (``scipy.linalg.solve_sylvester``) that decouples the selected block, which
stays stable where an eigenvector basis would be ill-conditioned.
"""

from __future__ import annotations

import numpy as np
import torch
from jaxtyping import Float
from scipy import linalg
from torch import Tensor

__all__ = ["CHANNELS", "channel_of", "channel_projectors", "top_k_projector"]

CHANNELS = ("positive_real", "negative_real", "complex")


def channel_of(re: float, im: float, scale: float, eps: float = 1e-8, null_tol: float = 1e-10
               ) -> str:
    """The channel of eigenvalue re + i·im, given the largest modulus ``scale``."""
    if np.hypot(re, im) <= null_tol * scale:
        return "null"
    if abs(im) > eps * scale:
        return "complex"
    return "positive_real" if re > 0 else "negative_real"


def _projector(B: np.ndarray, select) -> np.ndarray:
    """Spectral projector of B onto the eigenvalues where ``select(re, im)`` is True."""
    d = B.shape[0]
    T, Z, k = linalg.schur(B, output="real", sort=select)
    if k == 0:
        return np.zeros_like(B)
    if k == d:
        return np.eye(d)
    A, C, D = T[:k, :k], T[:k, k:], T[k:, k:]
    # With Y solving A Y - Y D = -C, [[I, Y], [0, I]] block-diagonalizes T and the
    # projector onto the leading block along the trailing one is [[I, -Y], [0, 0]].
    Y = linalg.solve_sylvester(A, -D, -C)
    P = np.zeros_like(B)
    P[:k, :k] = np.eye(k)
    P[:k, k:] = -Y
    return Z @ P @ Z.T


def channel_projectors(B: Float[Tensor, "d_head d_head"], eps: float = 1e-8,
                       null_tol: float = 1e-10) -> dict[str, Float[Tensor, "d_head d_head"]]:
    """Π_c for c in :data:`CHANNELS` plus ``null``, float64, for one head's B = W_K^T W_Q.

    Args:
        B: the small form of the QK circuit.
        eps: λ is complex when |Im λ| > eps · max|λ| (as in the rotational measures).
        null_tol: λ is null when |λ| <= null_tol · max|λ|.

    Returns:
        ``{channel: Π_c}``; an empty channel has Π_c = 0.

    Raises:
        ValueError: if ``B`` is not square.
    """
    if B.ndim != 2 or B.shape[0] != B.shape[1]:
        raise ValueError(f"B must be a square [d_head, d_head] matrix, got {tuple(B.shape)}")
    b = B.detach().double().cpu().numpy()
    scale = float(np.abs(np.linalg.eigvals(b)).max()) if b.size else 0.0
    out = {}
    for c in (*CHANNELS, "null"):
        if scale == 0.0:
            out[c] = np.eye(len(b)) if c == "null" else np.zeros_like(b)
            continue
        out[c] = _projector(b, lambda re, im, c=c: channel_of(re, im, scale, eps, null_tol) == c)
    return {c: torch.from_numpy(p) for c, p in out.items()}


def top_k_projector(B: Float[Tensor, "d_head d_head"], k: int) -> Float[Tensor, "d_head d_head"]:
    """Projector onto the k largest-|λ| eigen-channels of B (a pair cut at k is kept whole).

    Raises:
        ValueError: if ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    b = B.detach().double().cpu().numpy()
    mods = np.sort(np.abs(np.linalg.eigvals(b)))[::-1]
    if k >= len(mods):
        return torch.eye(len(mods), dtype=torch.float64)
    threshold = mods[k - 1] * (1 - 1e-9)  # conjugate partners share |λ|: both pass
    return torch.from_numpy(_projector(b, lambda re, im: np.hypot(re, im) >= threshold))
