"""Cosine self-similarity of the residual stream (Zuo et al. 2024, arXiv 2501.00073, §3).

Pure tensor functions first, hook plumbing last. Padding is never a position: real
tokens are compacted to the front, so the k-th real token is position k whatever the
padding side, and entries involving padding are NaN.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._checks import check_attention_mask, check_tokens, on_cpu, run_cached

__all__ = ["SITES", "compact_real_tokens", "cosine_self_similarity", "residual_hooks", "similarity_by_layer",
           "site_hooks"]

SITES = ("attn_out", "resid_mid", "mlp_out", "resid_post")


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
    if not isinstance(resid, torch.Tensor):
        raise ValueError(f"resid must be a torch.Tensor [batch, pos, d_model], got "
                         f"{type(resid).__name__} (torch.as_tensor converts an array)")
    resid, attention_mask = on_cpu(resid), on_cpu(attention_mask)
    if resid.ndim == 2:
        resid = resid[None]
    if resid.ndim != 3:
        raise ValueError(f"resid must have shape [batch, pos, d_model], got {tuple(resid.shape)}")
    x = compact_real_tokens(resid.detach().to(torch.float64), attention_mask)
    unit = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)
    sim = unit @ unit.transpose(-1, -2)
    # Exact ties: a matmul may round <u_k, u_i> and <u_k, u_j> differently (~1e-17) even
    # when x_i == x_j bit for bit (blocked kernels sum in different orders per column),
    # which would break a tie that the adjacency score must count as 1/2. So every row
    # and column is read from its first identical copy in the sequence: equal vectors get
    # exactly equal cosines. Distinct vectors are compared exactly, with no tolerance.
    rep = _first_copy(x)  # [batch, pos]
    if bool((rep == torch.arange(rep.shape[1])).all()):
        return sim  # no repeated vector: nothing to align (and two O(pos^2) gathers saved)
    index = rep[:, :, None].expand_as(sim)
    sim = sim.gather(1, index)
    return sim.gather(2, rep[:, None, :].expand_as(sim))


def _first_copy(x: Float[Tensor, "batch pos d"]) -> Int[Tensor, "batch pos"]:
    """Index of the first position in the same sequence whose vector equals ``x[b, i]``
    exactly (NaN rows, i.e. padding, are their own copy).

    Rows are grouped by a hash of their bits (``-0.0`` counted as ``0.0``, as ``==``
    does) and every row is then checked against its group's first row element by
    element; should two different rows ever share a hash, the exact but slower
    lexicographic grouping (:func:`_first_copy_exact`) is used instead. Sorting whole
    rows (``torch.unique(dim=0)``) cost as much as the rest of ``adjacency_by_layer``.
    """
    batch, pos, d = x.shape
    has_nan = torch.isnan(x).any(-1)
    clean = (torch.nan_to_num(x, nan=0.0) + 0.0).contiguous()
    gen = torch.Generator().manual_seed(0)
    odd = torch.randint(0, 2**62, (d,), generator=gen, dtype=torch.int64) * 2 + 1
    flat = torch.arange(batch * pos).reshape(batch, pos)
    # int64 products and sums wrap modulo 2**64: equal bits, equal key
    key = (clean.view(torch.int64) * odd).sum(-1) * 1_000_003 + torch.arange(batch)[:, None]
    key = torch.where(has_nan, -1 - flat, key)
    _, inverse = torch.unique(key.reshape(-1), return_inverse=True)
    rep = torch.full((int(inverse.max()) + 1,), batch * pos, dtype=torch.long)
    rep = rep.scatter_reduce(0, inverse, flat.reshape(-1), reduce="amin")[inverse]
    b_rep, i_rep = rep // pos, rep % pos
    rows = clean.reshape(batch * pos, d)
    ok = ((b_rep == flat.reshape(-1) // pos) & (rows[rep] == rows).all(-1)
          & (~has_nan.reshape(-1) | (rep == flat.reshape(-1))))
    if not bool(ok.all()):
        return _first_copy_exact(x)
    return i_rep.reshape(batch, pos)


def _first_copy_exact(x: Float[Tensor, "batch pos d"]) -> Int[Tensor, "batch pos"]:
    """:func:`_first_copy` by sorting whole rows: exact, no hash (its fallback and oracle)."""
    batch, pos, _ = x.shape
    has_nan = torch.isnan(x).any(-1)
    b = torch.arange(batch)[:, None].expand(batch, pos)
    i = torch.arange(pos)[None, :].expand(batch, pos)
    # Key: sequence id, a unique tag for NaN rows, then the vector (-0.0 == 0.0 as in ==).
    tag = torch.where(has_nan, i + 1, 0)
    key = torch.cat([b[..., None].double(), tag[..., None].double(),
                     torch.nan_to_num(x, nan=0.0) + 0.0], -1).reshape(batch * pos, -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), batch * pos, dtype=torch.long)
    first = first.scatter_reduce(0, inverse, i.reshape(-1), reduce="amin")
    return first[inverse].reshape(batch, pos)


def residual_hooks(model) -> list[tuple[str, int]]:
    """``(hook name, layer)`` for the embedding (layer -1), after each attention and block.

    The embedding is ``blocks.0.hook_resid_pre`` (token embedding plus any learned
    position embedding; ``hook_pos_embed`` is not read: TL 4 fires it with RoPE's cos/sin);
    ``blocks.{l}.hook_resid_mid`` is "after attention l" and ``hook_resid_post`` "after
    block l" (docs/concepts.md). Attention-only models have no ``resid_mid``.
    """
    return site_hooks(model, ("resid_mid", "resid_post"))


def site_hooks(model, sites=SITES) -> list[tuple[str, int]]:
    """``(hook name, layer)`` for the embedding (layer -1) and each ``sites`` hook per layer.

    ``sites`` are hook suffixes among :data:`SITES`: ``attn_out`` is the attention
    sublayer's output alone (``blocks.{l}.hook_attn_out``, the point of Zuo et al.'s
    mediation argument), ``resid_mid`` the residual stream after it (embedding plus
    attention output), ``mlp_out`` the MLP output and ``resid_post`` the stream after the
    block (docs/concepts.md, "Where the adjacency pattern is measured"). Hooks a model
    lacks (attention-only models have no ``resid_mid`` or ``mlp_out``) are left out. A
    site whose HookPoint another plugin replaced with its own module (a SAELens SAE) is
    kept and read from that module's output (:func:`posinterp.models.backend.site_module`).

    Raises:
        ValueError: for a site not in :data:`SITES`.
    """
    if isinstance(sites, str):  # one site, as TL's names_filter takes one hook name
        sites = (sites,)
    bad = [s for s in sites if s not in SITES]
    if bad:
        raise ValueError(f"sites must be among {SITES}, got {bad}")
    from ..models.backend import site_module

    hooks = [("blocks.0.hook_resid_pre", -1)]
    for layer in range(model.cfg.n_layers):
        for site in SITES:
            name = f"blocks.{layer}.hook_{site}"
            if site in sites and site_module(model, name) is not None:
                hooks.append((name, layer))
    return hooks


@torch.no_grad()
def similarity_by_layer(
    model,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    hooks: list[tuple[str, int]] | None = None,
) -> dict[str, Float[Tensor, "batch pos pos"]]:
    """Cosine self-similarity at every residual hook of :func:`residual_hooks` (or ``hooks``,
    ``(name, layer)`` pairs such as :func:`site_hooks` returns).

    Runs one forward pass caching only those hooks. Works with any model exposing the
    TransformerLens surface (``run_with_cache``, ``hook_dict``, ``cfg``).

    Returns:
        ``{hook_name: [batch, pos, pos]}`` float64, real tokens compacted to the front.

    Raises:
        ValueError: for tokens longer than ``n_ctx`` or a malformed attention mask.
    """
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    hooks = residual_hooks(model) if hooks is None else hooks
    names = {name for name, _ in hooks}
    cache = run_cached(model, tokens, mask, names)
    return {name: cosine_self_similarity(cache[name], mask) for name, _ in hooks}
