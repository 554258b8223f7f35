"""Old path of :mod:`posinterp.models.sources.qk_only` (re-exports its public names)."""

from .sources.qk_only import (  # noqa: F401
    QK_ONLY_ARCHITECTURES,
    LayerReader,
    QKWeights,
    read_qk_weights,
)

__all__ = ["QK_ONLY_ARCHITECTURES", "LayerReader", "QKWeights", "read_qk_weights"]
