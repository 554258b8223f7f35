"""What `posinterp inspect` costs on a short input, in a new process (issue 39, item 7).

Run from the repository root, alone, with the shared SmolLM2 file::

    OMP_NUM_THREADS=1 python benchmarks/inspect_short.py [PATH.gguf]

On two paragraphs of text (the first two of README.md, at most 64 tokens each) it times,
in two fresh processes that share one new, empty on-disk cache (``POSINTERP_CACHE``):

1. the first ``inspect_heads(ablate=False)`` of the process / one ``run_with_cache`` of
   the same batch (after a warm-up ``run_with_cache``). In the first process this call
   draws the seeded random-head nulls (2,500 heads for the percentiles, 200 for the |λ|
   band) and stores them; in the second it reads them back (``posinterp._disk_cache``);
2. a second ``inspect_heads`` call in the same process / the same ``run_with_cache``.

Both processes compute the same inspection: the script checks that their tables are
equal, bit for bit. Ratios are measured within one process; the machine's speed drifts,
so each process times its two sides in turn.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _paragraphs(n: int = 2) -> list[str]:
    text = (ROOT / "README.md").read_text()
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 80
             and not p.lstrip().startswith(("#", "```", "|"))]
    return paras[:n]


def _one_process(path: str) -> dict:
    import hashlib

    import torch

    from posinterp.dashboard.inspect import inspect_heads
    from posinterp.models import load_model
    from posinterp.models.text import tokenize_texts

    torch.set_num_threads(1)
    model, _ = load_model(path, device="cpu")
    tokens, mask = tokenize_texts(model, _paragraphs(), max_len=64)
    with torch.no_grad():
        model.run_with_cache(tokens, attention_mask=mask)  # warm-up
        t = time.perf_counter()
        model.run_with_cache(tokens, attention_mask=mask)
        fwd = time.perf_counter() - t
    t = time.perf_counter()
    first = inspect_heads(model, tokens, attention_mask=mask)
    t_first = time.perf_counter() - t
    with torch.no_grad():
        t = time.perf_counter()
        model.run_with_cache(tokens, attention_mask=mask)
        fwd2 = time.perf_counter() - t
    t = time.perf_counter()
    inspect_heads(model, tokens, attention_mask=mask)
    t_second = time.perf_counter() - t
    table = first.table.to_csv(index=False).encode()
    return {"tokens": list(tokens.shape), "real_tokens": int(mask.sum()), "fwd": fwd,
            "fwd2": fwd2, "first": t_first, "second": t_second,
            "table_sha256": hashlib.sha256(table).hexdigest(), "rows": len(first.table)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", nargs="?", default=str(SMOL))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_one_process(args.path)))
        return 0
    import torch

    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; "
          f"torch {torch.__version__}; torch threads 1; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="posinterp-cache-") as cache:
        env = {**os.environ, "POSINTERP_CACHE": cache, "OMP_NUM_THREADS": "1"}
        runs = []
        for label in ("first process (empty disk cache: the nulls are drawn and stored)",
                      "second process (the nulls read from the disk cache)"):
            out = subprocess.run([sys.executable, __file__, args.path, "--child"], env=env,
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            runs.append(r)
            print(f"{label}: batch {r['tokens']} ({r['real_tokens']} real tokens); "
                  f"run_with_cache {r['fwd']:.2f} s; first inspect_heads {r['first']:.2f} s, "
                  f"ratio {r['first'] / r['fwd']:.1f}; second call {r['second']:.2f} s, ratio "
                  f"{r['second'] / r['fwd2']:.1f} (run_with_cache timed next to it {r['fwd2']:.2f} s)")
        same = runs[0]["table_sha256"] == runs[1]["table_sha256"]
        print(f"tables of the two processes ({runs[0]['rows']} rows): "
              f"{'equal, bit for bit' if same else 'DIFFERENT'}")
    print(f"# load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
