"""What the hook-meaning probe costs on a loaded model (issue 39 item 7), one thread.

    OMP_NUM_THREADS=1 python benchmarks/probe_cost.py [SPEC]   # default: the shared SmolLM2

Loads SPEC, then times ``backend.hook_meaning`` from an empty verdict cache twice (the
probe runs once per loaded model; the cache is dropped between the two) and prints the
verdicts' digest, so two commits can be compared for time and for equal verdicts.
Measured 2026-12-02 on SmolLM2-135M (30 layers, TL 4.3): 14.3 s at 5290427 (one forward
pass per edit), 3.4 s at 209a8fc (edits batched), the same verdicts.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    import posinterp as pi
    from posinterp.models.backend import probe

    spec = sys.argv[1] if len(sys.argv) > 1 else str(SMOL)
    model, _ = pi.load_model(spec)
    for i in range(2):
        model.__dict__.pop(probe._VERDICTS, None)
        t0 = time.perf_counter()
        probe.hook_meaning(model, 0)
        print(f"probe {i + 1}: {time.perf_counter() - t0:.2f} s")
    verdicts = model.__dict__[probe._VERDICTS]
    digest = hashlib.sha256(repr(sorted(verdicts.items())).encode()).hexdigest()[:16]
    print(f"{len(verdicts)} layers, verdicts digest {digest}")


if __name__ == "__main__":
    main()
