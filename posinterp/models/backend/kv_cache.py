"""Whether a model's KV cache gives the numbers of a full forward pass: checked once at
load on TL 4 bridges (:func:`guard_kv_cache`), refused by name where it does not
(:func:`has_kv_cache`)."""

from __future__ import annotations

import contextlib
import warnings

import torch

from .errors import MissingFeatureError
from .modes import _in_float32, eval_mode, unwrap
from .probe import _probe_tokens
from .surface import _is_native, is_bridge
from .version import TL_VERSION

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
    the reason instead of returning other tokens. Returns the verdict, which
    :func:`has_kv_cache` reads. A no-op returning True on TL 3.9.

    TransformerLens 4.3 with transformers 5.x: the attention the Llama-family bridges
    rebuild (``PositionEmbeddingsAttentionBridge``) looks for the cache under
    ``past_key_values``, which transformers 5 passes to each layer as ``cache``, so each
    new token attends to itself alone. Where that is the fault, each attention bridge
    here gets an ``_update_kv_cache`` that also reads ``cache`` (:func:`_repair_cache_argument`)
    and the check is run again: kept only if the cached step then matches. (Bridges that
    run HF's own attention module, e.g. GPT-NeoX, OPT, BLOOM, keep a working cache.)"""
    if not is_bridge(model):
        return True
    if _is_native(model):
        object.__setattr__(model, _KV, False)
        return False
    works = _cached_step_matches(model)
    if not works and _repair_cache_argument(model):
        works = _cached_step_matches(model)
        if not works:
            _remove_cache_repair(model)
    object.__setattr__(model, _KV, works)
    if not works:
        model.original_model.register_forward_pre_hook(_refuse_cache(
            f"TransformerLens {TL_VERSION}'s bridge over this {getattr(model.cfg, 'architecture', '')} "
            "model does not use the keys a KV cache holds (checked at load: a cached step's "
            "logits differ from the full forward pass), so cached generation would give other "
            "tokens"), with_kwargs=True)
    return works


@contextlib.contextmanager
def quiet_past_key_values():
    """TL's bridge hands a cache to HF as ``past_key_values``, which transformers 5.x
    deprecates (for ``cache``) with a FutureWarning; posinterp's cached passes take TL's
    path, the one its ``generate`` takes, so the warning is posinterp's to silence."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated",
                                category=FutureWarning)
        yield


def _cached_step_matches(model) -> bool:
    """An 8-token probe: 7 tokens cached, then 1; its logits against the full pass."""
    from ...devices import model_device

    tokens = _probe_tokens(model)[:1].to(model_device(model))
    # float32: half precision rounds the two paths apart by more than the tolerance
    with eval_mode(model), _in_float32(model):
        full = model(tokens)
        try:
            _, cache = model(tokens[:, :-1], return_type="logits_and_cache")
            with quiet_past_key_values():
                step = model(tokens[:, -1:], past_key_values=cache)
            return bool(torch.allclose(step[:, -1].double(), full[:, -1].double(),
                                       atol=1e-4, rtol=1e-4))
        except Exception:  # noqa: BLE001 - a cache that cannot even run is no cache
            return False


_REPAIRED = "posinterp_cache_argument"  # instance attribute: the repaired method


def _repair_cache_argument(model) -> bool:
    """Give each attention bridge whose class reads the KV cache only as
    ``past_key_values`` an ``_update_kv_cache`` that also takes transformers 5's ``cache``
    argument (see :func:`guard_kv_cache`). Returns whether any was repaired."""
    import types

    repaired = False
    for block in getattr(model, "blocks", []):
        attn = getattr(block, "attn", None)
        method = getattr(type(attn), "_update_kv_cache", None)
        if method is None:
            continue

        def update(self, k, v, _method=method, **kwargs):
            if kwargs.get("past_key_values") is None and kwargs.get("cache") is not None:
                kwargs["past_key_values"] = kwargs["cache"]
            return _method(self, k, v, **kwargs)

        attn._update_kv_cache = types.MethodType(update, attn)
        object.__setattr__(attn, _REPAIRED, True)
        repaired = True
    return repaired


def _remove_cache_repair(model) -> None:
    for block in getattr(model, "blocks", []):
        attn = getattr(block, "attn", None)
        if attn is not None and attn.__dict__.pop(_REPAIRED, False):
            del attn._update_kv_cache
