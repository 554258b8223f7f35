"""Spectral channels of a QK circuit and their projectors (docs/concepts.md, "Spectral channels").

For head h, B = W_K^T W_Q (d_head x d_head) carries the nonzero spectrum of
M = W_Q W_K^T. Its eigenvalues fall into channels: ``positive_real``, ``negative_real``,
``complex`` (conjugate pairs, the rotational channel) and the null channel (|λ| ~ 0),
which belongs to none. Π_c is B's spectral projector onto channel c along the others:
real (pairs are kept together), Π_c B = B Π_c, Π_c^2 = Π_c and Σ_c Π_c = I - Π_null.
The channel's part of the circuit is M_c = W_Q Π_c W_K^T, whose content score is
q_i Π_c k_j^T, so removing c scores with q_i (I - Π_c) k_j^T and keeps every shape.

The null channel is not empty content: where B is singular, M_null = W_Q Π_null W_K^T
can be nonzero (nilpotent: W_Q = [e1, e2], W_K = [e1, e3] give M = e1 e1^T + e2 e3^T,
B = diag(1, 0) and M_null = e2 e3^T, with eigenvalues 0 yet a score). So
:func:`channel_decomposition` reports its Frobenius norm next to the channels', and
removing "every channel" must remove it too (``remove_all`` does).

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

from ..analysis.spectral import real_within_rounding

__all__ = ["CHANNELS", "channel_decomposition", "channel_of", "channel_projector",
           "channel_projectors", "top_k_projector"]

CHANNELS = ("positive_real", "negative_real", "complex")


def channel_of(re: float, im: float, scale: float, eps: float = 1e-8, null_tol: float = 1e-10
               ) -> str:
    """The channel of eigenvalue re + i·im, given the largest modulus ``scale`` (the eps
    test alone; projectors of a matrix B also count a pair that rounding split off a
    real double eigenvalue as real, :func:`posinterp.analysis.spectral.real_within_rounding`)."""
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


def channel_projector(B: np.ndarray, channel: str, eps: float = 1e-8, null_tol: float = 1e-10
                      ) -> np.ndarray:
    """Π_c of one channel of a float64 numpy B (``[d_head, d_head]``); 0 if B = 0.

    Raises:
        ValueError: for a ``channel`` not in :data:`CHANNELS` or ``null``.
    """
    if channel not in (*CHANNELS, "null"):
        raise ValueError(f"channel must be one of {(*CHANNELS, 'null')}, got {channel!r}")
    scale = float(np.abs(np.linalg.eigvals(B)).max()) if B.size else 0.0
    if scale == 0.0:
        return np.eye(len(B)) if channel == "null" else np.zeros_like(B)
    return _projector(B, lambda re, im: _channel(B, re, im, scale, eps, null_tol) == channel)


def _channel(B: np.ndarray, re: float, im: float, scale: float, eps: float, null_tol: float) -> str:
    """:func:`channel_of`, with a pair that rounding split off a real double eigenvalue
    counted real, as the rotational measures count it
    (:func:`posinterp.analysis.spectral.real_within_rounding`)."""
    c = channel_of(re, im, scale, eps, null_tol)
    if c == "complex":
        lam = torch.tensor([complex(re, im)], dtype=torch.complex128)
        if bool(real_within_rounding(torch.from_numpy(B), lam)[0]):
            return "positive_real" if re > 0 else "negative_real"
    return c


def channel_projectors(B: Float[Tensor, "d_head d_head"], eps: float = 1e-8,
                       null_tol: float = 1e-10) -> dict[str, Float[Tensor, "d_head d_head"]]:
    """Π_c for c in :data:`CHANNELS` plus ``null``, float64, for one head's B = W_K^T W_Q.

    Args:
        B: the small form of the QK circuit.
        eps: λ is complex when |Im λ| > eps · max|λ| and no rounding of B explains its
            imaginary part (as in the rotational measures).
        null_tol: λ is null when |λ| <= null_tol · max|λ|.

    Returns:
        ``{channel: Π_c}``; an empty channel has Π_c = 0.

    Raises:
        ValueError: if ``B`` is not square.
    """
    if B.ndim != 2 or B.shape[0] != B.shape[1]:
        raise ValueError(f"B must be a square [d_head, d_head] matrix, got {tuple(B.shape)}")
    b = B.detach().double().cpu().numpy()
    return {c: torch.from_numpy(channel_projector(b, c, eps, null_tol))
            for c in (*CHANNELS, "null")}


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


def channel_decomposition(W_Q: Float[Tensor, "d_model d_head"], W_K: Float[Tensor, "d_model d_head"],
                          eps: float = 1e-8, null_tol: float = 1e-10) -> dict[str, float]:
    """Frobenius norms ||M_c||_F of M = W_Q W_K^T split by B's channels, null included.

    M_c = W_Q Π_c W_K^T for c in :data:`CHANNELS` and ``null`` (the null-space
    remainder: content that no eigenvalue carries, e.g. a nilpotent part). The M_c sum
    to M exactly; their norms do not add (the parts need not be orthogonal). Computed
    without a d_model x d_model matrix: ||W_Q P W_K^T||_F^2 = tr(P^T Q P K) with
    Q = W_Q^T W_Q and K = W_K^T W_K. Units: those of M (score units times attn_scale).

    Returns:
        ``{"positive_real", "negative_real", "complex", "null", "total"}`` -> float,
        ``total`` being ||M||_F.

    Raises:
        ValueError: if W_Q and W_K are not both ``[d_model, d_head]``.

    Source: docs/concepts.md, "Spectral channels" (the null channel belongs
    to no channel, so the Π_c sum to I minus the null projector).
    """
    if W_Q.ndim != 2 or W_Q.shape != W_K.shape:
        raise ValueError(f"W_Q and W_K must both be [d_model, d_head], got {tuple(W_Q.shape)} "
                         f"and {tuple(W_K.shape)}")
    q, k = W_Q.detach().double().cpu(), W_K.detach().double().cpu()
    Q, K = q.T @ q, k.T @ k
    P = channel_projectors(k.T @ q, eps, null_tol)
    out = {c: float(torch.sqrt(torch.clamp(torch.trace(p.T @ Q @ p @ K), min=0.0)))
           for c, p in P.items()}
    out["total"] = float(torch.sqrt(torch.clamp((Q * K).sum(), min=0.0)))
    return out
