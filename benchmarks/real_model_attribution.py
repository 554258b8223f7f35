"""Re-measure only run_with_cache and inspect's attribution ablations on SmolLM2-135M
(docs/performance.md), timing the forward pass before and after, since a shared machine's
load moves during the step. Run alone, from the repository root:

    OMP_NUM_THREADS=1 python benchmarks/real_model_attribution.py
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model as rm  # noqa: E402


def _load() -> str:
    return str(tuple(round(x, 2) for x in os.getloadavg()))


def main() -> int:
    from posinterp.dashboard.inspect import _ablation_rows
    from posinterp.interventions import head_ablation as ha
    from posinterp.models import load_model

    torch.set_num_threads(1)
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}; load average {_load()}", flush=True)
    model, _ = load_model(str(rm.SMOL), device="cpu")
    tokens = rm._text_tokens(model.tokenizer, 8, 128)
    with torch.no_grad():
        model.run_with_cache(tokens)
        fwd = rm._best(lambda: model.run_with_cache(tokens), 2)
    print(f"run_with_cache {fwd:.2f} s", flush=True)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    every = [(layer, h, k) for layer in range(n_layers) for h in range(n_heads) for k in ha.HEAD_ABLATIONS]
    t = time.perf_counter()
    ha._projectors(model, every)
    print(f"projectors for 810 channel ablations {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    _ablation_rows(model, tokens, None, list(range(n_layers)), "attribution", 20)
    t_attr = time.perf_counter() - t
    print(f"ablations, attribution patching (approximate) for all 1080 + exact reruns of the 20 largest: "
          f"{t_attr:.1f} s; ratio to run_with_cache = {t_attr / fwd:.1f}  (target <= 30)", flush=True)
    with torch.no_grad():
        fwd2 = rm._best(lambda: model.run_with_cache(tokens), 1)
    print(f"run_with_cache again {fwd2:.2f} s; ratio to it {t_attr / fwd2:.1f}; load average {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
