"""Estimated device-hours of each full reproduction (docs/scale.md, "GPU-hours per full
reproduction").

Run alone, from the repository root::

    python benchmarks/gpu_hours.py --device cuda --out gpu-hours      # GPU, ~2-4 min
    OMP_NUM_THREADS=1 python benchmarks/gpu_hours.py --quick --device cpu --out cpu-hours

An **estimate**, not a run: for every kind of training run or analysis cell a full
reproduction does, this measures the seconds per optimizer step (or per call) of that
run's own code (``posinterp.train.train``, the qk-constraints cell, the zoo's ``fit``) on
``--device``, in float32 and with bf16 autocast (CUDA only), and multiplies by how many
steps/calls the full run does, read from the code's configs (``ReproConfig.full()``,
``depth_width_configs``, ``ConstraintGrid()``, ``ZooConfig()``), never retyped. Only the
zoo's seed count (3) comes from docs/reproductions/fingerprints.md, which is where the
full zoo is defined.

Per-step time is *marginal*: the wall time of a run of ``n2`` steps minus that of ``n1``
steps, over ``n2 - n1``, after a warm-up run, so model building, CUDA start-up and the
evaluation at the last step cancel. Each step already synchronizes (the loop reads the
loss with ``.item()``); every timed call is also bracketed by ``torch.cuda.synchronize``.

Step counts are each run's ``max_steps``: an **upper bound** where training stops early
at its target accuracy (zuo2024 at 90% exact match, qk-constraints at the grid's target).
Evaluations are counted as the loop runs them (every ``eval_every`` steps, plus the final
ones). ``--quick`` measures fewer steps and scales a few rows from measured ones (deeper
models by layer count, more sequences by count); those rows say "scaled" and from what.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posinterp.analysis import adjacency_by_layer, probe_positions  # noqa: E402
from posinterp.analysis.probing import ProbeConfig  # noqa: E402
from posinterp.devices import resolve_device  # noqa: E402
from posinterp.experiments import qk_constraints as qk  # noqa: E402
from posinterp.experiments import zuo2024  # noqa: E402
from posinterp.experiments.zoo import ZooConfig  # noqa: E402
from posinterp.models import build_model, preset  # noqa: E402
from posinterp.tasks.corpus import stdlib_corpus  # noqa: E402
from posinterp.train import TrainConfig, evaluate, fit, train  # noqa: E402

ZOO_SEEDS = 3  # docs/reproductions/fingerprints.md: `posinterp zoo train --seeds 3` (12 models)
N_BENCH_SAMPLES = 2_000  # task samples built for timing; batch shapes do not depend on it


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Wall seconds of ``fn()``, synchronized before and after on CUDA."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def marginal(run, n1: int, n2: int, device: torch.device) -> float:
    """Seconds per step: (time of ``run(n2)`` - time of ``run(n1)``) / (n2 - n1), after a
    warm-up ``run(n1)``; the smaller of two tries of each, to damp noise."""
    run(n1)  # warm-up: kernels, allocator, numba, caches
    t1 = min(timed(lambda: run(n1), device) for _ in range(2))
    t2 = min(timed(lambda: run(n2), device) for _ in range(2))
    return max(t2 - t1, 0.0) / (n2 - n1)


class Rows:
    def __init__(self, device: torch.device):
        self.device, self.rows = device, []

    def add(self, repro, component, precision, per_unit, unit, units, how):
        self.rows.append(dict(reproduction=repro, component=component, device=str(self.device),
                              precision=precision, seconds_per_unit=per_unit, unit=unit,
                              units=units, hours=per_unit * units / 3600, how=how))
        print(f"  {repro:15s} {component:44s} {precision:5s} {per_unit:9.4f} s/{unit:5s} "
              f"x {units:>9,} = {per_unit * units / 3600:8.3f} h  ({how})", flush=True)


def _precisions(device: torch.device) -> list:
    return [None, "bf16"] if device.type == "cuda" else [None]


def _pname(mp) -> str:
    return mp or "fp32"


# --- zuo2024 --full --------------------------------------------------------------------


def _train_run(mc, data, mp, device):
    """``run(n)``: ``posinterp.train.train`` for n steps (no early stop, no checkpoints)."""
    def run(n):
        train(mc, data, TrainConfig(max_steps=n, eval_every=10**9, n_eval=16, warmup_steps=50,
                                    target_accuracy=None, checkpoint_seconds=None, seed=0),
              progress=False, device=device, mixed_precision=mp)
    return run


def bench_zuo2024(rows: Rows, quick: bool) -> None:
    device, R = rows.device, "zuo2024 --full"
    full = zuo2024.ReproConfig.full()
    cfg = dataclasses.replace(full, n_samples=N_BENCH_SAMPLES)
    steps, eval_every, n_eval = full.train_steps, 100, TrainConfig().n_eval  # as _train_cell
    n1, n2 = (1, 3) if quick else (10, 40)
    tasks, seeds = list(full.task_lengths), len(full.train_seeds)
    data = {task: zuo2024._task_data(cfg, task, 0) for task in (["reversal"] if quick else tasks)}
    for mp in _precisions(device):
        step_t = {task: marginal(_train_run(preset(full.model_preset, seed=0), d, mp, device),
                                 n1, n2, device) for task, d in data.items()}
        for task in tasks:
            how = ("measured" if task in step_t else
                   "scaled: reversal's step time (its strings are the longest), --quick")
            rows.add(R, f"train {task} 6L x {seeds} seeds", _pname(mp),
                     step_t.get(task, step_t["reversal"]), "step", steps * seeds, how)
        for depth in full.train_depths:  # reversal trained at each depth
            if quick:
                t, how = step_t["reversal"] * depth / 6, f"scaled: 6L reversal x {depth}/6 layers, --quick"
            else:
                mc = preset(full.model_preset, seed=0, n_layers=depth)
                t, how = marginal(_train_run(mc, data["reversal"], mp, device), n1, n2, device), "measured"
            rows.add(R, f"train reversal at depth {depth}L x {seeds} seeds", _pname(mp), t, "step",
                     steps * seeds, how)
    # Evaluations: every eval_every steps on n_eval test samples, and a final one on the
    # whole test split, per training run (float32: evaluation runs outside autocast).
    model = build_model(preset(full.model_preset, seed=0), device=device)
    n_ev = 200 if quick else n_eval
    evaluate(model, data["reversal"].test, 16)  # warm-up
    ev = timed(lambda: evaluate(model, data["reversal"].test, n_ev), device) * n_eval / n_ev
    n_runs = (len(tasks) + len(full.train_depths)) * seeds
    per_run = ev * (steps // eval_every + full.n_samples / n_eval)
    rows.add(R, f"evaluations, 6L reversal ({n_runs} runs)", "fp32", per_run, "run", n_runs,
             f"measured one eval on {n_ev} samples, x evals per run")
    # Adjacency calls: init seeds, the mean x std grid, before/after each training run.
    rand, _ = zuo2024._random_tokens(full.n_sequences, full.n_tokens, seed=1234)
    n_seq = 64 if quick else full.n_sequences
    adjacency_by_layer(model, rand[:8])  # warm-up (numba compile)
    t_adj = timed(lambda: adjacency_by_layer(model, rand[:n_seq]), device) * full.n_sequences / n_seq
    n_calls = (len(full.init_seeds) + len(full.init_means) * len(full.init_stds) * len(full.grid_seeds)
               + 2 * n_runs)
    rows.add(R, f"adjacency, 6L, {full.n_sequences} seqs ({n_calls} calls)", "fp32", t_adj, "call",
             n_calls, "measured" + (f" on {n_seq} seqs, scaled by count" if quick else ""))
    # Depth x width grid at init: the largest cell's time for every cell (an upper bound).
    grid = zuo2024.depth_width_configs(full)
    depth, width, _, mc = max(grid, key=lambda g: g[0] * g[1] ** 2)
    if quick:
        t_dw = t_adj * (16 / full.n_sequences) * depth / 6 * width / 384
        how = f"scaled from the 6L x 384 call by layers x width to {depth}L x {width}, --quick"
    else:
        big = build_model(mc, device=device)
        t_dw = timed(lambda: adjacency_by_layer(big, rand[:16]), device)
        how = f"measured on the largest cell ({depth}L x {width}), used for all (upper bound)"
        del big
    rows.add(R, f"depth x width init grid ({len(grid)} cells)", "fp32", t_dw, "cell", len(grid), how)
    # Probe cells: one measured, times their number.
    toks, mask = zuo2024._random_tokens(full.n_probe_sequences, full.n_tokens, seed=5000,
                                        variable=True)
    t_probe = timed(lambda: probe_positions(model, toks, mask, features=zuo2024.PROBE_FEATURES,
                                            seeds=(0,), config=ProbeConfig()), device)
    n_probe = 3 * seeds  # (random, init), (random, trained), (reversal strings, trained)
    rows.add(R, f"probe cells ({n_probe})", "fp32", t_probe, "cell", n_probe, "measured")


# --- experiment qk-constraints (full grid) --------------------------------------------------


def bench_qk(rows: Rows, quick: bool) -> None:
    device = rows.device
    grid = qk.ConstraintGrid()
    n1, n2 = (10, 30) if quick else (20, 80)
    measured_pes = grid.pes[-1:] if quick else grid.pes  # rotary only with --quick
    step_t = {}
    for pe in measured_pes:
        for constraint in grid.constraints:
            def run(n, pe=pe, constraint=constraint):
                # target 1.0: no early stop within a few steps; evals every eval_every
                qk._train_cell(dataclasses.replace(grid, max_steps=n, target=1.0), pe,
                               constraint, 0, device)
            step_t[pe, constraint] = marginal(run, n1, n2, device)
    for pe in grid.pes:
        for constraint in grid.constraints:
            if (pe, constraint) in step_t:
                t, how = step_t[pe, constraint], "measured (the cell's own loop, evals included)"
            else:
                t = step_t[measured_pes[0], constraint]
                how = f"scaled: {measured_pes[0]}'s step time, --quick"
            rows.add("qk-constraints", f"train {pe} {constraint} x {grid.seeds} seeds", "fp32", t, "step",
                     grid.max_steps * grid.seeds, how)


# --- zoo (fingerprints page: --seeds 3) -------------------------------------------------------


def _zoo_run(zc, mc, tc, corpus, mp, device):
    """``run(n)``: the zoo's training loop (``fit`` as ``train_zoo`` calls it) for n steps."""
    n_train = len(corpus.train) - zc.n_ctx

    def next_batch(gen):
        starts = torch.randint(n_train, (zc.batch_size,), generator=gen)
        return corpus.windows("train", starts, zc.n_ctx)

    def run(n):
        fit(build_model(mc, device=device), next_batch, lambda m, toks: m(toks, return_type="loss"),
            lambda m: {}, dataclasses.replace(tc, max_steps=n, eval_every=10**9), {},
            progress=False, mixed_precision=mp)
    return run


def bench_zoo(rows: Rows, quick: bool) -> None:
    from posinterp.experiments.zoo import _val_loss

    device, R = rows.device, f"zoo --seeds {ZOO_SEEDS}"
    zc = ZooConfig()
    corpus = stdlib_corpus()
    n1, n2 = (1, 3) if quick else (10, 40)
    measured = ("rotary",) if quick else zc.schemes
    for mp in _precisions(device):
        step_t = {pe: marginal(_zoo_run(zc, zc.model_config(pe, 0), zc.train_config(0), corpus, mp,
                                        device), n1, n2, device) for pe in measured}
        for pe in zc.schemes:
            how = "measured" if pe in step_t else "scaled: rotary's step time, --quick"
            rows.add(R, f"train {pe} x {ZOO_SEEDS} seeds", _pname(mp), step_t.get(pe, step_t["rotary"]),
                     "step", zc.max_steps * ZOO_SEEDS, how)
    model = build_model(zc.model_config("rotary", 0), device=device)
    _val_loss(model, corpus, zc)  # warm-up
    t_val = timed(lambda: _val_loss(model, corpus, zc), device)
    n_val = len(zc.schemes) * ZOO_SEEDS * (zc.max_steps // zc.eval_every + 1)
    rows.add(R, f"validation losses ({n_val})", "fp32", t_val, "call", n_val, "measured")


def _summary(df: pd.DataFrame) -> pd.DataFrame:
    """Hours per reproduction and training precision: that precision's training rows plus
    every other row (evaluations and analyses run in float32 either way)."""
    out = []
    for repro, g in df.groupby("reproduction", sort=False):
        training = g.component.str.startswith("train")
        for p in dict.fromkeys(g.precision[training]):
            part = g[(training & (g.precision == p)) | ~training]
            out.append(dict(reproduction=repro, training_precision=p, hours=part.hours.sum()))
    return pd.DataFrame(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="auto (default: cuda if available), cpu, cuda")
    ap.add_argument("--quick", action="store_true", help="fewer steps and scaled rows (< 2 min on CPU)")
    ap.add_argument("--only", nargs="+", choices=["zuo2024", "qk", "zoo"], default=None)
    ap.add_argument("--out", default=None, help="folder for gpu_hours.csv and gpu_hours.md")
    args = ap.parse_args(argv)
    device = resolve_device(args.device, "--device")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    header = (f"# Estimated {'GPU' if device.type == 'cuda' else 'CPU'}-hours per full reproduction\n\n"
              f"Device: {device} ({name}); torch {torch.__version__}; {torch.get_num_threads()} torch "
              f"threads; {os.cpu_count()} CPUs; "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
              f"{'--quick' if args.quick else 'full measurement'}.\n\n"
              "estimate = measured seconds per step (or per call) x the number the full run does "
              "(max_steps: an upper bound where training stops at its target). Not a run.\n")
    print(header, flush=True)
    t0 = time.time()
    rows = Rows(device)
    for key, fn in (("zuo2024", bench_zuo2024), ("qk", bench_qk), ("zoo", bench_zoo)):
        if args.only is None or key in args.only:
            fn(rows, args.quick)
    df = pd.DataFrame(rows.rows)
    summary = _summary(df)
    print("\nTotals (hours on this device, one process at a time; evaluations and analyses are "
          "float32 and count under every training precision):")
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"\nbenchmark wall time {time.time() - t0:.0f} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        df.to_csv(out / "gpu_hours.csv", index=False)
        md = [header, "| reproduction | component | precision | s per unit | unit | units | hours | how |",
              "|---|---|---|---:|---|---:|---:|---|"]
        md += [f"| {r.reproduction} | {r.component} | {r.precision} | {r.seconds_per_unit:.4f} | "
               f"{r.unit} | {r.units:,} | {r.hours:.3f} | {r.how} |" for r in df.itertuples()]
        md += ["", "| reproduction | training precision | hours |", "|---|---|---:|"]
        md += [f"| {r.reproduction} | {r.training_precision} | {r.hours:.2f} |"
               for r in summary.itertuples()]
        (out / "gpu_hours.md").write_text("\n".join(md) + "\n")
        print(f"wrote {out / 'gpu_hours.csv'} and {out / 'gpu_hours.md'}")
    return 0 if all(math.isfinite(h) for h in df.hours) else 1


if __name__ == "__main__":
    sys.exit(main())
