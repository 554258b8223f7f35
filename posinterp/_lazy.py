"""Names imported on first use (PEP 562): one implementation for the packages that re-export.

``import posinterp`` and ``import posinterp.dashboard`` must not load torch or the pages,
so their public names are resolved from a ``{name: submodule}`` table when first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` for its ``exports`` table.

    Args:
        package: the package's ``__name__`` (relative submodules resolve against it).
        exports: public name -> submodule that defines it (e.g. ``".analysis"``).
        namespace: the package's ``globals()``; a resolved name is stored there, so later
            lookups skip ``__getattr__``.

    Returns:
        ``(__getattr__, __dir__)`` to assign at module level.

    Raises:
        AttributeError: (from ``__getattr__``) for a name not in ``exports``.
    """
    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
