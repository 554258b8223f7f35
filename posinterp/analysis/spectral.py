"""QK-circuit spectra of attention heads and their rotational measures (docs/concepts.md).

For head h, the bilinear form is M = W_Q W_K^T (d_model x d_model), so with no biases
the content score is c_ij = x_i M x_j^T / attn_scale. Its nonzero eigenvalues are those
of the small form B = W_K^T W_Q (d_head x d_head), computed in float64 as
TransformerLens's ``FactoredMatrix`` reduces it (never W_Q^T W_K = B^T, whose
eigen-channels differ), every head of every layer in one batched call.

**Rotary heads.** Key j and query i are rotated by R(j), R(i), so the score is
x_i W_Q R(i - j) W_K^T x_j^T: the form depends on the offset Δ = j - i,
M(Δ) = W_Q R(-Δ) W_K^T, where R rotates the first ``rotary_dim`` dims of a head in
pairs (adjacent or split-half, as the model's ``rotary_adjacent_pairs`` says) and leaves
the rest alone. The fingerprint claim concerns Δ = 0, the raw W_Q W_K^T; Δ = -1 is the
previous token. Results always carry their ``offset`` (NA for non-rotary heads).

**One weight convention for every loader** (:data:`QK_CONVENTION`). The circuit is the
one acting on the *normalized* residual, the attention input x̂ before the norm's
gain: W_Q^eff = C diag(g) W_Q (and W_K likewise), with g the gain of the norm that
feeds attention and C = I - 11^T/d_model for LayerNorm (its output is mean-free, so
the component along 1 never reaches W) or C = I for RMSNorm. This is what
TransformerLens's ``fold_ln`` writes into the weights, so a model loaded raw (llama2.c
files, zoo and toy models) and the same model loaded processed (HF checkpoints) give
the same spectra; the gain g is folded here when the model still has it
(:func:`qk_convention` says which). ``weights="stored"`` gives the raw stored matrices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Complex, Float
from scipy import stats
from torch import Tensor

from .._disk_cache import cached_arrays
from .._validate import check_indices, is_int
from ..models.qk_convention import (  # re-exported: how a loaded model's W_Q, W_K are formed
    QK_CONVENTION,
    QK_NORM_CONVENTION,  # noqa: F401  (a public name of this module before the move)
    attention_input_norm,
    qk_convention,
)
from ..models.rope_layout import pair_dims

__all__ = [
    "CHANNELS", "NULL_CHANNEL", "QK_CONVENTION", "antisymmetric_energy", "attention_input_norm",
    "channel_masses",
    "effective_weights", "fold_qk_norm",
    "eigenvalues", "ginibre_null", "real_within_rounding", "null_percentiles", "qk_convention", "qk_spectrum",
    "model_rotary_matrix", "qk_weights", "random_small_forms", "rotary_matrix", "rotational_measures",
    "spectral_measures",
    "directionality_score", "qk_geometry", "symmetry_score",
]

WEIGHTS = ("effective", "stored")

DEFAULT_EPS = 1e-8
# Backward-error tolerance of the real/complex test (docs/spectra.md, "Real or complex"):
# a pair is real when B is within ROUNDING_TOL * ||B||_F of a real matrix that has Re λ
# as an eigenvalue. float64 eig is backward stable to ~d * 1e-16; forming B adds a few
# ulps times the conditioning of W_K^T W_Q: 1e-12 leaves room for both.
ROUNDING_TOL = 1e-12
# Only pairs this close to the real axis (relative to ||B||_F) are tested: rounding moves
# a defective pair by ~sqrt(1e-16 * conditioning), far below this; it saves the SVDs.
_CANDIDATE = 1e-3
NULL_HEADS = 2500  # Monte Carlo SE of a null percentile <= 1 point (binomial, p = 0.5)
MEASURES = ("rotational_mass", "phase", "antisymmetric_energy")
# The spectral channels of M (docs/concepts.md, "Spectral channels"): an eigenvalue is
# complex (|Im λ| > eps·max|λ|), else positive- or negative-real; the one home of these
# names, which interventions (projectors, bans, ablation kinds) and explain build on.
CHANNELS = ("positive_real", "negative_real", "complex")
# What is left of a singular B: eigenvalues |λ| <= null_tol·max|λ| (projectors only).
NULL_CHANNEL = "null"


# --- pure functions over weights -----------------------------------------------------------

def qk_float64(W_Q: Tensor, W_K: Tensor) -> tuple[Tensor, Tensor]:
    """``W_Q``, ``W_K`` (``[..., d_model, d_head]``) as detached float64 copies.

    Raises:
        ValueError: if the shapes differ or are not ``[..., d_model, d_head]``.
    """
    if W_Q.shape != W_K.shape or W_Q.ndim < 2:
        raise ValueError(f"W_Q and W_K must both be [..., d_model, d_head], got "
                         f"{tuple(W_Q.shape)} and {tuple(W_K.shape)}")
    return W_Q.detach().double(), W_K.detach().double()


def eigenvalues(W_Q: Float[Tensor, "... d_model d_head"], W_K: Float[Tensor, "... d_model d_head"]
                ) -> Complex[Tensor, "... d_head"]:
    """Eigenvalues of B = W_K^T W_Q (the nonzero spectrum of M = W_Q W_K^T), float64.

    Sorted by decreasing modulus. fp16/bf16/fp32 inputs are upcast to float64 first. A
    pair that rounding split off a real double eigenvalue (:func:`real_within_rounding`)
    is returned real, so the rotational measures do not jump on rounding.
    Source: docs/concepts.md ("QK circuit of head h"); ``FactoredMatrix.eigenvalues``
    (the d_head x d_head form BA instead of the d_model x d_model AB).

    Raises:
        ValueError: if the shapes differ or are not ``[..., d_model, d_head]``.
    """
    q, k = qk_float64(W_Q, W_K)
    return small_form_eigenvalues(k.mT @ q)


def small_form_eigenvalues(B: Float[Tensor, "... d_head d_head"]) -> Complex[Tensor, "... d_head"]:
    """:func:`eigenvalues` from the small forms B = W_K^T W_Q themselves, any leading dims.

    One batched ``torch.linalg.eigvals`` call (LAPACK geev without eigenvectors: the
    same eigenvalues as ``FactoredMatrix.eigenvalues``' ``linalg.eig``, at less than half
    the cost), then :func:`real_within_rounding` and a stable sort by decreasing |λ|.

    Raises:
        ValueError: if ``B`` is not ``[..., n, n]``.
    """
    if B.ndim < 2 or B.shape[-1] != B.shape[-2]:
        raise ValueError(f"B must be [..., n, n] square matrices, got {tuple(B.shape)}")
    B = B.detach().double()
    lam = torch.linalg.eigvals(B)
    # A real pair that rounding split (a defective or nearly defective real block) is real.
    lam = torch.where(real_within_rounding(B, lam), lam.real.to(lam.dtype), lam)
    order = torch.argsort(lam.abs(), dim=-1, descending=True, stable=True)
    return torch.gather(lam, -1, order)


def real_within_rounding(B: Float[Tensor, "... n n"], lam: Complex[Tensor, "... n"],
                         tol: float = ROUNDING_TOL) -> Tensor:
    """True where eigenvalue λ of B has a nonzero imaginary part that rounding explains.

    The imaginary part rounding gives a real double eigenvalue grows with its condition
    number (about sqrt(1e-16 * ||B||) for a defective block), so no fixed eps on |Im λ|
    separates it from a true rotation. The test is on the backward error instead: λ is
    real within rounding when B is within ``tol * ||B||_F`` of a real matrix that has
    Re λ as an eigenvalue, i.e. σ_min(B - Re λ · I) <= tol * ||B||_F (Trefethen &
    Embree, *Spectra and Pseudospectra*, §2: the ε-pseudospectrum). A true complex pair
    a ± ib keeps σ_min(B - aI) >= b / κ(V) (κ(V): the eigenvector basis' condition
    number), far above ``tol`` unless no float64 computation could tell it from real.

    Args:
        B: ``[..., n, n]`` real matrices (float64 advised).
        lam: ``[..., m]`` eigenvalues of B to test (all n, or a few).
        tol: relative backward error (default :data:`ROUNDING_TOL`, 1e-12).

    Returns:
        ``[..., m]`` bool; False for real λ (Im λ = 0) and for pairs farther than
        1e-3 · ||B||_F from the real axis (not tested: no rounding moves them that far).
    """
    lam = lam.to(torch.complex128)
    B = B.detach().double()
    n, m = B.shape[-1], lam.shape[-1]
    flat_lam, flat_B = lam.reshape(-1, m), B.reshape(-1, n, n)
    norm = torch.linalg.matrix_norm(flat_B)[:, None]  # [batch, 1], Frobenius
    cand = (flat_lam.imag != 0) & (flat_lam.imag.abs() <= _CANDIDATE * norm)
    out = torch.zeros_like(cand)
    if bool(cand.any()):
        row, col = cand.nonzero(as_tuple=True)
        # A conjugate pair shares Re λ bit for bit (LAPACK returns a ± ib), hence one
        # shifted matrix: one SVD per distinct (matrix, Re λ) halves the work.
        keys, inverse = torch.unique(torch.stack([row.double(), flat_lam.real[row, col]], 1),
                                     dim=0, return_inverse=True)
        urow = keys[:, 0].long()
        shifted = flat_B[urow] - keys[:, 1][:, None, None] * torch.eye(n, dtype=B.dtype)
        smin = torch.linalg.svdvals(shifted)[:, -1]
        out[row, col] = (smin <= tol * norm[urow, 0])[inverse]
    return out.reshape(lam.shape)


def antisymmetric_energy(W_Q: Float[Tensor, "... d_model d_head"],
                         W_K: Float[Tensor, "... d_model d_head"]) -> Float[Tensor, "..."]:
    """a(M) = ||(M - M^T)/2||_F^2 / ||M||_F^2 without forming M (unitless, [0, 1]).

    Exact identity: a = (1 - tr(B^2) / tr(W_Q^T W_Q W_K^T W_K)) / 2 with B = W_K^T W_Q.
    0 for symmetric M, 1 for antisymmetric M, 0 (not NaN) for M = 0. Invariant under
    orthogonal changes of basis but not spectral. Source: docs/concepts.md.
    """
    q, k = W_Q.detach().double(), W_K.detach().double()
    return _antisymmetric_energy(q, k, k.mT @ q)


def _antisymmetric_energy(q: Tensor, k: Tensor, B: Tensor) -> Tensor:
    """:func:`antisymmetric_energy` of float64 q, k whose small form B = k^T q is at hand."""
    return _antisymmetric_energy_from_forms(B, q.mT @ q, k.mT @ k)


def _antisymmetric_energy_from_forms(B: Tensor, Gq: Tensor, Gk: Tensor) -> Tensor:
    """:func:`antisymmetric_energy` from the d_head x d_head forms B = k^T q, G_Q = q^T q
    and G_K = k^T k."""
    tr_b2 = (B * B.mT).sum((-1, -2))
    norm2 = (Gq * Gk).sum((-1, -2))  # tr(Q^T Q K^T K), both symmetric
    safe = torch.where(norm2 > 0, norm2, torch.ones_like(norm2))
    return torch.where(norm2 > 0, 0.5 * (1 - tr_b2 / safe), torch.zeros_like(norm2))


def symmetry_score(W_Q: Float[Tensor, "... d_model d_head"], W_K: Float[Tensor, "... d_model d_head"]
                   ) -> Float[Tensor, "..."]:
    """s(M) = tr(M M) / tr(M M^T) for M = W_Q W_K^T, without forming M (unitless, [-1, 1]).

    s = (||S||_F^2 - ||N||_F^2) / ||M||_F^2 with S, N the symmetric and skew parts: 1 for
    a symmetric M, -1 for a skew-symmetric one, near 0 for independent Gaussian W_Q, W_K
    (E tr(M M) = d_model d_head, E ||M||_F^2 = d_model^2 d_head: s is about 1/d_model),
    0 (not NaN) for M = 0. Computed from d_head x d_head products as
    tr(B^2) / tr(W_Q^T W_Q W_K^T W_K), B = W_K^T W_Q. Related measures: the antisymmetric
    energy a = (1 - s)/2 (:func:`antisymmetric_energy`) and attention-geometry's
    symmetry score ||S||^2/||M||^2 = (1 + s)/2. Source: Saponati et al., "The underlying
    structures of self-attention: symmetry, directionality, and emergent dynamics in
    Transformer training" (2025, arXiv 2502.10927), §3 (their ``get_scores_trace``).

    Raises:
        ValueError: if the shapes differ or are not ``[..., d_model, d_head]``.
    """
    q, k = qk_float64(W_Q, W_K)
    B = k.mT @ q
    tr_b2 = (B * B.mT).sum((-1, -2))
    norm2 = ((q.mT @ q) * (k.mT @ k)).sum((-1, -2))  # ||M||_F^2
    safe = torch.where(norm2 > 0, norm2, torch.ones_like(norm2))
    return torch.where(norm2 > 0, tr_b2 / safe, torch.zeros_like(norm2))


def directionality_score(W_Q: Float[Tensor, "... d_model d_head"],
                         W_K: Float[Tensor, "... d_model d_head"], num_std: float = 2.0
                         ) -> Float[Tensor, "..."]:
    """Column vs row dominance of M = W_Q W_K^T, without forming M (unitless, [-1, 1]).

    Row a of M (a query-side direction) has norm² (W_Q G_K W_Q^T)_aa with G_K = W_K^T W_K,
    column b (key side) (W_K G_Q W_K^T)_bb: d_model x d_head² work, no d_model² matrix.
    With thresholds τ = mean + ``num_std`` · std (unbiased) over the d_model row norms and
    over the column norms, the excesses E_row = Σ (r_a - τ_r)_+ and E_col likewise give
    d = (E_col - E_row) / (E_col + E_row): positive when a few key-side directions
    dominate every score (column dominance, which autoregressive training grows), 0 when
    no norm exceeds its threshold. Source: Saponati et al. 2025 (arXiv 2502.10927), §3 and
    their ``directionality_score`` (``num_std=2``).

    Raises:
        ValueError: if the shapes differ or are not ``[..., d_model, d_head]``.
    """
    q, k = qk_float64(W_Q, W_K)
    rows = ((q @ (k.mT @ k)) * q).sum(-1).clamp_min(0).sqrt()  # [..., d_model]
    cols = ((k @ (q.mT @ q)) * k).sum(-1).clamp_min(0).sqrt()

    def excess(norms: Tensor) -> Tensor:
        tau = norms.mean(-1, keepdim=True) + num_std * norms.std(-1, keepdim=True)
        return torch.where(norms > tau, norms - tau, 0.0).sum(-1)

    e_row, e_col = excess(rows), excess(cols)
    total = e_row + e_col
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, (e_col - e_row) / safe, torch.zeros_like(total))


def rotational_measures(lam: Complex[Tensor, "... n"], k_e: int | None = None,
                        eps: float = DEFAULT_EPS) -> dict[str, Tensor]:
    """Rotational mass R and phase Φ of eigenvalues sorted by decreasing modulus.

    Over the top ``k_e`` eigenvalues (all by default; a conjugate pair cut by the
    boundary is kept whole): λ is complex when |Im λ| > eps · max|λ| (pass
    :func:`eigenvalues`' output, in which a real pair that rounding split is already
    real: :func:`real_within_rounding`);
    R = Σ|λ| 1[complex] / Σ|λ|; Φ = Σ|λ| |sin arg λ| / Σ|λ|; ``n_complex_pairs`` counts
    each conjugate pair once. All are 0 for an all-zero spectrum. Source: docs/concepts.md.

    Raises:
        ValueError: if ``k_e < 1``.
    """
    if k_e is not None and k_e < 1:
        raise ValueError(f"k_e must be >= 1 or None, got {k_e}")
    lam = lam.to(torch.complex128)
    mod = lam.abs()
    top = mod.amax(-1, keepdim=True)
    is_complex = lam.imag.abs() > eps * top
    n = lam.shape[-1]
    keep = torch.ones_like(mod, dtype=torch.bool)
    if k_e is not None and k_e < n:
        keep = torch.arange(n) < k_e
        keep = keep.expand_as(mod).clone()
        # Keep a conjugate pair whole: include index k_e if it is the partner of k_e - 1.
        partner = is_complex[..., k_e] & (
            (lam[..., k_e] - lam[..., k_e - 1].conj()).abs() <= 1e-9 * top[..., 0].clamp_min(1e-300))
        keep[..., k_e] |= partner
    w = torch.where(keep, mod, 0.0)
    total = w.sum(-1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    zero = torch.zeros_like(total)
    rot = torch.where(total > 0, (w * is_complex).sum(-1) / safe, zero)
    phase = torch.where(total > 0, (w * torch.sin(lam.angle()).abs()).sum(-1) / safe, zero)
    pairs = ((is_complex & keep).sum(-1) / 2).floor()
    return {"rotational_mass": rot, "phase": phase, "n_complex_pairs": pairs}


def channel_masses(lam: Complex[Tensor, "... n"], eps: float = DEFAULT_EPS) -> dict[str, Tensor]:
    """Share of the spectral mass Σ|λ| in each channel: positive-real, negative-real, complex.

    λ is complex when |Im λ| > eps · max|λ| (as :func:`rotational_measures`; ``complex``
    equals its rotational mass with all eigenvalues). The three shares sum to 1, or are
    all 0 for an all-zero spectrum. Source: docs/concepts.md ("Spectral channels").
    """
    lam = lam.to(torch.complex128)
    mod = lam.abs()
    top = mod.amax(-1, keepdim=True)
    is_complex = lam.imag.abs() > eps * top
    total = mod.sum(-1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    parts = dict(zip(CHANNELS, (~is_complex & (lam.real > 0), ~is_complex & (lam.real < 0), is_complex),
                     strict=True))
    return {c: torch.where(total > 0, (mod * m).sum(-1) / safe, torch.zeros_like(total))
            for c, m in parts.items()}


def rotary_matrix(d_head: int, rotary_dim: int, angle_steps: float, base: float = 10000.0,
                  adjacent_pairs: bool = False, inv_freq: Tensor | None = None
                  ) -> Float[Tensor, "d_head d_head"]:
    """R(t): the row-vector rotation RoPE applies at position t (float64).

    ``x R(t)`` rotates pair p of the first ``rotary_dim`` dims by t · base^(-2p/rotary_dim);
    pairs are (2p, 2p+1) if ``adjacent_pairs`` else (p, p + rotary_dim/2), as in
    TransformerLens (GPT-J vs GPT-NeoX); other dims are unchanged. R(s) R(t) = R(s+t).
    ``inv_freq`` (``[rotary_dim / 2]``, radians per position) replaces the base formula,
    e.g. with the scaled frequencies of a loaded model (:func:`model_rotary_matrix`).
    Source: Su et al. 2021 (RoFormer), eq. 13-15.

    Raises:
        ValueError: for an odd ``rotary_dim`` or one larger than ``d_head``.
    """
    if rotary_dim % 2 or not 0 < rotary_dim <= d_head:
        raise ValueError(f"rotary_dim must be even and in (0, d_head={d_head}], got {rotary_dim}")
    half = rotary_dim // 2
    if inv_freq is not None and tuple(inv_freq.shape) != (half,):
        raise ValueError(f"inv_freq must have rotary_dim/2 = {half} entries, got {tuple(inv_freq.shape)}")
    R = torch.eye(d_head, dtype=torch.float64)
    freqs = inv_freq.tolist() if inv_freq is not None else None
    theta = [angle_steps * freqs[p] if freqs is not None else angle_steps / base ** (p / half)
             for p in range(half)]
    c = torch.tensor([math.cos(t) for t in theta], dtype=torch.float64)
    s = torch.tensor([math.sin(t) for t in theta], dtype=torch.float64)
    a, b = pair_dims(torch.arange(half), rotary_dim, adjacent_pairs)
    # new_a = a c - b s, new_b = b c + a s  (TransformerLens's x cos + rotate(x) sin)
    R[a, a], R[b, a], R[a, b], R[b, b] = c, -s, s, c
    return R


def effective_weights(W: Float[Tensor, "... d_model d_head"], gain: Float[Tensor, "d_model"] | None,
                      center: bool) -> Float[Tensor, "... d_model d_head"]:
    """C diag(gain) W: a query/key weight as it acts on the normalized residual.

    ``gain`` None means already folded (or no norm); ``center`` subtracts the mean over
    d_model (LayerNorm's output is mean-free; idempotent, so a centred W is unchanged).
    Float64. Source: this module's docstring; TransformerLens ``fold_layer_norm``.
    """
    W = W.detach().double()
    if gain is not None:
        W = W * gain.double().to(W.device)[:, None]
    if center:
        W = W - W.mean(-2, keepdim=True)
    return W


def fold_qk_norm(W_Q: Float[Tensor, "... n_heads d_model d_head"],
                 W_K: Float[Tensor, "... n_heads d_model d_head"], norm) -> tuple[Tensor, Tensor]:
    """W_Q diag(γ_q), W_K diag(γ_k) per head: the QK circuit of a qk-norm head.

    With a q/k RMSNorm (Qwen3, OLMo-2, Gemma-3) the score is
    (γ_q ⊙ x_i W_Q / s_q(i)) R(i - j) (γ_k ⊙ x_j W_K / s_k(j))^T / attn_scale, so the
    bilinear form is M(Δ) = W_Q diag(γ_q) R(-Δ) diag(γ_k) W_K^T: the gains sit between
    the projection and the rotation (they need not commute with R when a pair's two gains
    differ), and the positive per-token scale 1/(s_q(i) s_k(j)) stays outside M: M gives
    each score up to that factor, which depends on the tokens and is no weight's.

    ``norm``: a :class:`~posinterp.models.backend.QKNorm` (``q_gain``, ``k_gain``
    ``[n_heads, d_head]``) or None (returned unchanged). Float64.
    Source: Dehghani et al. 2023 (ViT-22B), §3; DESIGN.md §4 "qk-norm".
    """
    if norm is None:
        return W_Q, W_K
    return (W_Q * norm.q_gain.to(W_Q)[..., None, :], W_K * norm.k_gain.to(W_K)[..., None, :])


# --- model plumbing --------------------------------------------------------------------------

def _check_model(model) -> None:
    from ..models.backend import check_not_mla

    for attr in ("cfg", "blocks"):
        if not hasattr(model, attr):
            raise ValueError(f"model has no {attr!r}: qk_spectrum needs a TransformerLens model "
                             "(HookedTransformer or compatible)")
    check_not_mla(model, "the QK circuit M = W_Q W_K^T (qk_spectrum, spectral_measures, qk_geometry)")
    if not hasattr(model.blocks[0].attn, "W_Q"):
        raise ValueError("model's attention has no W_Q; cannot form QK circuits")


def _select(name: str, chosen, n: int) -> list[int]:
    return list(range(n)) if chosen is None else check_indices(name, chosen, n)


def _scheme(model) -> str:
    from ..models.backend import positional_type

    return positional_type(model)


def is_rotary(model) -> bool:
    from ..models.backend import positional_type

    return positional_type(model) == "rotary"


def qk_weights(model, layer: int, offset: int | None = None, weights: str = "effective"
               ) -> tuple[Float[Tensor, "n_heads d_model d_head"], Float[Tensor, "n_heads d_model d_head"]]:
    """(W_Q, W_K') in float64 for every head of ``layer``, with M(Δ) = W_Q W_K'^T.

    ``weights="effective"`` (default, :data:`QK_CONVENTION`): C diag(g) W for both, with
    the attention input norm's gain g (:func:`attention_input_norm`), so raw and
    ``fold_ln``-processed loads of one model agree, and on qk-norm models each head's
    q/k-norm gains folded into the columns before any rotation (:func:`fold_qk_norm`);
    ``"stored"``: the matrices as stored.
    W_K is expanded over grouped-query heads. For rotary heads and an ``offset`` Δ,
    W_K' = W_K R(-Δ)^T, so M(Δ) = W_Q R(-Δ) W_K^T; Δ = None or 0 gives the unrotated W_K.

    Raises:
        ValueError: for a ``layer`` outside ``[0, n_layers)`` (a negative index would
            silently pick a layer from the end), an ``offset`` on a non-rotary model, or
            TL RoPE scaling on a model whose frequencies posinterp did not install, or
            ``weights`` not in ``("effective", "stored")``.
    """
    from ..models.backend import attention_weights, qk_norm

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    check_indices("layer", layer if is_int(layer) else [layer], model.cfg.n_layers)
    stored = attention_weights(model, layer, ("W_Q", "W_K"))  # K expanded over grouped-query heads
    W_Q, W_K = stored["W_Q"], stored["W_K"]
    if weights == "effective":
        gain, center, _ = attention_input_norm(model, layer)
        W_Q, W_K = effective_weights(W_Q, gain, center), effective_weights(W_K, gain, center)
        W_Q, W_K = fold_qk_norm(W_Q, W_K, qk_norm(model, layer))
    if offset is None or offset == 0:
        return W_Q, W_K
    if not is_rotary(model):
        raise ValueError(f"offset={offset} applies only to rotary heads; this model's "
                         f"positional scheme is {_scheme(model)!r}")
    R = model_rotary_matrix(model, -offset, layer)
    return W_Q, W_K @ R.T


def model_rotary_matrix(model, angle_steps: float, layer: int = 0) -> Float[Tensor, "d_head d_head"]:
    """R(t) of ``model``'s RoPE at ``layer``, with the frequencies the model really uses
    (HF's, scaling included, for loaded checkpoints; TL's base formula for toy models).

    Raises:
        ValueError: from :func:`posinterp.models.positions.rotary_inv_freq` (non-rotary
            model, or TL RoPE scaling it cannot reproduce).
    """
    from ..models.backend import rotary_spec

    spec = rotary_spec(model, layer)  # the layout and frequencies the model really uses
    return rotary_matrix(model.cfg.d_head, spec.rotary_dim, angle_steps,
                         adjacent_pairs=spec.adjacent_pairs, inv_freq=spec.inv_freq)


def _offsets(model, offset) -> list[int | None]:
    if offset is not None:
        if not is_rotary(model):
            raise ValueError(f"offset applies only to rotary heads; this model's "
                             f"positional scheme is {_scheme(model)!r}")
        return [int(offset)]
    return [0, -1] if is_rotary(model) else [None]


def _selected_qk_only(qk, layers, heads, offset, weights):
    """:func:`_selected_weights` for :class:`~posinterp.models.qk_only.QKWeights` (no model)."""
    if offset is not None and qk.pe != "rotary":
        raise ValueError(f"offset applies only to rotary heads; this model's positional scheme "
                         f"is {qk.pe!r}")
    offsets = [int(offset)] if offset is not None else ([0, -1] if qk.pe == "rotary" else [None])
    layer_ids = _select("layers", layers, qk.n_layers)
    head_ids = _select("heads", heads, qk.n_heads)

    def layer_weights(layer):  # read from the files now: one layer in memory at a time
        W_Q, W_K = qk.W_Q[layer], qk.W_K[layer]
        if weights == "effective":
            W_Q = effective_weights(W_Q, qk.gain[layer], qk.center)
            W_K = effective_weights(W_K, qk.gain[layer], qk.center)
            W_Q, W_K = fold_qk_norm(W_Q, W_K, qk.qk_norm[layer] if qk.qk_norm else None)
        return W_Q, W_K

    # each layer is read once per offset: memory stays one layer's whatever the depth, and
    # a second read of the same bytes comes from the page cache
    for off in offsets:
        R = (rotary_matrix(qk.d_head, qk.rotary_dim, -off, adjacent_pairs=qk.adjacent_pairs,
                           inv_freq=qk.inv_freq) if off else None)  # one RoPE for every layer
        for layer in layer_ids:
            W_Q, W_K = layer_weights(layer)
            if R is not None:
                W_K = W_K @ R.T
            yield off, layer, head_ids, W_Q[head_ids], W_K[head_ids]


def _selected_weights(model, layers, heads, offset, weights="effective"):
    """Yield ``(offset, layer, head_ids, W_Q, W_K')`` for every offset and selected layer.

    ``model`` may also be a :class:`~posinterp.models.qk_only.QKWeights` (weights read
    alone, no model built): the same weights give the same rows.
    """
    from ..models.sources.qk_only import QKWeights

    if isinstance(model, QKWeights):
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        yield from _selected_qk_only(model, layers, heads, offset, weights)
        return
    _check_model(model)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    layer_ids = _select("layers", layers, model.cfg.n_layers)
    head_ids = _select("heads", heads, model.cfg.n_heads)
    for off in _offsets(model, offset):
        for layer in layer_ids:
            W_Q, W_K = qk_weights(model, layer, off, weights)
            yield off, layer, head_ids, W_Q[head_ids], W_K[head_ids]


def qk_spectrum(model, layers: int | Sequence[int] | None = None,
                heads: int | Sequence[int] | None = None, offset: int | None = None,
                weights: str = "effective") -> pd.DataFrame:
    """Eigenvalues of every selected head's QK circuit, one row per eigenvalue.

    ``model`` is a TransformerLens model or the weights alone
    (:func:`posinterp.models.qk_only.read_qk_weights`: no forward pass, no full model).
    ``weights``: ``"effective"`` (default: the norm gain folded, :data:`QK_CONVENTION`)
    or ``"stored"`` (see :func:`qk_weights`).

    Computed on the d_head x d_head form B = W_K^T W_Q in float64 (any weight dtype), with
    grouped-query K shared as the model shares it. For rotary models the default reports
    both offset 0 (the raw W_Q W_K^T, the fingerprint's object) and offset -1 (previous
    token); ``offset`` picks one. Source: docs/concepts.md.

    Returns:
        DataFrame with columns ``hook, layer, head, offset, rank, real, imag, abs``
        (``offset`` NA for non-rotary heads; ``rank`` 0 = largest |λ|).

    Raises:
        ValueError: layers/heads out of range, a model without ``W_Q``, or ``offset`` on
            a non-rotary model.
    """
    keys, lam, _ = _spectra(model, layers, heads, offset, weights, antisymmetric=False)
    return _spectrum_frame(keys, lam)


def _qk_only_forms(qk, layers, heads, offset, weights, grams: bool):
    """:func:`_selected_forms` for :class:`~posinterp.models.qk_only.QKWeights`: each layer
    is read and its d_model-sized products formed once, whatever the number of offsets.
    With W_K' = W_K R^T, B' = R B and G_K' = R G_K R^T are d_head-sized; G_K is formed
    once per KV head, not per query head. Rows come out by layer, then offset (the
    caller restores offset-major order on its small results)."""
    if offset is not None and qk.pe != "rotary":
        raise ValueError(f"offset applies only to rotary heads; this model's positional scheme "
                         f"is {qk.pe!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    offsets = [int(offset)] if offset is not None else ([0, -1] if qk.pe == "rotary" else [None])
    layer_ids = _select("layers", layers, qk.n_layers)
    head_ids = _select("heads", heads, qk.n_heads)
    rot = {off: (rotary_matrix(qk.d_head, qk.rotary_dim, -off, adjacent_pairs=qk.adjacent_pairs,
                               inv_freq=qk.inv_freq) if off else None) for off in offsets}
    group = qk.n_heads // qk.n_kv_heads
    kv = [h // group for h in head_ids]
    first = sorted({k: i for i, k in reversed(list(enumerate(kv)))}.values())  # one per KV head
    back = torch.tensor([[kv[i] for i in first].index(k) for k in kv])
    for layer in layer_ids:  # read from the files now: one layer in memory at a time
        W_Q, W_K = qk.W_Q[layer], qk.W_K[layer]
        if weights == "effective":
            W_Q = effective_weights(W_Q, qk.gain[layer], qk.center)
            W_K = effective_weights(W_K, qk.gain[layer], qk.center)
            W_Q, W_K = fold_qk_norm(W_Q, W_K, qk.qk_norm[layer] if qk.qk_norm else None)
        q, k = qk_float64(W_Q[head_ids], W_K[head_ids])
        B0 = k.mT @ q
        Gq = q.mT @ q if grams else None
        Gk = (k[first].mT @ k[first])[back] if grams else None
        del q, k, W_Q, W_K
        for off in offsets:
            R = rot[off]
            if R is None:
                yield off, layer, head_ids, B0, Gq, Gk
            else:
                yield off, layer, head_ids, R @ B0, Gq, R @ Gk @ R.T if grams else None


def _selected_forms(model, layers, heads, offset, weights, grams: bool):
    """Yield ``(offset, layer, head_ids, B, G_Q, G_K)``: the d_head x d_head forms
    B = W_K'^T W_Q, G_Q = W_Q^T W_Q, G_K = W_K'^T W_K' (float64, ``[heads, d_head,
    d_head]``; the Gram matrices None without ``grams``) of every offset and selected
    layer, as :func:`_selected_weights` forms the weights."""
    from ..models.sources.qk_only import QKWeights

    if isinstance(model, QKWeights):
        yield from _qk_only_forms(model, layers, heads, offset, weights, grams)
        return
    for off, layer, head_ids, W_Q, W_K in _selected_weights(model, layers, heads, offset, weights):
        q, k = qk_float64(W_Q, W_K)
        yield (off, layer, head_ids, k.mT @ q, q.mT @ q if grams else None,
               k.mT @ k if grams else None)


def _spectra(model, layers, heads, offset, weights, antisymmetric: bool = True):
    """``(keys, eigenvalues, antisymmetric energies)`` of every selected head, where keys
    are ``(offset, layer, head_ids)`` in order and the tensors ``[sum heads, d_head]`` and
    ``[sum heads]`` follow them (None without ``antisymmetric``): one pass over the
    weights and one eigvals call for :func:`qk_spectrum` and :func:`spectral_measures`
    alike, so a caller that needs both (``inspect_heads``) solves each head once."""
    keys, lams, anti = [], [], []
    for off, layer, head_ids, B, Gq, Gk in _selected_forms(model, layers, heads, offset, weights,
                                                            grams=antisymmetric):
        keys.append((off, layer, head_ids))
        # solved as each layer comes: only eigenvalues are kept, so memory does not grow
        # with depth (a batched eigvals solves each matrix alone: the same numbers)
        lams.append(small_form_eigenvalues(B))
        if antisymmetric:
            anti.append(_antisymmetric_energy_from_forms(B, Gq, Gk))
    # offset-major, as the tables are laid out (weights-only input comes layer-major)
    offs = list(dict.fromkeys(key[0] for key in keys))
    order = sorted(range(len(keys)), key=lambda i: offs.index(keys[i][0]))
    keys, lams = [keys[i] for i in order], [lams[i] for i in order]
    anti = [anti[i] for i in order] if antisymmetric else None
    return keys, torch.cat(lams), (torch.cat(anti) if antisymmetric else None)


def _spectrum_frame(keys, lam: Tensor) -> pd.DataFrame:
    """:func:`qk_spectrum`'s rows from :func:`_spectra`'s keys and eigenvalues."""
    cols = _spectrum_columns(keys, lam)
    n_rows = [len(h) * lam.shape[-1] for _, _, h in keys]
    hooks = np.repeat([f"blocks.{layer}.attn" for _, layer, _ in keys], n_rows).astype(object)
    return pd.DataFrame({"hook": hooks, **cols})


def _spectrum_columns(keys, lam: Tensor) -> dict:
    """The spectrum's columns but ``hook``, as plain numeric arrays (``offset`` a nullable
    integer array built from a mask: no per-row Python objects, whose transient copies
    were the one part of a weights-only run that grew with depth)."""
    lam = lam.numpy()
    n = lam.shape[-1]
    n_rows = [len(h) * n for _, _, h in keys]
    offs = np.array([0 if off is None else off for off, _, _ in keys], dtype=np.int64)
    missing = np.array([off is None for off, _, _ in keys], dtype=bool)
    return {
        "layer": np.repeat(np.array([layer for _, layer, _ in keys], dtype=np.int64), n_rows),
        "head": np.concatenate([np.repeat(np.asarray(h, dtype=np.int64), n) for _, _, h in keys])
        if keys else np.zeros(0, dtype=np.int64),
        "offset": pd.arrays.IntegerArray(np.repeat(offs, n_rows), np.repeat(missing, n_rows)),
        "rank": np.tile(np.arange(n), sum(len(h) for _, _, h in keys)),
        "real": lam.real.flatten(), "imag": lam.imag.flatten(), "abs": np.abs(lam).flatten()}


def spectral_measures(model, layers=None, heads=None, offset: int | None = None,
                      k_e: int | None = None, eps: float = DEFAULT_EPS,
                      weights: str = "effective") -> pd.DataFrame:
    """Rotational mass, phase and antisymmetric energy of every selected head.

    ``model``: as in :func:`qk_spectrum` (a model or :class:`~posinterp.models.qk_only.QKWeights`).
    ``weights`` as in :func:`qk_weights` (default: the effective, norm-folded form).

    Returns:
        Tidy DataFrame ``hook, layer, head, position, offset, metric, value`` with
        ``metric`` in ``rotational_mass``, ``phase``, ``antisymmetric_energy``,
        ``n_complex_pairs``.

    Raises:
        ValueError: as :func:`qk_spectrum`, or ``k_e < 1``.
    """
    return _measures_frame(*_spectra(model, layers, heads, offset, weights), k_e, eps)


def _at_offset(keys, lam: Tensor, anti: Tensor, offset):
    """:func:`_spectra`'s output cut to one offset (None: every key), for callers that
    solved every offset once and want :func:`spectral_measures` at one of them."""
    if offset is None:
        return keys, lam, anti
    rows, kept, start = [], [], 0
    for key in keys:
        n = len(key[2])
        if key[0] == offset:
            kept.append(key)
            rows.extend(range(start, start + n))
        start += n
    idx = torch.tensor(rows, dtype=torch.long)
    return kept, lam[idx], anti[idx]


def _measures_frame(keys, lam: Tensor, anti: Tensor, k_e, eps) -> pd.DataFrame:
    """:func:`spectral_measures`' rows from :func:`_spectra`'s output: per (offset, layer),
    each measure over the heads, in that order."""
    meas = rotational_measures(lam, k_e, eps)
    meas["antisymmetric_energy"] = anti
    values = {m: v.double().numpy() for m, v in meas.items()}
    cols = {c: [] for c in ("hook", "layer", "head", "offset", "metric", "value")}
    start = 0
    for off, layer, head_ids in keys:  # one block per (offset, layer, measure), heads within
        stop, n = start + len(head_ids), len(head_ids)
        for metric, v in values.items():
            cols["hook"] += [f"blocks.{layer}.attn"] * n
            cols["layer"] += [layer] * n
            cols["head"] += list(head_ids)
            cols["offset"] += [pd.NA if off is None else off] * n
            cols["metric"] += [metric] * n
            cols["value"].append(v[start:stop])
        start = stop
    cols["value"] = np.concatenate(cols["value"]) if cols["value"] else np.zeros(0)
    df = pd.DataFrame({"hook": cols["hook"], "layer": cols["layer"], "head": cols["head"],
                       "position": pd.array([pd.NA] * len(cols["hook"]), dtype="Int64"),
                       "offset": pd.array(cols["offset"], dtype="Int64"),
                       "metric": cols["metric"], "value": cols["value"]})
    return df


def qk_geometry(model, layers=None, heads=None, offset: int | None = None,
                weights: str = "effective", num_std: float = 2.0) -> pd.DataFrame:
    """Symmetry and directionality of every selected head's M (Saponati et al. 2025).

    :func:`symmetry_score` and :func:`directionality_score` of M(Δ) = W_Q W_K'^T as
    :func:`qk_weights` forms it (``weights`` and rotary offsets as :func:`spectral_measures`:
    Δ = 0 and -1 for rotary models unless ``offset`` picks one), beside the rotational
    measures. Never forms a d_model x d_model matrix.

    Returns:
        Tidy DataFrame ``hook, layer, head, position, offset, metric, value`` with
        ``metric`` in ``symmetry``, ``directionality``.

    Raises:
        ValueError: as :func:`qk_spectrum`.
    """
    rows = []
    for off, layer, head_ids, W_Q, W_K in _selected_weights(model, layers, heads, offset, weights):
        meas = {"symmetry": symmetry_score(W_Q, W_K),
                "directionality": directionality_score(W_Q, W_K, num_std)}
        for metric, values in meas.items():
            for head, v in zip(head_ids, values.tolist(), strict=True):
                rows.append(dict(hook=f"blocks.{layer}.attn", layer=layer, head=head,
                                 position=pd.NA, offset=off, metric=metric, value=float(v)))
    return pd.DataFrame(rows).astype({"offset": "Int64", "position": "Int64"})


def ginibre_null(d_model: int, d_head: int, n_heads: int = NULL_HEADS, std: float = 0.02,
                 k_e: int | None = None, eps: float = DEFAULT_EPS, seed: int = 0) -> pd.DataFrame:
    """Measures of random heads: W_Q, W_K with i.i.d. N(0, std^2) entries (product-Ginibre B).

    At initialization B = W_K^T W_Q is a product of Gaussian matrices; about 89% of a
    64 x 64 Ginibre matrix's eigenvalues are already complex, so trained heads are
    compared with this null, not with zero (docs/concepts.md; Ginibre 1965). The default
    2,500 heads keep the Monte Carlo standard error of a percentile at most 1 point
    (100·sqrt(p(1-p)/n) <= 100·0.5/50); :func:`null_percentiles` reports it per head.

    Seeded: the same arguments give the same frame, so it is drawn once per process and
    copied out on later calls.

    Returns:
        Wide DataFrame, one row per simulated head, columns = measure names.

    Raises:
        ValueError: for non-positive sizes.
    """
    if min(d_model, d_head, n_heads) < 1:
        raise ValueError("d_model, d_head and n_heads must be >= 1")
    return _ginibre_null(int(d_model), int(d_head), int(n_heads), float(std),
                         None if k_e is None else int(k_e), float(eps), int(seed)).copy()


# Random heads are drawn this many at a time: at d_head 128 a block's B, Gram matrices and
# Bartlett factors are 6 x 32 MiB, whatever d_model (docs/scale.md).
RANDOM_HEAD_BLOCK = 256


def _bartlett(rng: np.random.Generator, n: int, rows: int, cols: int) -> np.ndarray:
    """``[n, cols, cols]`` upper-triangular R of the thin QR of ``n`` Gaussian
    ``[rows, cols]`` matrices (``rows >= cols``), drawn directly: R_ii = sqrt(chi2 with
    rows - i degrees of freedom), R_ij ~ N(0, 1) above the diagonal, all independent
    (Bartlett 1933; Muirhead 1982, Thm 3.2.14). R^T R is then Wishart(rows, I_cols)."""
    R = np.triu(rng.standard_normal((n, cols, cols)), 1)
    diag = np.sqrt(rng.chisquare(rows - np.arange(cols), size=(n, cols)))
    R[:, np.arange(cols), np.arange(cols)] = diag
    return R


def random_small_forms(rng: np.random.Generator, n: int, d_model: int, d_head: int,
                       block: int = RANDOM_HEAD_BLOCK):
    """Yield blocks ``(B, G_Q, G_K)``, each ``[b, d_head, d_head]`` float64 tensors, of
    ``n`` random heads: B = W_K^T W_Q, G_Q = W_Q^T W_Q, G_K = W_K^T W_K for W_Q, W_K
    ``[d_model, d_head]`` with i.i.d. N(0, 1) entries, drawn in d_head space.

    The same joint law as forming the products from d_model-sized draws, at a
    d_head/d_model fraction of the random numbers and none of the d_model-sized
    products: W_K = Q R with R a Bartlett factor and Q Haar, independent of R; given Q,
    A = Q^T W_Q is a d_head x d_head Gaussian and the rest of W_Q, (I - QQ^T) W_Q, a
    Gaussian in the other d_model - d_head dimensions, independent of A. So B = R^T A,
    G_K = R^T R and G_Q = A^T A + C^T C with C^T C ~ Wishart(d_model - d_head, I)
    (itself a Bartlett R'^T R' when d_model - d_head >= d_head). Where d_model <=
    d_head the d_model-sized draws are the small ones and are used as they are.
    ``rng`` (numpy's seeded generator) fixes every number; ``block`` heads at a time
    bound the memory. Source: product-Ginibre null, docs/spectra.md; issue 36.
    """
    for start in range(0, n, block):
        b = min(block, n - start)
        if d_model <= d_head:
            q = rng.standard_normal((b, d_model, d_head))
            k = rng.standard_normal((b, d_model, d_head))
            B, Gq, Gk = k.transpose(0, 2, 1) @ q, q.transpose(0, 2, 1) @ q, k.transpose(0, 2, 1) @ k
        else:
            R = _bartlett(rng, b, d_model, d_head)
            A = rng.standard_normal((b, d_head, d_head))
            Rt = R.transpose(0, 2, 1)
            B, Gk = Rt @ A, Rt @ R
            rest = d_model - d_head
            C = (_bartlett(rng, b, rest, d_head) if rest >= d_head
                 else rng.standard_normal((b, rest, d_head)))
            Gq = A.transpose(0, 2, 1) @ A + C.transpose(0, 2, 1) @ C
        yield torch.from_numpy(B), torch.from_numpy(Gq), torch.from_numpy(Gk)


# The null's algorithm version in the on-disk cache (posinterp._disk_cache): bump it
# whenever a change to the draws or the measures changes its numbers. 2: drawn in d_head
# space (random_small_forms), the same law as version 1's d_model-sized draws.
GINIBRE_NULL_VERSION = 2


@functools.lru_cache(maxsize=8)
def _ginibre_null(d_model: int, d_head: int, n_heads: int, std: float, k_e: int | None,
                  eps: float, seed: int) -> pd.DataFrame:
    # Seeded, so the same arguments always give the same frame: drawn once per machine
    # (seconds for 2,500 heads, the eigenvalues' cost), kept on disk and in this process, then
    # copied out. A notebook that inspects one model several times, a zoo of one
    # architecture, or a second `posinterp inspect` pays for it once.
    def draw() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        out = []
        for B, Gq, Gk in random_small_forms(rng, n_heads, d_model, d_head):
            var = std * std  # every form is quadratic in the weights
            B, Gq, Gk = B * var, Gq * var, Gk * var
            m = rotational_measures(small_form_eigenvalues(B), k_e, eps)
            m["antisymmetric_energy"] = _antisymmetric_energy_from_forms(B, Gq, Gk)
            out.append(pd.DataFrame({key: v.numpy() for key, v in m.items()}))
        frame = pd.concat(out, ignore_index=True)
        return {c: frame[c].to_numpy() for c in frame.columns}

    args = {"d_model": d_model, "d_head": d_head, "n_heads": n_heads, "std": std, "k_e": k_e,
            "eps": eps, "seed": seed}
    return pd.DataFrame(cached_arrays("ginibre_null", GINIBRE_NULL_VERSION, args, draw))


def null_percentiles(measures: pd.DataFrame, null: pd.DataFrame) -> pd.DataFrame:
    """Each head's percentile (0-100) within the null, per measure, with its Monte Carlo SE.

    Uses ``scipy.stats.percentileofscore(kind="mean")``; adds rows with metric
    ``<measure>_null_percentile`` and ``<measure>_null_percentile_se``, the binomial
    standard error of that percentile from a finite null, 100·sqrt(p(1-p)/n) in
    percentile points with p clipped to [1/n, 1 - 1/n] (another null seed moves a
    percentile by about this much; 2,500 null heads keep it <= 1 point).

    Raises:
        ValueError: for an empty null.
    """
    n = len(null)
    if n < 1:
        raise ValueError("null must hold at least one simulated head")
    rows = []
    for metric in MEASURES:
        sub = measures[measures.metric == metric]
        ref = null[metric].to_numpy()
        pct = np.atleast_1d(stats.percentileofscore(ref, sub.value.to_numpy(), kind="mean"))
        p = np.clip(pct / 100, 1 / n, 1 - 1 / n)
        rows.append(sub.assign(metric=f"{metric}_null_percentile", value=pct))
        rows.append(sub.assign(metric=f"{metric}_null_percentile_se",
                               value=100 * np.sqrt(p * (1 - p) / n)))
    return pd.concat(rows, ignore_index=True)
