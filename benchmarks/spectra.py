"""Time QK spectra of every head of a 32-layer x 32-head model (d_model 4096, d_head 128).

Such a model does not fit in 24 GiB (W_Q and W_K alone are 4.3 GB), so random W_Q/W_K
are generated one layer at a time, outside the timing. The small-form route
(eigenvalues of the d_head x d_head B = W_K^T W_Q) is timed for all 1,024 heads; the
dense route (eigenvalues of the 4096 x 4096 M = W_Q W_K^T) for ``--dense-heads`` heads,
and the per-head ratio is printed. Both routes' top eigenvalues are compared.

Run alone, threads pinned (docs/models.md): ``python benchmarks/spectra.py``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from posinterp.analysis.spectral import eigenvalues


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-head", type=int, default=128)
    p.add_argument("--dense-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    eigenvalues(torch.randn(2, 4, 2), torch.randn(2, 4, 2))  # warm-up: imports, allocator
    small_total = 0.0
    keep = None
    for layer in range(args.layers):
        shape = (args.heads, args.d_model, args.d_head)
        W_Q = torch.randn(shape, generator=gen) * 0.02  # float32, as models store them
        W_K = torch.randn(shape, generator=gen) * 0.02
        t = time.perf_counter()
        lam = eigenvalues(W_Q, W_K)
        small_total += time.perf_counter() - t
        if layer == 0:
            keep = (W_Q[: args.dense_heads].double(), W_K[: args.dense_heads].double(), lam)
        del W_Q, W_K
    n_heads = args.layers * args.heads
    print(f"small form: {n_heads} heads in {small_total:.2f} s "
          f"({1e3 * small_total / n_heads:.1f} ms/head)")
    W_Q, W_K, lam = keep
    t = time.perf_counter()
    for h in range(args.dense_heads):
        dense = np.linalg.eigvals((W_Q[h] @ W_K[h].T).numpy())
        top = dense[np.argsort(-np.abs(dense))][: args.d_head]
        err = np.abs(np.sort_complex(top) - np.sort_complex(lam[h].numpy())).max()
        print(f"  dense head {h}: max |λ_dense - λ_small| over the top {args.d_head} = {err:.2e}")
    dense_per_head = (time.perf_counter() - t) / args.dense_heads
    print(f"dense form: {dense_per_head:.1f} s/head; ratio dense/small per head = "
          f"{dense_per_head / (small_total / n_heads):.0f}x; all heads dense would take "
          f"~{dense_per_head * n_heads / 3600:.1f} h")


if __name__ == "__main__":
    main()
