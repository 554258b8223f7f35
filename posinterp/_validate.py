"""Config validation shared by the frozen dataclass configs."""

from __future__ import annotations


def require_at_least(obj, names: tuple[str, ...], minimum: int = 1) -> None:
    """Raise ``ValueError`` naming the first field of ``obj`` in ``names`` below ``minimum``."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def is_int(x) -> bool:
    """True for a Python or NumPy integer, False for bool (``True`` is not a layer)."""
    import numpy as np

    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def check_indices(name: str, chosen, stop: int, start: int = 0) -> list[int]:
    """``chosen`` (an int or a sequence of ints) as a list, each in ``[start, stop)``.

    Raises:
        ValueError: naming ``name`` and the allowed range, for a non-int, an index out of
            range (a negative index never counts from the end) or a repeated index.
    """
    items = [chosen] if is_int(chosen) else list(chosen)
    bad = [c for c in items if not (is_int(c) and start <= c < stop)]
    if bad:
        raise ValueError(f"{name} must be integers in [{start}, {stop - 1}], got {bad}")
    if len(set(items)) != len(items):
        raise ValueError(f"{name} must not repeat an index, got {items}")
    return [int(c) for c in items]
