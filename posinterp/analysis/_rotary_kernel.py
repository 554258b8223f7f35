"""The permutation residuals behind the positional/symbolic score, compiled.

Definition: :func:`posinterp.analysis.frequencies.positional_symbolic_from_qk`. For a
query i and key position j of its window, with m = σ_i(j) the key moved to j,

    l'_i(j) = (q_i R(i)) · (k_m R(j)) / scale
            = Σ_p [cos(j θ_p) (u1 v1 + u2 v2) + sin(j θ_p) (u2 v1 - u1 v2)] / scale
              + Σ_rest q_i · k_m / scale

with u = (q_i R(i))_p and v = (k_m)_p the two components of rotary pair p; the score
needs, per head, Σ (l' - l)² and Σ (l'_i(j) - l_i(m))² over the compared entries. Why a
compiled loop: the l' are n²/2 dot products of length d_head per head, but each pairs a
query with a different gathered key, so array code builds [head, query, key, pair]
temporaries several times the size of the answer and spends its time moving them through
memory (about 85 ms per layer and sequence on SmolLM2-135M, against 4 ms here). The loop
reads each operand once and keeps only the two sums, in float64.
"""

from __future__ import annotations

import numpy as np

from ._adjacency_kernel import _jit  # numba with a cache that can never stop a run

__all__ = ["permutation_residual_sums"]


# Reassociation lets LLVM vectorize the sums over pairs (the order of a float64 sum of
# 32 terms: differences near 1e-16 relative); NaN and inf keep their IEEE meaning.
@_jit(fastmath={"reassoc", "contract"})
def _kernel(u1, u2, v1, v2, qr, kr, sigma, cos, sin, logits, keep, scale, pos_sum, sym_sum):
    H, n, P = u1.shape
    R = qr.shape[2]
    for h in range(H):
        sp = 0.0
        ss = 0.0
        for i in range(n):
            for j in range(i + 1):
                if not keep[i, j]:
                    continue
                m = sigma[i, j]
                acc = 0.0
                for p in range(P):
                    a1, a2 = u1[h, i, p], u2[h, i, p]
                    b1, b2 = v1[h, m, p], v2[h, m, p]
                    acc += cos[j, p] * (a1 * b1 + a2 * b2) + sin[j, p] * (a2 * b1 - a1 * b2)
                for r in range(R):
                    acc += qr[h, i, r] * kr[h, m, r]
                lp = acc / scale
                dp = lp - logits[h, i, j]
                ds = lp - logits[h, i, m]
                sp += dp * dp
                ss += ds * ds
        pos_sum[h] = sp
        sym_sum[h] = ss


def permutation_residual_sums(q_rot: np.ndarray, k: np.ndarray, logits: np.ndarray,
                              sigma: np.ndarray, keep: np.ndarray, first: np.ndarray,
                              second: np.ndarray, rest: np.ndarray, cos: np.ndarray,
                              sin: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """``([H], [H])`` float64 sums of (l' - l)² and (l'_i(j) - l_i(σ_i(j)))² over ``keep``.

    Args:
        q_rot: ``[H, n, d_head]`` rotated queries; k: ``[H, n, d_head]`` unrotated keys;
            logits: ``[H, n, n]`` the unpermuted logits l (already divided by ``scale``).
        sigma: ``[n, n]`` int, the key moved to (i, j); keep: ``[n, n]`` bool, the entries
            compared (inside the causal triangle); first, second: the rotary pairs' dims;
            rest: the unrotated dims; cos, sin: ``[n, P]`` of j θ_p.
    """
    c = np.ascontiguousarray
    H = q_rot.shape[0]
    pos_sum, sym_sum = np.zeros(H), np.zeros(H)
    _kernel(c(q_rot[..., first]), c(q_rot[..., second]), c(k[..., first]), c(k[..., second]),
            c(q_rot[..., rest]), c(k[..., rest]), c(sigma.astype(np.int64)), c(cos), c(sin),
            c(logits), c(keep), float(scale), pos_sum, sym_sum)
    return pos_sum, sym_sum
