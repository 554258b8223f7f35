"""Old path of :mod:`posinterp.models.sources.llama2c` (re-exports its public names)."""

from .sources.llama2c import (  # noqa: F401
    BOS_ID,
    HEADER_INTS,
    Llama2cHeader,
    load_llama2c,
    read_llama2c,
)

__all__ = ["BOS_ID", "Llama2cHeader", "load_llama2c", "read_llama2c"]
