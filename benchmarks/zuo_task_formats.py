"""Does a task's input layout decide whether the --quick NoPE model learns it? An
exploration for issue 37 item 2: indexing stayed at ~0.28 exact match for 4,000 steps in
its default layout (``wherex(134504392,4)=``, benchmarks/zuo_task_budgets.py) and ordering
near 0.03. The paper's strings are not public (posinterp/tasks/synthetic.py), so a layout is
our reading, and adopting one that trains is a choice made after seeing these results
(posinterp.experiments.zuo2024.CHOICES_AFTER_RESULTS).

    OMP_NUM_THREADS=1 python benchmarks/zuo_task_formats.py --out benchmarks/results/zuo_task_formats \
        --task indexing --formats query_first --digits 1-9 --steps 4000 --seeds 0 1

Layouts are ``TaskConfig.format`` (posinterp/tasks/synthetic.py): indexing
``string_first`` (the default) or ``query_first`` (``4,134504392=``); ordering
``original_first`` (the default) or ``reordered_first`` (``73125,31725=``). Every layout
of a task draws the same samples from a seed. The settings are those of the
reproduction's --quick trainings (TrainConfig of ``zuo2024._train_spec``), so a result
here is the cell it would compute. ``pe`` may be ``absolute`` too (learned positions: is
the task learnable at all in this budget?). One JSON per (task, layout, pe, digits, steps,
seed) in OUT; a finished one is skipped.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from zuo_task_budgets import training_record  # benchmarks/ is the script's folder

from posinterp.experiments.zuo2024 import THRESHOLDS
from posinterp.io import atomic_write_json
from posinterp.models import preset
from posinterp.tasks import TASKS, TaskConfig, make_task_data
from posinterp.training import TrainConfig, train


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--task", default="indexing", choices=["indexing", "ordering"])
    p.add_argument("--formats", nargs="+", help="layouts of --task (default: all)")
    p.add_argument("--pe", default="nope", choices=["nope", "absolute"])
    p.add_argument("--digits", help="lo-hi string digits (default: the task's range)")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    a = p.parse_args()
    formats = a.formats or list(TASKS[a.task].formats)
    lo, hi = (map(int, a.digits.split("-")) if a.digits else TASKS[a.task].default_digits)
    for fmt in formats:  # bad layouts fail here, before any training
        TaskConfig(a.task, min_digits=lo, max_digits=hi, format=fmt)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        for seed in a.seeds:
            tag = f"{a.task}-{fmt}-{a.pe}-{lo}-{hi}-steps{a.steps}-seed{seed}"
            if (out / f"{tag}.json").exists():
                continue
            data = make_task_data(TaskConfig(a.task, min_digits=lo, max_digits=hi, seed=seed,
                                             format=fmt))
            trc = TrainConfig(max_steps=a.steps, eval_every=100, warmup_steps=50,
                              target_accuracy=THRESHOLDS["target_accuracy"], seed=seed)
            t0 = time.time()
            res = train(preset("small", seed=seed, pe=a.pe), data, trc,
                        checkpoint_dir=out / "checkpoints" / tag, progress=False)
            rec = {"task": a.task, "format": fmt, "example": data.train.inputs[0],
                   "pe": a.pe, "digits": [lo, hi], "seed": seed, **training_record(res, t0)}
            atomic_write_json(out / f"{tag}.json", rec)
            print(tag, rec["example"], res.steps, res.reached_target,
                  round(rec["curve"][-1][1], 3), f"{rec['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
