"""Input validation shared by the hook plumbing: clear errors before any forward pass."""

from __future__ import annotations

import torch

__all__ = ["check_tokens", "check_attention_mask", "lengths_from_mask", "on_cpu", "masked_scores",
           "next_token_loss", "next_token_pairs", "run_reduced"]


def check_tokens(model, tokens: torch.Tensor) -> torch.Tensor:
    """Return ``tokens`` as ``[batch, pos]`` int64 on the CPU, where analyses compute their
    metrics (:func:`run_cached` moves them to the model's device for the forward pass).

    Raises:
        ValueError: for a non-tensor, a wrong rank, an empty or non-integer tensor, ids
            outside ``[0, d_vocab)``, or more positions than ``n_ctx``.
    """
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"tokens must be a torch.Tensor of shape [batch, pos], got {type(tokens)}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape [batch, pos], got {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        raise ValueError(f"tokens is empty (shape {tuple(tokens.shape)}); need batch >= 1, pos >= 1")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if int(tokens.min()) < 0 or int(tokens.max()) >= model.cfg.d_vocab:
        raise ValueError(f"token ids must be in [0, d_vocab={model.cfg.d_vocab}), got "
                         f"min {int(tokens.min())}, max {int(tokens.max())}")
    if tokens.shape[1] > model.cfg.n_ctx:
        raise ValueError(
            f"tokens has {tokens.shape[1]} positions but the model's n_ctx is {model.cfg.n_ctx}")
    return tokens.long().cpu()


def check_attention_mask(mask: torch.Tensor | None, shape: tuple[int, ...],
                         device: torch.device | None = None) -> torch.Tensor | None:
    """Return ``mask`` as a ``[batch, pos]`` 0/1 int64 tensor (moved to ``device`` if
    given: analyses of a model pass their CPU tokens' device), or raise ``ValueError``.

    Raises:
        ValueError: if the shape differs from ``shape`` or values are not 0/1.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a torch.Tensor, got {type(mask)}")
    if mask.ndim == 1 and len(shape) == 2 and shape[0] == 1:
        mask = mask[None]
    if mask.dtype == torch.bool:
        mask = mask.long()
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask must have shape {tuple(shape)} (= [batch, pos]), "
            f"got {tuple(mask.shape)}")
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("attention_mask must contain only 0 (padding) and 1 (real token)")
    return mask.long() if device is None else mask.long().to(device)


def on_cpu(t):
    """``t`` on the CPU, where metrics are computed (docs/scale.md): a user's activations,
    patterns or masks may come from a CUDA cache. Non-tensors and None pass through, for
    the validation that follows to name them."""
    return t.detach().cpu() if isinstance(t, torch.Tensor) else t


def lengths_from_mask(mask: torch.Tensor | None, batch: int, pos: int) -> torch.Tensor:
    """Number of real tokens per sequence, ``[batch]`` int64."""
    if mask is None:
        return torch.full((batch,), pos, dtype=torch.long)
    return mask.sum(-1).long()


def next_token_pairs(mask: torch.Tensor | None, batch: int, pos: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair every real token with the next *real* token, for next-token loss/accuracy.

    A pad is never a position (docs/concepts.md, "Cosine self-similarity"): the logits at
    the k-th real token predict
    the (k+1)-th real token, whatever the padding side and across interior gaps, so a
    padded batch scores exactly as the unpadded one.

    Returns:
        ``(cur, nxt, valid)``, each ``[batch, pos - 1]``: the logits at ``cur[b, t]``
        predict the token at ``nxt[b, t]``; only pairs with ``valid[b, t]`` count.
    """
    if mask is None:
        ar = torch.arange(pos)
        return (ar[:-1].expand(batch, -1), ar[1:].expand(batch, -1),
                torch.ones(batch, pos - 1, dtype=torch.bool))
    # A stable sort on "is pad" lists each row's real positions first, in order.
    order = torch.sort((mask == 0).long(), dim=-1, stable=True).indices
    valid = torch.arange(1, pos)[None, :] < mask.sum(-1, keepdim=True)
    return order[:, :-1], order[:, 1:], valid


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None
                    ) -> torch.Tensor:
    """Mean next-token cross-entropy (nats, a float64 scalar tensor, differentiable) over
    real-token pairs (:func:`next_token_pairs`), from ``[batch, pos, d_vocab]`` logits on
    any device."""
    cur, nxt, valid = next_token_pairs(None if mask is None else mask.cpu(), *tokens.shape)
    dev = logits.device
    cur, nxt, valid, tokens = cur.to(dev), nxt.to(dev), valid.to(dev), tokens.to(dev)
    rows = torch.arange(tokens.shape[0], device=dev)[:, None]
    logp = logits[rows, cur].log_softmax(-1).gather(-1, tokens[rows, nxt][..., None])[..., 0]
    return -logp[valid].double().mean()


def masked_scores(scores: torch.Tensor) -> torch.Tensor:
    """Boolean ``[..., query, key]``: True where a pre-softmax score is masked.

    A score is masked when it is ``<= torch.finfo(dtype).min``: TransformerLens 3.9 writes
    ``-inf``, HF and many user hooks write ``finfo(dtype).min`` (or add it to a score,
    which in float rounds back to ``finfo.min``). Equality with one sentinel misses the
    other convention (docs/models.md). Masks written as a merely large negative number
    (e.g. ``-1e4``) are not recognized: they are not masks in exact arithmetic either.
    """
    return scores <= torch.finfo(scores.dtype).min


def run_cached(model, tokens: torch.Tensor, mask: torch.Tensor | None, names_filter,
               return_logits: bool = False):
    """``run_with_cache`` across model kinds (TL 3.9 ``HookedTransformer``/``HookedEncoder``,
    TL 4 ``TransformerBridge``): see :func:`posinterp.models.backend.run_cached`, the one
    place that knows their differences."""
    from ..models.backend import run_cached as backend_run_cached

    return backend_run_cached(model, tokens, mask, names_filter, return_logits)


def run_reduced(model, tokens: torch.Tensor, mask: torch.Tensor | None, reducers,
                query_block: int | None = None) -> list:
    """A forward pass reducing each hook as it fires: see
    :func:`posinterp.models.backend.run_reduced`."""
    from ..models.backend import run_reduced as backend_run_reduced

    return backend_run_reduced(model, tokens, mask, reducers, query_block=query_block)
