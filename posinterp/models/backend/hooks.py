"""The hook names features read, answered from the verified meanings
(:func:`~.probe.hook_meaning`), with a refusal naming what the probe found where no hook
has the meaning asked for."""

from __future__ import annotations

import re

from .errors import MissingFeatureError
from .mla import mla_message, mla_settings
from .modes import unwrap
from .probe import hook_meaning
from .surface import _attn, positional_type


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
