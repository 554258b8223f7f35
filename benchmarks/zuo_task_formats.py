"""Does indexing's input format decide whether the --quick NoPE model learns it? An
exploration for issue 37 item 2: indexing stayed at ~0.28 exact match for 4,000 steps in
its posinterp format (``wherex(134504392,4)=``, benchmarks/zuo_task_budgets.py). The paper's
strings are not public (posinterp/tasks/synthetic.py), so the format is our reading, and a
format that trains would be a choice made after seeing these results.

    OMP_NUM_THREADS=1 python benchmarks/zuo_task_formats.py --out /work/runs/zuo-formats

Formats (the answer is always the 0-based first occurrence of the queried digit):

- ``posinterp``       ``wherex(134504392,4)=``  the package's format
- ``string_first``    ``134504392,4=``          no prefix
- ``query_first``     ``4,134504392=``          query before the string, no prefix
- ``query_first_prefix``  ``wherex(4,134504392)=``  query first, with the prefix

``pe`` may be set to ``absolute`` too (learned positions: is the task learnable at all in
this budget?). One JSON per (format, pe, digits, seed, steps) in OUT; a finished one is
skipped. The package's task table is swapped only inside :func:`_format` and restored.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import time
from pathlib import Path

from zuo_task_budgets import training_record  # benchmarks/ is the script's folder

import posinterp.tasks.synthetic as synthetic
from posinterp.experiments.zuo2024 import THRESHOLDS
from posinterp.io import atomic_write_json
from posinterp.models import preset
from posinterp.tasks import TaskConfig, make_task_data
from posinterp.training import TrainConfig, train


def _string(rng: random.Random, cfg) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(cfg.min_digits,
                                                                         cfg.max_digits)))


def _first(q: str, s: str) -> str:
    return str(s.index(q))


FORMATS = {
    "string_first": (lambda rng, c: (lambda s: f"{s},{rng.choice(s)}=")(_string(rng, c)),
                     lambda inp: _first(*reversed(inp[:-1].split(",")))),
    "query_first": (lambda rng, c: (lambda s: f"{rng.choice(s)},{s}=")(_string(rng, c)),
                    lambda inp: _first(*inp[:-1].split(","))),
    "query_first_prefix": (lambda rng, c: (lambda s: f"wherex({rng.choice(s)},{s})=")(
        _string(rng, c)), lambda inp: _first(*inp[7:-2].split(","))),
}


@contextlib.contextmanager
def _format(name: str):
    old = synthetic.TASKS["indexing"]
    if name != "posinterp":
        sample, answer = FORMATS[name]
        synthetic.TASKS["indexing"] = synthetic._TaskSpec(sample, answer, old.digit_range,
                                                          old.default_digits)
    try:
        yield
    finally:
        synthetic.TASKS["indexing"] = old


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--formats", nargs="+", default=["posinterp", *FORMATS],
                   choices=["posinterp", *FORMATS])
    p.add_argument("--pe", default="nope", choices=["nope", "absolute"])
    p.add_argument("--digits", default="1-5", help="lo-hi string digits")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lo, hi = map(int, a.digits.split("-"))
    for fmt in a.formats:
        for seed in a.seeds:
            tag = f"indexing-{fmt}-{a.pe}-{lo}-{hi}-steps{a.steps}-seed{seed}"
            if (out / f"{tag}.json").exists():
                continue
            with _format(fmt):
                data = make_task_data(TaskConfig("indexing", min_digits=lo, max_digits=hi,
                                                 seed=seed))
            trc = TrainConfig(max_steps=a.steps, eval_every=100, warmup_steps=50,
                              target_accuracy=THRESHOLDS["target_accuracy"], seed=seed)
            t0 = time.time()
            res = train(preset("small", seed=seed, pe=a.pe), data, trc,
                        checkpoint_dir=out / "checkpoints" / tag, progress=False)
            rec = {"task": "indexing", "format": fmt, "example": data.train.inputs[0],
                   "pe": a.pe, "digits": [lo, hi], "seed": seed, **training_record(res, t0)}
            atomic_write_json(out / f"{tag}.json", rec)
            print(tag, rec["example"], res.steps, res.reached_target,
                  round(rec["curve"][-1][1], 3), f"{rec['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
