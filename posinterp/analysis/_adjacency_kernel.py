"""Compiled pair counts behind the adjacency score (DESIGN.md §2): exact, O(k log k) per row.

For a row v = (C_k0, ..., C_k,k-1) we count, over pairs i < j, the strict inversions
(v_i > v_j) and the ties (v_i == v_j); every other pair is concordant. Inversions come
from a merge sort (insertion sort on short runs, where it beats merging), ties from the
runs of equal values in the sorted row. Counts are integers, so the score is exact.

numba compiles this once per machine (cached on disk); a per-row Python call into
scipy costs far more than the comparisons themselves at the short lengths that are the
common case, and a vectorized torch merge needs ~10 full passes per level.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["batch_counts", "row_counts"]

_RUN = 16  # rows up to this length are one insertion sort: O(k^2) but branch-cheap


@njit(cache=True, nogil=True)
def _row_counts(v, a, b):
    """(inversions, ties) of ``v``; (-1, -1) if it holds a NaN. ``a``, ``b``: buffers >= len(v)."""
    k = v.shape[0]
    for i in range(k):
        x = v[i]
        if x != x:
            return -1, -1
        a[i] = x
    inv = 0
    for start in range(0, k, _RUN):
        stop = min(start + _RUN, k)
        for i in range(start + 1, stop):
            x = a[i]
            j = i
            while j > start and a[j - 1] > x:  # strict: equal values never count as inverted
                a[j] = a[j - 1]
                j -= 1
            a[j] = x
            inv += i - j
    src, dst = a, b
    width = _RUN
    while width < k:
        for lo in range(0, k, 2 * width):
            mid = min(lo + width, k)
            hi = min(lo + 2 * width, k)
            i, j, o = lo, mid, lo
            while i < mid and j < hi:
                # Branch-free (selects, not jumps): on random rows a branch mispredicts
                # half the time. Taking the right element means every left element still
                # waiting is strictly greater; equal values take the left one (a tie).
                left = src[i]
                right = src[j]
                take = right < left
                dst[o] = right if take else left
                inv += (mid - i) if take else 0
                j += take
                i += 1 - take
                o += 1
            while i < mid:
                dst[o] = src[i]
                i += 1
                o += 1
            while j < hi:
                dst[o] = src[j]
                j += 1
                o += 1
        src, dst = dst, src
        width *= 2
    tie = 0
    run = 1
    for i in range(1, k):
        if src[i] == src[i - 1]:
            run += 1
        else:
            tie += run * (run - 1) // 2
            run = 1
    tie += run * (run - 1) // 2
    return inv, tie


@njit(cache=True, nogil=True)
def _batch_counts(sim, lengths, inv, tie):
    n = sim.shape[1]
    a = np.empty(n)
    b = np.empty(n)
    for s in range(sim.shape[0]):
        for k in range(2, lengths[s]):
            inv[s, k], tie[s, k] = _row_counts(sim[s, k, :k], a, b)


def row_counts(values: np.ndarray) -> tuple[int, int]:
    """(inversions, ties) over pairs i < j of a 1-D float64 array; (-1, -1) if it has a NaN."""
    v = np.ascontiguousarray(values, dtype=np.float64)
    inv, tie = _row_counts(v, np.empty_like(v), np.empty_like(v))
    return int(inv), int(tie)


def batch_counts(sim: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts of every row k in 2..length-1 of each ``[batch, pos, pos]`` matrix, over C[k, :k].

    Returns ``(inversions, ties)``, both ``[batch, pos]`` int64; rows that are not scored
    hold 0, rows with a NaN among their used entries hold -1.
    """
    sim = np.ascontiguousarray(sim, dtype=np.float64)
    inv = np.zeros(sim.shape[:2], dtype=np.int64)
    tie = np.zeros(sim.shape[:2], dtype=np.int64)
    _batch_counts(sim, np.ascontiguousarray(lengths, dtype=np.int64), inv, tie)
    return inv, tie
