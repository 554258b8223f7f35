"""Atomic file output and run metadata.

Every result posinterp writes goes through these helpers, so an interrupted run never
leaves half a file behind: data go to a temporary file in the same folder, which is
then renamed over the target (``os.replace`` is atomic on POSIX and Windows).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "atomic_write_text", "atomic_write_json", "atomic_dir", "check_out_dir",
           "dumps_json", "json_ready", "versions"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path that is renamed onto ``path`` when the block succeeds.

    Use it for writers that insist on a filename (``safetensors``, ``torch.save``,
    ``DataFrame.to_csv``). If the block raises, the temporary file is removed and
    ``path`` keeps its previous content.

    Raises:
        OSError: if the parent folder cannot be created or the rename fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would surprise users
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and return the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def json_ready(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, ±inf, numpy's too) replaced by ``None``
    and numpy scalars turned into Python numbers, through dicts, lists and tuples.

    A score that does not exist is NaN in tables and ``null`` in JSON: ``NaN`` and
    ``-Infinity`` are not JSON, and ``JSON.parse`` (every browser) rejects a document
    holding them.
    """
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_ready(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0 and getattr(obj, "size", 1) == 1:
        obj = obj.item()  # numpy scalars (np.float32 is not a float)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps_json(obj: Any, **kwargs) -> str:
    """Strict JSON text of ``obj`` (:func:`json_ready`, then ``allow_nan=False``, so a
    non-finite number can never reach a file). ``kwargs`` go to ``json.dumps``."""
    return json.dumps(json_ready(obj), allow_nan=False, **kwargs)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented strict JSON (:func:`dumps_json`: NaN and ±inf are
    ``null``) to ``path`` atomically and return the path."""
    return atomic_write_text(path, dumps_json(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder that is renamed onto ``path`` when the block succeeds.

    A checkpoint is several files; building it in a sibling folder and renaming the
    folder means a reader sees either the whole checkpoint or none of it.

    Raises:
        FileExistsError: if ``path`` already exists (checkpoints are never overwritten).
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"refusing to overwrite existing folder {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def check_out_dir(path: str | os.PathLike, name: str = "out_dir", create: bool = True) -> Path:
    """Check that ``path`` can be an output folder, then create it (unless ``create`` is False).

    Called before any work, so a bad path fails at once, and after every other argument
    has been validated, so a bad argument never leaves an empty folder behind.

    Raises:
        ValueError: naming ``name``, if ``path`` or one of its parents is an existing file
            (or anything else that is not a folder), or ``path`` is empty.
    """
    if not str(path).strip():
        raise ValueError(f"{name} must be a folder path, got an empty string")
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == path else f"is inside {p}, which is a file"
            raise ValueError(f"{name} {path} {what}; give a folder path")
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def versions() -> dict[str, str]:
    """Versions of Python and of the packages that change numbers, for result metadata."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformer-lens", "transformers", "numpy", "scipy", "pandas",
                 "posinterp"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # pragma: no cover - all are dependencies
            out[name] = "missing"
    return out
