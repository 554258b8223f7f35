"""Config validation shared by the frozen dataclass configs."""

from __future__ import annotations


def require_at_least(obj, names: tuple[str, ...], minimum: int = 1) -> None:
    """Raise ``ValueError`` naming the first field of ``obj`` in ``names`` below ``minimum``."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
