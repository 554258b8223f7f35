"""Editing the attention pattern where no pre-softmax hook exists.

OPT and GPT-Neo bridges (TL 4.3) and TL 4 native models fire ``hook_attn_scores`` and
``hook_pattern`` after their attention module returned, so edits there are discarded.
Their module returns ``(output, pattern)``; a forward hook on it can replace both
exactly, by output' = output + Σ_h (pattern'_h - pattern_h) v_h W_O,h (the output is
linear in the pattern). Edits are armed per call by TransformerLens hooks that fire
inside the module (hook_q/k/v), and a pre-hook clears anything left armed by a call
that raised.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import MissingFeatureError
from .surface import _native_attention, attention_weights


def _module(model, layer: int):
    return _native_attention(model, layer)


def install_output_edit(model, layer: int) -> None:
    """Let ``arm_output_edit`` replace ``layer``'s attention pattern in the current call.

    Idempotent. A no-op hook pair on the wrapped attention module: a pre-hook clears
    edits left armed, a forward hook applies the armed ones, in order, to ``(output,
    pattern, ...)``.

    Raises:
        MissingFeatureError: for a model without a wrapped attention module (TL 3.9).
    """
    comp = _module(model, layer)
    if comp is None:
        raise MissingFeatureError("only a TransformerLens 4 bridge wraps an attention module")
    if getattr(comp, "posinterp_output_edit_handles", None):
        return

    def clear(module, args):
        object.__setattr__(module, "posinterp_armed", [])

    def apply(module, args, output):
        armed = module.__dict__.get("posinterp_armed") or []
        object.__setattr__(module, "posinterp_armed", [])
        for fn in armed:
            output = fn(output)
        return output

    object.__setattr__(comp, "posinterp_armed", [])
    object.__setattr__(comp, "posinterp_output_edit_handles", (
        comp.register_forward_pre_hook(clear), comp.register_forward_hook(apply)))


def arm_output_edit(model, layer: int, fn) -> None:
    """Apply ``fn((output, pattern, ...)) -> (output', pattern', ...)`` to ``layer``'s
    attention module output in the call now running (call from a hook that fires inside
    the module, e.g. at ``hook_v``)."""
    _module(model, layer).posinterp_armed.append(fn)


def pattern_edit(model, layer: int, heads: list[int], new_pattern, v: Tensor):
    """An output edit (for :func:`arm_output_edit`) that replaces ``heads``' pattern by
    ``new_pattern(pattern)`` (``[batch, len(heads), query, key]`` float64 -> same) and the
    output by output + Σ_h (pattern'_h - pattern_h) v_h W_O,h, with ``v`` the call's
    ``hook_v`` (``[batch, key, head or kv head, d_head]``)."""
    W_O = attention_weights(model, layer)["W_O"][heads]  # [h, d_head, d_model]
    H = model.cfg.n_heads

    def fn(output):
        out, pattern, *rest = output
        old = pattern[:, heads].double()
        new = new_pattern(old)
        vv = v if v.shape[2] == H else torch.repeat_interleave(v, H // v.shape[2], dim=2)
        dz = torch.einsum("bhij,bjhd->bihd", new - old, vv[:, :, heads].double())
        delta = torch.einsum("bihd,hdm->bim", dz, W_O.to(dz.device))
        pattern = pattern.clone()
        pattern[:, heads] = new.to(pattern.dtype)
        return (out + delta.to(out.dtype), pattern, *rest)
    return fn
