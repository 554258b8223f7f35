"""TransformerLens's weight processing on either line (:func:`process_weights`,
folded norm gains: :func:`mark_folded`, :func:`norm_gain_folded`) and TL 3.9 weights in
a TL 4 bridge's layout (:func:`convert_tl3_weights`)."""

from __future__ import annotations

from torch import Tensor

from .modes import compiled_kind, unwrap
from .probe import _VERDICTS
from .surface import is_bridge
from .version import TL_MAJOR, TL_VERSION, major_of

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


def _saved_tl(saved: dict | None) -> str:
    return str((saved or {}).get("transformer-lens", ""))


def load_weights(model, weights: dict[str, Tensor], saved: dict | None, where) -> None:
    """Load weights written by :func:`posinterp.train` or the zoo into ``model`` (strict).

    Weights written under TransformerLens 3.9 (``HookedTransformer`` names, per-head
    shapes) load into a TL 4 model through TL's ``convert_tl_checkpoint``
    (:func:`convert_tl3_weights`): the same numbers, so the
    model computes the same function (docs/tl4.md). TL offers no conversion back.

    Args:
        saved: the ``versions`` dict recorded with the weights (``io.versions``); files
            without one (older checkpoints) load as they are.
        where: the checkpoint folder or file, for messages.

    Raises:
        ValueError: TL 4 weights under TL 3.9 (naming both versions), or TL 3.9-labelled
            weights that are not in TL 3.9's layout (naming the file).
    """
    got = _saved_tl(saved)
    major = major_of(got)
    if major is not None and major < 4 <= TL_MAJOR:
        try:
            weights = convert_tl3_weights(model, weights)
        except ValueError as err:
            raise ValueError(f"{where} says it was written under TransformerLens {got} but its "
                             f"weights are not in that layout: {err}") from None
    else:
        check_tl_major(saved, where)
    model.load_state_dict(weights, strict=True)


def check_tl_major(saved: dict, where, resume: bool = False) -> None:
    """Refuse weights saved under another TransformerLens major version, by name.

    TL 3.9 saves a ``HookedTransformer``'s weights (``blocks.0.attn.W_Q``, per head) and
    TL 4 a ``TransformerBridge``'s (``blocks.0.attn.q.weight``, fused): the names and
    shapes differ. :func:`load_weights` converts TL 3.9 weights for TL 4; this check
    refuses the rest: TL 4 weights under TL 3.9 (TL has no converter back) and, with
    ``resume``, continuing training across majors (the optimizer's moments are stored
    per parameter, in the writer's layout).

    Args:
        saved: the ``versions`` dict recorded with the weights (``io.versions``); files
            without one (older checkpoints) are let through.
        where: the checkpoint folder or file, for the message.
        resume: the check is for resuming training (refused across majors either way).

    Raises:
        ValueError: naming both versions and how to load the weights.
    """
    got = _saved_tl(saved)
    if major_of(got) in (None, TL_MAJOR):
        return
    if resume:
        raise ValueError(
            f"{where} was written under TransformerLens {got} and this is TransformerLens "
            f"{TL_VERSION}: training cannot be resumed across major versions (the optimizer "
            f"state is stored per parameter, and HookedTransformer and TransformerBridge name "
            f"and shape them differently). Resume it with TransformerLens "
            f"{got.split('.')[0]}.x, e.g. pip install 'transformer-lens=={got}', or train "
            f"again in another folder; load_checkpoint reads TL 3.9 weights on TL 4 (docs/tl4.md).")
    raise ValueError(
        f"{where} was written under TransformerLens {got} and this is TransformerLens "
        f"{TL_VERSION}: its weights are a TransformerBridge's, and TransformerLens has no "
        f"conversion from that layout back to HookedTransformer's. Load it with TransformerLens "
        f"{got.split('.')[0]}.x, e.g. pip install 'transformer-lens=={got}' (docs/tl4.md), or "
        f"train it again in another folder.")
