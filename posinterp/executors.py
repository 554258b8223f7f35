"""One interface for running experiment grids: in-process, a process pool, or Ray.

A grid is a list of :class:`Cell` s (a top-level function, its keyword arguments and
the resources it asks for). :func:`run_cells` is the driver: it skips every cell whose
result file exists and reads back whole (a damaged one is moved aside and its cell run
again), runs the others through an executor, writes each result atomically *in the
driver* as soon as it arrives (so a crash keeps every finished cell), and lets every
cell finish before it reports the failed ones together (:class:`CellsFailed`). It holds
a lock on its folder, so a second run into it is refused, and treats SIGTERM like
Ctrl-C: pending cells are cancelled and no worker process is left behind (docs/faults.md).

Every executor runs a cell the same way (:func:`_call`): with ``torch`` set to
``int(num_cpus)`` threads for its duration, so a cell's numbers depend on its own seed
and thread count, never on the executor or on how many cells run beside it.

Executors: ``local`` (in this process, one cell after another; the default, no extra
dependency), ``process`` (a pool of ``workers`` spawned processes) and ``ray`` (each
cell a Ray task asking for its ``num_cpus``/``num_gpus``; ``pip install 'ray>=2.9'``).

Source: DESIGN.md §4 ("Experiments are grids of independent cells"); issue 17
("Beyond one CPU").
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import platform
import re
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .io import (
    atomic_path,
    atomic_write_json,
    clean_temporaries,
    cpu_facts,
    folder_lock,
    read_json_record,
    set_aside,
    versions,
)

__all__ = ["ENVIRONMENT_FILE", "EXECUTORS", "Cell", "CellsFailed", "Executor", "LocalExecutor",
           "ProcessExecutor", "RayExecutor", "cell_done", "cell_environment", "cell_environments",
           "gpus_for", "make_executor", "run_cells"]

EXECUTORS = ("local", "process", "ray")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*(/[A-Za-z0-9][A-Za-z0-9._+=-]*)*")


@dataclass(frozen=True)
class Cell:
    """One unit of a grid: ``fn(**kwargs)``, run once, its result stored under ``name``.

    ``fn`` must be a module-level function (process pools and Ray pickle it by name);
    ``kwargs`` must be picklable. ``name`` is a relative, file-safe path (letters,
    digits, ``._+=-``, ``/`` between parts); the result goes to ``<out_dir>/<name><suffix>``.
    ``num_cpus`` is both what the cell asks a scheduler for and the torch thread count it
    runs with (at least 1); ``num_gpus`` is what it asks Ray for (the other executors
    ignore it).

    ``key`` (optional, JSON-serializable) says what the result depends on: the resolved
    architectures, data and optimizer settings, a version of the computation.
    :func:`run_cells` stores it beside the result and reuses a result only under an equal
    key, so a cell whose inputs changed (say, an architecture a fixed default now derives
    differently) is recomputed instead of read back stale. None: reused by name alone.

    Raises:
        ValueError: for a malformed ``name``, a non-callable ``fn``, ``num_cpus <= 0``,
            ``num_gpus < 0`` or a ``key`` that JSON cannot encode.
    """

    name: str
    fn: Callable[..., Any]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    num_cpus: float = 1
    num_gpus: float = 0
    key: Any = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"Cell name must be a relative file-safe path (letters, digits, "
                             f"'._+=-', parts joined by '/'), got {self.name!r}")
        if not callable(self.fn):
            raise ValueError(f"Cell fn must be callable, got {self.fn!r}")
        if not self.num_cpus > 0:
            raise ValueError(f"Cell num_cpus must be > 0, got {self.num_cpus}")
        if not self.num_gpus >= 0:
            raise ValueError(f"Cell num_gpus must be >= 0, got {self.num_gpus}")
        if self.key is not None:
            try:
                json.dumps(self.key, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as err:
                raise ValueError(f"Cell key must be JSON-serializable, got {self.key!r} "
                                 f"({err})") from None


def _key_text(key) -> str:
    # One canonical text per key: sorted fields, tuples as lists, so equal keys compare
    # equal after a round trip through the key file.
    return json.dumps(key, sort_keys=True, allow_nan=False)


def _key_path(result: Path) -> Path:
    return result.with_name(result.name + ".key.json")


def cell_done(cell: Cell, out_dir: str | os.PathLike, fmt: str = "json") -> bool:
    """Whether ``cell``'s result is in ``out_dir`` and current: the file exists and, for a
    cell with a ``key``, the key stored beside it equals ``cell.key``.

    Raises:
        ValueError: for an unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    path = Path(out_dir) / f"{cell.name}{FORMATS[fmt][0]}"
    if not path.exists():
        return False
    if cell.key is None:
        return True
    stored = _key_path(path)
    return stored.exists() and stored.read_text() == _key_text(cell.key)


def cell_environment(threads: int) -> dict:
    """Where a cell's numbers were computed: torch's thread count during the cell, the CPU
    (:func:`posinterp.io.cpu_facts`: model and instruction-set digest) and the versions
    that change numbers (:func:`posinterp.io.versions`). A trained cell is reproducible
    bit for bit only under the same facts; a rerun report compares them."""
    import torch

    return {"torch_threads": int(threads), **cpu_facts(), "machine": platform.machine(),
            **versions(), "device_count_cuda": int(torch.cuda.device_count())}


def _call(fn: Callable[..., Any], kwargs: Mapping[str, Any], threads: int) -> tuple:
    """Run one cell with ``threads`` torch threads; never raises.

    Returns ``(True, result, seconds, environment)`` or ``(False, formatted traceback,
    seconds, environment)`` (:func:`cell_environment`, taken in the worker that ran the
    cell): the worker formats the traceback, so every executor reports a failure the
    same way.
    """
    import torch

    t0 = time.time()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        env = cell_environment(torch.get_num_threads())
        return True, fn(**kwargs), time.time() - t0, env
    except Exception:  # reported by the driver with the cell's name
        return False, traceback.format_exc(), time.time() - t0, None
    finally:
        torch.set_num_threads(before)


def _threads(cell: Cell) -> int:
    return max(1, int(cell.num_cpus))


class Executor:
    """Runs cells; :meth:`submit_all` yields ``(cell, ok, result_or_traceback, seconds,
    environment)``
    in completion order. Use as a context manager (or call :meth:`close`)."""

    name = "executor"

    def submit_all(self, cells: Sequence[Cell]) -> Iterator[tuple[Cell, bool, Any, float, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the executor started (processes, a local Ray instance)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalExecutor(Executor):
    """In this process, one cell after another (the default: nothing to install)."""

    name = "local"

    def submit_all(self, cells):
        for cell in cells:
            yield (cell, *_call(cell.fn, cell.kwargs, _threads(cell)))


class ProcessExecutor(Executor):
    """A pool of ``workers`` spawned processes (spawn, not fork: forking a process that
    has used torch's thread pool can hang). More workers than cores only adds contention,
    so the pool is capped at ``os.cpu_count()``.

    Raises:
        ValueError: if ``workers < 1``.
    """

    name = "process"

    def __init__(self, workers: int | None = None):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers or os.cpu_count() or 1

    def submit_all(self, cells):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        if not cells:
            return
        n = max(1, min(self.workers, len(cells), os.cpu_count() or 1))
        pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init)
        finished = False
        try:
            futures = {pool.submit(_call, c.fn, c.kwargs, _threads(c)): c for c in cells}
            for fut in as_completed(futures):
                try:
                    result = fut.result()
                except Exception:  # the worker died (killed, out of memory): not the cell's own error
                    result = False, traceback.format_exc(), float("nan"), None
                yield (futures[fut], *result)
            finished = True
        finally:
            if finished:
                pool.shutdown(wait=True)
            else:  # interrupted (Ctrl-C, SIGTERM) or abandoned: run nothing more
                _stop_pool(pool)


def _worker_init() -> None:
    """In each pool worker: leave Ctrl-C to the driver (which stops the pool), and die
    with the driver even when it is killed outright (Linux ``PR_SET_PDEATHSIG``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):  # not Linux: the driver's own cleanup must do
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the driver died before prctl
            os._exit(1)


def _stop_pool(pool) -> None:
    """Cancel every pending cell and end every worker of ``pool`` now (a running cell's
    checkpoints are written atomically, so killing it loses at most its unsaved steps)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # before shutdown drops them
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        with contextlib.suppress(Exception):
            proc.terminate()
    for proc in processes:
        with contextlib.suppress(Exception):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


class RayExecutor(Executor):
    """Each cell a Ray task asking for its ``num_cpus`` and ``num_gpus``.

    Connects to ``address`` if given, else to ``$RAY_ADDRESS``, else to a Ray instance
    already running on this machine, else starts a local one (which :meth:`close` shuts
    down); an instance already initialized in this process is reused as is.

    Raises:
        ImportError: naming how to install Ray when it is not installed.
        ValueError: naming the address when no Ray cluster answers there.
    """

    name = "ray"

    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError as err:
            raise ImportError("the ray executor needs Ray: pip install 'ray>=2.9' (in a clone "
                              "of posinterp: pip install '.[ray]')") from err
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            where = address or os.environ.get("RAY_ADDRESS") or None
            try:
                ray.init(address=where, log_to_driver=False, include_dashboard=False)
            except ConnectionError as err:  # a wrong address is bad input, not a crash
                source = "address" if address else "$RAY_ADDRESS"
                raise ValueError(f"the ray executor could not connect to {source}={where!r} "
                                 f"({err}); start the cluster with `ray start --head`, or "
                                 "leave the address out to start a local instance") from None
            self._started = True

    def submit_all(self, cells):
        ray = self._ray
        remote = ray.remote(_call)
        alive = _alive_nodes(ray)
        pending = {remote.options(num_cpus=c.num_cpus, num_gpus=c.num_gpus)
                   .remote(c.fn, dict(c.kwargs), _threads(c)): c for c in cells}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=30)
            alive = _report_lost_nodes(ray, alive)
            if not ready:
                continue
            cell = pending.pop(ready[0])
            try:
                yield (cell, *ray.get(ready[0]))
            except Exception:  # the task's worker died: not the cell's own error
                yield cell, False, traceback.format_exc(), float("nan"), None

    def close(self):
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()
            self._started = False


def _alive_nodes(ray) -> dict[str, str]:
    """``{node id: address}`` of the cluster's live nodes ({} if Ray cannot say)."""
    try:
        return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes() if n.get("Alive")}
    except Exception:  # a report, never a reason to stop the grid
        return {}


def _report_lost_nodes(ray, before: dict[str, str]) -> dict[str, str]:
    """Warn once for each node of ``before`` that is no longer alive; return the live ones."""
    now = _alive_nodes(ray)
    if not now:  # no answer: keep the last known state
        return before
    for node, address in before.items():
        if node not in now:
            warnings.warn(f"Ray node {node[:12]} ({address}) was lost during the run; Ray "
                          "retries its unfinished cells on the remaining nodes (each cell "
                          "carries its own seed, so the results are unchanged), and a cell that "
                          "runs out of retries is reported as failed", stacklevel=2)
    return now


def make_executor(name: str = "local", workers: int | None = None,
                  address: str | None = None) -> Executor:
    """The executor called ``name``: ``local``, ``process`` (``workers`` processes, default
    one per core) or ``ray`` (``address``, default ``$RAY_ADDRESS`` or a local instance).

    Raises:
        ValueError: for an unknown ``name``, ``workers < 1``, or ``workers``/``address``
            given to an executor that does not use them.
        ImportError: for ``ray`` when Ray is not installed.
    """
    if name not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {name!r}")
    if workers is not None and name != "process":
        raise ValueError(f"workers applies to executor 'process' only, got executor {name!r}")
    if address is not None and name != "ray":
        raise ValueError(f"address applies to executor 'ray' only, got executor {name!r}")
    if name == "process":
        return ProcessExecutor(workers)
    if name == "ray":
        return RayExecutor(address)
    return LocalExecutor()


class CellsFailed(RuntimeError):
    """Some cells of a grid raised; every other cell finished and was written.

    Attributes:
        failures: ``{cell name: formatted traceback}``.
        errors: ``{cell name: exception class name}`` (read off the traceback's last line,
            so it is the same whichever process raised it).
        results: ``{cell name: result}`` of the cells that are done.
    """

    def __init__(self, failures: dict[str, str], results: dict[str, Any]):
        self.failures, self.results = failures, results
        self.errors = {}
        lines = [f"{len(failures)} of {len(failures) + len(results)} cells failed "
                 f"(the {len(results)} others are written; rerun to retry only the failed ones):"]
        for name, tb in failures.items():
            last = tb.strip().splitlines()[-1] if tb.strip() else "unknown error"
            kind = re.match(r"[\w.]+", last)
            self.errors[name] = kind.group(0).rsplit(".", 1)[-1] if kind else "unknown"
            lines.append(f"  {name}: {last}")
        lines.append("")
        for name, tb in failures.items():
            lines.append(f"--- {name} ---\n{tb.rstrip()}")
        super().__init__("\n".join(lines))


# Result formats: (suffix, save(result, path), load(path)).
def _save_json(obj, path):
    atomic_write_json(path, obj)


def _load_json(path):
    return json.loads(Path(path).read_text())


def _save_csv(df, path):
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def _load_csv(path):
    import pandas as pd

    return pd.read_csv(path)


def _save_pickle(obj, path):
    with atomic_path(path) as tmp:
        tmp.write_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _load_pickle(path):
    return pickle.loads(Path(path).read_bytes())


FORMATS = {"json": (".json", _save_json, _load_json), "csv": (".csv", _save_csv, _load_csv),
           "pickle": (".pkl", _save_pickle, _load_pickle)}


def run_cells(cells: Sequence[Cell], out_dir: str | os.PathLike, executor: Executor | None = None,
              fmt: str = "json", progress: bool = True, desc: str = "cells",
              seconds_file: str | None = "_seconds.json", log=None,
              verify: Callable[[Cell, Any], None] | None = None,
              lock: bool = True) -> dict[str, Any]:
    """Run (or resume) a grid; return ``{name: result}`` in the order of ``cells``.

    A cell whose ``<out_dir>/<name><suffix>`` exists, reads back (and passes ``verify``)
    and, for a cell with a ``key``, has an equal stored key (:func:`cell_done`) is not run
    again; one whose key changed is recomputed and logged as stale; a damaged one is moved
    aside to ``broken-<name>`` with a warning naming both, and its cell runs again. The
    others go through ``executor`` (default :class:`LocalExecutor`); each result is
    written atomically by this driver as it arrives (``fmt``: ``json`` for dicts, ``csv``
    for DataFrames, ``pickle`` for anything else) and its compute seconds are added to
    ``<out_dir>/<seconds_file>`` (``None``: not recorded), and the environment it ran in
    (:func:`cell_environment`) to ``<out_dir>/_environment.json``. Every result returned is read
    back from its file, so a fresh run and a resumed one hand on the same values.

    While it runs, the driver holds :func:`posinterp.io.folder_lock` on ``out_dir``
    (``lock=False``: the caller locks finer, as the zoo does per model) and, in the main
    thread, turns SIGTERM into ``KeyboardInterrupt``: on either, pending cells are
    cancelled and the executor's workers are ended before the interrupt goes on.

    Args:
        verify: ``(cell, result) -> None``, raising ``ValueError`` or ``OSError`` when
            what the result stands for is damaged (e.g. the weights a zoo card points
            to); called on every result found on disk.

    Raises:
        ValueError: for an unknown ``fmt`` or repeated cell names.
        posinterp.io.FolderInUse: if another run holds ``out_dir``.
        CellsFailed: after every other cell finished and was written, naming each cell
            that raised with its traceback.

    Source: DESIGN.md §4 (a cell: config + seed -> a result file, skipped when done);
    issues 17 and 23.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    names = [c.name for c in cells]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"cell names must be unique, repeated: {dup}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (folder_lock(out) if lock else contextlib.nullcontext()), _sigterm_interrupts():
        return _run_cells(cells, out, executor, fmt, progress, desc, seconds_file, log, verify,
                          lock)


def _run_cells(cells, out, executor, fmt, progress, desc, seconds_file, log, verify, locked):
    from ._progress import tqdm

    names = [c.name for c in cells]
    suffix, save, load = FORMATS[fmt]
    path = {c.name: out / f"{c.name}{suffix}" for c in cells}
    if locked:  # writes killed mid-way; no other writer runs while we hold the lock
        for folder in {p.parent for p in path.values()}:
            clean_temporaries(folder)
    todo = [c for c in cells if not _done(c, path[c.name], load, verify, log)]
    failures: dict[str, str] = {}
    if log is not None and todo and len(todo) < len(cells):
        log(f"[posinterp] resuming in {out}: {len(cells) - len(todo)} of {len(cells)} cells "
            f"are done, {len(todo)} to run")
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), disable=not progress, desc=desc)
    if todo:
        own = executor is None
        executor = executor or LocalExecutor()
        arriving = executor.submit_all(todo)
        try:
            for cell, ok, value, seconds, env in arriving:
                if ok:
                    if cell.key is not None:  # the old key goes first: never a stale pair
                        _key_path(path[cell.name]).unlink(missing_ok=True)
                    save(value, path[cell.name])
                    if cell.key is not None:
                        with atomic_path(_key_path(path[cell.name])) as tmp:
                            tmp.write_text(_key_text(cell.key))
                    if seconds_file is not None:
                        _add_seconds(out / seconds_file, cell.name, seconds)
                        _add_environment(out / ENVIRONMENT_FILE, cell.name, env)
                else:
                    failures[cell.name] = value
                if log is not None:
                    log(f"[posinterp] {cell.name}: " + ("done" if ok else "FAILED")
                        + f" ({seconds:.1f} s)")
                bar.update()
        finally:
            arriving.close()  # an interrupt here stops the executor's pending cells now
            bar.close()
            if own:
                executor.close()
    else:
        bar.close()
    results = {c.name: load(path[c.name]) for c in cells if c.name not in failures}
    if failures:
        raise CellsFailed({n: failures[n] for n in names if n in failures}, results)
    return results


def _done(cell: Cell, path: Path, load, verify, log=None) -> bool:
    """Whether ``cell``'s result is on disk, current (its stored key equals the cell's)
    and whole; a damaged one is moved aside, a stale one is recomputed."""
    if not path.exists():
        return False
    if cell.key is not None:
        stored = _key_path(path)
        if not (stored.exists() and stored.read_text() == _key_text(cell.key)):
            if log is not None:
                log(f"[posinterp] {cell.name}: stale (its key changed), recomputing")
            return False
    try:
        result = load(path)
        if verify is not None:
            verify(cell, result)
        return True
    except Exception as err:  # json, pandas and pickle each raise their own errors
        problem = f"{type(err).__name__}: {err}"
    aside = set_aside(path)
    warnings.warn(f"result {path} of cell {cell.name} is damaged ({problem}); moved it to "
                  f"{aside} and running the cell again", stacklevel=4)
    return False


class Terminated(KeyboardInterrupt):
    """SIGTERM (from a scheduler, ``timeout`` or ``kill``), handled as Ctrl-C is."""


@contextlib.contextmanager
def _sigterm_interrupts():
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere,
    or when a non-default handler is installed, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"terminated by signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: Beside the seconds file: each finished cell's :func:`cell_environment`.
ENVIRONMENT_FILE = "_environment.json"


def _add_environment(path: Path, name: str, env: dict | None) -> None:
    table = read_json_record(path) or {}
    table[name] = env
    atomic_write_json(path, table)


def cell_environments(out_dir: str | Path, names: Sequence[str]) -> dict:
    """The environments the cells ``names`` of ``out_dir`` were computed in, compactly:
    ``{"environments": [env, ...], "cells": {name: index or None}}`` (None: a cell written
    before environments were recorded, or restored from committed outputs). Raises
    nothing: an unreadable record reads as empty."""
    table = read_json_record(Path(out_dir) / ENVIRONMENT_FILE) or {}
    envs: list[dict] = []
    cells: dict[str, int | None] = {}
    for n in names:
        env = table.get(n)
        if env is None:
            cells[n] = None
            continue
        if env not in envs:
            envs.append(env)
        cells[n] = envs.index(env)
    return {"environments": envs, "cells": cells}


def _add_seconds(path: Path, name: str, seconds: float) -> None:
    # Each cell's compute time, kept across resumed runs: a report can sum them, and a
    # rerun that only reads cells back cannot pass its seconds off as the run's cost.
    table = read_json_record(path) or {}
    table[name] = round(seconds, 1)
    atomic_write_json(path, table)


def gpus_for(device) -> float:
    """What a cell running on ``device`` asks a scheduler for: 1 GPU when ``device`` names
    CUDA explicitly (``"cuda"``, ``"cuda:N"``), else 0.

    ``None``/``"auto"`` ask for none, so on a Ray cluster such a cell sees no GPU and runs
    on CPU: pass ``--device cuda`` to place cells on GPUs (docs/scale.md). Raises nothing.
    """
    return 1.0 if str(device or "").strip().lower().startswith("cuda") else 0.0
