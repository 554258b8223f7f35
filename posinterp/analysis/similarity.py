"""Cosine self-similarity of the residual stream (Zuo et al. 2024, arXiv 2501.00073, §3).

Pure tensor functions first, hook plumbing last. Padding is never a position: real
tokens are compacted to the front, so the k-th real token is position k whatever the
padding side, and entries involving padding are NaN.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._checks import check_attention_mask, check_tokens, run_cached

__all__ = ["compact_real_tokens", "cosine_self_similarity", "residual_hooks", "similarity_by_layer"]


def compact_real_tokens(
    x: Float[Tensor, "batch pos ..."], attention_mask: Int[Tensor, "batch pos"] | None
) -> Float[Tensor, "batch pos ..."]:
    """Move each sequence's real tokens to the front, in order; fill the rest with NaN.

    One batched gather (a stable sort of the mask puts real positions first, in order),
    no per-sequence loop. Source: docs/concepts.md, "Cosine self-similarity" (a pad is never a position).

    Args:
        x: ``[batch, pos, ...]`` values per position (any dtype that holds NaN).
        attention_mask: ``[batch, pos]``, 1 for real tokens, 0 for padding (either side);
            None keeps ``x`` as is.

    Returns:
        ``[batch, pos, ...]``: row k of sequence b is its k-th real token; NaN past its
        number of real tokens.

    Raises:
        ValueError: if ``attention_mask`` is not a 0/1 tensor of shape ``x.shape[:2]``.
    """
    mask = check_attention_mask(attention_mask, tuple(x.shape[:2]))
    if mask is None:
        return x
    mask = mask.to(x.device)
    order = torch.sort(1 - mask, dim=1, stable=True).indices  # real (0) before pad (1)
    index = order.reshape(*order.shape, *([1] * (x.ndim - 2))).expand_as(x)
    out = x.gather(1, index)
    past_end = torch.arange(x.shape[1], device=x.device)[None, :] >= mask.sum(1, keepdim=True)
    return out.masked_fill(past_end.reshape(*past_end.shape, *([1] * (x.ndim - 2))), float("nan"))


def cosine_self_similarity(
    resid: Float[Tensor, "batch pos d_model"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    eps: float = 1e-8,
) -> Float[Tensor, "batch pos pos"]:
    """C_ij = <x_i, x_j> / (|x_i| |x_j|) between positions of each sequence (unitless, [-1, 1]).

    Computed in float64. Each vector is divided by ``max(|x|, eps)``, the convention of
    ``torch.nn.functional.cosine_similarity``, so a zero vector has similarity 0.
    Source: Zuo et al. 2024 (arXiv 2501.00073), §3; docs/concepts.md.

    Args:
        resid: residual-stream activations, e.g. ``cache["blocks.0.hook_resid_mid"]``;
            a 2-D ``[pos, d_model]`` input is treated as one sequence.
        attention_mask: 1 for real tokens, 0 for padding (either side). Real tokens are
            compacted to the front; rows and columns past a sequence's length are NaN.

    Returns:
        ``[batch, pos, pos]`` float64.

    Raises:
        ValueError: if ``resid`` is not 2-D or 3-D, or the mask has the wrong shape/values.
    """
    if resid.ndim == 2:
        resid = resid[None]
    if resid.ndim != 3:
        raise ValueError(f"resid must have shape [batch, pos, d_model], got {tuple(resid.shape)}")
    x = compact_real_tokens(resid.detach().to(torch.float64), attention_mask)
    unit = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)
    return unit @ unit.transpose(-1, -2)


def residual_hooks(model) -> list[tuple[str, int]]:
    """``(hook name, layer)`` for the embedding (layer -1), after each attention and block.

    The embedding is ``blocks.0.hook_resid_pre`` (``hook_embed`` + ``hook_pos_embed``);
    ``blocks.{l}.hook_resid_mid`` is "after attention l" and ``hook_resid_post`` "after
    block l" (docs/concepts.md). Attention-only models have no ``resid_mid``.
    """
    hooks = [("blocks.0.hook_resid_pre", -1)]
    for layer in range(model.cfg.n_layers):
        for site in ("hook_resid_mid", "hook_resid_post"):
            name = f"blocks.{layer}.{site}"
            if name in model.hook_dict:
                hooks.append((name, layer))
    return hooks


@torch.no_grad()
def similarity_by_layer(
    model,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> dict[str, Float[Tensor, "batch pos pos"]]:
    """Cosine self-similarity at every residual hook of :func:`residual_hooks`.

    Runs one forward pass caching only those hooks. Works with any model exposing the
    TransformerLens surface (``run_with_cache``, ``hook_dict``, ``cfg``).

    Returns:
        ``{hook_name: [batch, pos, pos]}`` float64, real tokens compacted to the front.

    Raises:
        ValueError: for tokens longer than ``n_ctx`` or a malformed attention mask.
    """
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape))
    names = {name for name, _ in residual_hooks(model)}
    cache = run_cached(model, tokens, mask, lambda n: n in names)
    return {name: cosine_self_similarity(cache[name], mask) for name, _ in residual_hooks(model)}
