"""Old path of :mod:`posinterp.models.sources.encoder` (re-exports its public names)."""

from .sources.encoder import (  # noqa: F401
    MINILM_PACKAGE,
    load_bert_encoder,
    minilm_path,
)

__all__ = ["load_bert_encoder", "minilm_path"]
