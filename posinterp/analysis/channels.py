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

Projectors come from one real Schur form (``scipy.linalg.schur``), reordered per channel
by LAPACK's ``dtrsen``, and a Sylvester equation on the reordered form's blocks
(LAPACK's ``dtrsyl``, the step ``scipy.linalg.solve_sylvester`` ends in) that decouples
the selected block, which stays stable where an eigenvector basis would be
ill-conditioned.
"""

from __future__ import annotations

import numpy as np
import torch
from jaxtyping import Float
from scipy import linalg
from scipy.linalg import lapack
from torch import Tensor

from .spectral import CHANNELS, NULL_CHANNEL, real_within_rounding

__all__ = ["CHANNELS", "channel_decomposition", "channel_of", "channel_projector",
           "channel_projectors", "top_k_projector"]


def channel_of(re: float, im: float, scale: float, eps: float = 1e-8, null_tol: float = 1e-10
               ) -> str:
    """The channel of eigenvalue re + i·im, given the largest modulus ``scale`` (the eps
    test alone; projectors of a matrix B also count a pair that rounding split off a
    real double eigenvalue as real, :func:`posinterp.analysis.spectral.real_within_rounding`)."""
    if np.hypot(re, im) <= null_tol * scale:
        return NULL_CHANNEL
    positive, negative, rotational = CHANNELS
    if abs(im) > eps * scale:
        return rotational
    return positive if re > 0 else negative


def _projector(B: np.ndarray, select) -> np.ndarray:
    """Spectral projector of B onto the eigenvalues where ``select(re, im)`` is True."""
    T, Z, k = linalg.schur(B, output="real", sort=select)
    return _leading_projector(T, Z, k)


def _leading_projector(T: np.ndarray, Z: np.ndarray, k: int) -> np.ndarray:
    """Projector onto the leading k x k block of the real Schur form B = Z T Z^T."""
    d = T.shape[0]
    if k == 0:
        return np.zeros_like(T)
    if k == d:
        return np.eye(d)
    A, C, D = T[:k, :k], T[:k, k:], T[k:, k:]
    # With Y solving A Y - Y D = -C, [[I, Y], [0, I]] block-diagonalizes T and the
    # projector onto the leading block along the trailing one is [[I, -Y], [0, 0]].
    # A and D are blocks of a real Schur form already, so LAPACK's triangular Sylvester
    # solver takes them as they are (solve_sylvester would Schur-decompose both again).
    Y = _sylvester_schur(A, D, -C)
    P = np.zeros_like(T)
    P[:k, :k] = np.eye(k)
    P[:k, k:] = -Y
    return Z @ P @ Z.T


def _sylvester_schur(A: np.ndarray, D: np.ndarray, C: np.ndarray) -> np.ndarray:
    """Y with A Y - Y D = C for A, D in real Schur canonical form (``dtrsyl``; what
    ``scipy.linalg.solve_sylvester`` calls after reducing its inputs to that form)."""
    Y, scale, info = lapack.dtrsyl(A, D, C, isgn=-1)
    if info < 0:
        raise np.linalg.LinAlgError(f"LAPACK dtrsyl: illegal argument {-info}")
    # info = 1: A and D have close eigenvalues and LAPACK perturbed them to solve; the
    # channels never share an eigenvalue, and solve_sylvester accepts the same answer
    return Y / scale


def _schur_channels(B: np.ndarray, eps: float, null_tol: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """B's real Schur form (T, Z) and the channel of each of its eigenvalues, in T's order.

    One Schur decomposition serves every channel (LAPACK ``dtrsen`` reorders it); the
    rounding test runs once, batched, on the complex eigenvalues (:func:`_channel`'s rule).
    """
    T, Z = linalg.schur(B, output="real")
    wr, wi = _schur_eigenvalues(T)
    scale = float(np.hypot(wr, wi).max())  # max |λ|, read off the Schur form B = Z T Z^T
    channels = np.array([channel_of(r, i, scale, eps, null_tol) for r, i in zip(wr, wi, strict=True)],
                        dtype=object)
    positive, negative, rotational = CHANNELS
    rot = np.flatnonzero(channels == rotational)
    if rot.size:
        lam = torch.from_numpy(wr[rot] + 1j * wi[rot])
        real = real_within_rounding(torch.from_numpy(B), lam[None])[0].numpy()
        channels[rot[real]] = np.where(wr[rot[real]] > 0, positive, negative)
    return T, Z, channels


def _schur_eigenvalues(T: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(wr, wi) of a real Schur form, as LAPACK reports them (``dtrsen`` selecting none)."""
    none = np.zeros(T.shape[0], dtype=np.int32)
    _, _, wr, wi, _, _, _, info = lapack.dtrsen(none, T, np.eye(T.shape[0]), job="N",
                                                wantq=0)
    if info != 0:
        raise np.linalg.LinAlgError(f"LAPACK dtrsen failed (info={info})")
    return wr, wi


def _channel_projector_from_schur(T: np.ndarray, Z: np.ndarray, selected: np.ndarray
                                  ) -> np.ndarray:
    """Projector onto the eigenvalues ``selected`` (bool, T's order; pairs agree)."""
    if not selected.any():
        return np.zeros_like(T)
    if selected.all():
        return np.eye(T.shape[0])
    Ts, Zs, _, _, k, _, _, info = lapack.dtrsen(selected.astype(np.int32), T, Z, job="N")
    if info != 0:
        raise np.linalg.LinAlgError(f"LAPACK dtrsen failed to reorder (info={info})")
    return _leading_projector(Ts, Zs, int(k))


def channel_projector(B: np.ndarray, channel: str, eps: float = 1e-8, null_tol: float = 1e-10
                      ) -> np.ndarray:
    """Π_c of one channel of a float64 numpy B (``[d_head, d_head]``); 0 if B = 0.

    Raises:
        ValueError: for a ``channel`` not in :data:`CHANNELS` or ``null``.
    """
    if channel not in (*CHANNELS, NULL_CHANNEL):
        raise ValueError(f"channel must be one of {(*CHANNELS, NULL_CHANNEL)}, got {channel!r}")
    return _all_projectors(B, (channel,), eps, null_tol)[channel]


def _all_projectors(B: np.ndarray, channels, eps: float, null_tol: float
                    ) -> dict[str, np.ndarray]:
    if not np.isfinite(B).all():  # the eigen-solvers raised on these before; say so by name
        raise ValueError("B must be finite; it holds NaN or inf")
    if not B.size or not np.abs(B).max() > 0:
        return {c: np.eye(len(B)) if c == NULL_CHANNEL else np.zeros_like(B) for c in channels}
    T, Z, which = _schur_channels(B, eps, null_tol)
    return {c: _channel_projector_from_schur(T, Z, which == c) for c in channels}


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
        ValueError: if ``B`` is not square or holds NaN or inf.
    """
    if B.ndim != 2 or B.shape[0] != B.shape[1]:
        raise ValueError(f"B must be a square [d_head, d_head] matrix, got {tuple(B.shape)}")
    b = B.detach().double().cpu().numpy()
    return {c: torch.from_numpy(P) for c, P in
            _all_projectors(b, (*CHANNELS, NULL_CHANNEL), eps, null_tol).items()}


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
