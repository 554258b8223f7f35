"""Which coordinates of a head a RoPE pair occupies: the one definition of the two layouts.

RoPE rotates the first ``rotary_dim`` dims of each head as ``rotary_dim / 2`` pairs, pair
p by ``t · θ_p`` at position t (Su et al. 2021, RoFormer, eq. 34); the remaining
``d_head - rotary_dim`` dims (partial rotary) pass through. Implementations differ only
in which two dims form pair p:

* **split halves** (GPT-NeoX, Llama and HF's ``rotate_half``; TransformerLens
  ``rotary_adjacent_pairs=False``): pair p is ``(p, p + rotary_dim/2)``; the per-dim
  frequency table is ``[θ_0 .. θ_{P-1}, θ_0 .. θ_{P-1}]`` (einops ``"d -> (2 d)"``);
* **adjacent pairs** (GPT-J, Karpathy's llama2.c; TransformerLens
  ``rotary_adjacent_pairs=True``, HF GPT-J's ``rotate_every_two``): pair p is
  ``(2p, 2p + 1)``; the table is ``[θ_0, θ_0, θ_1, θ_1, ..]`` (einops ``"d -> (d 2)"``).

Either way a pair (a, b) becomes ``(a cos - b sin, b cos + a sin)``, i.e.
``x cos + rotate_pairs(x) sin`` with the duplicated table. Sources: Su et al. 2021 eq. 34;
GPT-NeoX ``megatron/model/positional_embeddings.py`` (``rotate_half``) vs GPT-J
``mesh_transformer/layers.py`` (``rotate_every_two``); TransformerLens
``AbstractAttention.rotate_every_two`` / ``calculate_sin_cos_rotary``.

Pure functions, torch only: every user (models, backend, analysis, interventions) imports
the layout from here.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["duplicate_frequencies", "merge_pairs", "pair_dims", "pair_indices", "rotate_pairs",
           "split_pairs"]


def pair_dims(p, rotary_dim: int, adjacent_pairs: bool):
    """``(first, second)``: the two dims of rotary pair ``p`` (an int, or an integer tensor
    of pair indices, elementwise).

    ``(2p, 2p + 1)`` if ``adjacent_pairs`` else ``(p, p + rotary_dim/2)``. No range check:
    callers validate ``p`` (see :func:`pair_indices`).
    """
    return (2 * p, 2 * p + 1) if adjacent_pairs else (p, p + rotary_dim // 2)


def pair_indices(d_head: int, rotary_dim: int, adjacent_pairs: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(first, second, unrotated)`` dim indices: pair p is (first[p], second[p]).

    Pairs are (2p, 2p+1) if ``adjacent_pairs`` else (p, p + rotary_dim/2), as
    TransformerLens's ``rotary_adjacent_pairs`` says; ``unrotated`` is
    ``rotary_dim .. d_head - 1`` (empty without partial rotary). ``first`` and ``second``
    are int64 ``[rotary_dim / 2]``, ``unrotated`` int64 ``[d_head - rotary_dim]``.

    Raises:
        ValueError: for an odd ``rotary_dim`` or one outside ``(0, d_head]``.
    """
    if rotary_dim % 2 or not 0 < rotary_dim <= d_head:
        raise ValueError(f"rotary_dim must be even and in (0, d_head={d_head}], got {rotary_dim}")
    first, second = pair_dims(torch.arange(rotary_dim // 2), rotary_dim, adjacent_pairs)
    return first, second, torch.arange(rotary_dim, d_head)


def duplicate_frequencies(freqs: Tensor, adjacent_pairs: bool) -> Tensor:
    """Per-pair values ``[..., rotary_dim / 2]`` (frequencies, angles) spread over the dims
    of each pair, ``[..., rotary_dim]``: ``repeat_interleave(2)`` for adjacent pairs
    (``"d -> (d 2)"``), ``cat([f, f])`` for split halves (``"d -> (2 d)"``). A copy, so
    the values are bit for bit those given."""
    return freqs.repeat_interleave(2, -1) if adjacent_pairs else torch.cat([freqs, freqs], -1)


def rotate_pairs(x: Tensor, adjacent_pairs: bool) -> Tensor:
    """Each pair (a, b) of ``x`` ``[..., rotary_dim]`` replaced by (-b, a): the quarter turn
    in ``x cos + rotate_pairs(x) sin``. Split halves: HF/GPT-NeoX ``rotate_half``;
    adjacent pairs: GPT-J/TransformerLens ``rotate_every_two``. Same shape and dtype."""
    if adjacent_pairs:
        out = torch.empty_like(x)
        out[..., ::2] = -x[..., 1::2]
        out[..., 1::2] = x[..., ::2]
        return out
    n = x.shape[-1] // 2
    return torch.cat([-x[..., n:], x[..., :n]], dim=-1)


def split_pairs(x: Tensor, adjacent_pairs: bool) -> tuple[Tensor, Tensor]:
    """``(a, b)`` ``[..., rotary_dim / 2]`` each: the first and second members of every pair
    of ``x`` ``[..., rotary_dim]`` (views, no copy)."""
    if adjacent_pairs:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def merge_pairs(a: Tensor, b: Tensor, adjacent_pairs: bool) -> Tensor:
    """The inverse of :func:`split_pairs`: ``[..., rotary_dim]`` with pair p = (a[p], b[p])."""
    if adjacent_pairs:
        return torch.stack([a, b], -1).flatten(-2)
    return torch.cat([a, b], -1)
