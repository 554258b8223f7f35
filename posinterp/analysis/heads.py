"""Previous-token and induction heads, scored on attention patterns.

Previous-token: how much each head attends from token i to token i-1. Our own score on
attention patterns (docs/concepts.md). TransformerLens's ``detect_head`` differs: it
divides by n (counting row 0, which cannot attend backwards), needs strings and a
tokenizer, and scores one sequence at a time.

Induction: how much each head attends from a token to the token that followed its
earlier occurrence (Olsson et al. 2022, "In-context Learning and Induction Heads", §2;
the target of TransformerLens's ``detect_head(..., "induction_head")``), averaged over
the queries that have an earlier occurrence.
"""

from __future__ import annotations

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ._attention_blocks import reduce_attention
from ._checks import check_attention_mask, check_tokens, lengths_from_mask, on_cpu, run_reduced

__all__ = ["induction_score", "induction_scores", "induction_targets", "previous_token_score",
           "previous_token_scores", "random_tokens", "repeated_random_tokens", "sampled_tokens"]


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
    # in query blocks: no [batch, head, q, k] float64 copy
    out = reduce_attention(pattern, mask, kernel=False, scores=True, start=start)
    return out.scores()["previous_token_score"]


def induction_targets(tokens: Int[Tensor, "batch pos"],
                      attention_mask: Int[Tensor, "batch pos"] | None = None
                      ) -> Bool[Tensor, "batch query key"]:
    """Where an induction head attends: T[b, i, j] is True when token j - 1 is an earlier
    occurrence of token i (j - 1 < i, same id), i.e. j followed an earlier copy of i.

    The target of TransformerLens's ``detect_head`` induction pattern and of Olsson et al.
    2022 ("In-context Learning and Induction Heads", §2: "attend to the token that came
    after the previous occurrence of the current token"). Every earlier occurrence
    counts; j = i when the previous token repeats token i. Positions are real tokens:
    pads are dropped first (the k-th real token is position k), so rows and columns at
    or beyond a sequence's length are False.

    Args:
        tokens: ``[batch, pos]`` token ids.
        attention_mask: ``[batch, pos]`` 1 for real tokens (either padding side), or None.

    Returns:
        ``[batch, pos, pos]`` bool, lower-triangular (j <= i).

    Raises:
        ValueError: for tokens that are not ``[batch, pos]`` or a bad mask.
    """
    tokens = on_cpu(tokens)
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:
        raise ValueError(f"tokens must be a [batch, pos] tensor, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)}")
    batch, pos = tokens.shape
    mask = check_attention_mask(on_cpu(attention_mask), (batch, pos))
    lengths = lengths_from_mask(mask, batch, pos)
    if mask is not None:  # real tokens first, in order
        order = torch.sort((mask == 0).long(), dim=-1, stable=True).indices
        tokens = tokens.gather(1, order)
    i = torch.arange(pos)
    real = i[None, :] < lengths[:, None]  # [batch, pos]
    earlier = (tokens[:, :, None] == tokens[:, None, :]) & (i[None, None, :] < i[None, :, None])
    earlier &= real[:, :, None] & real[:, None, :]  # [batch, i, k]: k < i holds token i
    # j = k + 1: shift the earlier occurrences one key to the right
    return torch.cat([torch.zeros(batch, pos, 1, dtype=torch.bool), earlier[..., :-1]], -1)


def induction_score(
    pattern: Float[Tensor, "batch head query key"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch head"]:
    """Induction mass: per sequence, the mean over queries i that have an earlier
    occurrence of their token of sum_j A[i, j] T[i, j] (a probability, [0, 1]).

    ``T`` is :func:`induction_targets`: the keys that followed an earlier occurrence of
    token i. On the standard input of Olsson et al. 2022 (§2, "In-context Learning and
    Induction Heads"; TransformerLens's induction demo), [BOS, r_1..r_n, r_1..r_n] with
    the r distinct (:func:`repeated_random_tokens`), the queries are the second copy and
    the score is the mean of A[i, i - n + 1] over them. On natural text it is the same
    quantity wherever the text repeats a token. Unlike ``detect_head`` it averages over
    the queries that have a target only (``detect_head`` divides by every row), and
    takes a batch of id tensors (no strings).

    Args:
        pattern: post-softmax attention ``[batch, head, pos, pos]``, e.g.
            ``cache["blocks.0.attn.hook_pattern"]``.
        tokens: ``[batch, pos]`` the ids the pattern was computed on.
        attention_mask: ``[batch, pos]`` 1 for real tokens (either padding side).

    Returns:
        ``[batch, head]`` float64; NaN for a sequence with no repeated token (no query
        has a target).

    Raises:
        ValueError: a pattern that is not ``[batch, head, pos, pos]``, tokens or a mask
            whose shape is not its ``[batch, pos]``.
    """
    if pattern.ndim != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must have shape [batch, head, pos, pos], got {tuple(pattern.shape)}")
    batch, _, pos, _ = pattern.shape
    if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (batch, pos):
        raise ValueError(f"tokens must have the pattern's [batch, pos] = {(batch, pos)}, got "
                         f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens)}")
    mask = check_attention_mask(on_cpu(attention_mask), (batch, pos))
    # in query blocks (no [batch, head, q, k] float64 copy or target tensor)
    return reduce_attention(pattern, mask, kernel=False, tokens=tokens).induction_score()


def repeated_random_tokens(model, batch: int, n: int, seed: int = 0, bos: bool = True
                           ) -> Int[Tensor, "batch pos"]:
    """The induction input: ``[BOS, r_1..r_n, r_1..r_n]`` (``pos = 2n + 1``; ``2n``
    without BOS), r seeded random ids, distinct within a copy and never the BOS id.

    Olsson et al. 2022 ("In-context Learning and Induction Heads", §2) score induction
    heads on repeated random tokens; the ids are drawn without replacement so that the
    second copy's query i has exactly one earlier occurrence and one target,
    i - n + 1 (:func:`induction_targets`), and the first copy none.

    Raises:
        ValueError: ``batch``/``n`` not positive integers, ``2n (+1)`` above ``n_ctx``,
            ``n`` above the ids available (``d_vocab``, less the BOS), or ``bos`` asked
            of a model without one.
    """
    for name, v in (("batch", batch), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    bos_id = None
    if bos:
        from ..models.backend import bos_token_id

        bos_id = bos_token_id(model)
        if bos_id is None:
            raise ValueError("bos=True but the model has no BOS id (no tokenizer with a "
                             "bos_token_id, none recorded by its loader); "
                             "pass bos=False")
    pos = 2 * n + (bos_id is not None)
    if pos > model.cfg.n_ctx:
        raise ValueError(f"n={n} gives {pos} positions, above the model's n_ctx={model.cfg.n_ctx}")
    ids = torch.tensor([t for t in range(model.cfg.d_vocab) if t != bos_id])
    if n > len(ids):
        raise ValueError(f"n={n} distinct ids are more than the {len(ids)} the vocabulary holds")
    gen = torch.Generator().manual_seed(seed)
    r = ids[torch.rand(batch, len(ids), generator=gen).argsort(-1)[:, :n]]  # without replacement
    parts = ([torch.full((batch, 1), bos_id)] if bos_id is not None else []) + [r, r]
    return torch.cat(parts, 1).long()


def _has_bos(model) -> bool:
    """Whether random inputs for ``model`` start with its BOS (it has a real one)."""
    from ..models.backend import bos_token_id

    return bos_token_id(model) is not None


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
            raise ValueError("bos=True but the model has no BOS id (no tokenizer with a "
                             "bos_token_id, none recorded by its loader); "
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

    Runs one forward pass reducing each layer's ``hook_pattern`` as it fires (memory: one
    layer's attention), its meaning verified on the loaded model first
    (:func:`posinterp.models.backend.run_reduced`; TL 4 fires it after the attention
    module returned on some bridges). Never modifies a caller's cache.

    Returns:
        Tidy DataFrame ``hook, layer, head, position, metric, value, n_sequences`` with
        ``metric == "previous_token_score"``, one row per (layer, head).

    Raises:
        ValueError: as :func:`previous_token_score`, tokens longer than ``n_ctx``, or a
            ``hook_pattern`` not verified as the layer's attention (named).
    """
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    hooks = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
    # each layer's pattern reduced as the pass makes it: memory is one layer's attention
    per_layer = run_reduced(model, tokens, mask, [
        (h, lambda p: previous_token_score(p, mask, start).mean(0)) for h in hooks])
    rows = []
    for layer, (hook, scores) in enumerate(zip(hooks, per_layer, strict=True)):
        for head, v in enumerate(scores.tolist()):
            rows.append(dict(hook=hook, layer=layer, head=head, position=pd.NA,
                             metric="previous_token_score", value=v, n_sequences=tokens.shape[0]))
    return pd.DataFrame(rows).astype({"position": "Int64"})


@torch.no_grad()
def induction_scores(
    model,
    tokens: Int[Tensor, "batch pos"] | None = None,
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    *,
    n: int = 32,
    batch: int = 4,
    seed: int = 0,
) -> pd.DataFrame:
    """Induction score of every head, averaged over the sequences that repeat a token.

    With ``tokens`` None, on ``batch`` sequences of :func:`repeated_random_tokens`
    (``n`` ids repeated once, a BOS first where the model has one; seeded), the standard
    input of Olsson et al. 2022, §2. One forward pass reducing each ``hook_pattern`` as it
    fires, its meaning verified first (:func:`posinterp.models.backend.run_reduced`).

    Returns:
        Tidy DataFrame ``hook, layer, head, position, metric, value, n_sequences`` with
        ``metric == "induction_score"``, one row per (layer, head); ``value`` NaN and
        ``n_sequences`` 0 when no sequence repeats a token.

    Raises:
        ValueError: as :func:`induction_score` and :func:`repeated_random_tokens`, or
            tokens longer than ``n_ctx``.
    """
    if tokens is None:
        tokens = repeated_random_tokens(model, batch, n, seed=seed, bos=_has_bos(model))
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    hooks = [f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)]
    per_layer = run_reduced(model, tokens, mask, [
        (h, lambda p: induction_score(p, tokens, mask)) for h in hooks])  # [batch, head] each
    rows = []
    for layer, (hook, per_seq) in enumerate(zip(hooks, per_layer, strict=True)):
        ok = ~torch.isnan(per_seq)
        means = torch.where(ok, per_seq, 0.0).sum(0) / ok.sum(0)
        for head, v in enumerate(means.tolist()):
            rows.append(dict(hook=hook, layer=layer, head=head, position=pd.NA, metric="induction_score",
                             value=v, n_sequences=int(ok[:, head].sum())))
    return pd.DataFrame(rows).astype({"position": "Int64"})
