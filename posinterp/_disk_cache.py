"""Results of pure, seeded computations kept on disk, keyed by their inputs and versions.

The random-head nulls (:func:`posinterp.analysis.spectral.ginibre_null`,
:func:`posinterp.analysis.kernels.null_band`) depend only on a shape and a seed, yet cost
seconds to draw: 62x one ``run_with_cache`` on a short ``posinterp inspect`` input, paid
again by every new process (issue 39). They are kept here, one ``.npz`` file per key,
under ``$POSINTERP_CACHE`` (a folder; ``off`` turns the cache off), else the ``cache``
folder of :func:`posinterp.specs.cache_home` (``$POSINTERP_HOME``, else
``$XDG_CACHE_HOME/posinterp``, else ``~/.cache/posinterp``).

The key holds the computation's name, its own algorithm version (bumped when its numbers
change), its arguments, and what draws and reduces the numbers: the torch and numpy
versions, the machine type, the CPU's model and instruction-set flags. A file is only
ever reused for the exact computation that wrote it, so a cached result equals a fresh
one bit for bit. Each file records its whole
key, checked on read (a hash collision or a foreign file is recomputed). Files are written
atomically (:func:`posinterp.io.atomic_path`); a damaged one is recomputed and
rewritten, and an unwritable cache folder costs only the recomputation (each with a
warning).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .io import atomic_path, cpu_facts
from .specs import cache_home

__all__ = ["CACHE_ENV", "cache_root", "cached_arrays"]

#: the environment variable naming the cache folder (``off``, ``0`` or empty: no cache)
CACHE_ENV = "POSINTERP_CACHE"
_OFF = ("", "0", "off", "false", "no")


def cache_root() -> Path | None:
    """The cache folder, or None when ``$POSINTERP_CACHE`` turns the cache off."""
    if CACHE_ENV in os.environ:
        value = os.environ[CACHE_ENV]
        value = value.strip()
        return None if value.lower() in _OFF else Path(value).expanduser()
    return cache_home() / "cache"


def _cpu() -> str:
    """The CPU's model and instruction-set flags, as a digest (kernels round by what the
    CPU offers: a cache shared by machines of one architecture but other CPUs must not mix
    them)."""
    facts = cpu_facts()
    return facts["cpu_flags"] or facts["cpu"]


def _environment() -> dict:
    import torch

    return {"torch": torch.__version__, "numpy": np.__version__, "machine": platform.machine(),
            "cpu": _cpu()}


def cached_arrays(name: str, version: int, args: dict, compute: Callable[[], dict[str, np.ndarray]],
                  root: Path | None = None) -> dict[str, np.ndarray]:
    """``compute()`` (named arrays), read from the cache when this exact computation was
    stored, else computed and stored.

    Args:
        name: the computation (a folder of the cache).
        version: its algorithm version: bump it whenever its numbers change.
        args: its arguments (JSON-serializable; floats are kept exactly).
        compute: returns ``{array name: numpy array}``, the same every call for ``args``.
        root: the cache folder (default :func:`cache_root`).

    Returns:
        the arrays, in ``compute``'s order, with their dtypes (numeric dtypes only).

    Warns:
        UserWarning: a damaged cache file (recomputed, rewritten) or an unwritable cache
            folder (computed, not stored).
    """
    root = cache_root() if root is None else root
    if root is None:
        return compute()
    key = json.dumps({"name": name, "version": version, "args": args, **_environment()},
                     sort_keys=True)
    path = root / name / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as stored:
                if str(stored["__key__"]) == key:
                    order = json.loads(str(stored["__order__"]))
                    return {k: stored[k] for k in order}
        except Exception as err:  # noqa: BLE001 - damage: OSError, BadZipFile, KeyError, ...
            warnings.warn(f"posinterp cache file {path} is damaged ({type(err).__name__}: "
                          f"{err}); computing it again and rewriting it", stacklevel=3)
    arrays = compute()
    try:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, __key__=np.array(key), __order__=np.array(json.dumps(list(arrays))),
                         **arrays)
    except OSError as err:
        # a read-only or full cache folder costs only the recomputation, said once per place
        warnings.warn(f"cannot write the posinterp cache at {root} ({err.strerror or err}); "
                      f"{name} is computed again in every process (set {CACHE_ENV} to a "
                      f"writable folder, or to off)", stacklevel=3)
    return arrays
