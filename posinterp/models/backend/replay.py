"""Running a suffix of the blocks (exact ablations from a cached prefix).

An edit at layer l leaves every layer below l unchanged, so ablations of layer-l heads
rerun only blocks l.. from the cached resid_pre of layer l. TL 3.9's start_at_layer does
this; TL 4's bridge accepts start_at_layer but still runs blocks 0..l-1 (its docstring).
So on both lines each block is called as the model itself called it: its inputs (the
residual, plus the mask, positions and RoPE tables the model passed) are recorded once
on a clean pass and replayed, tiled along the batch axis for several ablations at once.
The replay is checked against the model's own logits before any ablation uses it
(:func:`suffix_replay_matches`), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .modes import eager, eval_mode, unwrap


@dataclass(frozen=True)
class BlockInputs:
    """What every block received on one clean forward pass (:func:`capture_block_inputs`).

    ``resid_pre[l]``: ``[batch, pos, d_model]``, block l's input, on the model's device;
    ``args[l]`` / ``kwargs[l]``: the rest of that call (attention mask, position ids,
    RoPE tables; a KV cache is dropped); ``logits``: the clean ``[batch, pos, d_vocab]``
    logits on the model's device; ``batch``: the batch size the inputs were recorded at.
    """

    resid_pre: dict
    args: dict
    kwargs: dict
    logits: Tensor
    batch: int


def _cache_class():
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a TransformerLens dependency
        return None
    return Cache


def _without_kv_cache(kwargs: dict) -> dict:
    """A replayed block call must not read or append to the clean pass's KV cache."""
    Cache = _cache_class()  # noqa: N806
    out = {}
    for k, v in kwargs.items():
        if Cache is not None and isinstance(v, Cache):
            v = None
        if k == "use_cache":
            v = False
        out[k] = v
    return out


def _args_without_kv_cache(args: tuple) -> tuple:
    """The same for positional arguments (HF's GPT-2 block takes its cache second): with a
    working cache (the TL 4 bridges' repaired one, :func:`~.kv_cache.guard_kv_cache`) a
    replay would attend to the clean pass's cached keys too."""
    Cache = _cache_class()  # noqa: N806
    return tuple(None if Cache is not None and isinstance(a, Cache) else a for a in args)


def capture_block_inputs(model, tokens: Tensor, mask: Tensor | None) -> BlockInputs:
    """One clean forward pass recording every block's inputs (for :func:`run_blocks_from`).

    Runs eagerly, in eval mode, without autograd, on the model's device.

    Returns:
        :class:`BlockInputs`.
    """
    from ...devices import model_device

    model = unwrap(model)
    device = model_device(model)
    tokens = tokens.to(device)
    mask = None if mask is None else mask.to(device)
    resid, args, kwargs, handles = {}, {}, {}, []

    def recorder(layer):
        def hook(_module, a, kw):
            resid[layer] = a[0] if a else kw["hidden_states"]
            args[layer] = _args_without_kv_cache(tuple(a[1:]))
            kwargs[layer] = _without_kv_cache({k: v for k, v in kw.items() if k != "hidden_states"})
        return hook

    try:
        for layer, block in enumerate(model.blocks):
            handles.append(block.register_forward_pre_hook(recorder(layer), with_kwargs=True))
        with torch.no_grad(), eager(model), eval_mode(model):
            logits = model(tokens, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return BlockInputs(resid, args, kwargs, logits, tokens.shape[0])


def _tile(obj, batch: int, copies: int, n_heads: int = 0):
    """``obj`` with every tensor whose dim 0 is the batch repeated ``copies`` times along
    it (copy g holds rows g*batch .. (g+1)*batch - 1); also one whose dim 0 is batch x
    ``n_heads``, batch-major (BLOOM's ``alibi``, ``[batch * n_heads, 1, key]``), whose
    copies follow the same order. Other values (and broadcast tensors of dim 0 = 1 when
    batch > 1) unchanged; :func:`suffix_replay_matches` checks the result."""
    if isinstance(obj, Tensor):
        if copies > 1 and obj.ndim and obj.shape[0] in (batch, batch * n_heads):
            return obj.repeat(copies, *([1] * (obj.ndim - 1)))
        return obj
    if isinstance(obj, tuple):
        return tuple(_tile(o, batch, copies, n_heads) for o in obj)
    if isinstance(obj, list):
        return [_tile(o, batch, copies, n_heads) for o in obj]
    if isinstance(obj, dict):
        return {k: _tile(v, batch, copies, n_heads) for k, v in obj.items()}
    return obj


def run_blocks_from(model, inputs: BlockInputs, layer: int, resid: Tensor) -> Tensor:
    """Blocks ``layer`` .. n_layers - 1 on ``resid`` (``[copies * batch, pos, d_model]``),
    each called with the inputs the clean pass gave it, tiled to ``copies``; hooks fire as
    in a full pass. Returns the last block's output (before ``ln_final``).

    Raises:
        ValueError: if ``resid``'s batch is not a multiple of the recorded batch.
    """
    if resid.shape[0] % inputs.batch:
        raise ValueError(f"resid batch {resid.shape[0]} is not a multiple of the recorded "
                         f"batch {inputs.batch}")
    copies = resid.shape[0] // inputs.batch
    x, heads = resid, model.cfg.n_heads
    for j in range(layer, model.cfg.n_layers):
        out = model.blocks[j](x, *_tile(inputs.args[j], inputs.batch, copies, heads),
                              **_tile(inputs.kwargs[j], inputs.batch, copies, heads))
        x = out[0] if isinstance(out, tuple) else out
    return x


def final_logits(model, resid: Tensor) -> Tensor:
    """``unembed(ln_final(resid))``: logits from the last block's output (``[batch, pos,
    d_vocab]``); ``ln_final`` is skipped where the model has none."""
    norm = getattr(model, "ln_final", None)
    return model.unembed(norm(resid) if norm is not None else resid)


def suffix_replay_matches(model, inputs: BlockInputs, rtol: float = 1e-5) -> bool:
    """True when replaying the last block on its recorded input, tiled to two copies, gives
    the clean pass's logits in both copies (max error <= ``rtol`` times the largest
    |logit|): the check :func:`run_blocks_from` must pass before ablations rely on it."""
    last = model.cfg.n_layers - 1
    with torch.no_grad(), eager(model), eval_mode(model):
        resid = inputs.resid_pre[last]
        try:
            out = run_blocks_from(model, inputs, last, resid.repeat(2, 1, 1))
        except RuntimeError:  # an input of the block that _tile cannot tile: full passes
            return False
        b = inputs.batch
        scale = float(inputs.logits.abs().max()) or 1.0
        for g in range(2):
            got = final_logits(model, out[g * b:(g + 1) * b])
            if got.shape != inputs.logits.shape:
                return False
            if float((got - inputs.logits).abs().max()) > rtol * scale:
                return False
    return True
