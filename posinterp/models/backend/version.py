"""The TransformerLens line posinterp runs on: the one home of version facts.

Imports no other posinterp module, so anything may ask it. No module outside
``models/backend/`` tests the version (tests/test_architecture.py keeps it so): code that
has one implementation per line picks it with :func:`by_line`, and weights recorded under
another line are this package's (:mod:`.weights`). Also what each line itself does with a
name or a config: TL's aliases for hub names (:func:`hub_repo_for`) and the HF settings
TL 4's bridge ignores (:func:`unhonoured_settings`).
"""

from __future__ import annotations

import importlib.metadata

TL_VERSION = importlib.metadata.version("transformer-lens")
TL_MAJOR = int(TL_VERSION.split(".")[0])


def by_line(*, tl3, tl4):
    """``tl3`` on TransformerLens 3.x, ``tl4`` on 4.x and later: the one place a
    line-specific implementation (a ``HookedTransformer`` builder, a bridge builder) is
    chosen, so the choice never hides in a version test elsewhere."""
    return tl4 if TL_MAJOR >= 4 else tl3


def major_of(version: str | None) -> int | None:
    """The major version in a recorded TransformerLens version string (``io.versions``),
    or None for a missing or unreadable one (files written before versions were kept)."""
    v = str(version or "")
    return int(v.split(".")[0]) if v[:1].isdigit() else None


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
