"""A forward pass in query blocks through the model's own KV cache (:func:`chunked_pass`):
each block of positions attends to the keys cached for the blocks before it, so a layer's
``hook_pattern`` and ``hook_attn_scores`` fire with rows ``a .. b-1`` and keys ``0 .. b-1``
(``[batch, head, b - a, b]``) and no ``[pos, pos]`` tensor is ever made: memory
O(block x pos) per head instead of O(pos^2) (docs/scale.md, long inputs).

TL 3.9 ``HookedTransformer`` takes TransformerLens's own ``TransformerLensKeyValueCache``
and each block's mask (it appends it); a TL 4 bridge over HF modules takes HF's
``DynamicCache`` and the mask of every position so far (it derives positions from it).
The pass is verified once per model against the full pass (:func:`check_chunked_pass`)
and refused by name where it differs or the model has no cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import MissingFeatureError
from .kv_cache import guard_kv_cache, has_kv_cache, quiet_past_key_values
from .modes import _in_float32, eval_mode, unwrap
from .surface import is_bridge

_VERDICT = "posinterp_chunked_pass"  # attribute on the model: (verdict, reason)


def _run_blocks(model, tokens: Tensor, mask: Tensor, query_block: int, on_block=None,
                logits: bool = False) -> list:
    """Run ``tokens`` (with ``mask``, both on the model's device) block by block;
    ``on_block(a, b)`` is called before block ``a .. b-1`` runs. Returns each block's
    logits with ``logits`` (else nothing is unembedded)."""
    n = tokens.shape[1]
    out = []
    kind = "logits" if logits else None
    if is_bridge(model):
        from transformers import DynamicCache

        cache = DynamicCache()
    else:
        from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

        cache = TransformerLensKeyValueCache.init_cache(model.cfg, tokens.device, tokens.shape[0])
    for a in range(0, n, query_block):
        b = min(n, a + query_block)
        if on_block is not None:
            on_block(a, b)
        if is_bridge(model):
            with quiet_past_key_values():
                out.append(model(tokens[:, a:b], attention_mask=mask[:, :b],
                                 past_key_values=cache, return_type=kind))
        else:  # TL 3.9 appends each block's mask to the one the cache holds
            out.append(model(tokens[:, a:b], attention_mask=mask[:, a:b], past_kv_cache=cache,
                             return_type=kind))
    return out if logits else []


def _refusal(model, why: str) -> MissingFeatureError:
    return MissingFeatureError(
        f"the query-block pass (query_block=...) is not available on this "
        f"{type(unwrap(model)).__name__}: {why}; run without query_block (the whole "
        "attention pattern of one layer at a time) on fewer tokens")


@torch.no_grad()
def check_chunked_pass(model) -> None:
    """Verify once per model that :func:`chunked_pass` gives what the full forward pass
    gives: two probe sequences (one left-padded, one with a gap), blocks of 3 positions,
    every real position's logits within 1e-4 of the full pass's, in float32.

    Raises:
        MissingFeatureError: bidirectional attention (a block cannot see later keys), no
            working KV cache (TL 4's native models: posinterp's toys and llama2.c
            files), or logits that differ (the reason is kept and raised again).
    """
    model = unwrap(model)
    known = model.__dict__.get(_VERDICT)
    if known is None:
        known = _verdict(model)
        object.__setattr__(model, _VERDICT, known)
    if known is not True:
        raise _refusal(model, known)


def _verdict(model):
    from ...devices import model_device

    if getattr(model.cfg, "attention_dir", "causal") != "causal":
        return "its attention is bidirectional, so a block of queries needs later keys"
    if is_bridge(model) and "posinterp_kv_cache" not in model.__dict__:
        guard_kv_cache(model)  # a model loaded without posinterp: check its cache here
    if not has_kv_cache(model):
        return "it has no KV cache that gives the full pass's numbers (backend.has_kv_cache)"
    n = int(min(10, model.cfg.n_ctx))
    gen = torch.Generator().manual_seed(0)
    device = model_device(model)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, n), generator=gen).to(device)
    mask = torch.ones(2, n, dtype=torch.long, device=device)
    mask[0, :2] = 0  # left padding
    mask[1, n // 2] = 0  # a gap
    with eval_mode(model), _in_float32(model):
        full = model(tokens, attention_mask=mask)
        try:
            got = _run_blocks(model, tokens, mask, 3, logits=True)
        except Exception as err:  # noqa: BLE001 - a pass that cannot run is refused, naming why
            return f"a pass in blocks failed ({type(err).__name__}: {err})"
    blocks = torch.cat(got, 1)
    real = mask.bool()
    if blocks.shape != full.shape or not torch.allclose(
            blocks[real].double(), full[real].double(), atol=1e-4, rtol=1e-4):
        return "a pass in blocks of 3 positions gave other logits than the full pass"
    return True


def chunked_pass(model, tokens: Tensor, mask: Tensor | None, query_block: int,
                 on_block=None) -> None:
    """Run ``model`` on ``tokens`` ``[batch, pos]`` (``mask`` ``[batch, pos]``, 1 = real)
    ``query_block`` positions at a time through its KV cache: every hook the caller put on
    fires once per block with that block's positions (attention hooks: rows ``a .. b-1``,
    keys ``0 .. b-1``). ``on_block(a, b)`` is called before each block. Eval mode, no
    autograd graph, eagerly.

    Raises:
        MissingFeatureError: where :func:`check_chunked_pass` refuses the model.
        ValueError: ``query_block`` not a positive integer.
    """
    from ...devices import model_device
    from .modes import eager

    if isinstance(query_block, bool) or not isinstance(query_block, int) or query_block < 1:
        raise ValueError(f"query_block must be a positive integer, got {query_block!r}")
    model = unwrap(model)
    check_chunked_pass(model)
    device = model_device(model)
    tokens = tokens.to(device)
    mask = (torch.ones_like(tokens) if mask is None else mask).to(device)
    with torch.no_grad(), eager(model), eval_mode(model):
        _run_blocks(model, tokens, mask, query_block, on_block)
