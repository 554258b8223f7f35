"""Exact pair counts behind the adjacency score: O(k log k) per row, compiled.

Definition: docs/concepts.md, "Adjacency probability score".

For a row v = (C_k0, ..., C_k,k-1) we count, over pairs i < j, the strict inversions
(v_i > v_j) and the ties (v_i == v_j); every other pair is concordant. Counts are
integers, so the score derived from them is exact.

How, and why this way (numba; no compiler needed at install time):

1. **Pack.** Each value becomes an order-preserving unsigned 64-bit key whose lowest
   ``bits`` bits are replaced by its column j. One numpy sort of these keys (a SIMD
   sort, several times faster than any sort we can write in numba) orders every row by
   (value, column) at once, except that values differing only in those low bits compare
   as equal and fall back to column order.
2. **Repair.** Runs of equal truncated keys are re-sorted by the full key, stably, so
   the order is exactly (value, column). Such runs are short unless values are equal,
   and equal values are already in column order.
3. **Count.** Ties are the runs of equal values. In (value, column) order, a pair is an
   inversion exactly when its columns are out of order (equal values never are), so
   the inversions are those of the column sequence, counted with a Fenwick tree.

``-0.0`` and ``0.0`` are one value (``x + 0.0`` folds the sign), as ``==`` says.

The compiled code is cached on disk (numba's cache) where a place can be written, and
that cache can never stop a run (:func:`_jit`): a cache file truncated by an interrupted
first run is recompiled over, and where no cache folder is writable (an unwritable HOME
and no ``NUMBA_CACHE_DIR``) the kernels compile in memory on each run. The cache is never
written inside the installed package (numba's default, ``__pycache__`` beside this file):
pip does not know those files, so after ``pip uninstall`` or a switch to an editable
install they keep a ``posinterp`` folder without ``__init__.py`` in site-packages, which
Python then imports as an empty namespace package in place of the real one.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import caching

__all__ = ["batch_counts", "row_counts"]

_TOP = np.uint64(0xFFFFFFFFFFFFFFFF)  # above every packed key: fills unused columns
_CHUNK_BYTES = 1 << 25  # packed keys per chunk of matrices: 32 MiB, whatever the batch
_SHORT_RUN = 16  # repair runs up to this length by insertion, longer ones by merge sort


class _SafeCache:
    """numba's on-disk cache of one function, unable to fail a call.

    A load that fails (a truncated or corrupt index or data file, e.g. from a run killed
    while writing: numba raises ``UnpicklingError`` on every later call) resets the
    function's index and reports a miss, so numba compiles and writes a fresh entry; a
    save that fails is retried once over a reset index and then given up (the compiled
    code still runs, uncached).
    """

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _reset(self) -> None:
        try:
            self._inner.flush()  # an empty index: the old entries are forgotten
        except Exception:  # noqa: BLE001 (an unwritable index: stop using the cache)
            self._inner.disable()

    def load_overload(self, sig, target_context):
        try:
            return self._inner.load_overload(sig, target_context)
        except Exception:  # noqa: BLE001 (any unreadable cache content is a miss)
            self._reset()
            return None

    def save_overload(self, sig, data):
        for attempt in range(2):
            try:
                return self._inner.save_overload(sig, data)
            except Exception:  # noqa: BLE001 (a cache that cannot be written is skipped)
                if attempt == 0:
                    self._reset()
        self._inner.disable()
        return None


class _OutOfTreeCacheImpl(caching.CompileResultCacheImpl):
    """numba's cache without its in-tree locator: ``NUMBA_CACHE_DIR`` where set, else the
    user-wide cache folder (keyed by this file's path, so two installs never share one).
    ``NUMBA_CACHE_LOCATOR_CLASSES`` still overrides the list, as numba documents."""

    _locator_classes = [c for c in caching.CompileResultCacheImpl._locator_classes
                        if c.__name__.lstrip("_") != "InTreeCacheLocator"]


class _OutOfTreeCache(caching.FunctionCache):
    _impl_class = _OutOfTreeCacheImpl


def _jit(fn=None, **options):
    """``numba.njit(nogil=True, **options)`` with an on-disk cache outside the package
    (:class:`_OutOfTreeCacheImpl`) that cannot fail a run (:class:`_SafeCache`), or none
    where numba finds no writable cache folder (it raises "cannot cache function" then).
    ``@_jit`` or ``@_jit(fastmath=...)``."""
    if fn is None:
        return lambda f: _jit(f, **options)
    disp = njit(nogil=True, **options)(fn)
    try:
        cache = _OutOfTreeCache(fn)  # what Dispatcher.enable_caching does, out of tree
    except RuntimeError as e:  # no writable user cache or NUMBA_CACHE_DIR
        if "cannot cache" not in str(e):
            raise
        return disp
    disp._cache = _SafeCache(cache)
    return disp


@_jit
def _order_key(x):
    """uint64 whose unsigned order is the float order (-0.0 folded onto 0.0); NaN excluded."""
    u = np.float64(x + 0.0).view(np.uint64)
    if u >> np.uint64(63):
        return ~u
    return u | np.uint64(0x8000000000000000)


@_jit
def _pack_row(v, k, out, bits):
    """Write the k packed keys of ``v[:k]`` to ``out[:k]`` and ``_TOP`` after; False on NaN."""
    col_mask = np.uint64((1 << bits) - 1)
    for j in range(k):
        x = v[j]
        if x != x:
            return False
        out[j] = (_order_key(x) & ~col_mask) | np.uint64(j)
    for j in range(k, out.shape[0]):
        out[j] = _TOP
    return True


@_jit
def _count_sorted_row(v, k, keys, bits, cols, full, tree):
    """(inversions, ties) of ``v[:k]`` from its packed keys sorted ascending (``keys[:k]``).

    ``cols``, ``full``: int64 / uint64 work arrays >= k; ``tree``: int64 >= k + 1.
    """
    col_mask = np.uint64((1 << bits) - 1)
    for t in range(k):
        cols[t] = np.int64(keys[t] & col_mask)
    # Repair each run of equal truncated keys: sort it by full key, stably (its columns
    # ascend), and count its ties. Values in different runs differ, so most rows never
    # look at a full key.
    tie = 0
    start = 0
    for t in range(1, k + 1):
        if t < k and (keys[t] & ~col_mask) == (keys[start] & ~col_mask):
            continue
        if t - start > 1:
            for u in range(start, t):
                full[u] = _order_key(v[cols[u]])
            if t - start <= _SHORT_RUN:
                for u in range(start + 1, t):
                    f = full[u]
                    c = cols[u]
                    w = u
                    while w > start and full[w - 1] > f:
                        full[w] = full[w - 1]
                        cols[w] = cols[w - 1]
                        w -= 1
                    full[w] = f
                    cols[w] = c
            else:
                order = np.argsort(full[start:t], kind="mergesort")  # stable
                seg_full = full[start:t].copy()
                seg_cols = cols[start:t].copy()
                for u in range(t - start):
                    full[start + u] = seg_full[order[u]]
                    cols[start + u] = seg_cols[order[u]]
            run = 1
            for u in range(start + 1, t):
                if full[u] == full[u - 1]:
                    run += 1
                else:
                    tie += run * (run - 1) // 2
                    run = 1
            tie += run * (run - 1) // 2
        start = t
    # Inversions of the column sequence: for each t, earlier entries with a larger column.
    for t in range(k + 1):
        tree[t] = 0
    inv = 0
    for t in range(k):
        c = cols[t] + 1  # Fenwick trees are 1-based
        smaller = 0
        p = c - 1
        while p > 0:
            smaller += tree[p]
            p -= p & (-p)
        inv += t - smaller
        p = c
        while p <= k:
            tree[p] += 1
            p += p & (-p)
    return inv, tie


@_jit
def _pack_batch(sim, lengths, keys, bits, inv):
    for s in range(sim.shape[0]):
        for k in range(sim.shape[1]):
            used = 2 <= k < lengths[s]
            if not _pack_row(sim[s, k], k if used else 0, keys[s, k], bits) and used:
                inv[s, k] = -1  # NaN among the used entries


@_jit
def _count_batch(sim, lengths, keys, bits, inv, tie):
    n = sim.shape[1]
    cols = np.empty(n, np.int64)
    full = np.empty(n, np.uint64)
    tree = np.empty(n + 1, np.int64)
    for s in range(sim.shape[0]):
        for k in range(2, lengths[s]):
            if inv[s, k] == 0:
                inv[s, k], tie[s, k] = _count_sorted_row(sim[s, k], k, keys[s, k], bits, cols,
                                                         full, tree)


def _col_bits(n: int) -> int:
    return max(1, (n - 1).bit_length())


def row_counts(values: np.ndarray) -> tuple[int, int]:
    """(inversions, ties) over pairs i < j of a 1-D array; (-1, -1) if it holds a NaN."""
    v = np.ascontiguousarray(values, dtype=np.float64)
    k = v.shape[0]
    bits = _col_bits(k)
    keys = np.empty(k, np.uint64)
    if not _pack_row(v, k, keys, bits):
        return -1, -1
    keys.sort()
    inv, tie = _count_sorted_row(v, k, keys, bits, np.empty(k, np.int64),
                                 np.empty(k, np.uint64), np.empty(k + 1, np.int64))
    return int(inv), int(tie)


def batch_counts(sim: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts of every row k in 2..length-1 of each ``[batch, pos, pos]`` matrix, over C[k, :k].

    Returns ``(inversions, ties)``, both ``[batch, pos]`` int64; rows that are not scored
    hold 0, rows with a NaN among their used entries hold -1.
    """
    sim = np.ascontiguousarray(sim, dtype=np.float64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    batch, n = sim.shape[:2]
    inv = np.zeros((batch, n), dtype=np.int64)
    tie = np.zeros((batch, n), dtype=np.int64)
    bits = _col_bits(n)
    step = max(1, _CHUNK_BYTES // max(1, 8 * n * n))
    for lo in range(0, batch, step):
        part = slice(lo, min(batch, lo + step))
        keys = np.empty(sim[part].shape, np.uint64)
        _pack_batch(sim[part], lengths[part], keys, bits, inv[part])
        keys.sort(axis=-1)
        _count_batch(sim[part], lengths[part], keys, bits, inv[part], tie[part])
    nan_rows = inv < 0
    tie[nan_rows] = -1
    return inv, tie
