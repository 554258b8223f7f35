"""Induction heads of SmolLM2-135M on the inspect dashboard's scores (issue 39, item 5).

Run alone, from the repository root, with the gguf extra and the shared model file::

    OMP_NUM_THREADS=1 python benchmarks/induction_smollm2.py [PATH.gguf] [--repeat 3]

Prints:

1. the top 8 heads by ``induction_score_input`` on two paragraphs, each a natural English
   passage followed by its repetition (the issue's heads: L18H6, L17H5, L20H6, L17H4),
   and by ``induction_score`` (repeated random tokens, the dashboard's standard score);
2. the run time of ``inspect_heads`` on that input with the induction score and without
   it (``induction_tokens=0``), the best of ``--repeat`` calls each after a warm-up, and
   one ``run_with_cache`` of the same batch for scale.

Weights are the dequantized Q4_1 file, an approximation of the released float weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ISSUE_HEADS = ["L18H6", "L17H5", "L20H6", "L17H4"]
PASSAGES = [
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp, "
    "and the ships that passed the rocky point at night relied on its steady beam.",
    "Maria planted tomatoes, beans and sunflowers in the small garden behind her house, "
    "watering them each morning before she walked to the bakery where she worked.",
]


def text() -> str:
    """Two paragraphs, each a passage followed by its repetition (one sequence each)."""
    return "\n\n".join(f"{p} {p}" for p in PASSAGES)


def top(wide, col: str, k: int = 8) -> list[tuple[str, float]]:
    best = wide.sort_values(col, ascending=False).head(k)
    return [(f"L{int(r.layer)}H{int(r['head'])}", float(r[col])) for _, r in best.iterrows()]


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default=str(SMOL))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import posinterp as pi
    from posinterp.dashboard.inspect import inspect_heads
    from posinterp.experiments.inspect import text_batch
    from posinterp.models.backend import run_cached

    t0 = time.perf_counter()
    model, _ = pi.load_model(args.path, device="cpu")
    print(f"loaded {args.path} in {time.perf_counter() - t0:.1f} s")
    tokens, mask, _ = text_batch(model, text())
    print(f"input: {tokens.shape[0]} paragraphs (passage + repetition), lengths {mask.sum(-1).tolist()}")
    res = inspect_heads(model, tokens, mask, n_null=200)
    wide = res.head_view()
    for col in ("induction_score_input", "induction_score"):
        print(f"\ntop 8 heads by {col}:")
        for name, v in top(wide, col):
            print(f"  {name:7s} {v:.3f}" + ("   <- issue 39" if name in ISSUE_HEADS else ""))
    ranked = [n for n, _ in top(wide, "induction_score_input", 4)]
    print(f"\nissue's 4 heads are the top 4 by induction_score_input: {set(ranked) == set(ISSUE_HEADS)}")

    with_ind = _best(lambda: inspect_heads(model, tokens, mask, n_null=200), args.repeat)
    without = _best(lambda: inspect_heads(model, tokens, mask, n_null=200, induction_tokens=0),
                    args.repeat)
    fwd = _best(lambda: run_cached(model, tokens, mask, lambda n: n.endswith("hook_pattern")),
                args.repeat)
    print(f"\ninspect_heads: {with_ind:.2f} s with the induction score, {without:.2f} s without "
          f"({with_ind / without:.2f}x); one run_with_cache {fwd:.2f} s "
          f"(best of {args.repeat}, one thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
