"""Atomic file output and run metadata.

Every result posinterp writes goes through these helpers, so an interrupted run never
leaves half a file behind: data go to a temporary file in the same folder, which is
then renamed over the target (``os.replace`` is atomic on POSIX and Windows).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import inspect
import json
import math
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["POSINTERP_VERSION", "cpu_facts", "FolderInUse", "atomic_dir", "atomic_path",
           "atomic_write_csv_gz", "atomic_write_json", "atomic_write_text", "check_out_dir",
           "clean_temporaries", "describe_os_error", "dumps_json", "folder_lock", "json_ready",
           "json_value", "locks_output", "output_lock", "read_json_record", "set_aside",
           "sha256_file", "versions"]

#: posinterp's version (``posinterp.__version__`` is this name): here, in a foundation, so
#: the files that record it (``inspection.json``) need not import the top-level package.
POSINTERP_VERSION = "0.1.0"


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
        OSError: if the parent folder cannot be created, a write in the block fails or
            the rename fails (a write's error names ``path``, e.g. on a full disk).
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
    except OSError as err:
        if err.filename is not None and err.filename != str(tmp_path):
            raise
        # Writers (pandas, write_text) raise without a path, or with the hidden one:
        # name the file the user asked for.
        raise type(err)(err.errno, err.strerror or str(err), str(path)) from err
    finally:
        with contextlib.suppress(OSError):  # never hide the write's own error
            tmp_path.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and return the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def atomic_write_csv_gz(path: str | os.PathLike, df) -> Path:
    """Write the DataFrame ``df`` (no index) to ``path`` as gzipped CSV, atomically.

    The gzip header holds no file name and mtime 0, so the same rows always give the same
    bytes (committed data is compared byte for byte; pandas' own gzip writes the
    temporary file's name into the header). Returns the path.

    Raises:
        OSError: if the file cannot be written; ``path`` is then left as it was
            (:func:`atomic_path`).

    Source: DESIGN.md §4 (results are written atomically); issue 37 item 1 (committed
    per-seed tables).
    """
    import gzip

    with atomic_path(path) as tmp, open(tmp, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(df.to_csv(index=False).encode("utf-8"))
    return Path(path)


def json_value(v: Any) -> Any:
    """One table cell or metadata value as JSON holds it: a missing value (None, pandas'
    NA, NaN, ±inf) becomes ``None`` (``null``), numpy scalars become Python numbers and
    bools; anything else is returned as it is. Nothing is rounded.

    The one rule for "a score that does not exist" in every file and page posinterp
    writes (:func:`json_ready` applies it through containers).
    """
    if v is None or _is_pandas_na(v):
        return None
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0 and getattr(v, "size", 1) == 1:
        v = v.item()  # numpy scalars (np.float32 is not a float), 0-d arrays and tensors
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _is_pandas_na(v: Any) -> bool:
    """``v is pandas.NA``, without importing pandas (a value can only be NA once pandas
    is loaded; this module stays standard-library only)."""
    import sys

    pd = sys.modules.get("pandas")
    return pd is not None and v is pd.NA


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
    return json_value(obj)


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
            shutil.rmtree(tmp, ignore_errors=True)  # never hide the write's own error


def set_aside(path: str | os.PathLike, prefix: str = "broken-") -> Path:
    """Rename a damaged file or folder to ``<prefix><name>`` beside it (``-2``, ``-3``, ...
    when that name is taken) and return the new path.

    Damaged results are the user's files: they are kept for a look, never deleted, and
    once renamed they are neither resumed from nor counted as done.

    Raises:
        OSError: if the rename fails.
    """
    path = Path(path)
    aside, n = path.with_name(f"{prefix}{path.name}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{prefix}{path.name}-{n}")
    os.replace(path, aside)
    return aside


def read_json_record(path: str | os.PathLike) -> dict | None:
    """The JSON object in ``path`` (a bookkeeping file a run extends, e.g. ``run.json``),
    or None when it is missing or damaged; a damaged one is moved aside to ``broken-*``
    with a warning, so every later run does not trip over it. Raises nothing else than
    the ``OSError`` of a failed rename.
    """
    import warnings

    path = Path(path)
    if not path.exists():
        return None
    try:
        obj = json.loads(path.read_text())
        if isinstance(obj, dict):
            return obj
        problem = f"a JSON {type(obj).__name__}, not an object"
    except (OSError, ValueError) as err:
        problem = f"{type(err).__name__}: {err}"
    aside = set_aside(path)
    warnings.warn(f"{path} is damaged ({problem}); moved it to {aside} and starting it anew",
                  stacklevel=2)
    return None


def clean_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove the hidden ``.<name>.*.tmp`` files and folders that :func:`atomic_path` and
    :func:`atomic_dir` leave when a process is killed mid-write; return what was removed.

    Call it only while holding :func:`folder_lock` on ``folder`` (another writer's
    temporaries would be removed under it). Raises nothing for a missing folder.
    """
    folder = Path(folder)
    removed = []
    for tmp in sorted(folder.glob(".*.tmp")) if folder.is_dir() else []:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class FolderInUse(ValueError):
    """Another process holds the lock on an output folder (:func:`folder_lock`)."""


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold an exclusive lock on ``folder`` (``flock`` on ``folder/.lock``) for the block.

    Two runs writing one folder would both do all the work and race on its
    read-modify-write files; the second is refused at once instead. The lock goes with
    the process (a killed run leaves no stale lock). Where ``fcntl`` is missing
    (Windows) no lock is taken.

    Raises:
        FolderInUse: naming the folder and the holder's process id, if another process
            (or another open of the same lock in this one) holds it.
        OSError: if the lock file cannot be created (e.g. a read-only folder).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield Path(folder)
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise FolderInUse(
                f"{folder} is in use by another posinterp run (process {holder}); wait for it "
                "to finish, or give this run another output folder") from None
        pid = str(os.getpid()).encode()
        if os.pread(fd, 64, 0) != pid:  # the holder, for the message; unchanged if it is us
            os.ftruncate(fd, 0)
            os.pwrite(fd, pid, 0)
        yield folder
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# What a failed write means for the user, by errno.
_CAUSES = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded",
           errno.EROFS: "read-only file system", errno.EACCES: "not writable (permission denied)",
           errno.EPERM: "not writable (operation not permitted)",
           errno.EFBIG: "file too large for this file system or the process's file-size limit"}


def describe_os_error(err: OSError) -> str:
    """One line naming the path and the cause of an ``OSError``, e.g. ``run/x.json: disk
    full (No space left on device)``. Raises nothing."""
    cause = _CAUSES.get(err.errno or -1)
    what = err.strerror or str(err)
    text = what if not cause or cause.lower() in what.lower() else f"{cause} ({what})"
    return text if err.filename is None else f"{err.filename}: {text}"


#: Prefix of the empty file :func:`check_out_dir` creates and removes to test a folder.
WRITE_CHECK_PREFIX = ".posinterp-write-check-"


def check_out_dir(path: str | os.PathLike, name: str = "out_dir", create: bool = True,
                  writable: bool = False) -> Path:
    """Check that ``path`` can be an output folder, then create it (unless ``create`` is False).

    Called before any work, so a bad path fails at once, and after every other argument
    has been validated, so a bad argument never leaves an empty folder behind.
    ``writable`` also checks that the folder, or the nearest existing folder above it,
    can be written (``os.access``, then creating and removing a file there), so a read-only
    ``--out`` fails before the work runs, not when the results are written.

    Raises:
        ValueError: naming ``name``, if ``path`` or one of its parents is an existing file
            (or anything else that is not a folder), ``path`` is empty, or (``writable``)
            it cannot be written (a read-only file system, no permission, or a folder
            such as /proc where creating a file fails even for root).
    """
    if not str(path).strip():
        raise ValueError(f"{name} must be a folder path, got an empty string")
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == path else f"is inside {p}, which is a file"
            raise ValueError(f"{name} {path} {what}; give a folder path")
    if writable:
        base = next((p for p in (path, *path.parents) if p.exists()), Path("."))
        where = "" if base == path else f" ({base} is the nearest existing folder)"
        if not os.access(base, os.W_OK | os.X_OK):
            try:
                cause = ("a read-only file system" if os.statvfs(base).f_flag & os.ST_RDONLY
                         else "no write permission")
            except OSError:
                cause = "no write permission"
            raise ValueError(f"{name} {path} cannot be written: {cause}{where}; give a folder "
                             "you can write")
        # os.access answers yes to root everywhere, /proc and /sys included: only creating
        # a file there tells
        try:
            fd, probe = tempfile.mkstemp(dir=base, prefix=WRITE_CHECK_PREFIX)
        except OSError as err:
            raise ValueError(f"{name} {path} cannot be written: creating a file there failed "
                             f"({err.strerror}){where}; give a folder you can write") from None
        os.close(fd)
        os.unlink(probe)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, name: str = "out_dir") -> Iterator[Path]:
    """Hold :func:`folder_lock` on an output folder for a whole run, taken before any work.

    A second run into the folder is refused at once (before it loads a model), not after
    it has redone the first one's work and replaced its files. The folder is checked
    (:func:`check_out_dir`) and created for the lock; if this call created it and the block
    raises before writing anything into it (a bad spec, say), it is removed again, so bad
    input leaves no empty folder behind.

    Raises:
        FolderInUse: if another run holds the folder (named, with its process id).
        ValueError: as :func:`check_out_dir`.
    """
    path = check_out_dir(folder, name, create=False)
    created, remove = not path.exists(), False
    try:
        with folder_lock(path):
            try:
                yield path
            except BaseException:
                remove = created and [p.name for p in path.iterdir()] == [".lock"]
                if remove:  # unlinked while held: a run that opens it meanwhile is refused
                    (path / ".lock").unlink(missing_ok=True)
                raise
    finally:
        if remove:
            with contextlib.suppress(OSError):  # another run created it again meanwhile
                path.rmdir()


def locks_output(param: str = "out_dir"):
    """Decorator: the function runs inside :func:`output_lock` on its argument ``param``
    (every command that writes an ``--out`` folder)."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def locked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            with output_lock(bound.arguments[param], param):
                return fn(*args, **kwargs)
        return locked
    return wrap


def cpu_facts() -> dict[str, str]:
    """The CPU a number was computed on: ``{"cpu": model name, "cpu_flags": a 16-hex digest
    of its instruction-set flags}`` (kernels round by what the CPU offers, so two CPUs of
    one architecture can give results that differ in the last bits; a cache or a rerun
    report must be able to tell them apart). From /proc/cpuinfo where there is one, else
    :func:`platform.processor` (no flags)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"cpu": platform.processor() or platform.machine(), "cpu_flags": ""}
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    first: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in wanted and key.strip() not in first:
            first[key.strip()] = value.strip()
    name = first.get("model name") or " ".join(
        first.get(k, "") for k in ("CPU implementer", "CPU part")).strip() or platform.machine()
    return {"cpu": name,
            "cpu_flags": hashlib.sha256(json.dumps(first, sort_keys=True).encode()).hexdigest()[:16]}


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
