"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, ...): recognized once
(:func:`mla_settings`) and refused by name wherever per-head W_Q/W_K or one RoPE layout
would be read (:func:`check_not_mla`)."""

from __future__ import annotations

from .errors import MissingFeatureError
from .modes import unwrap

# Config fields of multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, Kimi-K2, ...):
# q and k are decompressed from low-rank latents and split into a "nope" part and a rope
# part whose key is shared by every head.
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _mla_of_config(config) -> dict | None:
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    defining = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
    if not any(isinstance(get(k), int) and not isinstance(get(k), bool) and get(k) > 0
               for k in defining):
        return None
    return {k: get(k) for k in _MLA_FIELDS if get(k, "absent") != "absent"}


def mla_settings(source) -> dict | None:
    """The multi-head latent attention (MLA) settings of a model or a config (``{field:
    value}`` over ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``), None where it has no MLA.

    ``source``: a model (a bridge's HF config and TL config, and TransformerLens's MLA
    attention component, are read), an HF config object, or a ``config.json`` dict. The one
    place posinterp recognizes MLA (:func:`check_not_mla`).
    """
    if isinstance(source, dict) or not hasattr(source, "cfg"):
        return _mla_of_config(source)
    model = unwrap(source)
    hf = getattr(model, "original_model", None)
    for config in (getattr(hf, "config", None), model.cfg):
        found = _mla_of_config(config) if config is not None else None
        if found:
            return found
    blocks = getattr(model, "blocks", None)
    if blocks is not None and len(blocks) and "MLA" in type(getattr(blocks[0], "attn", None)).__name__:
        return {"attention": type(blocks[0].attn).__name__}
    return None


def mla_message(settings: dict, analysis: str) -> str:
    """Why ``analysis`` refuses multi-head latent attention, naming ``settings``."""
    fields = ", ".join(f"{k}={v}" for k, v in settings.items())
    return (f"{analysis} does not support multi-head latent attention (MLA, as in DeepSeek-V2/V3 "
            f"and GLM-4-MoE-Lite: {fields}): each head's query and key are decompressed from "
            "low-rank latents (q_lora_rank, kv_lora_rank) and concatenate a content part "
            "(qk_nope_head_dim) with a rotary part (qk_rope_head_dim) whose key is shared by all "
            "heads, so no per-head W_Q, W_K (M = W_Q W_K^T, B = W_K^T W_Q) or single RoPE layout "
            "describes the score; posinterp refuses rather than analyse other matrices. Analyses of "
            "the attention pattern and the residual stream (previous_token_scores, "
            "adjacency_by_layer, similarity_by_layer) still run on a TransformerBridge you boot "
            "over the model yourself")


def check_not_mla(model, analysis: str) -> None:
    """Refuse ``analysis`` (one that reads W_Q/W_K, q/k hooks or the RoPE layout) on a
    model with multi-head latent attention (:func:`mla_settings`).

    Raises:
        MissingFeatureError: (a ``ValueError``) naming MLA and its config fields.
    """
    settings = mla_settings(model)
    if settings:
        raise MissingFeatureError(mla_message(settings, analysis))
