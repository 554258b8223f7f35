"""Old path of :mod:`posinterp.models.sources.gguf` (re-exports its public names)."""

from .sources.gguf import (  # noqa: F401
    GGUF_INSTALL_HINT,
    gguf_cache_home,
    gguf_folder,
    load_gguf,
    read_gguf_header,
)

__all__ = ["GGUF_INSTALL_HINT", "gguf_cache_home", "gguf_folder", "load_gguf", "read_gguf_header"]
