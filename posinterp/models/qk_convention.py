"""How posinterp reads a loaded model's W_Q, W_K: the one weight convention of every QK
spectrum (:data:`QK_CONVENTION`), the norm whose gain it folds (:func:`attention_input_norm`)
and the per-model record of both (:func:`qk_convention`, kept in ``ModelInfo``).

The circuit is the one acting on the *normalized* residual: W_Q^eff = C diag(g) W_Q (and
W_K likewise), with g the gain of the norm feeding attention and C = I - 11^T/d_model
for LayerNorm, C = I for RMSNorm, as TransformerLens's ``fold_ln`` writes them
(:mod:`posinterp.analysis.spectral` computes the spectra).
"""

from __future__ import annotations

from torch import Tensor

from .backend import attention_input_norm_module, norm_gain_folded, qk_norm

__all__ = ["QK_CONVENTION", "QK_NORM_CONVENTION", "attention_input_norm", "qk_convention"]

QK_CONVENTION = ("effective: W_Q, W_K acting on the normalized residual (the gain of the norm "
                 "feeding attention folded in, LayerNorm's centering applied), as "
                 "TransformerLens's fold_ln writes them")
QK_NORM_CONVENTION = ("{module} gains ({over}) folded into W_Q, W_K columns before "
                      "RoPE: M(Δ) = W_Q diag(γ_q) R(-Δ) diag(γ_k) W_K^T; the per-token "
                      "1/(s_q s_k) of the norm is outside M")


def attention_input_norm(model, layer: int) -> tuple[Tensor | None, bool, str]:
    """``(gain, center, where)`` of the norm whose output feeds ``layer``'s attention.

    Pre-norm blocks: ``blocks.{layer}.ln1`` (``LN``/``RMS``: gain still there;
    ``LNPre``/``RMSPre``, or a TL 4 load whose gains TL's processing folded and left at 1
    (:func:`~posinterp.models.backend.norm_gain_folded`): gain folded by the loader).
    Post-norm encoders (BERT): the previous block's ``ln2``, or ``embed.ln`` for layer 0.
    ``gain`` is None when it is already folded or there is no norm; ``center`` is True
    for LayerNorm.
    """
    norm_type = model.cfg.normalization_type
    center = norm_type in ("LN", "LNPre")
    # post-LN encoders: the input is an earlier norm's output (TL 3.9 and TL 4 name it apart)
    norm, where = attention_input_norm_module(model, layer)
    gain = (getattr(norm, "w", None) if norm_type in ("LN", "RMS") and not norm_gain_folded(model)
            else None)
    if norm_type is None:
        where = "none"
    # A CPU copy, like attention_weights: spectra are computed on CPU (docs/scale.md).
    return (gain.detach().cpu() if gain is not None else None), center, where


def qk_convention(model) -> dict:
    """How :func:`posinterp.analysis.spectral.qk_weights` forms W_Q, W_K for ``model``
    (recorded in ``ModelInfo``).

    Returns:
        ``{"convention", "normalization", "norm_gain", "centered", "norm", "qk_norm"}``,
        where ``norm_gain`` is ``"folded by the loader"``, ``"folded by posinterp.spectral"``
        or ``"no norm before attention"``, and ``qk_norm`` says how q/k-norm gains enter
        (:func:`posinterp.analysis.spectral.fold_qk_norm`) or ``"none"``.

    Raises:
        MissingFeatureError: for a q/k norm posinterp cannot fold exactly.
    """
    norm_type = model.cfg.normalization_type
    gain, center, where = attention_input_norm(model, 0)
    how = ("no norm before attention" if norm_type is None
           else "folded by posinterp.spectral" if gain is not None else "folded by the loader")
    qkn = qk_norm(model, 0)
    return {"convention": QK_CONVENTION, "normalization": norm_type, "norm_gain": how,
            "centered": bool(center), "norm": where if norm_type else "none",
            "qk_norm": QK_NORM_CONVENTION.format(over=qkn.over, module=qkn.module) if qkn else "none"}
