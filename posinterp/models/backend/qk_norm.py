"""qk-norm (Qwen3, OLMo-2, Gemma-3; TL 3.9's ``use_qk_norm``): the RMS gains q and k
pass before their dot product, read exactly from the model (:func:`qk_norm`), or a
refusal where a feature has no exact meaning under them (:func:`refuse_qk_norm`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import MissingFeatureError
from .surface import _attn, _expand, is_bridge, n_kv_heads


@dataclass(frozen=True)
class QKNorm:
    """The per-head norm q and k pass before their dot product (qk-norm: Qwen3, OLMo-2,
    Gemma-3; TL 3.9's ``use_qk_norm``), as one layer applies it.

    The score of query i and key j is (γ_q ⊙ q_i / s_q(i)) R(i - j) (γ_k ⊙ k_j / s_k(j))^T,
    with q_i = x_i W_Q, k_j = x_j W_K and s the root-mean-square of the normed vector (one
    head's d_head entries where ``over == "per head"``; all heads' n_heads * d_head
    entries, OLMo-2's layout, where ``over == "over all heads"``); the gain is applied
    before RoPE.

    Attributes:
        q_gain, k_gain: γ_q, γ_k as ``[n_heads, d_head]`` float64 CPU tensors (keys
            expanded over grouped-query heads), the gain the module really multiplies by
            (``weight`` or Gemma's ``1 + weight``).
        over: ``"per head"`` or ``"over all heads"``.
        module: ``"RMSNorm (gain w)"`` or ``"RMSNorm (gain 1 + w)"``, for records.
    """

    q_gain: Tensor
    k_gain: Tensor
    over: str
    module: str


def _norm_modules(model, layer: int):
    """``(q_norm, k_norm, calls)`` where the norms exist, else None; ``calls`` is the module
    that computes the norm (HF's own inside a bridge, TL 3.9's component otherwise)."""
    attn = _attn(model, layer)
    q, k = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q is None and k is None:
        return None
    if q is None or k is None:
        raise MissingFeatureError(f"blocks.{layer}.attn has only one of q_norm/k_norm; posinterp "
                                  "cannot form its QK circuit")
    if is_bridge(model):  # the HF module the bridge wraps computes the norm
        q, k = (getattr(m, "original_component", m) for m in (q, k))
    return q, k


def _gain_of(norm, length: int, layer: int, which: str) -> tuple[Tensor, str]:
    """The gain ``norm`` multiplies its RMS-normalized input by, ``[length]`` float64, and
    its formula in the weight w (``"w"`` or ``"1 + w"``).

    The weight is read exactly; which formula the module applies (``w`` as Qwen3, OLMo-2
    and TL's RMSNorm, or ``1 + w`` as Gemma) is decided by running the module once on a
    seeded vector and comparing with both, so a norm of another kind (a LayerNorm, which
    centres q) is refused rather than folded wrongly."""
    w = getattr(norm, "w", None)
    if w is None:
        w = getattr(norm, "weight", None)
    name = type(norm).__name__
    if w is None:
        w = torch.ones(length, dtype=torch.float64)  # TL's RMSNormPre: no gain
    w = w.detach().cpu().double().reshape(-1)
    if w.numel() != length:
        raise MissingFeatureError(f"blocks.{layer}.attn.{which}_norm ({name}) has a gain of "
                                  f"{w.numel()} entries, expected {length}")
    param = next(iter(norm.parameters()), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    x = torch.randn(3, length, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        out = norm(x.to(device=device, dtype=dtype)).detach().cpu().double()
    unit = x / x.square().mean(-1, keepdim=True).sqrt()
    # half-precision modules round each output to ~4e-3; eps in the norm moves it ~1e-6
    tol = 3e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    for gain, formula in ((w, "w"), (1.0 + w, "1 + w")):
        if torch.allclose(out, unit * gain, rtol=tol, atol=tol * float(gain.abs().max()) + 1e-12):
            return gain, formula
    raise MissingFeatureError(
        f"blocks.{layer}.attn.{which}_norm ({name}) is not an RMSNorm with gain w or 1 + w "
        "(a LayerNorm over q/k centres them); posinterp cannot fold it into the QK circuit")


def qk_norm(model, layer: int) -> QKNorm | None:
    """The qk-norm of ``layer`` (:class:`QKNorm`), or None where q and k are not normed.

    Read from the model surface: TL 3.9's ``attn.q_norm``/``attn.k_norm`` (``use_qk_norm``
    per head; OLMo-family over all heads), a TL 4 bridge's ``q_norm``/``k_norm`` components
    (the HF module they wrap). Source: Dehghani et al. 2023 (ViT-22B, §3 "QK
    normalization"); HF's Qwen3/OLMo-2/Gemma-3 attention.

    Raises:
        MissingFeatureError: for a q/k norm posinterp cannot fold exactly (not RMS-type, or
            a gain of unexpected size), naming the module.
    """
    mods = _norm_modules(model, layer)
    if mods is None:
        return None
    H, dh, kv = model.cfg.n_heads, model.cfg.d_head, n_kv_heads(model)
    q_norm, k_norm = mods
    q_len = _gain_length(q_norm)
    over = "per head" if q_len == dh else "over all heads"
    q_gain, formula = _gain_of(q_norm, dh if over == "per head" else H * dh, layer, "q")
    k_gain, _ = _gain_of(k_norm, dh if over == "per head" else kv * dh, layer, "k")
    if over == "per head":
        q_gain, k_gain = q_gain.expand(H, dh).clone(), k_gain.expand(H, dh).clone()
    else:
        q_gain, k_gain = q_gain.reshape(H, dh), _expand(k_gain.reshape(kv, dh), H)
    return QKNorm(q_gain, k_gain, over, f"RMSNorm (gain {formula})")


def refuse_qk_norm(model, feature: str, why: str) -> None:
    """Refuse ``feature`` on a qk-norm model, where it has no exact meaning (``why`` says
    what breaks).

    Raises:
        MissingFeatureError: where any layer's attention has a ``q_norm``, naming qk-norm,
            the layer and what still works.
    """
    for layer in range(model.cfg.n_layers):
        if getattr(_attn(model, layer), "q_norm", None) is not None:
            raise MissingFeatureError(
                f"{feature} is not available on qk-norm models (blocks.{layer}.attn.q_norm): "
                f"{why}; spectra, frequency profiles and pattern scores are (docs/models.md, "
                "architecture features)")


def _gain_length(norm) -> int | None:
    w = getattr(norm, "w", None)
    if w is None:
        w = getattr(norm, "weight", None)
    if w is not None:
        return w.numel()
    return getattr(norm, "length", None)
