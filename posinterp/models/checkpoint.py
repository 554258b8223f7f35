"""Old path of :mod:`posinterp.models.sources.hf_files` (re-exports its public names)."""

from .sources.hf_files import (  # noqa: F401
    IncompleteCheckpointError,
    checkpoint_files,
    explicit_weights,
    refuse_incomplete,
    safetensors_files,
    weight_layouts,
)

__all__ = ["IncompleteCheckpointError", "checkpoint_files", "explicit_weights", "refuse_incomplete",
           "safetensors_files"]
