"""Previous-token heads: how much each head attends from token i to token i-1.

Our own score on attention patterns (docs/concepts.md). TransformerLens's ``detect_head``
differs: it divides by n (counting row 0, which cannot attend backwards), needs strings
and a tokenizer, and scores one sequence at a time.
"""

from __future__ import annotations

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._checks import check_attention_mask, check_tokens, lengths_from_mask, on_cpu, run_cached
from .similarity import compact_real_tokens

__all__ = ["previous_token_score", "previous_token_scores", "random_tokens", "sampled_tokens"]


def previous_token_score(
    pattern: Float[Tensor, "batch head query key"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    start: int = 1,
) -> Float[Tensor, "batch head"]:
    """Mean over real query positions i >= ``start`` of A[i, i-1] (a probability, [0, 1]).

    Source: the induction/previous-token head literature (Olsson et al. 2022, "In-context
    learning and induction heads", §2); definition as in docs/concepts.md.

    Args:
        pattern: post-softmax attention, e.g. ``cache["blocks.0.attn.hook_pattern"]``.
        attention_mask: ``[batch, pos]``; pads are dropped so "previous" means the previous
            real token (either padding side).
        start: first query position counted (>= 1). With a BOS at position 0, ``start=2``
            leaves out the query whose previous token is the BOS (an attention sink).

    Returns:
        ``[batch, head]`` float64 scores.

    Raises:
        ValueError: for a pattern that is not ``[batch, head, pos, pos]``, a bad mask,
            ``start < 1``, or a sequence with no query position >= ``start``.
    """
    if pattern.ndim != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must have shape [batch, head, pos, pos], got {tuple(pattern.shape)}")
    if start < 1:
        raise ValueError(f"start must be >= 1, got {start}")
    batch, _, pos, _ = pattern.shape
    pattern, attention_mask = on_cpu(pattern), on_cpu(attention_mask)
    mask = check_attention_mask(attention_mask, (batch, pos))
    lengths = lengths_from_mask(mask, batch, pos)
    if (lengths <= start).any():
        raise ValueError(f"every sequence needs more than start={start} real tokens; "
                         f"got lengths {lengths.tolist()}")
    p = pattern.detach().to(torch.float64)
    if mask is not None:
        # Compact queries, then keys: [batch, head, q, k] -> real tokens first on both axes.
        p = compact_real_tokens(p.permute(0, 2, 1, 3), mask).permute(0, 2, 1, 3)
        p = compact_real_tokens(p.permute(0, 3, 1, 2), mask).permute(0, 2, 3, 1)
    diag = torch.diagonal(p, offset=-1, dim1=-2, dim2=-1)  # [batch, head, pos-1]: A[i, i-1]
    i = torch.arange(1, pos)
    valid = (i[None, :] >= start) & (i[None, :] < lengths[:, None])  # [batch, pos-1]
    total = torch.where(valid[:, None, :], diag, 0.0).sum(-1)
    return total / valid.sum(-1, keepdim=True)


def random_tokens(model, batch: int, pos: int, seed: int = 0, bos: bool = True,
                  low: int = 0) -> Int[Tensor, "batch pos"]:
    """Uniform random token ids ``[batch, pos]`` in ``[low, d_vocab)``, BOS first if asked.

    Raises:
        ValueError: if ``batch`` or ``pos`` is not a positive integer, ``pos`` exceeds
            ``n_ctx``, or ``bos`` is asked of a model without one.
    """
    for name, v in (("batch", batch), ("pos", pos)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if pos > model.cfg.n_ctx:
        raise ValueError(f"pos={pos} exceeds the model's n_ctx={model.cfg.n_ctx}")
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(low, model.cfg.d_vocab, (batch, pos), generator=gen)
    if bos:
        from ..models.backend import bos_token_id

        bos_id = bos_token_id(model)
        if bos_id is None:
            raise ValueError("bos=True but the model has no tokenizer with a bos_token_id; "
                             "pass bos=False")
        toks[:, 0] = bos_id
    return toks


@torch.no_grad()
def sampled_tokens(model, batch: int, pos: int, bos_id: int, seed: int = 0,
                   temperature: float = 1.0) -> Int[Tensor, "batch pos"]:
    """The model's own text: ``batch`` seeded samples of ``pos`` tokens, each from a BOS.

    For a model without a tokenizer (llama2.c's stories260K) this is natural input: its
    heads are seen on the distribution they were trained on, where uniform random ids
    make every head look alike. Token t+1 is drawn from softmax(logits_t / temperature)
    (float64, CPU generator seeded by ``seed``), recomputing the whole prefix each step
    (no KV cache: O(pos) forward passes of a growing batch; fine at a few hundred tokens).

    Args:
        model: a causal TransformerLens model.
        batch: rows of the output.
        pos: tokens per row, ``pos <= n_ctx`` (position 0 is ``bos_id``).
        bos_id: the BOS token id (llama2.c: 1; else ``tokenizer.bos_token_id``).
        seed: sampling seed; the same seed gives the same tokens on the same model.
        temperature: > 0; 1 samples the model's own distribution.

    Returns:
        ``[batch, pos]`` int64 token ids on CPU.

    Raises:
        ValueError: ``batch``/``pos`` not positive integers, ``pos > n_ctx``, ``bos_id``
            outside ``[0, d_vocab)``, or ``temperature <= 0``.
    """
    from ..devices import model_device

    for name, v in (("batch", batch), ("pos", pos)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if pos > model.cfg.n_ctx:
        raise ValueError(f"pos={pos} exceeds the model's n_ctx={model.cfg.n_ctx}")
    if isinstance(bos_id, bool) or not isinstance(bos_id, int) or not 0 <= bos_id < model.cfg.d_vocab:
        raise ValueError(f"bos_id must be a token id in [0, {model.cfg.d_vocab}), got {bos_id!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    gen = torch.Generator().manual_seed(seed)
    device = model_device(model)
    toks = torch.full((batch, 1), bos_id, dtype=torch.long)
    for _ in range(pos - 1):
        logits = model(toks.to(device))[:, -1].detach().cpu().double()
        probs = (logits / temperature).softmax(-1)
        toks = torch.cat([toks, torch.multinomial(probs, 1, generator=gen)], 1)
    return toks


@torch.no_grad()
def previous_token_scores(
    model,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    start: int = 1,
) -> pd.DataFrame:
    """Previous-token score of every head, averaged over the batch.

    Runs one forward pass caching only ``hook_pattern``, whose meaning
    :func:`posinterp.models.backend.run_cached` verifies on the loaded model first (TL 4
    fires it after the attention module returned on some bridges). Never modifies a
    caller's cache.

    Returns:
        Tidy DataFrame ``hook, layer, head, position, metric, value, n_sequences`` with
        ``metric == "previous_token_score"``, one row per (layer, head).

    Raises:
        ValueError: as :func:`previous_token_score`, tokens longer than ``n_ctx``, or a
            ``hook_pattern`` not verified as the layer's attention (named).
    """
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    cache = run_cached(model, tokens, mask, lambda n: n.endswith("attn.hook_pattern"))
    rows = []
    for layer in range(model.cfg.n_layers):
        hook = f"blocks.{layer}.attn.hook_pattern"
        scores = previous_token_score(cache[hook], mask, start).mean(0)
        for head, v in enumerate(scores.tolist()):
            rows.append(dict(hook=hook, layer=layer, head=head, position=pd.NA,
                             metric="previous_token_score", value=v, n_sequences=tokens.shape[0]))
    return pd.DataFrame(rows).astype({"position": "Int64"})
