"""What an intervention changes: loss, answer accuracy, previous-token score, adjacency."""

from __future__ import annotations

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from .._validate import check_indices
from ..analysis._checks import (
    check_attention_mask,
    check_tokens,
    lengths_from_mask,
    next_token_pairs,
    run_cached,
)
from ..analysis.adjacency import adjacency_score
from ..analysis.heads import previous_token_score
from ..analysis.similarity import cosine_self_similarity
from ..models.backend import unwrap
from .qk import QKIntervention, check_intervention, intervene

__all__ = ["ablation_effect", "per_head_interventions"]


def per_head_interventions(model, kinds, layers=None, k: int | None = None
                           ) -> list[QKIntervention]:
    """One single-head intervention per (kind, layer, head): a sweep for ablation_effect.

    Raises:
        ValueError: for an unknown kind (from :class:`QKIntervention`), or ``layers``
            that are not distinct ints in ``[0, n_layers)``.
    """
    layers = (range(model.cfg.n_layers) if layers is None
              else check_indices("layers", layers, model.cfg.n_layers))
    return [QKIntervention(kind, layer, heads=(head,), k=k) for kind in kinds for layer in layers
            for head in range(model.cfg.n_heads)]


def _targets(tokens, mask, answer_mask):
    """``(cur, nxt, target)``: real-token pairs (see ``next_token_pairs``) that are scored.

    Raises:
        ValueError: if nothing would be scored (the loss would be NaN), or, with
            ``answer_mask``, a sequence has no answer token after its first real token
            (it would count as an exact match).
    """
    cur, nxt, target = next_token_pairs(mask, *tokens.shape)
    if answer_mask is not None:
        target = target & answer_mask[torch.arange(tokens.shape[0])[:, None], nxt].bool()
        empty = (~target.any(-1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"answer_mask marks no predictable answer token (one after the "
                             f"first real token) in sequences {empty}")
    if not target.any():
        raise ValueError("no token has a real next token to predict: every sequence needs "
                         ">= 2 real tokens")
    return cur, nxt, target


@torch.no_grad()
def _measure(model, tokens, mask, answer_mask, lengths) -> dict:
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    names = {last} | {f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)}
    # names, not a filter: a site another plugin replaced (an SAE) is read from its module
    logits, cache = run_cached(model, tokens, mask, names, return_logits=True)
    cur, nxt, target = _targets(tokens, mask, answer_mask)
    rows = torch.arange(tokens.shape[0])[:, None]
    pred = logits[rows, cur]  # [batch, pos-1, d_vocab]: predicts tokens[rows, nxt]
    logp = pred.log_softmax(-1).gather(-1, tokens[rows, nxt][..., None])[..., 0]
    out = {"loss": float(-logp[target].mean())}
    if answer_mask is not None:
        hit = (pred.argmax(-1) == tokens[rows, nxt]) | ~target
        out["answer_accuracy"] = float(hit.all(-1).float().mean())
    out["adjacency_score"] = adjacency_score(cosine_self_similarity(cache[last], mask),
                                             lengths).score
    out["patterns"] = {layer: cache[f"blocks.{layer}.attn.hook_pattern"]
                       for layer in range(model.cfg.n_layers)}
    return out


def ablation_effect(model, tokens: Int[Tensor, "batch pos"], interventions,
                    attention_mask: Int[Tensor, "batch pos"] | None = None,
                    answer_mask: Int[Tensor, "batch pos"] | None = None) -> pd.DataFrame:
    """Change in loss, answer accuracy, previous-token score and adjacency per intervention.

    ``loss`` is the mean next-token cross-entropy (nats) over answer tokens when
    ``answer_mask`` is given (1 on answer tokens, as in :class:`posinterp.tasks.TaskSplit`),
    else over all real tokens after the first. A pad is never a position: the logits at
    each real token predict the next real token, so any padding (left, right, or a gap
    inside) gives the unpadded numbers for models whose positions come from the mask
    (every posinterp-built or -loaded model: NoPE, absolute, RoPE and ALiBi);
    ``answer_accuracy`` is exact match (only with ``answer_mask``);
    ``previous_token_score`` is the mean over the intervened heads;
    ``adjacency_score`` is at the last ``resid_post``.

    Returns:
        Tidy DataFrame ``hook, layer, head, position, metric, value, clean, intervened,
        kind, heads, k, rope_variant, band`` where ``value = intervened - clean``: one column
        per field of the intervention, so no two different interventions give rows that
        read alike. ``head`` is NA for multi-head interventions, ``heads`` lists them
        ("0,1,2"); ``k`` is NA unless ``keep_top_k``; ``band`` lists the rotary pairs of a
        band kind ("0,1"), NA otherwise; ``rope_variant`` is NA where it
        changes nothing (anything but symmetrization of a rotary model).

    Raises:
        ValueError: for malformed tokens/masks, invalid interventions (checked before
            any forward pass), no token with a real next token, or an ``answer_mask``
            sequence without a predictable answer token.
    """
    model = unwrap(model)  # hooks do not fire in a torch.compile wrapper's calls
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    answer_mask = check_attention_mask(answer_mask, tuple(tokens.shape), tokens.device)
    lengths = lengths_from_mask(mask, *tokens.shape)
    interventions = [interventions] if isinstance(interventions, QKIntervention) else list(interventions)
    if not interventions:
        raise ValueError("interventions must hold at least one QKIntervention, got none")
    for iv in interventions:
        check_intervention(model, iv)
    _targets(tokens, mask, answer_mask)
    clean = _measure(model, tokens, mask, answer_mask, lengths)
    rows = []
    for iv in interventions:
        with intervene(model, iv):
            after = _measure(model, tokens, mask, answer_mask, lengths)
        heads = list(range(model.cfg.n_heads)) if iv.heads is None else list(iv.heads)
        prev = {}
        for name, res in (("clean", clean), ("intervened", after)):
            scores = previous_token_score(res["patterns"][iv.layer], mask)  # [batch, head]
            prev[name] = float(scores[:, heads].mean())
        metrics = {m: (clean[m], after[m]) for m in ("loss", "answer_accuracy", "adjacency_score")
                   if m in clean}
        metrics["previous_token_score"] = (prev["clean"], prev["intervened"])
        for metric, (c, a) in metrics.items():
            rows.append(dict(hook=f"blocks.{iv.layer}.attn", layer=iv.layer,
                             head=heads[0] if len(heads) == 1 else pd.NA, position=pd.NA,
                             metric=metric, value=a - c, clean=c, intervened=a, kind=iv.kind,
                             heads=",".join(map(str, heads)), k=iv.k,
                             rope_variant=iv.rope_variant if _has_variant(model, iv) else pd.NA,
                             band=",".join(map(str, iv.band)) if iv.band else pd.NA))
    return pd.DataFrame(rows).astype({"head": "Int64", "position": "Int64", "k": "Int64",
                                      "rope_variant": "string", "band": "string"})


def _has_variant(model, iv: QKIntervention) -> bool:
    """``rope_variant`` changes the result only for symmetrization of a rotary model."""
    from .qk import SCORE_KINDS

    return iv.kind in SCORE_KINDS and model.cfg.positional_embedding_type == "rotary"
