"""Time the exact O(n^2 log n) adjacency score against the naive O(n^3) pair count.

Run alone (threads pinned; docs/models.md): ``python benchmarks/adjacency.py``.
Prints, for n = 256, 1024 and 2048, both times and their ratio, and checks that both
give the same score. Targets are ratios within one run, never absolute times.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from posinterp.analysis import adjacency_score


def naive_score(sim: np.ndarray) -> float:
    """Per-row vectorized pair count: O(k^2) per row, O(n^3) per matrix (docs/concepts.md)."""
    n = sim.shape[0]
    rows = []
    for k in range(2, n):
        v = sim[k, :k]
        less = v[:, None] < v[None, :]
        tie = v[:, None] == v[None, :]
        upper = np.triu(np.ones((k, k), dtype=bool), 1)  # pairs i < j
        rows.append((less[upper].sum() + 0.5 * tie[upper].sum()) / (k * (k - 1) / 2))
    return float(np.mean(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    print(f"{'n':>6} {'exact (s)':>10} {'naive (s)':>10} {'naive/exact':>12}  same score")
    for n in args.sizes:
        x = rng.normal(size=(n, 64))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        sim = x @ x.T
        t = time.perf_counter()
        fast = adjacency_score(torch.from_numpy(sim)).score
        t_fast = time.perf_counter() - t
        t = time.perf_counter()
        slow = naive_score(sim)
        t_slow = time.perf_counter() - t
        print(f"{n:>6} {t_fast:>10.3f} {t_slow:>10.3f} {t_slow / t_fast:>12.1f}  "
              f"{abs(fast - slow) < 1e-12}")


if __name__ == "__main__":
    main()
