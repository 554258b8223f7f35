"""The adjacency probability score of Zuo et al. 2024 (arXiv 2501.00073), docs/concepts.md.

For row k of a cosine-similarity matrix C (0-based positions over real tokens), over
all pairs 0 <= i < j < k::

    P_k = (1 / C(k, 2)) * sum( 1[C_ki < C_kj] + 1/2 * 1[C_ki = C_kj] )

i.e. how often a nearer earlier token is more similar than a farther one. Rows k < 2
are skipped and the matrix score is the mean of P_k. Since P_k = (1 + tau_a) / 2 with
Kendall's tau-a between j and C_kj, each row costs O(k log k): we take the exact
concordant-minus-discordant count from ``scipy.stats.kendalltau`` (tau-b, converted
with the tie counts), so the whole matrix is O(n^2 log n), not the O(n^3) pair loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy import stats
from torch import Tensor

from ._checks import check_attention_mask, check_tokens, lengths_from_mask
from .similarity import residual_hooks, similarity_by_layer

__all__ = ["AdjacencyScore", "adjacency_by_layer", "adjacency_row", "adjacency_score"]

Ties = Literal["half", "strict"]


def adjacency_row(values: np.ndarray, ties: Ties = "half") -> float:
    """P_k for one row: ``values[j] = C_kj`` for j < k (the row's prefix before k).

    Args:
        values: 1-D array of length k >= 2 (float; compared exactly).
        ties: ``"half"`` counts a tie C_ki = C_kj as 1/2 (default); ``"strict"`` counts
            only 1[C_ki < C_kj], the literal indicator.

    Returns:
        P_k in [0, 1]; a constant row gives 0.5 with ``"half"`` and 0 with ``"strict"``.

    Raises:
        ValueError: for fewer than 2 values, NaNs, or an unknown ``ties``.
    """
    if ties not in ("half", "strict"):
        raise ValueError(f"ties must be 'half' or 'strict', got {ties!r}")
    v = np.asarray(values, dtype=np.float64)
    k = v.shape[0]
    if v.ndim != 1 or k < 2:
        raise ValueError(f"values must be 1-D with at least 2 entries, got shape {v.shape}")
    if np.isnan(v).any():
        raise ValueError("values contain NaN; drop padding before scoring")
    n0 = k * (k - 1) // 2
    _, counts = np.unique(v, return_counts=True)
    n_tie = int((counts * (counts - 1) // 2).sum())
    if n_tie == n0:  # constant row: kendalltau is NaN, every pair is a tie
        con_minus_dis = 0
    elif k == 2:  # scipy's asymptotic variance divides by k - 2
        con_minus_dis = int(np.sign(v[1] - v[0]))
    else:
        tau_b = stats.kendalltau(np.arange(k), v, method="asymptotic").statistic
        # tau_b = (n_c - n_d) / sqrt(n0 * (n0 - n_tie)); n_c - n_d is an integer.
        con_minus_dis = round(tau_b * math.sqrt(n0) * math.sqrt(n0 - n_tie))
    if ties == "half":  # (n_c + n_tie / 2) / n0
        return (n0 + con_minus_dis) / (2 * n0)
    return (n0 - n_tie + con_minus_dis) / (2 * n0)  # n_c / n0


@dataclass(frozen=True)
class AdjacencyScore:
    """Adjacency scores of a batch of similarity matrices.

    Attributes:
        score: mean over sequences of the per-sequence score (unitless, chance = 0.5).
        per_sequence: ``[batch]`` mean of P_k over rows 2 <= k < length.
        per_row: ``[batch, pos]`` P_k, NaN where undefined (k < 2 or past the length).
    """

    score: float
    per_sequence: Float[Tensor, "batch"]
    per_row: Float[Tensor, "batch pos"]

    @property
    def row_curve(self) -> Float[Tensor, "pos"]:
        """Mean P_k over the sequences that have row k, ``[pos]``; NaN where none do."""
        valid = ~torch.isnan(self.per_row)
        total = torch.where(valid, self.per_row, 0.0).sum(0)
        n = valid.sum(0)
        return torch.where(n > 0, total / n.clamp_min(1), float("nan"))


def adjacency_score(
    similarity: Float[Tensor, "batch pos pos"],
    lengths: Int[Tensor, "batch"] | None = None,
    ties: Ties = "half",
) -> AdjacencyScore:
    """Adjacency probability score of cosine-similarity matrices (exact, O(n^2 log n) each).

    Source: Zuo, Guerzhoy & Guerzhoy 2024, arXiv 2501.00073 (the adjacency pattern);
    definition and tie convention as in docs/concepts.md.

    Args:
        similarity: ``[batch, pos, pos]`` (or one ``[pos, pos]``) matrices, real tokens
            first as returned by :func:`~posinterp.analysis.cosine_self_similarity`.
        lengths: real tokens per sequence, ``[batch]``; default: all ``pos``.
        ties: ``"half"`` (default) or ``"strict"``, see :func:`adjacency_row`.

    Returns:
        :class:`AdjacencyScore`.

    Raises:
        ValueError: if matrices are not square, ``lengths`` has the wrong shape or range,
            a sequence has fewer than 3 real tokens, a used entry is NaN, or ``ties`` is
            unknown.
    """
    if ties not in ("half", "strict"):
        raise ValueError(f"ties must be 'half' or 'strict', got {ties!r}")
    if similarity.ndim == 2:
        similarity = similarity[None]
    if similarity.ndim != 3 or similarity.shape[-1] != similarity.shape[-2]:
        raise ValueError(
            f"similarity must have shape [batch, pos, pos], got {tuple(similarity.shape)}")
    batch, pos, _ = similarity.shape
    if lengths is None:
        lengths = torch.full((batch,), pos, dtype=torch.long)
    lengths = torch.as_tensor(lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape [batch] = ({batch},), got {tuple(lengths.shape)}")
    if (lengths > pos).any():
        raise ValueError(f"lengths must be <= pos = {pos}, got max {int(lengths.max())}")
    if (lengths < 3).any():
        raise ValueError(
            "adjacency needs at least 3 real tokens per sequence (rows k >= 2); "
            f"got lengths {lengths.tolist()}")
    sim = similarity.detach().to(torch.float64).cpu().numpy()
    per_row = np.full((batch, pos), np.nan)
    for b in range(batch):
        for k in range(2, int(lengths[b])):
            per_row[b, k] = adjacency_row(sim[b, k, :k], ties)
    per_sequence = np.nanmean(per_row, axis=1)
    return AdjacencyScore(
        score=float(per_sequence.mean()),
        per_sequence=torch.from_numpy(per_sequence),
        per_row=torch.from_numpy(per_row),
    )


def adjacency_by_layer(
    model,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    ties: Ties = "half",
    per_position: bool = False,
) -> pd.DataFrame:
    """Adjacency score at the embedding, after each attention sublayer and after each block.

    One forward pass caching only the residual hooks of
    :func:`~posinterp.analysis.residual_hooks`. Padding (either side) is dropped through
    ``attention_mask``, so left-padding leaves the real tokens' scores unchanged.
    Source: Zuo et al. 2024 (arXiv 2501.00073); docs/concepts.md.

    Args:
        model: a TransformerLens model (``HookedTransformer`` or compatible).
        tokens: ``[batch, pos]`` token ids, ``pos <= n_ctx``.
        attention_mask: ``[batch, pos]``, 1 for real tokens.
        ties: see :func:`adjacency_row`.
        per_position: also add rows ``metric="adjacency_row"`` with P_k per position k
            (mean over the sequences that have it).

    Returns:
        Tidy DataFrame with columns ``hook, layer, head, position, metric, value,
        n_sequences``; ``metric == "adjacency_score"`` rows hold the batch score, ``layer``
        is -1 for the embedding.

    Raises:
        ValueError: for tokens longer than ``n_ctx``, a malformed mask, fewer than 3 real
            tokens in a sequence, or an unknown ``ties``.
    """
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape))
    lengths = lengths_from_mask(mask, *tokens.shape)
    if (lengths < 3).any():
        raise ValueError(
            "adjacency needs at least 3 real tokens per sequence; "
            f"got lengths {lengths.tolist()}")
    sims = similarity_by_layer(model, tokens, mask)
    rows = []
    for hook, layer in residual_hooks(model):
        res = adjacency_score(sims[hook], lengths, ties)
        rows.append(dict(hook=hook, layer=layer, head=pd.NA, position=pd.NA,
                         metric="adjacency_score", value=res.score, n_sequences=len(lengths)))
        if per_position:
            valid = ~torch.isnan(res.per_row)
            for k, v in enumerate(res.row_curve.tolist()):
                if not math.isnan(v):
                    rows.append(dict(hook=hook, layer=layer, head=pd.NA, position=k,
                                     metric="adjacency_row", value=v,
                                     n_sequences=int(valid[:, k].sum())))
    df = pd.DataFrame(rows)
    return df.astype({"head": "Int64", "position": "Int64", "layer": "int64"})
