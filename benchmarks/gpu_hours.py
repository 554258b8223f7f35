"""Estimated device-hours of each full reproduction (docs/scale.md, "GPU-hours per full
reproduction").

Run alone, from the repository root::

    python benchmarks/gpu_hours.py --device cuda --out gpu-hours      # GPU, ~2-4 min
    OMP_NUM_THREADS=1 python benchmarks/gpu_hours.py --quick --device cpu --out cpu-hours
    OMP_NUM_THREADS=1 python benchmarks/gpu_hours.py --project h200 --out gpu-proj  # no GPU, ~4 min

An **estimate**, not a run: for every kind of training run or analysis cell a full
reproduction does, this measures the seconds per optimizer step (or per call) of that
run's own code (``posinterp.training.train``, the qk-constraints cell, the zoo's ``fit``) on
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

``--project h200`` measures nothing on a GPU: it **projects** each training/evaluation row's
seconds on an H200 as a bracket [low, high] from the step's matrix-product FLOPs (counted
from the model config, :func:`flops_forward`) over the chip's rate at an assumed
utilization, and the host floor (the same code path timed on CPU with 8-wide tensors,
plus a launch cost per kernel counted with torch.profiler): see :func:`bracket` and
:func:`projection_header` for the assumptions, which the output states. Analysis rows
that run partly on CPU keep this CPU's ``--quick`` time. Output:
``gpu_hours_projection.{csv,md}``. docs/scale.md, "Projection for an NVIDIA H200".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
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
from posinterp.training import TrainConfig, evaluate, fit, train  # noqa: E402

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


# --- projection (--project h200): no GPU needed --------------------------------------------
#
# Seconds per step on a GPU we do not have, bracketed from two things this machine can give:
# the step's matrix-product FLOPs, counted from the model config (flops_forward), over a
# stated fraction of the chip's rate; and the host's time to issue the step's operations
# (the "dispatch floor"), measured on CPU on the same code path with tiny tensors, plus a
# launch cost per kernel counted with torch.profiler.

# Rates in FLOP/s, from /work/.library/device/H200.md and KINDS.md (this workplace's notes).
DEVICES = {
    "h200": dict(
        name="NVIDIA H200 (SXM)",
        rate={"fp32": 67e12, "bf16": 788e12},
        source=("fp32: 67 TFLOP/s, plain fp32 (no tensor cores), NVIDIA's H100/H200 SXM datasheet "
                "as quoted in /work/.library/device/H200.md; PyTorch runs fp32 matmuls at this rate "
                "because TF32 is off by default (torch.backends.cuda.matmul.allow_tf32 is False) and "
                "posinterp never turns it on. bf16: 788 TFLOP/s, an 8192^3 bf16 matmul on random "
                "data measured on this workplace's H200 (/work/.library/device/KINDS.md, 2026-10-28; "
                "datasheet dense bf16 ~990)."),
    ),
}
UTILIZATION = (0.10, 0.50)  # assumed fraction of the rate small matmuls reach: (pessimistic, optimistic)
LAUNCH_S = (5e-6, 10e-6)  # assumed host cost of one CUDA kernel launch: (low, high), seconds
TINY = dict(d_model=8, d_head=2, d_mlp=8)  # the floor's model: same layers, heads and ops


def flops_forward(cfg, batch: int, n: int) -> int:
    """Matrix-product FLOPs (2 per multiply-add) of one forward pass of the toy model
    ``cfg`` on ``batch`` sequences of ``n`` tokens, logits at every position.

    Per layer and token: Q, K, V and O projections 4 x 2·d_model·(heads·d_head); MLP in and
    out 2 x 2·d_model·d_mlp (none if attn_only); per layer and sequence: the scores Q·K^T and
    the weighted sum of values, 2 x 2·heads·n²·d_head (full n x n: the causal mask is applied
    after the product); unembedding 2·d_model·d_vocab per token. Embedding lookups, norms,
    activations, softmax, rotary/ALiBi and the loss are elementwise and left out: they are
    memory-bound, O(n·d_model) each, and this is a count of matmul work only.
    Source: the TransformerLens 3.9 HookedTransformer forward pass (einsum/linear per weight).
    """
    hd = cfg.n_heads * cfg.d_head
    per_token = 4 * 2 * cfg.d_model * hd + (0 if cfg.attn_only else 2 * 2 * cfg.d_model * cfg.d_mlp)
    attn = 2 * 2 * cfg.n_heads * n * n * cfg.d_head
    return batch * (cfg.n_layers * (n * per_token + attn) + n * 2 * cfg.d_model * cfg.d_vocab)


def flops_train_step(cfg, batch: int, n: int) -> int:
    """Forward plus backward: each matmul's backward is two matmuls of its size (the
    gradients of both operands), so 3x the forward's matmul FLOPs. Cross-check: the
    non-attention part equals 6·N·tokens with N the matmul parameters."""
    return 3 * flops_forward(cfg, batch, n)


def tiny_config(cfg, **overrides):
    """``cfg`` with the same layers, heads, scheme and vocabulary but 8-wide tensors."""
    return dataclasses.replace(cfg, **{**TINY, **overrides})


# aten ops that only reshape metadata or allocate: no kernel on a GPU
_NO_KERNEL = {
    "aten::" + op for op in (
        "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "t", "transpose",
        "permute", "expand", "expand_as", "unsqueeze", "squeeze", "slice", "select", "detach",
        "alias", "empty", "empty_like", "empty_strided", "resize_", "split", "split_with_sizes",
        "unbind", "chunk", "narrow", "lift_fresh", "view_as", "contiguous", "numpy_T",
        "result_type", "is_nonzero", "_has_compatible_shallow_copy_type", "unflatten", "flatten",
        "to", "set_", "requires_grad_", "is_same_size", "size", "stride", "dim")
}


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: the profiler's C++ side prints a start/stop line."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def count_kernels(fn) -> tuple[int, int]:
    """Kernels ``fn()`` would launch on a GPU, bracketed from the aten ops torch.profiler
    records on CPU: (top-level ops, leaf ops), metadata-only ops left out. A top-level op
    (called from Python or by autograd) launches at least one kernel; a leaf op at most
    about one. AdamW and clip_grad_norm_ run per tensor on CPU but as multi-tensor
    (foreach) kernels on CUDA, so the leaf count over-counts them."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    top = leaf = 0
    for ev in prof.events():
        if not ev.name.startswith("aten::") or ev.name in _NO_KERNEL:
            continue
        parent = ev.cpu_parent
        while parent is not None and parent.name in _NO_KERNEL:
            parent = parent.cpu_parent
        top += parent is None or not parent.name.startswith("aten::")
        leaf += not any(c.name.startswith("aten::") and c.name not in _NO_KERNEL
                        for c in ev.cpu_children)
    return top, leaf


@dataclasses.dataclass(frozen=True)
class Host:
    """Host-side cost of one step (or call) of the tiny version: CPU seconds, kernel counts."""

    seconds: float
    top: int
    leaf: int


def host_per_step(run, n1: int, n2: int) -> Host:
    """Marginal CPU seconds and kernel counts per step of ``run`` (as :func:`marginal`)."""
    cpu = torch.device("cpu")
    # the profiled runs come first and are the warm-up
    (t1, l1), (t2, l2) = count_kernels(lambda: run(n1)), count_kernels(lambda: run(n2))
    sec = max(min(timed(lambda: run(n2), cpu) for _ in range(2))
              - min(timed(lambda: run(n1), cpu) for _ in range(2)), 0.0) / (n2 - n1)
    return Host(sec, round((t2 - t1) / (n2 - n1)), round((l2 - l1) / (n2 - n1)))


def host_per_call(fn) -> Host:
    """CPU seconds (the smaller of two, after a warm-up) and kernel counts of one call."""
    fn()
    sec = min(timed(fn, torch.device("cpu")) for _ in range(2))
    return Host(sec, *count_kernels(fn))


def bracket(flops: float, host: Host, precision: str, device: str = "h200") -> tuple[float, float]:
    """Projected seconds (low, high) of one step.

    low  = max(host floor + top-level kernels x 5 us, FLOPs / (rate x 50%)): host and GPU
           overlap perfectly;
    high = host floor + leaf kernels x 10 us + FLOPs / (rate x 10%): no overlap (each step
           ends in a synchronizing loss.item()).
    The host floor is the CPU time of the tiny version (Python, dispatcher, autograd and the
    tiny tensors' CPU kernels), measured on this machine, whose single core may be slower
    or faster than the GPU host's.
    """
    rate = DEVICES[device]["rate"][precision]
    (u_low, u_high), (c_low, c_high) = UTILIZATION, LAUNCH_S
    low = max(host.seconds + host.top * c_low, flops / (rate * u_high))
    high = host.seconds + host.leaf * c_high + flops / (rate * u_low)
    return low, high


class Rows:
    """The table's rows. ``project`` None: ``step``/``call`` measure on ``device``; a key of
    DEVICES: they project that GPU's (low, high) seconds from FLOPs and the CPU host floor."""

    def __init__(self, device: torch.device, project: str | None = None, tiny_steps=(3, 13)):
        self.device, self.project, self.rows = device, project, []
        self.tiny_steps, self._hosts, self.checks = tiny_steps, {}, []

    def precisions(self) -> list:
        return [None, "bf16"] if self.device.type == "cuda" or self.project else [None]

    def _host(self, key, measure) -> Host:
        if key not in self._hosts:
            self._hosts[key] = measure()
        return self._hosts[key]

    def step(self, key, make_run, mc, mp, n1, n2, flops, tiny_mc):
        """Seconds per step of ``make_run(mc, None, mp)`` (measured) or its projection:
        the FLOPs ``flops`` and the host floor of ``make_run(tiny_mc, 1, None)`` (batch 1,
        float32 on CPU; autocast's extra casts on CUDA are not in it)."""
        if self.project is None:
            return marginal(make_run(mc, None, mp), n1, n2, self.device)
        host = self._host(("step", key, tiny_mc),
                          lambda: host_per_step(make_run(tiny_mc, 1, None), *self.tiny_steps))
        return Projected(*bracket(flops, host, _pname(mp), self.project), flops, host)

    def call(self, measure, flops, tiny_fn, key):
        """Seconds per call: ``measure()`` (measured) or projected from ``flops`` and the
        host floor of ``tiny_fn()``, a call of the same code on a tiny model."""
        if self.project is None:
            return measure()
        host = self._host(("call", key), lambda: host_per_call(tiny_fn))
        return Projected(*bracket(flops, host, "fp32", self.project), flops, host)

    def add(self, repro, component, precision, per_unit, unit, units, how):
        row = dict(reproduction=repro, component=component, precision=precision, unit=unit,
                   units=units)
        if self.project is None:
            row.update(device=str(self.device), seconds_per_unit=per_unit,
                       hours=per_unit * units / 3600, how=how)
            print(f"  {repro:15s} {component:44s} {precision:5s} {per_unit:9.4f} s/{unit:5s} "
                  f"x {units:>9,} = {per_unit * units / 3600:8.3f} h  ({how})", flush=True)
        else:
            if isinstance(per_unit, Projected):
                lo, hi, h = per_unit.low, per_unit.high, per_unit.host
                how = (f"projected: {per_unit.flops / 1e9:.3g} GFLOP/{unit}, host floor "
                       f"{h.seconds * 1e3:.1f} ms, {h.top}-{h.leaf} kernels")
            else:  # analysis partly on CPU (numba, scikit-learn): this CPU's time, carried over
                lo = hi = per_unit
                how = f"not projected: this CPU's time carried over ({how})"
            row.update(device=self.project, seconds_low=lo, seconds_high=hi,
                       hours_low=lo * units / 3600, hours_high=hi * units / 3600, how=how)
            print(f"  {repro:15s} {component:44s} {precision:5s} {lo:8.4f}-{hi:8.4f} s/{unit:5s} "
                  f"x {units:>9,} = {lo * units / 3600:7.3f}-{hi * units / 3600:7.3f} h  ({how})",
                  flush=True)
        self.rows.append(row)


@dataclasses.dataclass(frozen=True)
class Projected:
    """A projected time per unit: (low, high) seconds, with the FLOPs and host floor used."""

    low: float
    high: float
    flops: float
    host: Host

    def __mul__(self, k: float) -> Projected:  # k calls or steps of this
        h = self.host
        return Projected(self.low * k, self.high * k, self.flops * k,
                         Host(h.seconds * k, round(h.top * k), round(h.leaf * k)))


def _pname(mp) -> str:
    return mp or "fp32"


# --- zuo2024 --full --------------------------------------------------------------------


def _train_run(mc, data, mp, device, batch_size=None):
    """``run(n)``: ``posinterp.training.train`` for n steps (no early stop, no checkpoints)."""
    def run(n):
        train(mc, data, _train_config(n, batch_size), progress=False, device=device,
              mixed_precision=mp, threads=None)  # the benchmark's own thread count
    return run


def _train_config(n, batch_size=None) -> TrainConfig:
    return TrainConfig(max_steps=n, eval_every=10**9, n_eval=16, warmup_steps=50,
                       target_accuracy=None, checkpoint_seconds=None, seed=0,
                       batch_size=batch_size or TrainConfig().batch_size)


def bench_zuo2024(rows: Rows, quick: bool) -> None:
    device, R = rows.device, "zuo2024 --full"
    full = zuo2024.ReproConfig.full()
    cfg = dataclasses.replace(full, n_samples=N_BENCH_SAMPLES)
    steps, eval_every, n_eval = full.train_steps, 100, TrainConfig().n_eval  # as _train_cell
    n1, n2 = (1, 3) if quick else (10, 40)
    every = not quick or rows.project  # a projection costs little: every row its own
    tasks, seeds = list(full.task_lengths), len(full.train_seeds)
    data = {task: zuo2024._task_data(cfg, task, 0) for task in (tasks if every else ["reversal"])}
    batch = _train_config(1).batch_size

    def step_time(task, mc, mp):
        # the batch is cut to its longest sequence: max_len, an upper bound on the width
        d = data[task]
        return rows.step(f"zuo {task}", lambda m, b, p: _train_run(m, d, p, device, b), mc, mp,
                         n1, n2, flops_train_step(mc, batch, d.max_len), tiny_config(mc))

    for mp in rows.precisions():
        paper = preset(full.model_preset, seed=0)
        step_t = {task: step_time(task, paper, mp) for task in data}
        for task in tasks:
            how = ("measured" if task in step_t else
                   "scaled: reversal's step time (its strings are the longest), --quick")
            rows.add(R, f"train {task} 6L x {seeds} seeds", _pname(mp),
                     step_t.get(task, step_t["reversal"]), "step", steps * seeds, how)
        for depth in full.train_depths:  # reversal trained at each depth
            if not every:
                t, how = step_t["reversal"] * depth / 6, f"scaled: 6L reversal x {depth}/6 layers, --quick"
            else:
                deep = preset(full.model_preset, seed=0, n_layers=depth)
                t, how = step_time("reversal", deep, mp), "measured"
            rows.add(R, f"train reversal at depth {depth}L x {seeds} seeds", _pname(mp), t, "step",
                     steps * seeds, how)
    if rows.project:  # a check of the FLOP count against this CPU's measured time
        d = data["reversal"]
        sec = marginal(_train_run(paper, d, None, device), 1, 2, device)
        gf = flops_train_step(paper, batch, d.max_len) / 1e9
        rows.checks.append(
            f"FLOP-count check: the {full.model_preset} model's reversal step (batch {batch} x "
            f"{d.max_len} tokens) counts {gf:.1f} GFLOP; measured here at {sec:.2f} s/step on "
            f"{torch.get_num_threads()} CPU thread(s), that is {gf / sec:.0f} GFLOP/s")
        print("  " + rows.checks[-1], flush=True)
    # Evaluations: every eval_every steps on n_eval test samples, and a final one on the
    # whole test split, per training run (float32: evaluation runs outside autocast).
    model = build_model(preset(full.model_preset, seed=0), device=device)
    n_ev = 200 if quick else n_eval
    test = data["reversal"].test

    def measure_eval():
        evaluate(model, test, 16)  # warm-up
        return timed(lambda: evaluate(model, test, n_ev), device) * n_eval / n_ev

    tiny_model = build_model(tiny_config(model.posinterp_config), device="cpu") if rows.project else None
    # the floor: as many forward batches as one evaluation of n_eval samples, of 1 sample each
    n_batches = -(-n_eval // inspect.signature(evaluate).parameters["batch_size"].default)
    ev = rows.call(measure_eval, flops_forward(model.posinterp_config, n_eval, test.tokens.shape[1]),
                   lambda: evaluate(tiny_model, test, n_batches, batch_size=1), "zuo eval")
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
    every = not quick or rows.project
    measured_pes = grid.pes if every else grid.pes[-1:]  # rotary only with --quick
    # The floor's grid: the same 2 layers and heads, 8 wide, 4 tokens, batch 1.
    tiny = dataclasses.replace(grid, d_model=TINY["d_model"], n_ctx=4, d_vocab=4, batch_size=1)
    step_t = {}
    for pe in measured_pes:
        for constraint in grid.constraints:
            def make(g, b, mp, pe=pe, constraint=constraint):
                def run(n):
                    # target 1.0: no early stop within a few steps; evals every eval_every
                    qk._train_cell(dataclasses.replace(g, max_steps=n, target=1.0), pe,
                                   constraint, 0, device if g is grid else "cpu")
                return run
            mc = qk._cell_config(grid, pe, 0)
            # a step, and the cell's evaluation forward pass every eval_every steps
            flops = (flops_train_step(mc, grid.batch_size, grid.n_ctx)
                     + flops_forward(mc, qk.EVAL_SEQUENCES, grid.n_ctx) / grid.eval_every)
            step_t[pe, constraint] = rows.step(f"qk {pe} {constraint}",
                                               lambda m, b, mp, make=make: make(m, b, mp),
                                               grid, None, n1, n2, flops, tiny)
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
    measured = zc.schemes if not quick or rows.project else ("rotary",)
    tiny_zc = dataclasses.replace(zc, n_ctx=8, batch_size=1, n_val_windows=1)

    def make(mc, b, mp):
        z = zc if b is None else tiny_zc
        return _zoo_run(z, mc, zc.train_config(0), corpus, mp, device if b is None else "cpu")

    for mp in rows.precisions():
        step_t = {}
        for pe in measured:
            mc = zc.model_config(pe, 0)
            step_t[pe] = rows.step(f"zoo {pe}", make, mc, mp, n1, n2,
                                   flops_train_step(mc, zc.batch_size, zc.n_ctx),
                                   tiny_config(mc, n_ctx=tiny_zc.n_ctx))
        for pe in zc.schemes:
            how = "measured" if pe in step_t else "scaled: rotary's step time, --quick"
            rows.add(R, f"train {pe} x {ZOO_SEEDS} seeds", _pname(mp), step_t.get(pe, step_t["rotary"]),
                     "step", zc.max_steps * ZOO_SEEDS, how)
    mc = zc.model_config("rotary", 0)
    model = build_model(mc, device=device)

    def measure_val():
        _val_loss(model, corpus, zc)  # warm-up
        return timed(lambda: _val_loss(model, corpus, zc), device)

    tiny = build_model(tiny_config(mc, n_ctx=tiny_zc.n_ctx), device="cpu") if rows.project else None
    t_val = rows.call(measure_val, flops_forward(mc, zc.n_val_windows, zc.n_ctx),
                      lambda: _val_loss(tiny, corpus, tiny_zc), "zoo val")
    n_val = len(zc.schemes) * ZOO_SEEDS * (zc.max_steps // zc.eval_every + 1)
    rows.add(R, f"validation losses ({n_val})", "fp32", t_val, "call", n_val, "measured")


def _summary(df: pd.DataFrame) -> pd.DataFrame:
    """Hours per reproduction and training precision: that precision's training rows plus
    every other row (evaluations and analyses run in float32 either way)."""
    cols = [c for c in ("hours", "hours_low", "hours_high") if c in df]
    out = []
    for repro, g in df.groupby("reproduction", sort=False):
        training = g.component.str.startswith("train")
        for p in dict.fromkeys(g.precision[training]):
            part = g[(training & (g.precision == p)) | ~training]
            out.append(dict(reproduction=repro, training_precision=p,
                            **{c: part[c].sum() for c in cols}))
    return pd.DataFrame(out)


def projection_header(device: str) -> str:
    """What a projection is and the assumptions it rests on, for the printed and written table."""
    d = DEVICES[device]
    (u_lo, u_hi), (c_lo, c_hi) = UTILIZATION, LAUNCH_S
    return (
        f"# Projected {d['name']} GPU-hours per full reproduction\n\n"
        "**Projection, not a GPU measurement**: computed on this CPU machine "
        f"({platform.processor() or 'cpu'}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch "
        f"threads, torch {torch.__version__}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC). "
        "Run benchmarks/gpu_check.sh on a GPU to replace it with measured numbers.\n\n"
        "Seconds per step (or call), as a bracket [low, high]:\n"
        f"- FLOPs: matrix products counted from the model config (Q/K/V/O, attention scores and "
        f"weighted sum, MLP, unembedding; backward = 2 x forward), over the rate x an assumed "
        f"utilization: {u_hi:.0%} of it for low, {u_lo:.0%} for high (small matmuls reach a "
        f"fraction of peak).\n"
        f"- Rates: {d['source']}\n"
        f"- Host floor: the same code path run on this CPU with tiny tensors (d_model "
        f"{TINY['d_model']}, d_head {TINY['d_head']}, d_mlp {TINY['d_mlp']}, batch 1, same layers, "
        f"heads and ops): Python, dispatcher and autograd time, plus a CUDA launch cost per "
        f"kernel, kernels counted with torch.profiler: top-level aten ops x {c_lo * 1e6:.0f} us "
        f"for low, leaf aten ops x {c_hi * 1e6:.0f} us for high. On CPU, AdamW and gradient "
        "clipping run per tensor where CUDA runs multi-tensor (foreach) kernels, so the floor "
        "and the leaf count over-state them; autocast's casts (bf16) are not in them.\n"
        "- low = max(host floor + launches, FLOPs time at the high utilization) (host and GPU "
        "overlap); high = host floor + launches + FLOPs time at the low utilization (no overlap).\n"
        "- Step counts as the measured estimate: max_steps, an upper bound where training stops "
        "early. Analysis rows that run partly on CPU (adjacency, probes) carry this CPU's "
        "--quick time over, unprojected.\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="auto (default: cuda if available), cpu, cuda")
    ap.add_argument("--quick", action="store_true", help="fewer steps and scaled rows (< 2 min on CPU)")
    ap.add_argument("--project", default=None, choices=sorted(DEVICES),
                    help="no measurement on --device: project this GPU's hours from FLOPs and the "
                         "host floor measured on CPU (implies --quick for the analysis rows)")
    ap.add_argument("--only", nargs="+", choices=["zuo2024", "qk", "zoo"], default=None)
    ap.add_argument("--out", default=None, help="folder for gpu_hours.csv and gpu_hours.md "
                    "(gpu_hours_projection.* with --project)")
    args = ap.parse_args(argv)
    if args.project and args.device not in (None, "cpu"):
        ap.error(f"--project runs on the CPU; drop --device {args.device}")
    device = torch.device("cpu") if args.project else resolve_device(args.device, "--device")
    quick = args.quick or bool(args.project)
    if args.project:
        header = projection_header(args.project)
    else:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        header = (f"# Estimated {'GPU' if device.type == 'cuda' else 'CPU'}-hours per full reproduction\n\n"
                  f"Device: {device} ({name}); torch {torch.__version__}; {torch.get_num_threads()} torch "
                  f"threads; {os.cpu_count()} CPUs; "
                  f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
                  f"{'--quick' if quick else 'full measurement'}.\n\n"
                  "estimate = measured seconds per step (or per call) x the number the full run does "
                  "(max_steps: an upper bound where training stops at its target). Not a run.\n")
    print(header, flush=True)
    t0 = time.time()
    rows = Rows(device, project=args.project)
    for key, fn in (("zuo2024", bench_zuo2024), ("qk", bench_qk), ("zoo", bench_zoo)):
        if args.only is None or key in args.only:
            fn(rows, quick)
    df = pd.DataFrame(rows.rows)
    summary = _summary(df)
    where = (f"projected {DEVICES[args.project]['name']} hours" if args.project else
             "hours on this device")
    print(f"\nTotals ({where}, one process at a time; evaluations and analyses are "
          "float32 and count under every training precision):")
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    for line in rows.checks:
        print(line)
    print(f"\nbenchmark wall time {time.time() - t0:.0f} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = "gpu_hours_projection" if args.project else "gpu_hours"
        df.to_csv(out / f"{stem}.csv", index=False)
        md = [header]
        if args.project:
            md += ["| reproduction | component | precision | s per unit (low-high) | unit | units | "
                   "hours low | hours high | how |", "|---|---|---|---:|---|---:|---:|---:|---|"]
            md += [f"| {r.reproduction} | {r.component} | {r.precision} | {r.seconds_low:.4g}-"
                   f"{r.seconds_high:.4g} | {r.unit} | {r.units:,} | {r.hours_low:.3f} | "
                   f"{r.hours_high:.3f} | {r.how} |" for r in df.itertuples()]
            md += ["", "| reproduction | training precision | GPU-hours low | GPU-hours high |",
                   "|---|---|---:|---:|"]
            md += [f"| {r.reproduction} | {r.training_precision} | {r.hours_low:.2f} | "
                   f"{r.hours_high:.2f} |" for r in summary.itertuples()]
        else:
            md += ["| reproduction | component | precision | s per unit | unit | units | hours | how |",
                   "|---|---|---|---:|---|---:|---:|---|"]
            md += [f"| {r.reproduction} | {r.component} | {r.precision} | {r.seconds_per_unit:.4f} | "
                   f"{r.unit} | {r.units:,} | {r.hours:.3f} | {r.how} |" for r in df.itertuples()]
            md += ["", "| reproduction | training precision | hours |", "|---|---|---:|"]
            md += [f"| {r.reproduction} | {r.training_precision} | {r.hours:.2f} |"
                   for r in summary.itertuples()]
        md += ["", *rows.checks]
        (out / f"{stem}.md").write_text("\n".join(md) + "\n")
        print(f"wrote {out / (stem + '.csv')} and {out / (stem + '.md')}")
    hours = df[[c for c in ("hours", "hours_low", "hours_high") if c in df]].to_numpy().ravel()
    return 0 if all(math.isfinite(h) for h in hours) else 1


if __name__ == "__main__":
    sys.exit(main())
