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


def moved_names(package: str, moved: dict[str, str]) -> Callable[[str], object]:
    """A ``__getattr__`` for ``package`` that refuses names which moved to another package,
    saying where they went, without importing it (the new home may sit in a higher layer).

    Args:
        package: the package's ``__name__``.
        moved: old public name -> the module that holds it now (``"posinterp.dashboard"``).

    Raises:
        ImportError: (from ``__getattr__``) for a moved name, naming the new import; an
            ImportError, not an AttributeError, so ``from package import name`` shows it.
        AttributeError: for any other missing name.
    """
    def __getattr__(name: str):
        if name in moved:
            raise ImportError(f"{package}.{name} moved to {moved[name]}: use "
                              f"`from {moved[name]} import {name}` (issue 35: the inspect "
                              "dashboard is one package)")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
