"""The model surface posinterp reads, for TransformerLens 3.9 and 4.x (docs/architecture.md).

Analyses ask this module, never the TransformerLens version or a model's class:

* :func:`attention_weights` — W_Q, W_K, W_V, W_O of one layer as ``[n_heads, d_model,
  d_head]`` (W_O ``[n_heads, d_head, d_model]``), keys and values expanded over
  grouped-query heads (TL 3.9 expands them in ``attn.W_K``; a TL 4 bridge does not);
* :func:`attn_scale`, :func:`positional_type`, :func:`rotary_spec` — the score scale and
  positional scheme, as the model really computes them (TL 4 configs hold ``attn_scale
  = -1`` and ``rotary_dim = None`` as "unset" sentinels, and cannot say "alibi" for a
  native model);
* :func:`hook_meaning` — what each attention hook really carries on the loaded model,
  verified once per model by a probe (softmax of the scores hook is the pattern and an
  edit of it changes the output; q·k/attn_scale of the q/k hooks explains the pattern;
  ...) and cached on the model object; :func:`scores_hook`, :func:`rotated_qk_hooks`,
  :func:`content_qk_hooks`, :func:`query_hooks`, :func:`z_hook` answer from it and raise
  :class:`MissingFeatureError`, naming what the probe found, where no hook has the
  meaning (TL 4 native attention and OPT/GPT-Neo bridges fire ``hook_attn_scores`` after
  the softmax with the pattern; native attention never fires ``hook_rot_q``);
  :func:`install_output_edit` / :func:`pattern_edit` edit the pattern where no hook can;
* :func:`compiled_kind`, :func:`eager`, :func:`unwrap` — compiled models, whose graphs
  skip hooks, run eagerly for hook-based features;
* :func:`run_cached` — ``run_with_cache`` with an attention mask, for every model kind,
  in eval mode (:func:`eval_mode`), sites replaced by other plugins included
  (:func:`site_module`).

docs/tl4.md lists every TL 4 hook whose meaning differs from 3.9 and what posinterp
does about it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import re
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils import parametrize

__all__ = ["TL_MAJOR", "TL_VERSION", "BlockInputs", "CompiledModelError", "HookMeaning",
           "MissingFeatureError", "QKNorm", "QKSlot", "RotarySpec", "arm_output_edit", "capture_block_inputs",
           "final_logits", "run_blocks_from", "suffix_replay_matches", "attention_input_norm_module",
           "attention_weights", "attn_scale", "attn_soft_cap", "check_no_soft_cap", "check_not_mla",
           "check_not_wrapped", "compiled_kind",
           "content_qk_from", "content_qk_hooks", "convert_tl3_weights", "eager", "eval_mode",
           "guard_kv_cache", "has_kv_cache", "hook_meaning", "hooks_at_sites", "hub_repo_for",
           "install_output_edit", "is_bridge", "is_post_ln", "mark_folded", "mla_settings",
           "n_kv_heads", "norm_gain_folded", "pattern_edit", "position_limit", "positional_type",
           "process_weights", "qk_norm", "qk_slots", "refuse_qk_norm",
           "query_hooks", "rope_rotate", "rotary_spec", "rotated_qk_hooks", "run_cached",
           "scores_hook", "site_module", "unhonoured_settings", "unwrap", "verify_pattern_hook",
           "z_hook"]

TL_VERSION = importlib.metadata.version("transformer-lens")
TL_MAJOR = int(TL_VERSION.split(".")[0])


class MissingFeatureError(ValueError):
    """The model lacks a hook or feature an analysis needs (a ``ValueError`` naming it)."""


def hub_repo_for(name: str) -> str:
    """The hub repository TransformerLens loads for ``name``: its aliases (``"pythia-70m"``,
    ``"gpt2-small"``) resolved, any other name unchanged."""
    if TL_MAJOR >= 4:
        from transformer_lens.tools.model_registry.registry_io import resolve_model_alias

        return resolve_model_alias(name) or name
    from transformer_lens import loading_from_pretrained as tl_loading

    try:
        return tl_loading.get_official_model_name(name)
    except ValueError:  # not a name TL knows: a hub repo id as it is
        return name


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
    from .hf_config import hf_rotary_inv_freq

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
        from .positions import rotary_inv_freq

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


# --- What the attention hooks carry, verified on the loaded model -------------------------
#
# TL 4 changed what several hooks carry without renaming them (OPT/GPT-Neo bridges fire
# hook_attn_scores with the pattern, after the fact; native models never fire hook_rot_q),
# so no feature trusts a hook by its name: a probe checks each hook's meaning once per
# model and the verdict is cached on the model object (docs/tl4.md, "Hook meanings").

_VERDICTS = "posinterp_hook_meaning"  # attribute on the model: {layer: HookMeaning}


@dataclass(frozen=True)
class HookMeaning:
    """What one layer's attention hooks were verified to carry (:func:`hook_meaning`).

    ``scores``: the hook carrying pre-softmax scores (masked, bias added) whose edits
    change the output, else None. ``pattern``: where there is no such hook, the hook
    carrying the pattern the module goes on to use, whose edits change the output (TL 4
    native models), else None. ``output_edit``: the wrapped attention module returns
    ``(output, pattern)`` and posinterp can replace both (the route for score edits where
    no pre-softmax hook exists). ``content_qk``: hooks whose ``q_i · k_j / attn_scale``
    is the content term of the scores (rotated q/k for RoPE; see
    :func:`content_qk_from`), else None. ``query_qk``:
    ``hook_q``/``hook_k`` verified as the query/key before any rotation, whose edits take
    effect, else None. ``z``: ``hook_z``, verified as each head's pattern-weighted values
    (``[batch, pos, head, d_head]``, z_h = p_h v_h) whose edits take effect, else None.
    ``found``: what the probe saw, for error messages. ``soft_cap``: the attention
    soft-cap T the model applies to the content term (score = T tanh(q·k / (attn_scale T))
    + position terms; :func:`attn_soft_cap`), else None: ``content_qk``/``query_qk`` were
    then verified as the q/k of the **pre-cap** content term, which every reader of them
    must pass through the cap (or refuse, :func:`check_no_soft_cap`).
    """

    scores: str | None
    pattern: str | None
    output_edit: bool
    content_qk: tuple[str, ...] | None
    query_qk: tuple[str, str] | None
    z: str | None
    found: str
    soft_cap: float | None = None


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
    if spec.adjacent_pairs:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    else:
        a, b = rot[..., : rd // 2], rot[..., rd // 2:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    return torch.cat([out, rest], -1)


def compiled_kind(model) -> str | None:
    """``"torch.compile"`` for a ``torch.compile(model)`` wrapper, ``"model.compile()"`` for
    a module compiled in place, None for an eager model.

    TransformerLens hooks added after compilation do not fire inside the compiled graph
    (issue 22 item 5), so hook-based features ask this first (:func:`eager`).
    """
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        return "torch.compile"
    if getattr(model, "_compiled_call_impl", None) is not None:
        return "model.compile()"
    return None


class CompiledModelError(MissingFeatureError):
    """A hook-based feature was asked of a compiled model whose hooks would not fire."""


def check_not_wrapped(model, feature: str) -> None:
    """Refuse a ``torch.compile(model)`` wrapper for ``feature`` (hooks would not fire in
    its calls).

    Raises:
        CompiledModelError: naming the wrapper and the way out (pass ``model._orig_mod``).
    """
    if compiled_kind(model) == "torch.compile":
        raise CompiledModelError(
            f"{feature} needs TransformerLens hooks, which do not fire inside the graph of a "
            "torch.compile(model) wrapper; pass the uncompiled model (model._orig_mod)")


class eager:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Run a model compiled in place with ``model.compile()`` eagerly inside the block, so
    hooks fire; restored afterwards. A ``torch.compile(model)`` wrapper is unwrapped by
    :func:`unwrap` instead; an eager model is left alone.

    Uses ``nn.Module._compiled_call_impl`` (torch >= 2.2), the attribute ``Module.compile``
    sets; ``__call__`` falls back to the eager forward while it is None.
    """

    def __init__(self, model):
        self.model = unwrap(model)
        self.saved = None

    def __enter__(self):
        self.saved = getattr(self.model, "_compiled_call_impl", None)
        if self.saved is not None:
            self.model._compiled_call_impl = None
        return self.model

    def __exit__(self, *exc):
        if self.saved is not None:
            self.model._compiled_call_impl = self.saved
        return False


def unwrap(model):
    """The module a ``torch.compile(model)`` wrapper compiles (the model itself otherwise)."""
    return model._orig_mod if compiled_kind(model) == "torch.compile" else model


def _allowed(model, n: int) -> Tensor:
    causal = getattr(model.cfg, "attention_dir", "causal") == "causal"
    full = torch.ones(n, n, dtype=torch.bool)
    return full.tril() if causal else full


def _explains(pattern: Tensor, content: Tensor, allowed: Tensor, rtol: float = 1e-3) -> bool:
    """True if ``log pattern - content`` depends on positions only (on two probe
    sequences of different tokens): then content is the score's q·k term and everything
    else the model adds (mask, ALiBi, biases folded into positions) is token-independent.

    log p_ij = c_ij + b_ij - LSE_i, so centring each row at a shared key removes LSE_i.
    ``rtol``: relative to the largest |content|; a half-precision model's RoPE tables keep
    their half-precision rounding (about 4e-3) in the float32 probe, hence a looser one.
    """
    p = pattern.double()
    ok = allowed & (p > 1e-30).all(0)  # [head, query, key], both sequences
    if not ok.any():
        return False
    r = p.clamp_min(1e-300).log() - content.double()
    # centre each row at its best-resolved key (largest smaller probability of the two)
    ref = torch.where(ok, p.amin(0), -1.0).argmax(-1, keepdim=True)  # [head, query, 1]
    r = r - r.gather(-1, ref[None].expand(r.shape[0], -1, -1, -1))
    diff = (r[0] - r[1]).abs()[ok]
    tol = rtol * (1.0 + float(content.double().abs()[:, ok].max()))
    return bool(diff.max() <= tol)


def _probe_tokens(model) -> Tensor:
    n = int(min(8, model.cfg.n_ctx))
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.cfg.d_vocab, (2, n), generator=gen)


def _qk(cache, q_name, k_name, H):
    q, k = cache[q_name].double(), cache[k_name].double()
    if k.shape[2] != H:
        k = torch.repeat_interleave(k, H // k.shape[2], dim=2)
    return q, k


def content_qk_from(names: tuple[str, ...], captured, n_heads: int) -> tuple[Tensor, Tensor]:
    """``(q, k)`` float64 ``[batch, pos, head, d_head]`` (k expanded over grouped-query
    heads) of the content score, from the tensors of :func:`content_qk_hooks` (a dict
    name -> tensor): two hooks carry them rotated; four (q, k, cos, sin) carry the
    unrotated q/k and the call's RoPE tables ``[batch or 1, pos, rotary_dim]``, applied as
    HF does: x cos + rotate_half(x) sin on the leading rotary_dim dims (split halves)."""
    q, k = _qk(captured, names[0], names[1], n_heads)
    if len(names) == 4:
        cos, sin = captured[names[2]].double()[:, :, None], captured[names[3]].double()[:, :, None]
        rd = cos.shape[-1]

        def rot(x):
            a, b = x[..., : rd // 2], x[..., rd // 2: rd]
            half = torch.cat([-b, a], -1)
            return torch.cat([x[..., :rd] * cos.to(x.device) + half * sin.to(x.device), x[..., rd:]], -1)
        q, k = rot(q), rot(k)
    return q, k


def _content(q, k, scale, cap: float | None = None):
    """q·k / scale, through the soft-cap T tanh(. / T) where the model has one."""
    c = torch.einsum("bihd,bjhd->bhij", q, k) / scale
    return c if cap is None else cap * torch.tanh(c / cap)


def _changes_output(model, tokens, clean, hooks) -> bool:
    out = model.run_with_hooks(tokens, fwd_hooks=hooks)
    return not torch.allclose(out.double(), clean.double(), rtol=0, atol=1e-6)


def _noise(seed):
    def hook(x, hook):
        g = torch.Generator().manual_seed(seed)
        return x + torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device, x.dtype)
    return hook


def hook_meaning(model, layer: int) -> HookMeaning:
    """The verified meaning of ``layer``'s attention hooks on this model (see
    :class:`HookMeaning`), probed once per model on two random 8-token sequences and
    cached on the model object.

    Checks: softmax of ``hook_attn_scores`` equals ``hook_pattern`` and an edit of it
    changes the logits; q·k/attn_scale of the candidate q/k hooks explains the pattern
    up to a token-independent term (:func:`_explains`); an edit of ``hook_q`` changes
    the logits; where no pre-softmax hook exists, the wrapped module's ``(output,
    pattern)`` satisfies output = Σ_h pattern_h v_h W_O,h + b_O and replacing it takes
    effect.

    A ``torch.compile(model)`` wrapper is probed (and answered for) through the module
    it wraps, eagerly.

    Raises:
        ValueError: for a layer outside ``[0, n_layers)``.
    """
    model = unwrap(model)
    if not 0 <= layer < model.cfg.n_layers:
        raise ValueError(f"layer must be in [0, {model.cfg.n_layers - 1}], got {layer}")
    verdicts = model.__dict__.get(_VERDICTS)
    if verdicts is None:
        # eval mode: dropout moves the pattern and makes every edit look effective; every
        # module's own mode comes back afterwards (eval_mode)
        with eval_mode(model), _in_float32(model) as half, eager(model), torch.no_grad(), \
                _without_lens_hooks(model):
            verdicts = _probe(model, 3e-2 if half else 1e-3)
        object.__setattr__(model, _VERDICTS, verdicts)
    return verdicts[layer]


@contextlib.contextmanager
def _in_float32(model):
    """Run the block with every half-precision parameter and buffer of ``model`` in float32,
    then give each back its own dtype. A hook's meaning does not depend on the dtype, and
    float32 lets the probe's tolerances tell meanings apart in a bf16/fp16 model too (half
    precision rounds the pattern by ~1e-2). Half -> float32 -> half is exact, so the
    model's weights come back bit for bit. Yields whether anything was in half precision
    (tables computed from half-precision values, such as RoPE's cos/sin, keep that rounding).

    The configs say float32 for the block too: TL 3.9's norms cast their output to
    ``cfg.dtype`` (``LayerNormPre``/``RMSNormPre`` of a folded bf16 load would hand bf16
    activations to float32 weights: "mat1 and mat2 must have the same dtype"), and TL 3.9
    builds other tensors in ``cfg.dtype``, which must match the weights."""
    saved, configs = [], {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for t in store.values():
                # half precision only: a float64 model already resolves meanings
                if t is not None and t.dtype in (torch.float16, torch.bfloat16):
                    saved.append((t, t.data))
                    t.data = t.data.float()
        cfg = module.__dict__.get("cfg")
        if getattr(cfg, "dtype", None) in (torch.float16, torch.bfloat16):
            configs[id(cfg)] = (cfg, cfg.dtype)
    try:
        if saved:
            for cfg, _ in configs.values():
                cfg.dtype = torch.float32
        yield bool(saved)
    finally:
        for t, data in saved:
            t.data = data
        if saved:
            for cfg, dtype in configs.values():
                cfg.dtype = dtype


class _without_lens_hooks:  # noqa: N801
    """Hide the TransformerLens hooks already added (a user's, an outer ``intervene``'s)
    during the probe: it must see the model, and must not make those hooks fire. Hooks
    registered on hook points directly with torch (posinterp's ALiBi bias) are part of
    the model and stay."""

    def __init__(self, model):
        self.points = list(model.hook_dict.values())
        self.saved = []

    def __enter__(self):
        for hp in self.points:
            ids = {h.hook.id for h in getattr(hp, "fwd_hooks", ())}
            taken = [(i, hp._forward_hooks.pop(i)) for i in list(hp._forward_hooks) if i in ids]
            if taken:
                self.saved.append((hp, taken))

    def __exit__(self, *exc):
        for hp, taken in self.saved:
            hp._forward_hooks.update(taken)  # after the model's own hooks, as before
        return False


def _probe(model, rtol: float = 1e-3) -> dict[int, HookMeaning]:
    from ..devices import model_device

    tokens = _probe_tokens(model).to(model_device(model))
    H = model.cfg.n_heads
    n = tokens.shape[1]
    allowed = _allowed(model, n)
    names = {f"blocks.{layer}.attn.hook_{s}" for layer in range(model.cfg.n_layers)
             for s in ("attn_scores", "pattern", "q", "k", "v", "z", "rot_q", "rot_k", "cos", "sin")}
    names &= set(model.hook_dict)
    clean, cache = model.run_with_cache(tokens, names_filter=lambda x: x in names)
    cache = {k: v.detach().cpu() for k, v in cache.items()}
    rotary = positional_type(model) == "rotary"
    # MLA: hook_q/hook_k hold [nope | rope] concatenations of another width than d_head and
    # hook_z values of v_head_dim; no q/k/z meaning is probed (readers refuse by name)
    mla = mla_settings(model)
    out = {}
    for layer in range(model.cfg.n_layers):
        p = f"blocks.{layer}.attn."
        found = []
        pattern = cache.get(p + "hook_pattern")
        if pattern is None:
            out[layer] = HookMeaning(None, None, False, None, None, None, "hook_pattern does not fire")
            continue
        scale = attn_scale(model, layer)
        cap = attn_soft_cap(model, layer)
        if cap is not None:
            found.append(f"q/k checked through the attention soft-cap ({_soft_cap_setting(model, layer)})")
        # pre-softmax scores
        scores_name = None
        s = cache.get(p + "hook_attn_scores")
        if s is None:
            found.append("hook_attn_scores does not fire")
        elif not torch.allclose(s.double().softmax(-1), pattern.double(), atol=1e-5, rtol=1e-4):
            found.append("hook_attn_scores holds the post-softmax pattern" if torch.allclose(s, pattern)
                         else "softmax of hook_attn_scores is not hook_pattern")
        elif not _changes_output(model, tokens, clean, [(p + "hook_attn_scores", _noise(layer))]):
            found.append("edits of hook_attn_scores are discarded")
        else:
            scores_name = p + "hook_attn_scores"
        # q/k whose product is the content term
        content_qk = query_qk = None
        if mla:
            found.append("multi-head latent attention (MLA): hook_q/hook_k/hook_z not probed")
        elif p + "hook_q" in cache and p + "hook_k" in cache:
            q, k = _qk(cache, p + "hook_q", p + "hook_k", H)
            if rotary:
                spec = rotary_spec(model, layer)
                pos = torch.arange(n)[None].expand(2, n)
                q, k = rope_rotate(q, spec, pos), rope_rotate(k, spec, pos)
            if _explains(pattern, _content(q, k, scale, cap), allowed, rtol) and _changes_output(
                    model, tokens, clean, [(p + "hook_q", _noise(100 + layer))]):
                query_qk = (p + "hook_q", p + "hook_k")
            else:
                found.append("hook_q/hook_k do not give the scores' q·k term")
            if not rotary:
                content_qk = query_qk
        if rotary and not mla:
            if p + "hook_rot_q" in cache and p + "hook_rot_k" in cache:
                q, k = _qk(cache, p + "hook_rot_q", p + "hook_rot_k", H)
                if _explains(pattern, _content(q, k, scale, cap), allowed, rtol):
                    content_qk = (p + "hook_rot_q", p + "hook_rot_k")
                else:
                    found.append("hook_rot_q/hook_rot_k do not give the scores' q·k term")
            else:
                found.append("hook_rot_q/hook_rot_k do not fire")
            tables = (p + "hook_q", p + "hook_k", p + "hook_cos", p + "hook_sin")
            if content_qk is None and all(t in cache for t in tables):
                # GPT-NeoX bridges fire the cos/sin each call used (positions from the mask)
                q, k = content_qk_from(tables, cache, H)
                if _explains(pattern, _content(q, k, scale, cap), allowed, rtol):
                    content_qk = tables
                    found.append("hook_q/hook_k rotated by hook_cos/hook_sin give the scores")
        pattern_name, output_edit = None, False
        if scores_name is None and _changes_output(model, tokens, clean,
                                                   [(p + "hook_pattern", _noise(200 + layer))]):
            pattern_name = p + "hook_pattern"
        elif scores_name is None:
            found.append("edits of hook_pattern are discarded")
        if scores_name is None and pattern_name is None and p + "hook_v" in cache:
            output_edit = _verify_output_edit(model, layer, tokens, clean, cache)
            if not output_edit:
                found.append("its attention module's output cannot be edited with the pattern")
        z_name = None
        if p + "hook_z" in cache and p + "hook_v" in cache and not mla:
            v = cache[p + "hook_v"].double()
            v = v if v.shape[2] == H else torch.repeat_interleave(v, H // v.shape[2], dim=2)
            pv = torch.einsum("bhij,bjhd->bihd", pattern.double(), v)
            if pv.shape == cache[p + "hook_z"].shape and torch.allclose(
                    pv, cache[p + "hook_z"].double(), atol=1e-5, rtol=1e-4) and _changes_output(
                    model, tokens, clean, [(p + "hook_z", _noise(300 + layer))]):
                z_name = p + "hook_z"
            else:
                found.append("hook_z is not the pattern-weighted values or edits are discarded")
        out[layer] = HookMeaning(scores_name, pattern_name, output_edit, content_qk, query_qk,
                                 z_name, "; ".join(found), cap)
    return out


# --- Editing the pattern where no pre-softmax hook exists ---------------------------------
#
# OPT and GPT-Neo bridges (TL 4.3) and TL 4 native models fire hook_attn_scores and
# hook_pattern after their attention module returned, so edits there are discarded. Their
# module returns (output, pattern); a forward hook on it can replace both exactly, by
# output' = output + Σ_h (pattern'_h - pattern_h) v_h W_O,h (the output is linear in the
# pattern). Edits are armed per call by TransformerLens hooks that fire inside the module
# (hook_q/k/v), and a pre-hook clears anything left armed by a call that raised.


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


def _verify_output_edit(model, layer, tokens, clean, cache) -> bool:
    comp = _module(model, layer)
    if comp is None:
        return False
    p = f"blocks.{layer}.attn."
    H = model.cfg.n_heads
    install_output_edit(model, layer)
    seen = {}

    def grab(output):
        seen["out"] = output
        return output

    def arm(x, hook):
        arm_output_edit(model, layer, grab)
        return x
    model.run_with_hooks(tokens, fwd_hooks=[(p + "hook_v", arm)])
    out = seen.get("out")
    if not (isinstance(out, tuple) and len(out) >= 2 and isinstance(out[1], Tensor)):
        return False
    pattern = out[1].detach().cpu().double()
    if pattern.shape != cache[p + "hook_pattern"].shape or not torch.allclose(
            pattern, cache[p + "hook_pattern"].double(), atol=1e-6):
        return False
    v = cache[p + "hook_v"].double()
    v = v if v.shape[2] == H else torch.repeat_interleave(v, H // v.shape[2], dim=2)
    w = attention_weights(model, layer)
    b_O = getattr(model.blocks[layer].attn, "b_O", None)
    b_O = 0.0 if b_O is None else b_O.detach().cpu().double()
    want = torch.einsum("bhij,bjhd,hdm->bim", pattern, v, w["W_O"]) + b_O
    if not torch.allclose(out[0].detach().cpu().double(), want, atol=1e-4, rtol=1e-4):
        return False
    # and replacing it takes effect
    uniform = _allowed(model, tokens.shape[1]).double()
    uniform = uniform / uniform.sum(-1, keepdim=True)

    def arm_uniform(x, hook):
        arm_output_edit(model, layer, pattern_edit(model, layer, list(range(H)),
                                                   lambda old: uniform.to(old.device).expand_as(old),
                                                   x.detach()))
        return x
    return _changes_output(model, tokens, clean, [(p + "hook_v", arm_uniform)])


def _refusal(model, layer, what: str) -> MissingFeatureError:
    mla = mla_settings(model)
    if mla:
        return MissingFeatureError(mla_message(mla, f"reading {what} from hooks"))
    m = hook_meaning(model, layer)
    why = ""
    if getattr(_attn(model, layer), "q_norm", None) is not None:
        # the one cause users meet most: hook_q/hook_k fire before the q/k norm
        why = (f"; its q and k pass a q/k norm (blocks.{layer}.attn.q_norm, qk-norm) after "
               "hook_q/hook_k, so no hook carries the normed query before RoPE: features that "
               "edit or split q and k there are not available on qk-norm models, while spectra, "
               "frequency profiles and pattern scores are (docs/models.md, architecture features)")
    return MissingFeatureError(f"this model has no hook carrying {what} at layer {layer} "
                               f"(checked on the loaded model: {m.found or 'nothing fired'}){why}")


def scores_hook(model, layer: int) -> str:
    """Name of the hook carrying ``layer``'s pre-softmax scores (masked, bias added),
    whose edits change the output: verified on the model (:func:`hook_meaning`).

    Raises:
        MissingFeatureError: where no hook has that meaning (TL 4 native attention and
            OPT/GPT-Neo bridges fire ``hook_attn_scores`` after the softmax with the
            pattern and discard edits to it).
    """
    name = hook_meaning(model, layer).scores
    if name is None:
        raise _refusal(model, layer, "the pre-softmax scores")
    return name


def rotated_qk_hooks(model, layer: int) -> tuple[str, ...]:
    """Names of the hooks carrying ``layer``'s q and k after RoPE (``[batch, pos, head,
    d_head]``, k over KV heads), verified to give the scores' q·k term.

    Raises:
        MissingFeatureError: where they do not fire or do not carry that (TL 4 native
            attention, GPT-NeoX bridges; :func:`content_qk_hooks` may still give the
            rotated q/k from hook_q/hook_k and the call's cos/sin).
    """
    m = hook_meaning(model, layer)
    if positional_type(model) != "rotary" or m.content_qk is None or len(m.content_qk) != 2:
        raise _refusal(model, layer, "the rotated q and k (hook_rot_q/hook_rot_k)")
    return m.content_qk


def content_qk_hooks(model, layer: int) -> tuple[str, ...]:
    """Hooks whose ``q_i · k_j / attn_scale`` is ``layer``'s content score (rotated q/k on
    RoPE models), verified on the model: read them with :func:`content_qk_from` (two
    names: q and k; four: unrotated q, k and the call's cos/sin tables). On a soft-capped
    model (``hook_meaning(model, layer).soft_cap``) it is the content term before the cap:
    the score holds T tanh(q·k / (attn_scale T)).

    Raises:
        MissingFeatureError: where none is verified.
    """
    m = hook_meaning(model, layer)
    if m.content_qk is None:
        raise _refusal(model, layer, "the q and k of the content score")
    return m.content_qk


def query_hooks(model, layer: int) -> tuple[str, str]:
    """``hook_q``/``hook_k``, verified as ``layer``'s query and key before any rotation
    (rotating them with :func:`rotary_spec` gives the scores, through the soft-cap where
    ``hook_meaning(model, layer).soft_cap`` is set) with edits that take effect.

    Raises:
        MissingFeatureError: where they do not have that meaning.
    """
    m = hook_meaning(model, layer)
    if m.query_qk is None:
        raise _refusal(model, layer, "the unrotated query and key (hook_q/hook_k)")
    return m.query_qk


def z_hook(model, layer: int) -> str:
    """``hook_z`` of ``layer``, verified as z_h = pattern_h v_h (``[batch, pos, head,
    d_head]``) with edits that take effect.

    Raises:
        MissingFeatureError: where no hook has that meaning.
    """
    name = hook_meaning(model, layer).z
    if name is None:
        raise _refusal(model, layer, "each head's pattern-weighted values (hook_z)")
    return name


@contextlib.contextmanager
def eval_mode(model):
    """Run the block with every module of ``model`` in eval mode, then restore each
    module's own mode exactly (a model left in ``train()`` after a user's fine-tuning
    loop, or one with a single submodule in train mode, comes back as it was).

    Analyses are measurements: with dropout active (HF models bridged by TL 4, a user's
    module attached to a hook) the numbers would change from call to call. Every
    forward pass posinterp runs for an analysis goes through here (:func:`run_cached`
    and the inspector's scores pass). Yields ``model``.
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield model
    finally:
        for m, training in modes:
            m.training = training


def site_module(model, name: str):
    """The module that computes hook site ``name`` now, or None where the model has none.

    Usually the ``HookPoint`` of ``hook_dict``. Other plugins may put a module of their
    own there: SAELens's ``HookedSAETransformer.add_sae`` replaces the HookPoint with the
    SAE (TL 3.9: the name leaves ``hook_dict``, only ``name + ".hook_sae_output"`` and its
    siblings stay; TL 4's ``SAETransformerBridge`` registers the SAE under the name). Its
    output is what the rest of the model reads at that site.
    """
    mod = model.hook_dict.get(name)
    if mod is not None:
        return mod
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


@contextlib.contextmanager
def hooks_at_sites(model, fwd_hooks):
    """``model.hooks(fwd_hooks=...)`` for sites another plugin may have taken over.

    A site still computed by its ``HookPoint`` gets a TransformerLens hook; one whose
    module was replaced (:func:`site_module`: an SAE attached by SAELens) gets a torch
    forward hook on that module, called as ``fn(output, hook=None)`` with what the rest of
    the model reads there. Such hooks read, they cannot edit. Yields ``model``; every hook
    is removed on exit.
    """
    from transformer_lens.hook_points import HookPoint

    lens, handles = [], []

    def reader(fn):
        def hook(_module, _inputs, output):
            fn(output[0] if isinstance(output, tuple) else output, hook=None)
        return hook

    try:
        for name, fn in fwd_hooks:
            mod = site_module(model, name)
            if mod is None or isinstance(mod, HookPoint):
                lens.append((name, fn))
            else:
                handles.append(mod.register_forward_hook(reader(fn)))
        with model.hooks(fwd_hooks=lens):
            yield model
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _capture_outputs(modules: dict):
    """Record the forward output of each module (``{name: module}``) as ``{name: tensor}``."""
    out, handles = {}, []

    def recorder(name):
        def hook(_module, _inputs, output):
            value = output[0] if isinstance(output, tuple) else output
            out[name] = value.detach()
        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(recorder(name)))
        yield out
    finally:
        for h in handles:
            h.remove()


def run_cached(model, tokens: Tensor, mask: Tensor | None, names_filter, return_logits: bool = False):
    """``run_with_cache`` across model kinds: the one place that knows their differences.

    TL 3.9 ``HookedEncoder`` (BERT) takes ``one_zero_attention_mask`` and no
    ``return_type=None``; ``HookedTransformer`` and TL 4 bridges take ``attention_mask``
    (bridges derive positions from it, as TL 3.9 does).

    ``names_filter``: a callable on hook names, or a collection of site names; a name
    whose HookPoint another plugin replaced with its own module (an SAE,
    :func:`site_module`) is then read from that module's output.

    The forward pass runs in eval mode (:func:`eval_mode`; the caller's modes are
    restored) on the model's device (``tokens`` and ``mask`` are moved
    there); the cached activations (only those ``names_filter`` keeps) and the logits
    come back on CPU, where every metric is computed (docs/scale.md).

    Runs under ``torch.no_grad()``: activations are read here, never differentiated, and
    an autograd graph would keep every layer's intermediates alive (12 GB for SmolLM2-135M
    at 2048 tokens, instead of a few hundred MB).

    Returns:
        the cache, or ``(logits, cache)`` with ``return_logits``. For a TL 4 bridge over
        HF BERT the cache is a dict keyed by TL 3.9 ``HookedEncoder`` names, holding the
        quantities those names mean in TL 3.9 (``_tl39_encoder_hooks``).

    Raises:
        ValueError: a cached ``hook_pattern`` that :func:`verify_pattern_hook` cannot tie
            to the layer's attention on this model.
    """
    if isinstance(names_filter, str):  # one hook name, as TransformerLens accepts it
        names_filter = [names_filter]
    renamed = _tl39_encoder_hooks(model)
    if renamed is not None:  # a bridged BERT: ask for the hooks with TL 3.9's meanings
        return _run_renamed(model, tokens, mask, names_filter, return_logits, renamed)
    return _run_plain(model, tokens, mask, names_filter, return_logits)


def _run_plain(model, tokens: Tensor, mask: Tensor | None, names_filter, return_logits: bool):
    from ..devices import model_device

    model = unwrap(model)
    device = model_device(model)
    tokens = tokens.to(device)
    mask = None if mask is None else mask.to(device)
    bidirectional = getattr(model.cfg, "attention_dir", "causal") == "bidirectional"
    kwargs = {"names_filter": names_filter}
    if mask is not None:
        kwargs["one_zero_attention_mask" if bidirectional and not is_bridge(model)
               else "attention_mask"] = mask
        if bidirectional and is_bridge(model):
            # HF's BERT (and TL 3.9's HookedEncoder) count positions by index under any
            # padding; a bridge would derive them from the mask instead
            kwargs["position_ids"] = torch.arange(tokens.shape[1], device=device).expand(
                tokens.shape[0], -1)
    if not bidirectional and not return_logits:
        kwargs["return_type"] = None
    replaced = {}
    if not callable(names_filter):  # a collection of site names
        from transformer_lens.hook_points import HookPoint

        names = set(names_filter)
        mods = {n: site_module(model, n) for n in names}
        replaced = {n: m for n, m in mods.items() if m is not None and not isinstance(m, HookPoint)}
        hooked = names - set(replaced)
        kwargs["names_filter"] = lambda n: n in hooked
    # eagerly (hooks do not fire inside a compiled graph), in eval mode
    # no autograd graph: the cache is read, never differentiated (memory at real scale)
    with torch.no_grad(), eager(model), eval_mode(model), _capture_outputs(replaced) as captured:
        out, cache = model.run_with_cache(tokens, **kwargs)
    if device.type != "cpu":
        cache = cache.to("cpu")
        out = out.cpu() if isinstance(out, Tensor) else out
    if replaced:
        cache = {**{n: cache[n] for n in cache.keys()}, **{n: v.cpu() for n, v in captured.items()}}
    for name in cache.keys():
        found = _PATTERN_HOOK.fullmatch(name)
        if found and name not in replaced:
            verify_pattern_hook(model, int(found.group(1)))
    return (out, cache) if return_logits else cache


_PATTERN_HOOK = re.compile(r"blocks\.(\d+)\.attn\.hook_pattern")


def verify_pattern_hook(model, layer: int) -> str:
    """``blocks.{layer}.attn.hook_pattern``, once :func:`hook_meaning` verified that it
    carries the attention pattern the layer uses: softmax of an effective pre-softmax
    scores hook, a pattern hook whose edits take effect, the pattern the attention
    module returns with its output (output = Σ_h p_h v_h W_O,h + b_O), or the pattern
    whose product with the values is ``hook_z``. Every analysis that reads patterns
    through :func:`run_cached` is checked here.

    Raises:
        ValueError: the hook does not fire, or carries something none of those checks
            could tie to the layer's attention (what the probe found is named).
    """
    meaning = hook_meaning(model, layer)
    if not (meaning.scores or meaning.pattern or meaning.output_edit or meaning.z):
        raise ValueError(
            f"blocks.{layer}.attn.hook_pattern on this {type(unwrap(model)).__name__} could "
            f"not be verified as the attention pattern the layer uses ({meaning.found}); "
            "posinterp does not read a hook by its name (docs/tl4.md)")
    return f"blocks.{layer}.attn.hook_pattern"


@dataclass(frozen=True)
class QKSlot:
    """One of a layer's ``W_Q``, ``b_Q``, ``W_K``, ``b_K`` as the parameter that stores it:
    ``getattr(module, name)``, which ``torch.nn.utils.parametrize`` can reparametrize.

    TL 3.9 stores them per head (``[n, d_model, d_head]``, ``[n, d_head]``); TL 4 bridges
    as ``nn.Linear`` weights (``[n * d_head, d_model]``, ``[n * d_head]``, row h * d_head
    + e, the layout of TL's ``convert_tl_checkpoint``). :meth:`to_tl` and
    :meth:`from_tl` convert between the stored layout and TL 3.9's by reshapes only, so a
    function of the per-head tensors has the same values and gradients on either line;
    ``to_tl`` returns a view (in-place edits reach the parameter). ``n`` is ``n_heads`` for
    queries and the stored key heads for keys (``n_kv_heads`` under grouped-query attention).
    """

    module: torch.nn.Module
    name: str
    n: int
    d_head: int
    flat: bool

    def to_tl(self, t: Tensor) -> Tensor:
        if not self.flat:
            return t
        if t.ndim == 1:
            return t.view(self.n, self.d_head)
        return t.view(self.n, self.d_head, t.shape[-1]).transpose(1, 2)

    def from_tl(self, t: Tensor) -> Tensor:
        if not self.flat:
            return t
        if t.ndim == 2:
            return t.reshape(-1)
        return t.transpose(1, 2).reshape(-1, t.shape[1])


def qk_slots(model, layer: int) -> dict[str, QKSlot | None]:
    """Where ``layer`` stores ``W_Q``, ``b_Q``, ``W_K``, ``b_K`` (None: no such bias), for
    training-time reparametrization (:func:`posinterp.interventions.constraints.constrain_qk`).

    TL 3.9: the attention's own parameters (``_W_K``/``_b_K`` under grouped-query
    attention). TL 4: the ``nn.Linear`` the bridge's ``attn.q`` / ``attn.k`` wrap, which
    the forward pass multiplies by: native attention's ``q``/``k``, an HF module's
    ``q_proj``/``k_proj``, or, where HF fuses q, k and v (GPT-2's ``c_attn``, GPT-NeoX's
    and BLOOM's ``query_key_value``), the split projections TransformerLens 4 builds and
    runs instead of the fused one. A bridge's ``attn.W_Q`` is a reshaped copy;
    parametrizing it would change nothing. The per-head view of each weight is checked
    against the bridge's own ``attn.W_Q`` / ``attn.W_K`` once, so a projection in another
    layout is refused rather than reparametrized wrongly.

    Raises:
        MissingFeatureError: a bridge whose ``attn.q`` / ``attn.k`` wrap no ``nn.Linear``
            of shape ``[heads * d_head, d_model]`` in TL's per-head row order.
    """
    check_not_mla(model, "training-time QK constraints (qk_slots)")
    H, dh = model.cfg.n_heads, model.cfg.d_head
    if not is_bridge(model):
        attn = _attn(model, layer)
        gqa = hasattr(attn, "_W_K")
        out = {"W_Q": QKSlot(attn, "W_Q", H, dh, False),
               "W_K": QKSlot(attn, "_W_K" if gqa else "W_K", n_kv_heads(model), dh, False)}
        for b, stored in (("b_Q", "b_Q"), ("b_K", "_b_K" if gqa else "b_K")):
            out[b] = QKSlot(attn, stored, H if b == "b_Q" else n_kv_heads(model), dh, False) \
                if isinstance(getattr(attn, stored, None), torch.nn.Parameter) \
                or hasattr(getattr(attn, "parametrizations", {}), stored) else None
        return out
    attn = _attn(model, layer)
    out = {}
    for tl, n in (("Q", H), ("K", n_kv_heads(model))):
        wrapped = getattr(attn, tl.lower(), None)
        lin = getattr(wrapped, "original_component", wrapped)
        if not isinstance(lin, torch.nn.Linear) or tuple(lin.weight.shape) != (n * dh, model.cfg.d_model):
            raise MissingFeatureError(
                f"training-time QK constraints reparametrize the nn.Linear that computes "
                f"{tl.lower()} ([{n} * {dh}, {model.cfg.d_model}]); layer {layer}'s attn."
                f"{tl.lower()} wraps {type(lin).__name__}, which posinterp does not reparametrize")
        slot = QKSlot(lin, "weight", n, dh, True)
        _check_slot_layout(model, layer, tl, slot)
        out[f"W_{tl}"] = slot
        has_bias = getattr(lin, "bias", None) is not None or \
            hasattr(getattr(lin, "parametrizations", {}), "bias")
        out[f"b_{tl}"] = QKSlot(lin, "bias", n, dh, True) if has_bias else None
    return out


def _check_slot_layout(model, layer: int, tl: str, slot: QKSlot) -> None:
    """Refuse a projection whose per-head view is not the bridge's own ``attn.W_{tl}``
    (TransformerLens's reading of the same weight): the reparametrization would then
    constrain other numbers than the analyses read."""
    if parametrize.is_parametrized(slot.module, slot.name):
        return  # constrained already: checked when it was registered
    with torch.no_grad():
        mine = slot.to_tl(slot.module.weight).detach().cpu()
        theirs = getattr(_attn(model, layer), f"W_{tl}").detach().cpu()
    if mine.shape != theirs.shape or not torch.equal(mine, theirs.to(mine.dtype)):
        raise MissingFeatureError(
            f"layer {layer}'s {tl.lower()} projection is not stored in TransformerLens's per-head "
            f"row order (its [{slot.n} * {slot.d_head}, d_model] weight read per head is not "
            f"attn.W_{tl}); posinterp does not reparametrize it")


# TL 3.9 buffers with no bridge counterpart: RoPE tables (the bridge recomputes them from the
# config; convert_tl_checkpoint refuses rotary checkpoints that still hold them).
_TL3_ONLY_BUFFERS = (".rotary_sin", ".rotary_cos")


def convert_tl3_weights(model, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ``HookedTransformer`` (TL 3.9) state dict in the key/shape layout of ``model``, a TL 4
    bridge, through TransformerLens's ``convert_tl_checkpoint`` (RoPE sin/cos buffers dropped
    first; TL's converter drops the causal ``mask``/``IGNORE`` buffers itself).

    Raises:
        ValueError: ``model`` is not a bridge, or a key or shape that is not TL 3.9's
            layout for ``model.cfg`` (from ``convert_tl_checkpoint``).
    """
    if not is_bridge(model):
        raise ValueError("convert_tl3_weights converts for a TransformerLens 4 bridge; a "
                         "HookedTransformer loads TL 3.9 weights as they are")
    from transformer_lens.conversion_utils import convert_tl_checkpoint

    kept = {k: v for k, v in state_dict.items() if not k.endswith(_TL3_ONLY_BUFFERS)}
    return convert_tl_checkpoint(kept, model.cfg)


def bos_token_id(model) -> int | None:
    """The model's BOS token id, or None where it has none (or no tokenizer).

    The tokenizer's ``bos_token_id``, unless it is the tokenizer's unknown token: TL 4's
    bridge gives a tokenizer without a BOS (BERT's) the stand-in ``<|endoftext|>``, which
    such a vocabulary maps to ``[UNK]``, where TL 3.9 leaves it None. An unknown token is
    never a real BOS, so inputs built from this id are the same on both lines. Nor is an id
    the model cannot embed (``>= d_vocab``: a tokenizer attached to another model's
    vocabulary), which would only crash the embedding.
    """
    tok = getattr(unwrap(model), "tokenizer", None)
    bos = getattr(tok, "bos_token_id", None) if tok is not None else None
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


def _tl39_encoder_hooks(model) -> dict[str, str] | None:
    """For a TL 4 bridge over HF BERT: TL 3.9 ``HookedEncoder`` hook name -> the bridge hook
    carrying that quantity (None for other models). TL 4's BERT adapter fires
    ``hook_resid_post`` with the block's normalized output (TL 3.9: the sum before ``ln2``)
    and ``hook_attn_out`` after the attention's LayerNorm (TL 3.9: the output projection);
    tests/models/test_pretrained.py checks each entry against HF's hidden states."""
    if not (is_bridge(model) and is_post_ln(model)):
        return None
    out = {}
    for layer in range(model.cfg.n_layers):
        p = f"blocks.{layer}."
        out.update({p + "hook_attn_out": p + "attn.o.hook_out",
                    p + "hook_resid_mid": p + "ln1.hook_in",
                    p + "hook_mlp_out": p + "mlp.out.hook_out",
                    p + "hook_resid_post": p + "ln2.hook_in",
                    p + "hook_normalized_resid_post": p + "ln2.hook_out"})
    return out


def _run_renamed(model, tokens, mask, names_filter, return_logits, renamed: dict[str, str]):
    """:func:`run_cached` caching the bridge hooks ``renamed`` maps TL 3.9 names to, under
    the TL 3.9 names (a plain dict); a bridge hook whose name TL 3.9 uses for another
    quantity is never returned under that name."""
    if isinstance(names_filter, str):
        names_filter = {names_filter}
    wanted = names_filter if callable(names_filter) else (lambda n, s=set(names_filter): n in s)
    back = {v: k for k, v in renamed.items()}

    def bridge_filter(name: str) -> bool:
        if name in back:
            return bool(wanted(back[name]))
        return name not in renamed and bool(wanted(name))

    out, cache = _run_plain(model, tokens, mask, bridge_filter, True)
    cache = {back.get(k, k): v for k, v in cache.items()}
    return (out, cache) if return_logits else cache


# --- What TransformerLens itself runs, per line ---------------------------------------------

# HF config settings that TransformerLens 4's bridge does not honour because it computes
# that architecture's attention itself: (attribute, the value it assumes, what it does).
_BRIDGE_ASSUMES = {
    "GPT2LMHeadModel": (("scale_attn_weights", True,
                         "its JointQKVAttentionBridge always divides q·k by sqrt(d_head)"),),
}


def unhonoured_settings(architecture: str) -> tuple[tuple[str, object, str], ...]:
    """``(attribute, assumed value, why)`` for each HF config setting of ``architecture``
    that this TransformerLens line ignores when it runs the model (TL 4.3's bridge
    reimplements GPT-2's attention and drops ``scale_attn_weights``); empty on TL 3.9,
    whose ignored settings posinterp overrides or refuses in :mod:`.hf_config`."""
    return _BRIDGE_ASSUMES.get(architecture, ()) if TL_MAJOR >= 4 else ()


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


_KV = "posinterp_kv_cache"  # attribute on a TL 4 bridge: its KV cache verified to work


def has_kv_cache(model) -> bool:
    """True where ``model`` runs with a KV cache and gets the numbers it gets without one:
    TL 3.9 ``HookedTransformer`` (``past_kv_cache``), and TL 4 bridges over HF modules
    whose cache :func:`guard_kv_cache` verified at load time. TL 4's native model
    (``model_bridge/sources/native``: posinterp's toy models and llama2.c files) has none:
    posinterp's native bridges refuse a cache passed to them (TL's would ignore it and run
    the new tokens alone from position 0), and ``generate`` runs the whole sequence."""
    model = unwrap(model)
    if not is_bridge(model):
        return True
    return bool(model.__dict__.get(_KV, False))


def _refuse_cache(why: str):
    def hook(module, args, kwargs):
        for name in ("past_key_values", "past_kv_cache", "cache"):
            if kwargs.get(name) is not None:
                raise MissingFeatureError(f"{why}; run without a KV cache "
                                          "(generate(..., use_past_kv_cache=False))")
        return None
    return hook


@torch.no_grad()
def guard_kv_cache(model) -> bool:
    """Check once, on a TL 4 bridge over HF modules, that a step with the KV cache gives
    the logits of the full forward pass (an 8-token probe: 7 tokens cached, then 1); where
    it does not, make the model refuse a cache by name from then on (a forward pre-hook on
    the HF model), so ``generate`` with TL's default ``use_past_kv_cache=True`` stops with
    the reason instead of returning other tokens. (TransformerLens 4.3 with transformers
    5.x: the attention the GPT-2 and Llama bridges rebuild never sees the cached keys, so
    each new token attends to itself alone; bridges that run HF's own attention module,
    e.g. GPT-NeoX, OPT, BLOOM, keep a working cache.) Returns the verdict, which
    :func:`has_kv_cache` reads. A no-op returning True on TL 3.9."""
    if not is_bridge(model):
        return True
    if _is_native(model):
        object.__setattr__(model, _KV, False)
        return False
    from ..devices import model_device

    tokens = _probe_tokens(model)[:1].to(model_device(model))
    # float32: half precision rounds the two paths apart by more than the tolerance
    with eval_mode(model), _in_float32(model):
        full = model(tokens)
        try:
            _, cache = model(tokens[:, :-1], return_type="logits_and_cache")
            # TL's bridge hands the cache to HF as ``past_key_values``, which transformers
            # 5.x deprecates (for ``cache``) with a FutureWarning; the probe takes TL's path,
            # the one its ``generate`` takes, so the warning is posinterp's to silence here.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated",
                                        category=FutureWarning)
                step = model(tokens[:, -1:], past_key_values=cache)
            works = bool(torch.allclose(step[:, -1].double(), full[:, -1].double(),
                                        atol=1e-4, rtol=1e-4))
        except Exception:  # noqa: BLE001 - a cache that cannot even run is no cache
            works = False
    object.__setattr__(model, _KV, works)
    if not works:
        model.original_model.register_forward_pre_hook(_refuse_cache(
            f"TransformerLens {TL_VERSION}'s bridge over this {getattr(model.cfg, 'architecture', '')} "
            "model does not use the keys a KV cache holds (checked at load: a cached step's "
            "logits differ from the full forward pass), so cached generation would give other "
            "tokens"), with_kwargs=True)
    return works


_FOLDED = "posinterp_fold_ln"  # attribute on a TL 4 model whose norm gains posinterp folded


def mark_folded(model) -> None:
    """Record on a TL 4 bridge that its norm gains were folded into the weights. TL 4's
    weight processing leaves the gain parameters in place at 1 and its config says
    ``LN``/``RMS`` either way, so the model cannot tell; :func:`norm_gain_folded` reads this."""
    object.__setattr__(model, _FOLDED, True)


def norm_gain_folded(model) -> bool:
    """True where the gains of the norms feeding attention were folded into W_Q/W_K/W_V
    at load time (TL 3.9: ``LNPre``/``RMSPre``; TL 4: :func:`mark_folded`, or a native
    model built with a param-free norm)."""
    model = unwrap(model)
    if str(model.cfg.normalization_type) in ("LNPre", "RMSPre"):
        return True
    return bool(model.__dict__.get(_FOLDED, False))


def process_weights(model, *, fold_ln: bool = False, center_writing_weights: bool = False,
                    center_unembed: bool = False, fold_value_biases: bool = False):
    """A copy of ``model`` with TransformerLens's weight processing applied (the original
    is left as it is): TL 3.9's ``HookedTransformer.load_and_process_state_dict``, or TL 4's
    ``enable_compatibility_mode`` on a copy of the bridge. Each step preserves the
    log-probabilities (up to a constant shift of the logits for ``center_unembed``).

    Raises:
        ValueError: a ``torch.compile`` wrapper (pass ``model._orig_mod``).
    """
    import copy

    if compiled_kind(model) is not None:
        raise ValueError("process_weights needs an uncompiled model")
    flags = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                 center_unembed=center_unembed, fold_value_biases=fold_value_biases)
    if not is_bridge(model):
        from transformer_lens import HookedTransformer

        from .._rng import preserved_rng

        with preserved_rng():  # the twin's initial values are drawn, then replaced
            twin = HookedTransformer(copy.deepcopy(model.cfg), move_to_device=False)
        twin.load_and_process_state_dict(model.state_dict(), **flags)
        return twin.train(model.training)
    twin = copy.deepcopy(model)
    twin.__dict__.pop(_VERDICTS, None)  # probed hook meanings belong to the model probed
    twin.enable_compatibility_mode(disable_warnings=True, no_processing=not any(flags.values()),
                                   **flags)
    if fold_ln and getattr(getattr(twin, "adapter", None), "supports_fold_ln", True):
        mark_folded(twin)
    return twin.train(model.training)
# --- Running a suffix of the blocks (exact ablations from a cached prefix) -----------------
#
# An edit at layer l leaves every layer below l unchanged, so ablations of layer-l heads
# rerun only blocks l.. from the cached resid_pre of layer l. TL 3.9's start_at_layer does
# this; TL 4's bridge accepts start_at_layer but still runs blocks 0..l-1 (its docstring).
# So on both lines each block is called as the model itself called it: its inputs (the
# residual, plus the mask, positions and RoPE tables the model passed) are recorded once
# on a clean pass and replayed, tiled along the batch axis for several ablations at once.
# The replay is checked against the model's own logits before any ablation uses it
# (:func:`suffix_replay_matches`), never assumed.


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


def _without_kv_cache(kwargs: dict) -> dict:
    """A replayed block call must not read or append to the clean pass's KV cache."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a TransformerLens dependency
        Cache = None  # noqa: N806
    out = {}
    for k, v in kwargs.items():
        if Cache is not None and isinstance(v, Cache):
            v = None
        if k == "use_cache":
            v = False
        out[k] = v
    return out


def capture_block_inputs(model, tokens: Tensor, mask: Tensor | None) -> BlockInputs:
    """One clean forward pass recording every block's inputs (for :func:`run_blocks_from`).

    Runs eagerly, in eval mode, without autograd, on the model's device.

    Returns:
        :class:`BlockInputs`.
    """
    from ..devices import model_device

    model = unwrap(model)
    device = model_device(model)
    tokens = tokens.to(device)
    mask = None if mask is None else mask.to(device)
    resid, args, kwargs, handles = {}, {}, {}, []

    def recorder(layer):
        def hook(_module, a, kw):
            resid[layer] = a[0] if a else kw["hidden_states"]
            args[layer] = tuple(a[1:])
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


def _tile(obj, batch: int, copies: int):
    """``obj`` with every tensor whose dim 0 is the batch repeated ``copies`` times along
    it (copy g holds rows g*batch .. (g+1)*batch - 1); other values (and broadcast
    tensors of dim 0 = 1 when batch > 1) unchanged."""
    if isinstance(obj, Tensor):
        if copies > 1 and obj.ndim and obj.shape[0] == batch:
            return obj.repeat(copies, *([1] * (obj.ndim - 1)))
        return obj
    if isinstance(obj, tuple):
        return tuple(_tile(o, batch, copies) for o in obj)
    if isinstance(obj, list):
        return [_tile(o, batch, copies) for o in obj]
    if isinstance(obj, dict):
        return {k: _tile(v, batch, copies) for k, v in obj.items()}
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
    x = resid
    for j in range(layer, model.cfg.n_layers):
        out = model.blocks[j](x, *_tile(inputs.args[j], inputs.batch, copies),
                              **_tile(inputs.kwargs[j], inputs.batch, copies))
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
        out = run_blocks_from(model, inputs, last, resid.repeat(2, 1, 1))
        b = inputs.batch
        scale = float(inputs.logits.abs().max()) or 1.0
        for g in range(2):
            got = final_logits(model, out[g * b:(g + 1) * b])
            if got.shape != inputs.logits.shape:
                return False
            if float((got - inputs.logits).abs().max()) > rtol * scale:
                return False
    return True
