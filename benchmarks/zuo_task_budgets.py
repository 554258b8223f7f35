"""How many steps (and which settings) the three Zuo tasks the --quick budget leaves
untrained (addition, indexing, ordering) need to reach 0.9 exact match on the `small`
preset, one thread. An exploration for issue 37 item 2: its figures choose the budgets of
the reproduction, so that choice is made after seeing these results (the page says so).

    OMP_NUM_THREADS=1 python benchmarks/zuo_task_budgets.py --out /work/runs/zuo-budgets

Resumes: each (task, setting, seed) trains into its own checkpoint folder and writes
OUT/<tag>.json (step, test_accuracy) when done; a finished tag is skipped.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from posinterp.experiments.zuo2024 import TASK_LENGTHS, THRESHOLDS
from posinterp.io import atomic_write_json, cpu_facts, versions
from posinterp.models import preset
from posinterp.tasks import TaskConfig, make_task_data
from posinterp.training import TrainConfig, train

SETTINGS = {
    # name: (TrainConfig overrides)
    "lr1e-3": {},
    "lr3e-4": {"lr": 3e-4},
}


def training_record(res, t0: float) -> dict:
    """What a budget run records: steps, whether the target was reached, wall seconds since
    ``t0``, the thread settings, CPU and library versions, and the test-accuracy curve
    ``[[step, exact match], ...]``."""
    h = res.history[res.history.metric == "test_accuracy"]
    return {"steps": res.steps, "reached": res.reached_target, "seconds": time.time() - t0,
            "threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
            "cpu": cpu_facts(), "versions": versions(),
            "curve": [[int(s), float(v)] for s, v in zip(h.step, h.value, strict=True)]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", nargs="+", default=["addition", "indexing", "ordering"],
                   help="task names, each optionally with its digit range: reversal:4-8")
    p.add_argument("--settings", nargs="+", default=["lr1e-3"])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for setting in a.settings:
        for task in a.tasks:
            for seed in a.seeds:
                name, _, digits = task.partition(":")
                tag = f"{task.replace(':', '')}-{setting}-steps{a.steps}-seed{seed}"
                if (out / f"{tag}.json").exists():
                    continue
                lo, hi = (map(int, digits.split("-")) if digits else TASK_LENGTHS[name])
                data = make_task_data(TaskConfig(name, min_digits=lo, max_digits=hi, seed=seed))
                trc = TrainConfig(max_steps=a.steps, eval_every=100, warmup_steps=50,
                                  target_accuracy=THRESHOLDS["target_accuracy"], seed=seed,
                                  **SETTINGS[setting])
                t0 = time.time()
                res = train(preset("small", seed=seed), data, trc,
                            checkpoint_dir=out / "checkpoints" / tag, progress=False)
                rec = {"task": name, "digits": [lo, hi], "setting": setting, "seed": seed,
                       **training_record(res, t0)}
                atomic_write_json(out / f"{tag}.json", rec)
                print(tag, res.steps, res.reached_target, round(rec["curve"][-1][1], 3),
                      f"{rec['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
