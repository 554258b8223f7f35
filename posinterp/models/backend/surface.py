"""The attention a model really computes, asked of the model, never of its TL version or
class: bridge or ``HookedTransformer``, weights per head (:func:`attention_weights`, keys
and values expanded over grouped-query heads), score scale, positional scheme, soft-cap,
BOS token, post-LN encoders and the norm feeding attention."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import MissingFeatureError
from .mla import check_not_mla
from .modes import unwrap


def is_bridge(model) -> bool:
    """True for a TransformerLens 4 ``TransformerBridge`` (it wraps ``original_model``)."""
    return hasattr(type(model), "boot_transformers")


def _attn(model, layer: int):
    return model.blocks[layer].attn


def _native_attention(model, layer: int):
    """The wrapped attention module of a bridge (None for HookedTransformer)."""
    if not is_bridge(model):
        return None
    return getattr(_attn(model, layer), "original_component", None)


def is_posinterp_attention(model, layer: int = 0) -> bool:
    """True where posinterp's own attention runs (TL 4 toy models, :mod:`.native`)."""
    return bool(getattr(_native_attention(model, layer), "posinterp_attention", False))


def _is_native(model, layer: int = 0) -> bool:
    comp = _native_attention(model, layer)
    return comp is not None and type(comp).__name__ in ("NativeAttention", "PosinterpAttention")


def n_kv_heads(model) -> int:
    """Key/value heads (``n_heads`` without grouped-query attention)."""
    return model.cfg.n_key_value_heads or model.cfg.n_heads


def attn_scale(model, layer: int = 0) -> float:
    """The divisor of q·k in ``layer`` (usually sqrt(d_head)), as the model computes it.

    TL 4 configs hold -1 as "sqrt(d_head)"; native attention keeps the value it uses and
    HF modules their ``scaling`` (its inverse); GPT-2's inverse-layer scaling multiplies by
    ``layer + 1``. :func:`hook_meaning` checks the value against the model's pattern.
    """
    comp = _native_attention(model, layer)
    if comp is not None and isinstance(getattr(comp, "scale", None), (int, float)):
        return float(comp.scale)
    if comp is not None and isinstance(getattr(comp, "scaling", None), (int, float)):
        return 1.0 / float(comp.scaling)  # HF attention modules (OPT, Llama, GPT-NeoX, ...)
    arch = str(getattr(model.cfg, "architecture", "") or "")
    if is_bridge(model) and arch == "GPTNeoForCausalLM":
        # HF GPT-Neo never scales q·k; TL 4.3's config says it does (hook_meaning checks)
        return 1.0
    scale = float(getattr(model.cfg, "attn_scale", -1.0))
    if is_bridge(model) and (scale <= 0 or not getattr(model.cfg, "use_attn_scale", True)):
        return math.sqrt(model.cfg.d_head)
    attn = _attn(model, layer)
    if isinstance(getattr(attn, "attn_scale", None), (int, float)):
        return float(attn.attn_scale)  # TL 3.9: use_attn_scale and inverse-layer scaling applied
    return scale


def positional_type(model) -> str:
    """``standard``, ``rotary`` or ``alibi``: the scheme the attention really applies.

    A TL 4 native toy model with posinterp's ALiBi reads "standard" in its config.
    """
    native = _native_attention(model, 0)
    if getattr(native, "posinterp_alibi_slopes", None) is not None:
        return "alibi"
    return str(model.cfg.positional_embedding_type)


def attn_soft_cap(model, layer: int = 0) -> float | None:
    """The attention soft-cap T of ``layer`` (the score's content term is T tanh(q·k /
    (attn_scale T)) before any positional bias and the mask), None where it has none.

    Read from what runs: an HF module's ``attn_logit_softcapping`` (Gemma-2, through a TL 4
    bridge), TL 4 native attention's ``attn_scores_soft_cap``, else the config's
    ``attn_scores_soft_cap`` (TL 3.9 ``HookedTransformer``: > 0 when set, -1 when not).
    """
    model = unwrap(model)
    if is_posinterp_attention(model, layer):
        return None  # posinterp's own attention has no soft-cap (its builders refuse one)
    comp = _native_attention(model, layer)
    for name in ("attn_logit_softcapping", "attn_scores_soft_cap"):
        value = getattr(comp, name, None) if comp is not None else None
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    value = getattr(model.cfg, "attn_scores_soft_cap", None)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _soft_cap_setting(model, layer: int) -> str:
    """The setting that soft-caps ``layer``'s scores, as the user would find it."""
    comp = _native_attention(unwrap(model), layer)
    cap = attn_soft_cap(model, layer)
    if isinstance(getattr(comp, "attn_logit_softcapping", None), (int, float)):
        return f"attn_logit_softcapping={cap:g} in its HF config"
    return f"cfg.attn_scores_soft_cap={cap:g}"


def check_no_soft_cap(model, analysis: str, layers=None) -> None:
    """Refuse ``analysis``, an additive split of each head's pre-softmax score (score parts,
    the positional/symbolic score), on a model whose attention scores are soft-capped
    (:func:`attn_soft_cap`): with score = T tanh(c / T) no part of the content term c adds
    to the score, so the split has no exact meaning.

    Raises:
        MissingFeatureError: naming the setting, its value, and what still works.
    """
    for layer in range(model.cfg.n_layers) if layers is None else layers:
        cap = attn_soft_cap(model, layer)
        if cap is not None:
            raise MissingFeatureError(
                f"{analysis} splits each head's pre-softmax score into terms that add up to it, "
                f"but this model soft-caps its attention scores ({_soft_cap_setting(model, layer)}: "
                f"score = {cap:g} * tanh(q.k / (attn_scale * {cap:g})) at layer {layer}), so no "
                "term of q.k adds to the score and the split is not defined. Still exact on this "
                "model: attention patterns and previous-token scores, inspect_heads' kernels, "
                "QK spectra (of the pre-cap form W_Q W_K^T; the cap is monotone and acts after "
                "it), head and channel/band ablations (edits of q that the model's own cap then "
                "sees) and symmetrization (applied inside the cap)")


def _expand(W: Tensor, n_heads: int) -> Tensor:
    if W.shape[0] == n_heads:
        return W
    if n_heads % W.shape[0]:
        raise ValueError(f"{W.shape[0]} key/value heads do not divide n_heads={n_heads}")
    return torch.repeat_interleave(W, n_heads // W.shape[0], dim=0)


_ATTENTION_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V")


def attention_weights(model, layer: int, names=_ATTENTION_WEIGHTS) -> dict[str, Tensor]:
    """``W_Q, W_K, W_V`` ``[n_heads, d_model, d_head]``, ``W_O`` ``[n_heads, d_head,
    d_model]``, ``b_Q, b_K, b_V`` ``[n_heads, d_head]`` of ``layer``, detached float64
    CPU copies, whatever the model's device (spectra are computed on CPU in float64, so
    they are the same numbers for a model on any device; docs/scale.md).

    Keys and values are expanded over grouped-query heads (query head h reads KV head
    h // (n_heads / n_kv_heads), as both TL versions and HF do); missing biases are 0.
    ``names``: only these (a TL 4 bridge assembles each from its HF weights on access).

    Raises:
        ValueError: for a name not among the seven above.
        MissingFeatureError: a model with multi-head latent attention (:func:`check_not_mla`).
    """
    bad = [n for n in names if n not in _ATTENTION_WEIGHTS]
    if bad:
        raise ValueError(f"names must be among {_ATTENTION_WEIGHTS}, got {bad}")
    check_not_mla(model, "reading per-head W_Q, W_K, W_V, W_O (spectra, channels, score parts)")
    attn = _attn(model, layer)
    H, dh = model.cfg.n_heads, model.cfg.d_head
    out = {}
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        if name in names:
            out[name] = _expand(getattr(attn, name).detach().cpu().double(), H)
    for name in ("b_Q", "b_K", "b_V"):
        if name not in names:
            continue
        try:
            b = getattr(attn, name)
        except AttributeError:
            b = None
        out[name] = (torch.zeros(H, dh, dtype=torch.float64) if b is None
                     else _expand(b.detach().cpu().double().reshape(-1, dh), H))
    return out


#: Where a loader records the BOS id of a model that comes without a tokenizer (llama2.c:
#: run.c starts every sequence with token 1, and its tokenizer is not in the .bin).
BOS_ATTRIBUTE = "posinterp_bos_token_id"


def set_bos_token_id(model, bos: int) -> None:
    """Record ``bos`` as the BOS id of ``model``, which has no tokenizer to say it
    (:func:`bos_token_id` reads it). Used by loaders of tokenizer-less formats."""
    object.__setattr__(unwrap(model), BOS_ATTRIBUTE, int(bos))


def bos_token_id(model) -> int | None:
    """The model's BOS token id, or None where it has none.

    Without a tokenizer: the id its loader recorded (:func:`set_bos_token_id`; llama2.c's
    1), else None. Otherwise the tokenizer's ``bos_token_id``, unless it is the tokenizer's
    unknown token: TL 4's bridge gives a tokenizer without a BOS (BERT's) the stand-in
    ``<|endoftext|>``, which such a vocabulary maps to ``[UNK]``, where TL 3.9 leaves it
    None. An unknown token is never a real BOS, so inputs built from this id are the same
    on both lines. Nor is an id the model cannot embed (``>= d_vocab``: a tokenizer
    attached to another model's vocabulary), which would only crash the embedding.
    """
    tok = getattr(unwrap(model), "tokenizer", None)
    if tok is None:
        recorded = getattr(unwrap(model), BOS_ATTRIBUTE, None)
        return None if recorded is None else int(recorded)
    bos = getattr(tok, "bos_token_id", None)
    if bos is None or bos == getattr(tok, "unk_token_id", None):
        return None
    d_vocab = getattr(getattr(model, "cfg", None), "d_vocab", None)
    if isinstance(d_vocab, int) and d_vocab > 0 and int(bos) >= d_vocab:
        return None
    return int(bos)


def is_post_ln(model) -> bool:
    """True for post-LN encoders (BERT: TL 3.9 ``HookedEncoder``, or a TL 4 bridge over HF
    BERT), whose attention reads an earlier LayerNorm's output, not ``ln1``'s."""
    if not is_bridge(model):
        return type(model.blocks[0]).__name__ == "BertBlock"
    return str(getattr(model.cfg, "architecture", "") or "").startswith("Bert")


def attention_input_norm_module(model, layer: int):
    """``(norm module, name)`` of the LayerNorm whose output feeds ``layer``'s attention.

    Pre-norm models: ``blocks.{layer}.ln1``. Post-LN encoders: the previous block's
    ``ln2``, or the embedding LayerNorm for layer 0 (TL 3.9 ``embed.ln``; TL 4's BERT
    adapter calls it ``embed_ln``).
    """
    if not is_post_ln(model):
        return getattr(model.blocks[layer], "ln1", None), f"blocks.{layer}.ln1"
    if layer > 0:
        return model.blocks[layer - 1].ln2, f"blocks.{layer - 1}.ln2"
    if is_bridge(model):
        return model.embed_ln, "embed_ln"
    return model.embed.ln, "embed.ln"
