"""The model surface posinterp reads, for TransformerLens 3.9 and 4.x (docs/architecture.md).

Analyses ask this module, never the TransformerLens version or a model's class:

* :func:`attention_weights` — W_Q, W_K, W_V, W_O of one layer as ``[n_heads, d_model,
  d_head]`` (W_O ``[n_heads, d_head, d_model]``), keys and values expanded over
  grouped-query heads (TL 3.9 expands them in ``attn.W_K``; a TL 4 bridge does not);
* :func:`attn_scale`, :func:`positional_type`, :func:`rotary_spec` — the score scale and
  positional scheme, as the model really computes them (TL 4 configs hold ``attn_scale
  = -1`` and ``rotary_dim = None`` as "unset" sentinels, and cannot say "alibi" for a
  native model);
* :func:`scores_hook`, :func:`rotated_qk_hooks` — the hooks that carry the pre-softmax
  scores and the rotated q/k; each raises, naming the missing feature, where the model
  has no such hook (TL 4 native attention fires ``hook_attn_scores`` with the
  post-softmax pattern and never fires ``hook_rot_q``/``hook_rot_k``);
* :func:`run_cached` — ``run_with_cache`` with an attention mask, for every model kind,
  in eval mode (:func:`eval_mode`).

docs/tl4.md lists every TL 4 hook whose meaning differs from 3.9 and what posinterp
does about it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TL_MAJOR", "TL_VERSION", "MissingFeatureError", "RotarySpec", "attention_weights",
           "attn_scale", "eval_mode", "is_bridge", "n_kv_heads", "positional_type", "rotary_spec",
           "rotated_qk_hooks", "run_cached", "scores_hook", "scores_include_bias", "site_module"]

TL_VERSION = importlib.metadata.version("transformer-lens")
TL_MAJOR = int(TL_VERSION.split(".")[0])


class MissingFeatureError(ValueError):
    """The model lacks a hook or feature an analysis needs (a ``ValueError`` naming it)."""


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
    """The divisor of q·k in ``layer`` (usually sqrt(d_head)).

    TL 4 configs hold -1 as "sqrt(d_head)"; native attention keeps the value it uses.
    """
    comp = _native_attention(model, layer)
    if comp is not None and isinstance(getattr(comp, "scale", None), (int, float)):
        return float(comp.scale)
    scale = float(getattr(model.cfg, "attn_scale", -1.0))
    if is_bridge(model) and (scale <= 0 or not getattr(model.cfg, "use_attn_scale", True)):
        return math.sqrt(model.cfg.d_head)
    return scale


def positional_type(model) -> str:
    """``standard``, ``rotary`` or ``alibi``: the scheme the attention really applies.

    A TL 4 native toy model with posinterp's ALiBi reads "standard" in its config.
    """
    native = _native_attention(model, 0)
    if getattr(native, "posinterp_alibi_slopes", None) is not None:
        return "alibi"
    return str(model.cfg.positional_embedding_type)


def _expand(W: Tensor, n_heads: int) -> Tensor:
    if W.shape[0] == n_heads:
        return W
    if n_heads % W.shape[0]:
        raise ValueError(f"{W.shape[0]} key/value heads do not divide n_heads={n_heads}")
    return torch.repeat_interleave(W, n_heads // W.shape[0], dim=0)


def attention_weights(model, layer: int) -> dict[str, Tensor]:
    """``W_Q, W_K, W_V`` ``[n_heads, d_model, d_head]``, ``W_O`` ``[n_heads, d_head,
    d_model]``, ``b_Q, b_K, b_V`` ``[n_heads, d_head]`` of ``layer``, detached float64
    CPU copies, whatever the model's device (spectra are computed on CPU in float64, so
    they are the same numbers for a model on any device; docs/scale.md).

    Keys and values are expanded over grouped-query heads (query head h reads KV head
    h // (n_heads / n_kv_heads), as both TL versions and HF do); missing biases are 0.
    """
    attn = _attn(model, layer)
    H, dh = model.cfg.n_heads, model.cfg.d_head
    out = {}
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        out[name] = _expand(getattr(attn, name).detach().cpu().double(), H)
    for name in ("b_Q", "b_K", "b_V"):
        try:
            b = getattr(attn, name)
        except AttributeError:
            b = None
        out[name] = (torch.zeros(H, dh, dtype=torch.float64) if b is None
                     else _expand(b.detach().cpu().double().reshape(-1, dh), H))
    return out


@dataclass(frozen=True)
class RotarySpec:
    """RoPE as a layer applies it: ``rotary_dim`` leading dims of each head, pairs
    (2p, 2p+1) if ``adjacent_pairs`` else (p, p + rotary_dim/2), ``inv_freq`` radians per
    position (float64, ``[rotary_dim / 2]``)."""

    rotary_dim: int
    adjacent_pairs: bool
    inv_freq: Tensor


def _hf_inv_freq(model) -> Tensor | None:
    """The ``inv_freq`` buffer HF's rotary embedding computed (bridged HF models)."""
    for name, buf in model.original_model.named_buffers():
        if name.endswith("inv_freq"):
            return buf.detach().cpu().double()
    return None


def rotary_spec(model, layer: int = 0) -> RotarySpec:
    """The RoPE ``layer`` applies (see :class:`RotarySpec`).

    TL 3.9: the config's layout and :func:`~posinterp.models.positions.rotary_inv_freq`.
    TL 4 native attention: adjacent pairs, its own frequencies (whatever the config's
    ``rotary_adjacent_pairs`` says); posinterp's toy attention: TL 3.9's split halves and
    base formula; bridged HF models: HF's ``inv_freq`` buffer (GPT-J adjacent pairs).

    Raises:
        ValueError: for a model whose positional scheme is not rotary.
    """
    if positional_type(model) != "rotary":
        raise ValueError(f"a rotary model is needed; this model's positional scheme is "
                         f"{positional_type(model)!r}")
    cfg = model.cfg
    if not is_bridge(model):
        from .positions import rotary_inv_freq

        return RotarySpec(cfg.rotary_dim, bool(cfg.rotary_adjacent_pairs), rotary_inv_freq(model, layer))
    comp = _native_attention(model, layer)
    if getattr(comp, "posinterp_attention", False):
        return RotarySpec(comp.posinterp_rotary_dim, False, comp.posinterp_inv_freq)
    if _is_native(model, layer):
        from transformer_lens.model_bridge.sources.native.model import _resolve_rope_scaling

        rot = comp.rotary
        _, position_scale, inv = _resolve_rope_scaling(cfg, rot.rotary_dim)
        return RotarySpec(rot.rotary_dim, True, inv.detach().cpu().double() / position_scale)
    inv = _hf_inv_freq(model)
    if inv is None:
        raise MissingFeatureError("this bridged model exposes no RoPE inv_freq buffer; posinterp "
                                  "cannot tell which frequencies it rotates by")
    arch = str(getattr(cfg, "architecture", "") or "")
    return RotarySpec(2 * inv.shape[0], arch.startswith("GPTJ"), inv)


def scores_hook(model, layer: int) -> str:
    """Name of the hook carrying ``layer``'s pre-softmax scores (masked, bias added),
    whose edits change the output.

    Raises:
        MissingFeatureError: for TL 4 native attention, whose ``hook_attn_scores`` fires
            after the softmax with the pattern and whose edits are discarded.
    """
    if _is_native(model, layer) and not is_posinterp_attention(model, layer):
        raise MissingFeatureError(
            "this TransformerLens 4 native model has no pre-softmax score hook: its "
            "hook_attn_scores holds the post-softmax pattern and edits to it are discarded. "
            "Build the model with posinterp.build_model, whose attention fires "
            "hook_attn_scores before the softmax")
    return f"blocks.{layer}.attn.hook_attn_scores"


def rotated_qk_hooks(model, layer: int) -> tuple[str, str]:
    """Names of the hooks carrying ``layer``'s q and k after RoPE (``[batch, pos, head,
    d_head]``, k over KV heads).

    Raises:
        MissingFeatureError: where they do not fire (TL 4 native attention).
    """
    if _is_native(model, layer) and not is_posinterp_attention(model, layer):
        raise MissingFeatureError(
            "this TransformerLens 4 native model never fires hook_rot_q/hook_rot_k; build it "
            "with posinterp.build_model, whose attention fires them")
    p = f"blocks.{layer}.attn."
    return p + "hook_rot_q", p + "hook_rot_k"


def scores_include_bias(model, layer: int) -> bool:
    """True where ``scores_hook`` already carries a positional bias posinterp did not
    install and cannot read separately (bridged HF ALiBi models: BLOOM)."""
    return is_bridge(model) and positional_type(model) == "alibi" \
        and not is_posinterp_attention(model, layer)


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

    Returns:
        the cache, or ``(logits, cache)`` with ``return_logits``.
    """
    from ..devices import model_device

    device = model_device(model)
    tokens = tokens.to(device)
    mask = None if mask is None else mask.to(device)
    bidirectional = getattr(model.cfg, "attention_dir", "causal") == "bidirectional"
    kwargs = {"names_filter": names_filter}
    if mask is not None:
        kwargs["one_zero_attention_mask" if bidirectional and not is_bridge(model)
               else "attention_mask"] = mask
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
    with eval_mode(model), _capture_outputs(replaced) as captured:
        out, cache = model.run_with_cache(tokens, **kwargs)
    if device.type != "cpu":
        cache = cache.to("cpu")
        out = out.cpu() if isinstance(out, Tensor) else out
    if replaced:
        cache = {**{n: cache[n] for n in cache.keys()}, **{n: v.cpu() for n, v in captured.items()}}
    return (out, cache) if return_logits else cache
