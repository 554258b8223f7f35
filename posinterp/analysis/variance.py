"""The variance signal (Chi et al. 2023, "Latent Positional Information is in the
Self-Attention Variance of Transformer Language Models Without Positional Embeddings",
ACL 2023, arXiv 2305.13571, §3).

With causal attention over k + 1 roughly independent values, the attention output at
position k averages them, so its variance over d_model shrinks like 1/(k + 1): a
competing explanation of how NoPE models know position.
"""

from __future__ import annotations

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._checks import check_attention_mask, check_tokens, lengths_from_mask, on_cpu, run_reduced
from .similarity import compact_real_tokens

__all__ = ["position_variance", "variance_by_layer"]


def position_variance(
    act: Float[Tensor, "batch pos d_model"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, "batch pos"]:
    """Variance over d_model (population, in squared activation units) at each position.

    Real tokens are compacted to the front (position k = k-th real token); padding
    positions are NaN. Source: Chi et al. 2023, §3.

    Raises:
        ValueError: for a non-3-D input or a malformed mask.
    """
    if act.ndim != 3:
        raise ValueError(f"act must have shape [batch, pos, d_model], got {tuple(act.shape)}")
    x = compact_real_tokens(on_cpu(act).to(torch.float64), on_cpu(attention_mask))
    return x.var(dim=-1, unbiased=False)


@torch.no_grad()
def variance_by_layer(model, tokens: Int[Tensor, "batch pos"],
                      attention_mask: Int[Tensor, "batch pos"] | None = None) -> pd.DataFrame:
    """Mean over sequences of the per-position variance of ``hook_attn_out`` and the
    residual stream (``hook_resid_post``, and the embedding), per layer.

    Returns:
        Tidy DataFrame ``hook, layer, head, position, metric, value, n_sequences`` with
        ``metric == "variance"``; ``position`` is the real-token index.

    Raises:
        ValueError: for tokens longer than ``n_ctx`` or a malformed mask.
    """
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    hooks = [("blocks.0.hook_resid_pre", -1)]
    for layer in range(model.cfg.n_layers):
        hooks += [(f"blocks.{layer}.hook_attn_out", layer), (f"blocks.{layer}.hook_resid_post", layer)]
    # each hook's [batch, pos, d_model] reduced to its variances as it fires (replaced
    # sites read too): nothing of the residual stream is cached
    per_hook = run_reduced(model, tokens, mask, [(h, lambda a: position_variance(a, mask))
                                                 for h, _ in hooks])
    lengths = lengths_from_mask(mask, *tokens.shape)
    rows = []
    for (hook, layer), var in zip(hooks, per_hook, strict=True):
        for k in range(tokens.shape[1]):
            have = lengths > k
            if have.any():
                rows.append(dict(hook=hook, layer=layer, head=pd.NA, position=k, metric="variance",
                                 value=float(var[have, k].mean()), n_sequences=int(have.sum())))
    return pd.DataFrame(rows).astype({"head": "Int64", "position": "Int64"})
