"""Old path of :mod:`posinterp.models.sources.hub` (re-exports its public names)."""

from .sources.hf_files import weights_sha256  # noqa: F401
from .sources.hub import (  # noqa: F401
    distinct_revisions,
    hub_cache_dir,
    snapshot_folder,
)

__all__ = ["distinct_revisions", "hub_cache_dir", "snapshot_folder", "weights_sha256"]
