"""TransformerLens's weight processing on either line (:func:`process_weights`,
folded norm gains: :func:`mark_folded`, :func:`norm_gain_folded`) and TL 3.9 weights in
a TL 4 bridge's layout (:func:`convert_tl3_weights`)."""

from __future__ import annotations

from torch import Tensor

from .modes import compiled_kind, unwrap
from .probe import _VERDICTS
from .surface import is_bridge

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

        from ..._rng import preserved_rng

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
