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


class Derived(int):
    """An integer a config derived from its other fields, not one the caller set.

    ``dataclasses.replace`` passes every field back to ``__init__``, derived ones too, so
    a plain int would freeze a value computed for the old inputs
    (``replace(preset("small"), d_model=384)`` kept ``d_head=32``). Marked with this type
    and the field it was derived for, :func:`derive` recomputes it from the new inputs; a
    value the caller sets (a plain int, or a value derived for another field or another
    config class, such as ``TaskConfig(min_digits=demo.digits)``) is kept. It is an
    ``int`` everywhere else (arithmetic, JSON, ``torch`` shapes). To pin a value copied
    from a config of the same class and field, pass ``int(value)``.
    """

    def __new__(cls, value: int, key: tuple[str, str]):
        obj = super().__new__(cls, value)
        obj.key = key
        return obj

    def __repr__(self) -> str:
        return int.__repr__(self)

    def __reduce__(self):
        return (Derived, (int(self), self.key))


class DerivedStr(str):
    """A string a config derived from its other fields (:class:`Derived` for ``str``
    fields, such as a task's default format); a ``str`` everywhere else."""

    def __new__(cls, value: str, key: tuple[str, str]):
        obj = super().__new__(cls, value)
        obj.key = key
        return obj

    def __repr__(self) -> str:
        return str.__repr__(self)

    def __reduce__(self):
        return (DerivedStr, (str(self), self.key))


def derive(obj, name: str, compute) -> None:
    """Set frozen ``obj.name`` to ``compute()`` unless the caller gave it.

    Call from ``__post_init__``: a field still None, or carrying the :class:`Derived` value
    this class derived for this field (``dataclasses.replace`` passes it back), is derived
    again; ``compute`` may return None ("unset"), which stays None.
    """
    key = (type(obj).__qualname__, name)
    value = getattr(obj, name)
    if value is None or (isinstance(value, (Derived, DerivedStr)) and value.key == key):
        new = compute()
        mark = DerivedStr if isinstance(new, str) else Derived
        object.__setattr__(obj, name, None if new is None else mark(new, key))
