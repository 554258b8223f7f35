"""Plumbing every model source shares: offline HF reads, TL's handled warnings silenced,
``config.json`` read and MLA refused by name, and what TL's weight processing really did.

Used by the HF-folder, GGUF, hub, llama2.c and weights-only sources alike; it imports no
source and no dispatcher, so any source may import it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

# TransformerLens messages about things posinterp handles itself (root logger):
# * BLOOM/ALiBi has no W_pos; TL fills a zero one and warns on every load;
# * TL advises against processing in reduced precision; posinterp applies exactly the
#   processing the caller asked for and records it in ModelInfo.processing (docs/models.md).
_HANDLED_TL_MESSAGES = ("Missing key for a weight matrix in pretrained, filled in with an empty "
                        "tensor: pos_embed.W_pos",
                        "With reduced precision, it is advised to use `from_pretrained_no_processing`")

class _DropHandled(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in _HANDLED_TL_MESSAGES)

@contextlib.contextmanager
def _quiet_handled():
    """Drop TL's warnings about what posinterp handles, for the duration of one load."""
    import transformers

    root, drop = logging.getLogger(), _DropHandled()
    root.addFilter(drop)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # per-load "Loading weights" bars
    try:
        yield
    finally:
        root.removeFilter(drop)
        if bars:
            transformers.utils.logging.enable_progress_bar()

@contextlib.contextmanager
def _offline():
    """HF_HUB_OFFLINE=1 for the duration: a local folder must never reach the hub."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = before

def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a Hugging Face checkpoint folder: {path} is missing "
            "(expected config.json plus model.safetensors or pytorch_model.bin)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{path} has no 'architectures' entry; cannot tell the model family")
    return cfg

def _refuse_mla(raw_cfg: dict, architecture: str) -> None:
    """Refuse multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, ...) by name,
    from config.json and its ``text_config`` (:func:`.backend.mla_settings`)."""
    from ..backend import mla_message, mla_settings

    for cfg in (raw_cfg, raw_cfg.get("text_config") or {}):
        settings = mla_settings(cfg)
        if settings:
            raise ValueError(mla_message(settings, f"reading {architecture} (load_model, "
                                                   "weights-only spectra)"))

def _processing_done(requested: dict, normalization: str | None, final_rms: bool,
                     adapter=None) -> dict:
    """What TL's weight processing actually does with ``requested``.

    TL folds LN and RMSNorm gains but centres writing weights only for LayerNorm models
    without a final RMSNorm (RMSNorm is not translation invariant); it skips silently. TL 4
    also skips ``fold_ln`` / ``center_writing_weights``, with only a warning, where the
    architecture adapter says it cannot do them (``supports_fold_ln = False``: post-LN OPT,
    Qwen3, Phi-3, OLMo2, ...).
    """
    done = dict(requested)
    if normalization not in ("LN", "LNPre", "RMS", "RMSPre") \
            or not getattr(adapter, "supports_fold_ln", True):
        done["fold_ln"] = False
    if normalization not in ("LN", "LNPre") or final_rms \
            or not getattr(adapter, "supports_center_writing_weights", True):
        done["center_writing_weights"] = False
    return done
