"""The adjacency probability score of Zuo et al. 2024 (arXiv 2501.00073), docs/concepts.md.

For row k of a cosine-similarity matrix C (0-based positions over real tokens), over
all pairs 0 <= i < j < k::

    P_k = (1 / C(k, 2)) * sum( 1[C_ki < C_kj] + 1/2 * 1[C_ki = C_kj] )

i.e. how often a nearer earlier token is more similar than a farther one. Rows k < 2
are skipped and the matrix score is the mean of P_k. P_k = (1 + tau_a) / 2 with
Kendall's tau-a between j and C_kj. Each row costs O(k log k): a compiled merge sort
counts the inversions and the ties exactly (integers, ``_adjacency_kernel``), so a
matrix is O(n^2 log n), not the O(n^3) pair loop, and a batch is one compiled call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._adjacency_kernel import batch_counts, row_counts
from ._checks import check_attention_mask, check_tokens, lengths_from_mask, run_reduced
from .similarity import SITES, cosine_self_similarity, site_hooks

__all__ = ["AdjacencyScore", "adjacency_by_layer", "adjacency_row", "adjacency_score"]

Ties = Literal["half", "strict"]


def _check_ties(ties) -> None:
    if ties not in ("half", "strict"):
        raise ValueError(f"ties must be 'half' or 'strict', got {ties!r}")


def _score_from_counts(k, inv, tie, ties: Ties):
    """P_k from integer pair counts; one division, so it is the exact ratio rounded once."""
    n0 = k * (k - 1) // 2
    if ties == "half":  # (n_concordant + n_tie / 2) / n0, doubled to stay in integers
        return (2 * (n0 - inv) - tie) / (2 * n0)
    return (n0 - inv - tie) / n0  # n_concordant / n0


def adjacency_row(values: np.ndarray, ties: Ties = "half") -> float:
    """P_k for one row: ``values[j] = C_kj`` for j < k (the row's prefix before k).

    Source: Zuo et al. 2024 (arXiv 2501.00073), ties counting 1/2 as in
    docs/concepts.md, "Adjacency probability score".

    Args:
        values: 1-D array of length k >= 2 (float; compared exactly).
        ties: ``"half"`` counts a tie C_ki = C_kj as 1/2 (default); ``"strict"`` counts
            only 1[C_ki < C_kj], the literal indicator.

    Returns:
        P_k in [0, 1]; a constant row gives 0.5 with ``"half"`` and 0 with ``"strict"``.

    Raises:
        ValueError: for fewer than 2 values, NaNs, or an unknown ``ties``.
    """
    _check_ties(ties)
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.shape[0] < 2:
        raise ValueError(f"values must be 1-D with at least 2 entries, got shape {v.shape}")
    inv, tie = row_counts(v)
    if inv < 0:
        raise ValueError("values contain NaN; drop padding before scoring")
    return float(_score_from_counts(v.shape[0], inv, tie, ties))


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

    One compiled pass over every scored row of every matrix; no per-row Python.
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
        ValueError: if matrices are not square, ``lengths`` is not integer or has the
            wrong shape or range,
            a sequence has fewer than 3 real tokens, a used entry is NaN, or ``ties`` is
            unknown.
    """
    _check_ties(ties)
    if similarity.ndim == 2:
        similarity = similarity[None]
    if similarity.ndim != 3 or similarity.shape[-1] != similarity.shape[-2]:
        raise ValueError(
            f"similarity must have shape [batch, pos, pos], got {tuple(similarity.shape)}")
    batch, pos, _ = similarity.shape
    if lengths is None:
        lengths = torch.full((batch,), pos, dtype=torch.long)
    lengths = torch.as_tensor(lengths).cpu()
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be integer token counts, got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape [batch] = ({batch},), got {tuple(lengths.shape)}")
    if (lengths > pos).any():
        raise ValueError(f"lengths must be <= pos = {pos}, got max {int(lengths.max())}")
    if (lengths < 3).any():
        raise ValueError(
            "adjacency needs at least 3 real tokens per sequence (rows k >= 2); "
            f"got lengths {lengths.tolist()}")
    sim = similarity.detach().to(torch.float64).cpu().numpy()
    n_real = lengths.long().cpu().numpy()
    inv, tie = batch_counts(sim, n_real)
    if (inv < 0).any():
        b, k = np.argwhere(inv < 0)[0]
        raise ValueError(
            f"similarity has NaN among the entries used (sequence {b}, row {k}, columns < {k}); "
            "drop padding through lengths before scoring")
    k = np.arange(pos)
    scored = (k >= 2) & (k[None, :] < n_real[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):  # rows k < 2 have no pairs
        per_row = np.where(scored, _score_from_counts(k, inv, tie, ties), np.nan)
    per_sequence = np.nanmean(per_row, axis=1)
    return AdjacencyScore(
        score=float(per_sequence.mean()),
        per_sequence=torch.from_numpy(per_sequence),
        per_row=torch.from_numpy(per_row),
    )


@torch.no_grad()
def adjacency_by_layer(
    model,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    ties: Ties = "half",
    per_position: bool = False,
    sites=SITES,
    query_block: int | str | None = "auto",
) -> pd.DataFrame:
    """Adjacency score at the embedding and, per layer, at the attention output, after the
    attention sublayer, at the MLP output and after the block.

    One forward pass; each hook of :func:`~posinterp.analysis.site_hooks` is scored as the
    pass reaches it and its similarity matrix dropped, so peak memory is a few
    ``[batch, pos, pos]`` matrices whatever the number of hooks (nothing is cached).
    ``blocks.{l}.hook_attn_out`` is the paper's measurement point (the first attention
    output is a convex mix of earlier values); ``hook_resid_mid`` adds the embedding to it,
    so its score also depends on the two norms' ratio (docs/concepts.md).
    Padding (either side) is dropped through
    ``attention_mask``, so left-padding leaves the real tokens' scores unchanged.
    Source: Zuo et al. 2024 (arXiv 2501.00073); docs/concepts.md.

    Args:
        model: a TransformerLens model (``HookedTransformer`` or compatible).
        tokens: ``[batch, pos]`` token ids, ``pos <= n_ctx``.
        attention_mask: ``[batch, pos]``, 1 for real tokens.
        ties: see :func:`adjacency_row`.
        per_position: also add rows ``metric="adjacency_row"`` with P_k per position k
            (mean over the sequences that have it).
        sites: hook suffixes per layer, among ``("attn_out", "resid_mid", "mlp_out",
            "resid_post")``, or one of them as a string (all by default; a model's missing
            hooks are skipped).
        query_block: run the forward pass this many positions at a time through the
            model's KV cache, so no layer's ``[pos, pos]`` attention is made (each hook is
            scored once its last block ran); ``"auto"`` (default): blocks of 512 past
            2,048 tokens where the model's pass in blocks is verified, else one pass
            (:func:`~posinterp.analysis._attention_blocks.resolve_query_block`).

    Returns:
        Tidy DataFrame with columns ``hook, layer, head, position, metric, value,
        n_sequences``; ``metric == "adjacency_score"`` rows hold the batch score, ``layer``
        is -1 for the embedding.

    Raises:
        ValueError: for tokens longer than ``n_ctx``, a malformed mask, fewer than 3 real
            tokens in a sequence, an unknown ``ties``, an unknown site or a bad
            ``query_block``.
        MissingFeatureError: an int ``query_block`` on a model whose pass in blocks is
            refused (:func:`~posinterp.models.backend.check_chunked_pass`).
    """
    from ._attention_blocks import resolve_query_block

    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    fwd_hooks, table = adjacency_hooks(model, tokens, mask, ties, per_position, sites)
    block = resolve_query_block(model, tokens.shape[1], query_block)
    run_reduced(model, tokens, mask, [(name, lambda a, fn=fn: fn(a, hook=None))
                                      for name, fn in fwd_hooks], query_block=block)
    return table()


def adjacency_hooks(model, tokens, attention_mask=None, ties: Ties = "half",
                    per_position: bool = False, sites=SITES, layers=None):
    """:func:`adjacency_by_layer` as forward hooks, to ride along another forward pass.

    Each hook scores its activation as the pass reaches it and drops the similarity
    matrix, so nothing is cached and peak memory does not grow with the number of hooks.

    Returns:
        ``(fwd_hooks, table)``: ``[(hook_name, fn)]`` for ``model.hooks(fwd_hooks=...)``
        around one forward pass on ``tokens`` and ``attention_mask``, and a function
        that returns :func:`adjacency_by_layer`'s DataFrame once that pass has run.

    ``layers``: score only these blocks' sites (and the embedding); None: every block.

    Raises:
        ValueError: as :func:`adjacency_by_layer` (checked before any hook exists).
    """
    hooks = site_hooks(model, sites)
    if layers is not None:
        hooks = [(name, layer) for name, layer in hooks if layer == -1 or layer in set(layers)]
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    lengths = lengths_from_mask(mask, *tokens.shape)
    if (lengths < 3).any():
        raise ValueError(
            "adjacency needs at least 3 real tokens per sequence; "
            f"got lengths {lengths.tolist()}")
    scores = {}
    mask_cpu = None if mask is None else mask.cpu()

    def score(name):
        def hook(act, hook):  # scored here and dropped: no activation or matrix is kept
            sim = cosine_self_similarity(act.detach().cpu(), mask_cpu)
            scores[name] = adjacency_score(sim, lengths, ties)
        return hook

    return [(name, score(name)) for name, _ in hooks], lambda: _adjacency_table(
        hooks, scores, lengths, per_position)


def _adjacency_table(hooks, scores, lengths, per_position) -> pd.DataFrame:
    missing = [h for h, _ in hooks if h not in scores]
    if missing:
        raise ValueError(f"hooks {missing} did not fire during the forward pass")
    rows = []
    for hook, layer in hooks:
        res = scores[hook]
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
