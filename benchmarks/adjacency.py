"""Speed of the adjacency score, as ratios within one run (issue 12; docs/performance.md).

Run alone, from the repository root::

    python benchmarks/adjacency.py            # adjacency ratios, ~1 min on 2 cores
    python benchmarks/adjacency.py --demo     # also `posinterp demo --quick`, alone and loaded
    python benchmarks/adjacency.py --demo 1 2 # ... at one and at two torch threads

Prints, with the machine, the load average and the date:

1. ``adjacency_by_layer`` / the ``run_with_cache`` forward it needs (``small`` NoPE
   preset, batch 64 x 32 random tokens, one thread). Target <= 2.
2. ``adjacency_score`` on one n x n matrix against the naive per-row pair count
   (target >= 100 at n = 2048) and against computing the cosine matrix from
   ``[n, d]`` vectors (target <= 3 at n = 2048), with the cosine at several widths d,
   since its cost grows with d and the score's does not. Both scores are checked equal.
3. The score at every length: batches of short and long sequences against their
   cosine matrices.
4. With ``--demo``: wall and CPU time of ``posinterp demo --quick`` alone (target
   <= 120 s) and next to one CPU-bound process (a Python busy loop), their ratio
   (target <= 2), and the CPU time other processes used meanwhile, which says how
   alone "alone" was.

Times are the best of ``--repeat`` runs after a warm-up call (which also loads the
compiled kernel). Targets are ratios, never absolute times.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from posinterp.analysis import (
    adjacency_by_layer,
    adjacency_score,
    cosine_self_similarity,
    site_hooks,
)
from posinterp.analysis._checks import run_cached
from posinterp.models import build_model, preset


def naive_score(sim: np.ndarray) -> float:
    """Per-row vectorized pair count: O(k^2) per row, O(n^3) per matrix (DESIGN.md §2)."""
    n = sim.shape[0]
    rows = []
    for k in range(2, n):
        v = sim[k, :k]
        less = v[:, None] < v[None, :]
        tie = v[:, None] == v[None, :]
        upper = np.triu(np.ones((k, k), dtype=bool), 1)  # pairs i < j
        rows.append((less[upper].sum() + 0.5 * tie[upper].sum()) / (k * (k - 1) / 2))
    return float(np.mean(rows))


def best_times(fns, repeat: int) -> list[float]:
    """Best wall time of each function, calls interleaved so a load change hits all alike."""
    for fn in fns:
        fn()  # warm-up: compiled kernel, allocator, caches
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times, strict=True):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    import numba

    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}; "
            f"python {platform.python_version()}, torch {torch.__version__}, numpy "
            f"{np.__version__}, numba {numba.__version__}")


def load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def by_layer(repeat: int) -> None:
    model = build_model(preset("small", pe="nope", seed=0))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, model.cfg.d_vocab, (64, 32), generator=gen)
    names = {name for name, _ in site_hooks(model)}  # the hooks adjacency_by_layer scores

    @torch.no_grad()
    def forward():
        return run_cached(model, tokens, None, lambda n: n in names)

    t_fwd, t_adj = best_times([forward, lambda: adjacency_by_layer(model, tokens)], repeat)
    print(f"adjacency_by_layer, small NoPE, batch 64 x 32, {len(names)} hooks: "
          f"{t_adj * 1e3:.1f} ms; run_with_cache forward {t_fwd * 1e3:.1f} ms")
    print(f"  ratio adjacency_by_layer / forward = {t_adj / t_fwd:.2f}  (target <= 2)")


def one_matrix(n: int, dims: list[int], repeat: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = {d: torch.randn(1, n, d, generator=gen) for d in dims}
    sim = cosine_self_similarity(x[dims[0]])
    t_exact, *t_cos = best_times(
        [lambda: adjacency_score(sim)] + [lambda d=d: cosine_self_similarity(x[d]) for d in dims],
        repeat)
    fast = adjacency_score(sim).score
    t = time.perf_counter()
    slow = naive_score(sim[0].numpy())
    t_naive = time.perf_counter() - t
    print(f"adjacency_score, one {n} x {n} matrix: {t_exact * 1e3:.1f} ms; naive per-row "
          f"pair count {t_naive:.2f} s; same score: {abs(fast - slow) < 1e-12}")
    print(f"  ratio naive / adjacency_score = {t_naive / t_exact:.0f}  (target >= 100)")
    for d, t in zip(dims, t_cos, strict=True):
        print(f"  ratio adjacency_score / cosine matrix from [{n}, {d}] "
              f"({t * 1e3:.1f} ms) = {t_exact / t:.2f}  (target <= 3)")


def every_length(lengths: list[int], d: int, repeat: int, seed: int) -> None:
    print(f"adjacency_score vs its cosine matrices, d = {d}, at every length:")
    print(f"  {'n':>5} {'batch':>6} {'score (ms)':>11} {'cosine (ms)':>12} {'ratio':>7}")
    gen = torch.Generator().manual_seed(seed)
    for n in lengths:
        batch = max(1, min(64, 2**16 // n))  # enough sequences to time, bounded memory
        x = torch.randn(batch, n, d, generator=gen)
        sim = cosine_self_similarity(x)
        t_cos, t_adj = best_times([lambda x=x: cosine_self_similarity(x),
                                    lambda sim=sim: adjacency_score(sim)], repeat)
        print(f"  {n:>5} {batch:>6} {t_adj * 1e3:>11.2f} {t_cos * 1e3:>12.2f} "
              f"{t_adj / t_cos:>7.2f}")


def _busy_jiffies() -> int | None:
    """CPU time spent by every process on the machine so far, in clock ticks (Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return user + nice + system + irq + softirq + steal


def timed_demo(out: Path, threads: int) -> tuple[float, float, float | None]:
    """Wall and CPU (user + system) seconds of ``posinterp demo --quick`` in a subprocess,
    and the CPU seconds every other process on the machine used meanwhile (the load)."""
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine_before = _busy_jiffies()
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "posinterp.cli", "demo", "--quick", "--no-progress",
                    "--threads", str(threads), "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    machine_after = _busy_jiffies()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    others = (None if machine_before is None else
              (machine_after - machine_before) / os.sysconf("SC_CLK_TCK") - cpu)
    return wall, cpu, others


def demo(threads: list[int]) -> None:
    def show(label, wall, cpu, others):
        load = "" if others is None else f", other processes {others:.0f} CPU-s"
        print(f"  {label}: wall {wall:.0f} s, demo CPU {cpu:.0f} s{load}")

    with tempfile.TemporaryDirectory() as tmp:
        for n in threads:
            print(f"posinterp demo --quick --threads {n}:")
            alone = timed_demo(Path(tmp) / "alone", n)
            show("alone", *alone)
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                loaded = timed_demo(Path(tmp) / "loaded", n)
            finally:
                busy.kill()
                busy.wait()
            show("next to one busy-loop process (counted in 'other')", *loaded)
            print(f"  ratio loaded / alone = {loaded[0] / alone[0]:.2f}  (target <= 2; "
                  "target alone <= 120 s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2048, help="size of the one-matrix comparison")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 192, 768],
                   help="widths d of the vectors behind the cosine matrix")
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 128, 512, 2048])
    p.add_argument("--threads", type=int, default=1, help="torch threads (the targets are at 1)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo", type=int, nargs="*", default=None, metavar="THREADS",
                   help="also time `posinterp demo --quick` alone and next to one busy "
                   "process, for each thread count given (default 1; ~6 min per count)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}; {machine()}")
    print(f"# torch threads {args.threads}; {load()}")
    by_layer(args.repeat)
    one_matrix(args.n, args.dims, args.repeat, args.seed)
    every_length(args.lengths, 192, args.repeat, args.seed)
    if args.demo is not None:
        demo(args.demo or [1])


if __name__ == "__main__":
    main()
