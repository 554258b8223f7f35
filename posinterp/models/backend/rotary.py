"""RoPE as a layer really applies it: rotary dims, pair layout and frequencies
(:class:`RotarySpec`, :func:`rotary_spec`), the rotation itself (:func:`rope_rotate`) and
the longest input a model's position tables allow (:func:`position_limit`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..rope_layout import merge_pairs, split_pairs
from .errors import MissingFeatureError
from .mla import check_not_mla
from .modes import unwrap
from .surface import _is_native, _native_attention, is_bridge, positional_type


@dataclass(frozen=True)
class RotarySpec:
    """RoPE as a layer applies it: ``rotary_dim`` leading dims of each head, pairs
    (2p, 2p+1) if ``adjacent_pairs`` else (p, p + rotary_dim/2), ``inv_freq`` radians per
    position (float64, ``[rotary_dim / 2]``)."""

    rotary_dim: int
    adjacent_pairs: bool
    inv_freq: Tensor


_ROTARY_AT = ("model.rotary_emb", "gpt_neox.rotary_emb", "transformer.rotary_emb")


def _hf_inv_freq(model) -> Tensor | None:
    """The ``inv_freq`` buffer HF's rotary embedding computed (bridged HF models)."""
    hf = model.original_model
    for where in _ROTARY_AT:  # where HF's decoders keep it: no walk over every module
        try:
            mod = hf.get_submodule(where)
        except AttributeError:
            continue
        for name, buf in mod.named_buffers():  # the bridge may wrap it (_original_component)
            if name.endswith("inv_freq") and not name.endswith("original_inv_freq"):
                return buf.detach().cpu().double()
    for name, buf in hf.named_buffers():
        if name.endswith("inv_freq"):
            return buf.detach().cpu().double()
    return None


def _hf_sincos_inv_freq(model) -> Tensor | None:
    """Frequencies of an HF rotary table stored as ``sin | cos`` per position (GPT-J's
    ``embed_positions``, ``[max_positions, rotary_dim]``, no ``inv_freq`` buffer), None
    where there is no such table.

    The frequencies come from HF's config (``hf_config.hf_rotary_inv_freq``: GPT-J's fixed
    base 10000 over ``rotary_dim``), then are checked against the table the model really
    reads, at every position it holds.

    Raises:
        MissingFeatureError: the table is not sin | cos of positions x those frequencies.
    """
    table = None
    for name, buf in model.original_model.named_buffers():
        if name.endswith("embed_positions") and buf.ndim == 2:
            table = buf.detach().cpu().double()
            break
    if table is None:
        return None
    from ..hf_config import hf_rotary_inv_freq

    arch = str(getattr(model.cfg, "architecture", "") or "")
    inv = hf_rotary_inv_freq(arch, model.original_model.config)  # float32, as HF's
    # the angles rounded as HF rounds them (float32 product), so only sin/cos differ
    ang = (torch.arange(table.shape[0]).float()[:, None] * inv).double()
    want = torch.cat([ang.sin(), ang.cos()], -1)
    inv = inv.double()
    if want.shape != table.shape or not torch.allclose(table, want, atol=1e-5, rtol=0):
        raise MissingFeatureError(
            f"{arch}'s rotary table (embed_positions, {tuple(table.shape)}) is not sin | cos of "
            f"the frequencies its config gives ({2 * inv.shape[0]} rotary dims, base 10000); "
            "posinterp cannot tell which frequencies it rotates by")
    return inv


def rotary_spec(model, layer: int = 0) -> RotarySpec:
    """The RoPE ``layer`` applies (see :class:`RotarySpec`).

    TL 3.9: the config's layout and :func:`~posinterp.models.positions.rotary_inv_freq`.
    TL 4 native attention: adjacent pairs, its own frequencies (whatever the config's
    ``rotary_adjacent_pairs`` says); posinterp's attention: TL 3.9's base formula on split
    halves (toy models) or adjacent pairs (llama2.c); bridged HF models: HF's ``inv_freq``
    buffer, or for GPT-J (adjacent pairs), which keeps only a sin | cos table, the
    frequencies of its config checked against that table.

    Raises:
        ValueError: for a model whose positional scheme is not rotary.
        MissingFeatureError: a bridged HF model whose rotary frequencies cannot be read, or
            one with multi-head latent attention (:func:`check_not_mla`).
    """
    check_not_mla(model, "the RoPE layout of a head (rotary_spec)")
    if positional_type(model) != "rotary":
        raise ValueError(f"a rotary model is needed; this model's positional scheme is "
                         f"{positional_type(model)!r}")
    cfg = model.cfg
    if not is_bridge(model):
        from ..positions import rotary_inv_freq

        return RotarySpec(cfg.rotary_dim, bool(cfg.rotary_adjacent_pairs), rotary_inv_freq(model, layer))
    comp = _native_attention(model, layer)
    if getattr(comp, "posinterp_attention", False):
        return RotarySpec(comp.posinterp_rotary_dim, bool(comp.posinterp_adjacent_pairs),
                          comp.posinterp_inv_freq)
    if _is_native(model, layer):
        from transformer_lens.model_bridge.sources.native.model import _resolve_rope_scaling

        rot = comp.rotary
        _, position_scale, inv = _resolve_rope_scaling(cfg, rot.rotary_dim)
        return RotarySpec(rot.rotary_dim, True, inv.detach().cpu().double() / position_scale)
    inv = _hf_inv_freq(model)
    if inv is None:
        inv = _hf_sincos_inv_freq(model)
    if inv is None:
        raise MissingFeatureError("this bridged model exposes no RoPE inv_freq buffer and no "
                                  "sin | cos table (embed_positions); posinterp cannot tell which "
                                  "frequencies it rotates by")
    arch = str(getattr(cfg, "architecture", "") or "")
    return RotarySpec(2 * inv.shape[0], arch.startswith("GPTJ"), inv)


def rope_rotate(x: Tensor, spec: RotarySpec, positions: Tensor) -> Tensor:
    """``x`` (``[batch, pos, head, d_head]``) rotated by RoPE at ``positions``
    (``[batch, pos]``), with ``spec``'s layout and frequencies, in float64.

    Source: Su et al. 2021 (RoFormer) eq. 34 (pairs rotated by ``pos * inv_freq[p]``).
    """
    x = x.double()
    rd = spec.rotary_dim
    ang = positions.double()[..., None] * spec.inv_freq.to(x.device)[None, None]  # [b, pos, rd/2]
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    rot, rest = x[..., :rd], x[..., rd:]
    a, b = split_pairs(rot, spec.adjacent_pairs)
    out = merge_pairs(a * cos - b * sin, b * cos + a * sin, spec.adjacent_pairs)
    return torch.cat([out, rest], -1)


def position_limit(model) -> int | None:
    """The most positions one input may have for ``model`` to compute its source's
    function (None: any length).

    ALiBi needs no table (posinterp computes the bias per call on either line). A TL 4
    bridge over an HF RoPE model whose rotary embedding computes cos/sin from the
    position ids (an ``inv_freq`` buffer: Llama, Mistral, Qwen2, GPT-NeoX) has no limit,
    as HF has none; GPT-J's table stops at its ``max_position_embeddings``. Everything
    else stops at ``n_ctx``: a position table, TL 3.9's RoPE tables, TL 4 native models
    (which refuse longer inputs).
    """
    model = unwrap(model)
    if positional_type(model) == "alibi":
        return None
    if (is_bridge(model) and positional_type(model) == "rotary" and not _is_native(model)
            and _hf_inv_freq(model) is not None):
        return None
    return int(model.cfg.n_ctx)
