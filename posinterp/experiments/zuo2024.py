"""``posinterp reproduce zuo2024``: Zuo, Guerzhoy & Guerzhoy (2024), arXiv 2501.00073.

Claims checked (docs/concepts.md), each at two measurement points after the first
attention: the attention output alone (``blocks.0.hook_attn_out``, the paper's point:
its mediation argument is about the convex mix of earlier embeddings) and the residual
stream after it (``blocks.0.hook_resid_mid``, embedding + attention output):

1. at the token embedding the adjacency score is about 0.5 (chance);
2. after the first causal attention layer it is >= 0.8 at init (std <= 0.02);
3. ... and after training, on all four tasks (only models trained to the accuracy
   target are scored as "trained");
4. ... at 6/12/24 layers and d_model 192/384/768, with independent seeds per depth and
   every layer scored (so depth can matter);
5. it vanishes at init std 0.2, and a large init mean matters little;
6. a position probe reads position better from cosine similarities than from variance,
   on random-token sequences (no template), against count-matched controls.

Every figure is a mean over seeds with a 95% t-interval; a verdict is "yes" or "no" only
when the whole interval is on one side of the threshold (:data:`THRESHOLDS`), otherwise
"CI spans". ``--quick`` is the CPU protocol; ``--full`` is the paper's (a GPU job). Every
cell is a file under the output folder and is skipped when present, so an interrupted
run resumes; the cells run through :mod:`posinterp.executors` (in-process by default,
each with one torch thread); :func:`render_markdown` writes the reproduction page from
the run's CSVs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats

from ..analysis import adjacency_by_layer, probe_positions
from ..analysis.probing import ProbeConfig
from ..devices import resolve_device
from ..executors import Cell, CellsFailed, Executor, LocalExecutor, ProcessExecutor, gpus_for, run_cells
from ..io import atomic_path, atomic_write_json, check_out_dir, versions
from ..models import build_model, preset
from ..tasks import CHAR_VOCAB, TaskConfig, make_task_data
from ..training import TrainConfig, evaluate, latest_checkpoint, load_checkpoint, train

__all__ = ["THRESHOLDS", "ReproConfig", "depth_width_configs", "render_markdown", "run_zuo2024"]

#: The thresholds that turn figures into verdicts (ours: the paper states ranges).
THRESHOLDS = {"chance": 0.05, "high": 0.8, "vanishes": 0.6, "matters_little": 0.1,
              "target_accuracy": 0.9, "no_leak": 0.01}
POINTS = {"attn_out": "blocks.0.hook_attn_out", "resid_mid": "blocks.0.hook_resid_mid"}
EMBED = "blocks.0.hook_resid_pre"
# --quick training lengths. Reversal is fixed at 6 digits, the length the 4-layer, 192-wide
# NoPE model trains to the target in ~500 steps on 2 CPU cores (../shared/DESIGN.md §7);
# variable 4-8 digits reached 0.57 / 0.01 / 0.02 in 500 steps. The probes never see these
# strings: they read random tokens and variable-length strings (PROBE_LENGTHS).
TASK_LENGTHS = {
    "addition": (1, 3), "reversal": (6, 6), "indexing": (1, 9), "ordering": (2, 5)}
PROBE_LENGTHS = (4, 8)  # reversal strings for the probes: variable length, no fixed template
PROBE_FEATURES = ("cosine", "mask_only", "cosine_shuffled", "variance", "variance_window")


@dataclass(frozen=True)
class ReproConfig:
    """What ``--quick`` and ``--full`` run (see the module docstring and the page)."""

    quick: bool = True
    model_preset: str = "small"
    train_steps: int = 500
    train_seeds: tuple[int, ...] = (0, 1, 2)
    init_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    grid_seeds: tuple[int, ...] = (0, 1, 2)
    n_samples: int = 20_000  # train and (disjoint) test samples per task
    n_sequences: int = 64
    n_tokens: int = 32
    n_probe_sequences: int = 128
    init_means: tuple[float, ...] = (0.0, 4.0, 8.0)
    init_stds: tuple[float, ...] = (0.002, 0.02, 0.2)
    depths: tuple[int, ...] = (6, 12, 24)
    widths: tuple[int, ...] = (64, 192, 384, 768)
    train_depths: tuple[int, ...] = ()  # --full: reversal trained at each depth
    # A longer run (first training seed) of tasks the step budget may not train: it tests
    # whether "untrained at this budget" is only a budget limit, instead of saying so.
    long_train_tasks: tuple[str, ...] = ("addition",)
    long_train_steps: int = 1500
    task_lengths: dict = field(default_factory=lambda: dict(TASK_LENGTHS))
    probe_lengths: tuple[int, int] = PROBE_LENGTHS

    @classmethod
    def full(cls) -> ReproConfig:
        return cls(quick=False, model_preset="paper", train_steps=5000,
                   train_seeds=(0, 1, 2, 3, 4), grid_seeds=(0, 1, 2, 3, 4), n_sequences=256,
                   n_probe_sequences=256, train_depths=(6, 12, 24), long_train_tasks=(),
                   task_lengths={"addition": (1, 4), "reversal": (1, 16), "indexing": (1, 9),
                                 "ordering": (2, 5)}, probe_lengths=(1, 16))


def depth_width_configs(config: ReproConfig):
    """``(depth, width, seed, ToyModelConfig)`` for the depth x width grid at init.

    Weights are seeded per parameter name, so one seed would give the *same* layer 0 at
    every depth and depth could not matter; each (depth, width, replicate) gets its own
    seed instead. d_head is 64 (the paper's), so width 192 has 3 heads.

    Raises:
        ValueError: from :func:`~posinterp.models.preset` for an unknown preset or a
            width below 64 that is not divisible by its head count.
    """
    out = []
    for depth in config.depths:
        for width in config.widths:
            for rep in config.grid_seeds:
                seed = 1_000 * depth + width + 100_000 * rep
                out.append((depth, width, seed, preset(config.model_preset, n_layers=depth,
                                                       d_model=width,
                                                       n_heads=max(1, width // 64), seed=seed)))
    return out


def _random_tokens(n: int, length: int, seed: int, variable: bool = False):
    """BOS + uniform task-alphabet tokens; ``variable``: right-padded lengths in
    [length // 4, length] (so no fixed length or template can place a token)."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(4, CHAR_VOCAB.size, (n, length), generator=gen)
    toks[:, 0] = CHAR_VOCAB.bos_id
    mask = torch.ones(n, length, dtype=torch.long)
    if variable:
        lengths = torch.randint(max(3, length // 4), length + 1, (n,), generator=gen)
        mask = (torch.arange(length)[None] < lengths[:, None]).long()
        toks = toks.masked_fill(mask == 0, CHAR_VOCAB.pad_id)
    return toks, mask


def _task_data(config: ReproConfig, task: str, seed: int):
    lo, hi = config.task_lengths[task]
    return make_task_data(TaskConfig(task, min_digits=lo, max_digits=hi, seed=seed,
                                     n_train=config.n_samples, n_test=config.n_samples))


def _train_cell(config, out, task, seed, progress, n_layers=None, steps=None, device=None):
    data = _task_data(config, task, seed)
    overrides = {} if n_layers is None else {"n_layers": n_layers}
    mc = preset(config.model_preset, seed=seed, **overrides)
    tag = (f"{task}-seed{seed}" + ("" if n_layers is None else f"-L{n_layers}")
           + ("" if steps is None else f"-steps{steps}"))
    res = train(mc, data, TrainConfig(max_steps=steps or config.train_steps, eval_every=100,
                                      warmup_steps=50,
                                      target_accuracy=THRESHOLDS["target_accuracy"], seed=seed),
                checkpoint_dir=out / "checkpoints" / tag, progress=progress, device=device)
    toks = data.test.tokens[: config.n_sequences]
    mask = data.test.attention_mask[: config.n_sequences]
    before = adjacency_by_layer(build_model(mc, device=device), toks, mask).assign(state="init")
    after = adjacency_by_layer(res.model, toks, mask).assign(state="trained")
    acc = evaluate(res.model, data.test)["test_accuracy"]
    return pd.concat([before, after]).assign(task=task, seed=seed, accuracy=acc, steps=res.steps,
                                             reached_target=acc >= THRESHOLDS["target_accuracy"],
                                             n_layers=mc.n_layers)


def _labelled_train_cell(label, **kwargs):
    return _train_cell(**kwargs).assign(task=label)


def _init_cell(config: ReproConfig, device=None) -> pd.DataFrame:
    """1-2. Init, random tokens, several init seeds."""
    rand, _ = _random_tokens(config.n_sequences, config.n_tokens, seed=1234)
    return pd.concat([
        adjacency_by_layer(build_model(preset(config.model_preset, seed=s), device=device),
                           rand).assign(seed=s)
        for s in config.init_seeds])


def _depth_width_cell(config: ReproConfig, device=None) -> pd.DataFrame:
    """4. Depth x width at init, independent seeds, every layer."""
    rand, _ = _random_tokens(config.n_sequences, config.n_tokens, seed=1234)
    frames = []
    for depth, width, seed, mc in depth_width_configs(config):
        m = build_model(mc, device=device)
        frames.append(adjacency_by_layer(m, rand[:16]).assign(depth=depth, width=width, seed=seed))
        del m
    return pd.concat(frames)


def _init_grid_cell(config: ReproConfig, device=None) -> pd.DataFrame:
    """5. Init ablation: mean x std, several seeds."""
    rand, _ = _random_tokens(config.n_sequences, config.n_tokens, seed=1234)
    return pd.concat([
        adjacency_by_layer(build_model(preset(config.model_preset, init_mean=mean, init_std=std,
                                              seed=s), device=device), rand).assign(
            init_mean=mean, init_std=std, seed=s)
        for mean in config.init_means for std in config.init_stds for s in config.grid_seeds])


def _probe_cell(config: ReproConfig, out: Path, dataset: str, state: str, seed: int,
                device=None) -> pd.DataFrame:
    """6. Probes, embedding included, per model seed (the probe's split uses the same seed)."""
    if dataset == "random_tokens":
        toks, mask = _random_tokens(config.n_probe_sequences, config.n_tokens,
                                    seed=5000 + seed, variable=True)
    else:
        lo, hi = config.probe_lengths
        test = make_task_data(TaskConfig("reversal", min_digits=lo, max_digits=hi,
                                         seed=7000 + seed, n_train=1,
                                         n_test=config.n_probe_sequences)).test
        toks = test.tokens[: config.n_probe_sequences]
        mask = test.attention_mask[: config.n_probe_sequences]
    model = (build_model(preset(config.model_preset, seed=seed), device=device)
             if state == "init" else _trained_model(out, "reversal", seed, device))
    return probe_positions(model, toks, mask, features=PROBE_FEATURES, seeds=(seed,),
                           config=ProbeConfig()).assign(dataset=dataset, state=state)


def _trained_model(out: Path, task: str, seed: int, device=None):
    model, _ = load_checkpoint(latest_checkpoint(out / "checkpoints" / f"{task}-seed{seed}"),
                               device=device)
    return model


def run_zuo2024(config: ReproConfig = ReproConfig(), out_dir: str | Path = "posinterp-zuo2024",
                progress: bool = True, markdown: str | Path | None = None,
                command: str | None = None, executor: Executor | None = None,
                device=None) -> pd.DataFrame:
    """Run the reproduction; write the cells, the summary CSVs, ``claims.csv``, ``run.json``
    and ``report.html`` (and with ``markdown``, the page from :func:`render_markdown`).

    Models train and run on ``device`` (:func:`posinterp.devices.resolve_device`; None:
    CUDA when available, else CPU); ``run.json`` records it.

    Returns:
        The claims table (``claims.csv``): ``claim, point, figure, mean, ci_low, ci_high,
        n, holds, detail``.

    ``executor`` runs the cells (default: one after another in this process); training
    and analysis cells run first, the probes of trained models after them.

    Raises:
        ValueError: for invalid presets or task lengths.
        posinterp.executors.CellsFailed: naming each failed cell (and each probe left
            unrun because its training failed), after every other cell is written.
    """
    log = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    # A bad device fails here, not in every cell; Ray workers resolve their own.
    where = (str(resolve_device(device))
             if executor is None or isinstance(executor, (LocalExecutor, ProcessExecutor))
             else str(device or "auto"))
    # Bad presets and lengths fail here, before the folder and its config.json are made,
    # not as failed cells.
    preset(config.model_preset, seed=0)
    for task, (lo, hi) in config.task_lengths.items():
        TaskConfig(task, min_digits=lo, max_digits=hi, n_train=config.n_samples,
                   n_test=config.n_samples)
    TaskConfig("reversal", min_digits=config.probe_lengths[0], max_digits=config.probe_lengths[1])
    out = check_out_dir(Path(out_dir), "out_dir")
    _check_same_config(out, config)
    t0 = time.time()
    bars = progress and (executor is None or isinstance(executor, LocalExecutor))

    # Stage 1: every cell that needs no other (init, training, depth x width, init grid).
    train = dict(config=config, out=out, progress=bars, device=device)
    gpus = gpus_for(device)
    first = [Cell("init_random_tokens", _init_cell, dict(config=config, device=device),
                  num_gpus=gpus)]
    first += [Cell(f"train_{task}_seed{seed}", _train_cell, dict(task=task, seed=seed, **train),
                   num_gpus=gpus)
              for task in config.task_lengths for seed in config.train_seeds]
    first += [Cell(f"train_reversal_L{depth}_seed{seed}", _labelled_train_cell,
                   dict(label=f"reversal L{depth}", task="reversal", seed=seed, n_layers=depth,
                        **train), num_gpus=gpus)
              for depth in config.train_depths for seed in config.train_seeds]
    for task in config.long_train_tasks:
        seed, steps = config.train_seeds[0], config.long_train_steps
        first.append(Cell(f"train_{task}_steps{steps}_seed{seed}", _labelled_train_cell,
                          dict(label=f"{task} (long run, <= {steps} steps)", task=task, seed=seed,
                               steps=steps, **train), num_gpus=gpus))
    first += [Cell("depth_width_init", _depth_width_cell, dict(config=config, device=device),
                   num_gpus=gpus),
              Cell("init_mean_std", _init_grid_cell, dict(config=config, device=device),
                   num_gpus=gpus)]
    # Stage 2: the probes of trained models read the reversal checkpoints of stage 1.
    probes = [Cell(f"probe_{d}_{s}_seed{seed}", _probe_cell,
                   dict(config=config, out=out, dataset=d, state=s, seed=seed, device=device),
                   num_gpus=gpus)
              for d, s in (("random_tokens", "init"), ("random_tokens", "trained"),
                           ("reversal_strings", "trained"))
              for seed in config.train_seeds]
    failed, done = {}, {}
    for stage in (first, probes):
        ready = [c for c in stage if c.kwargs.get("state") != "trained"
                 or f"train_reversal_seed{c.kwargs['seed']}" not in failed]
        for c in stage:
            if c not in ready:
                failed[c.name] = (f"DependencyError: not run, it needs train_reversal_seed"
                                  f"{c.kwargs['seed']}, which failed")
        try:
            done.update(run_cells(ready, out / "cells", executor, fmt="csv", progress=False,
                                  log=log))
        except CellsFailed as err:  # the stage's other cells are done: go on, report at the end
            failed.update(err.failures)
            done.update(err.results)
    if failed:
        raise CellsFailed(failed, done)
    init, dw, grid = done["init_random_tokens"], done["depth_width_init"], done["init_mean_std"]
    adjacency = pd.concat([done[c.name] for c in first if c.name.startswith("train_")],
                          ignore_index=True)
    probe = pd.concat([done[c.name] for c in probes], ignore_index=True)

    tables = _summaries(init, adjacency, dw, grid, probe)
    claims = _claims(init, tables, grid, probe)
    for name, df in {**tables, "claims": claims}.items():
        with atomic_path(out / f"{name}.csv") as tmp:
            df.to_csv(tmp, index=False)
    atomic_write_json(out / "run.json", {"config": json.loads(json.dumps(asdict(config))),
                                         "command": command, "device": where,
                                         "versions": versions(),
                                         "thresholds": THRESHOLDS,
                                         "seconds": round(time.time() - t0, 1),
                                         "cell_seconds": _cell_seconds(out, config)})
    _report(config, claims, tables).save(out / "report.html")
    if markdown is not None:
        Path(markdown).write_text(render_markdown(out))
    return claims


def _check_same_config(out: Path, config: ReproConfig) -> None:
    """Refuse to resume a folder whose cells were computed under another configuration
    (cells are reused by name, so a mix would be silently wrong); record it otherwise."""
    now = json.loads(json.dumps(asdict(config)))
    path = out / "config.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in now.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"out_dir {str(out)!r} holds cells of another configuration "
                             f"(stored vs requested: {diff}); use a new out_dir")
    else:
        atomic_write_json(path, now)


def _cell_seconds(out: Path, config: ReproConfig) -> float | None:
    """Summed compute seconds of every cell, or None if a cell has no recorded time."""
    timing = out / "cells" / "_seconds.json"
    seconds = json.loads(timing.read_text()) if timing.exists() else {}
    names = [p.stem for p in (out / "cells").glob("*.csv")]
    if not names or any(n not in seconds for n in names):
        return None
    return round(sum(seconds[n] for n in names), 1)


# ----------------------------------------------------------------------------- statistics

def mean_ci(values) -> tuple[float, float, float, int]:
    """Mean and 95% t-interval over seeds: ``(mean, low, high, n)``; NaN bounds for n < 2,
    exact bounds for zero spread. NaNs are dropped (and not counted).

    Source: Student's t interval, ``scipy.stats.t.interval`` with the standard error of
    the mean (docs/concepts.md: mean over >= 3 seeds). Raises nothing; empty input gives
    NaN with n = 0.
    """
    v = np.asarray([x for x in values if not (isinstance(x, float) and math.isnan(x))], float)
    n = len(v)
    if n == 0:
        return float("nan"), float("nan"), float("nan"), 0
    m = float(v.mean())
    if n < 2:
        return m, float("nan"), float("nan"), n
    sem = float(v.std(ddof=1)) / math.sqrt(n)
    if sem == 0:
        return m, m, m, n
    lo, hi = stats.t.interval(0.95, n - 1, loc=m, scale=sem)
    return m, float(lo), float(hi), n


def _agg(df: pd.DataFrame, by: list[str], value: str = "value") -> pd.DataFrame:
    rows = []
    for key, g in df.groupby(by, sort=False):
        m, lo, hi, n = mean_ci(g[value].tolist())
        rows.append({**dict(zip(by, key if isinstance(key, tuple) else (key,), strict=True)),
                     "mean": m, "ci_low": lo, "ci_high": hi, "n": n})
    return pd.DataFrame(rows)


def _summaries(init, adjacency, dw, grid, probe) -> dict[str, pd.DataFrame]:
    score = "adjacency_score"
    adj = adjacency[adjacency.metric == score]
    first = adj[adj.layer.isin([-1, 0])]
    training = (first.groupby(["task", "seed", "state", "hook"], sort=False).value.first()
                .unstack(["state", "hook"]))
    training.columns = [f"{s}:{h}" for s, h in training.columns]
    acc = adj.groupby(["task", "seed"], sort=False)[["accuracy", "steps", "reached_target"]].first()
    training = acc.join(training).reset_index()
    return {
        "init_by_hook": _agg(init[init.metric == score], ["hook", "layer"]),
        "training": training,
        "training_by_hook": _agg(adj, ["task", "state", "hook", "layer"]),
        "depth_width": _agg(dw[dw.metric == score], ["depth", "width", "hook", "layer"]),
        "init_grid": _agg(grid[grid.metric == score], ["init_mean", "init_std", "hook", "layer"]),
        "probes": _agg(probe, ["dataset", "state", "layer", "feature", "metric"]),
    }


def _verdict(lo: float, hi: float, ok: Callable[[float], bool]) -> str:
    """yes / no when the whole CI is on one side; else "CI spans" (NaN CI: one seed)."""
    if math.isnan(lo) or math.isnan(hi):
        return "one seed: no CI"
    if ok(lo) and ok(hi):
        return "yes"
    if not ok(lo) and not ok(hi):
        return "no"
    return "CI spans"


def _fmt(m, lo, hi, n) -> str:
    if n == 0:
        return "not run"
    if math.isnan(lo):
        return f"{m:.3f} (n={n})"
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}] (n={n})"


def _row(claim, point, values, ok, detail="") -> dict:
    m, lo, hi, n = mean_ci(values)
    return dict(claim=claim, point=point, figure=_fmt(m, lo, hi, n), mean=m, ci_low=lo,
                ci_high=hi, n=n, holds=_verdict(lo, hi, ok) if n else "not run", detail=detail)


def _claims(init, tables, grid, probe) -> pd.DataFrame:
    T = THRESHOLDS
    high = lambda v: v >= T["high"]  # noqa: E731
    rows = []
    score = init.metric == "adjacency_score"
    rows.append(_row("embedding score ~0.5 (chance), random tokens, init seeds", "embedding",
                     init[score & (init.hook == EMBED)].value,
                     lambda v: abs(v - 0.5) <= T["chance"]))
    for point, hook in POINTS.items():
        rows.append(_row("after the first attention >= 0.8 at init (std 0.02), random tokens",
                         point, init[score & (init.hook == hook)].value, high))
    tr = tables["training"]
    for task in tr.task.unique():
        g = tr[tr.task == task]
        ok_seeds = g[g.reached_target.astype(bool)]
        acc = ", ".join(f"{a:.3f}" for a in g.accuracy)
        for point, hook in POINTS.items():
            claim = f"after the first attention >= 0.8 after training: {task}"
            if ok_seeds.empty:
                rows.append(dict(claim=claim, point=point, figure="not trained to target",
                                 mean=float("nan"), ci_low=float("nan"), ci_high=float("nan"),
                                 n=0, holds="not tested",
                                 detail=f"no seed reached {T['target_accuracy']} accuracy "
                                        f"(accuracies {acc})"))
            else:
                rows.append(_row(claim, point, ok_seeds[f"trained:{hook}"], high,
                                 f"seeds at target: {len(ok_seeds)}/{len(g)} (accuracies {acc})"))
    dw = tables["depth_width"]
    paper = dw[dw.width >= 192]
    dwc = _depth_cells(dw)
    for point, hook in POINTS.items():
        cells = paper[(paper.hook == hook)]
        worst = cells.loc[cells["mean"].idxmin()] if len(cells) else None
        rows.append(dict(
            claim="holds at depth 6/12/24 x width 192/384/768 at init (layer 0, every cell)",
            point=point, figure="" if worst is None else
            f"lowest cell L{worst.depth}/d{worst.width}: "
            + _fmt(worst["mean"], worst.ci_low, worst.ci_high, worst.n),
            mean=float("nan") if worst is None else worst["mean"],
            ci_low=float("nan") if worst is None else worst.ci_low,
            ci_high=float("nan") if worst is None else worst.ci_high,
            n=0 if worst is None else int(worst.n),
            holds=("not run" if worst is None else
                   "yes" if all(_verdict(r.ci_low, r.ci_high, high) == "yes"
                                for r in cells.itertuples()) else
                   "no" if any(_verdict(r.ci_low, r.ci_high, high) == "no"
                               for r in cells.itertuples()) else "CI spans"),
            detail=dwc.get(point, "")))
    gs = grid[grid.metric == "adjacency_score"]
    for point, hook in POINTS.items():
        g = gs[gs.hook == hook]

        def at(mean, std, g=g):
            return g[(g.init_mean == mean) & (g.init_std == std)].sort_values("seed")
        rows.append(_row("vanishes at init std 0.2 (mean 0)", point, at(0.0, 0.2).value,
                         lambda v: v <= T["vanishes"]))
        rows.append(_row("holds at init std 0.002 (mean 0)", point, at(0.0, 0.002).value, high))
        base = at(0.0, 0.02).value.to_numpy()
        for mean in sorted(set(g.init_mean) - {0.0}):
            other = at(mean, 0.02).value.to_numpy()
            rows.append(_row(f"a large init mean matters little: mean {mean:g} minus mean 0 "
                             "(std 0.02, paired by seed)", point, other - base,
                             lambda v: abs(v) <= T["matters_little"]))
    p = probe[(probe.dataset == "random_tokens") & (probe.metric == "nrmse")]
    rev = tr[tr.task == "reversal"]
    rev_note = (f"the reversal models: {int(rev.reached_target.astype(bool).sum())}/{len(rev)} "
                f"seeds at the accuracy target (accuracies "
                + ", ".join(f"{a:.3f}" for a in rev.accuracy) + ")")
    for state in ("init", "trained"):
        q = p[p.state == state]
        wide = q.pivot_table(index=["seed", "layer"], columns="feature", values="value")
        post = wide[wide.index.get_level_values("layer") >= 0].groupby("seed").mean()
        emb = wide[wide.index.get_level_values("layer") == -1].groupby("seed").mean()
        for other in ("variance", "variance_window", "mask_only", "cosine_shuffled"):
            if other in post and "cosine" in post:
                rows.append(_row(f"cosine probe beats {other} (NRMSE difference cosine - {other}, "
                                 f"random tokens, {state} model, mean over layers >= 0)", "probe",
                                 (post.cosine - post[other]).tolist(), lambda v: v < 0,
                                 rev_note if state == "trained" else ""))
        if "mask_only" in emb and "cosine" in emb:
            rows.append(_row(f"no leak at the embedding: cosine minus mask-only NRMSE, random "
                             f"tokens, {state} model (0 expected)", "probe",
                             (emb.cosine - emb.mask_only).tolist(),
                             lambda v: abs(v) <= T["no_leak"]))
    return pd.DataFrame(rows)


def _depth_cells(dw: pd.DataFrame) -> dict[str, str]:
    """Per point: layer-0 mean by depth (all widths >= 192) and the deepest layer's mean."""
    out = {}
    paper = dw[dw.width >= 192]
    for point, site in (("attn_out", "hook_attn_out"), ("resid_mid", "hook_resid_mid")):
        parts = []
        for depth, g in paper[paper.hook.str.endswith(site)].groupby("depth"):
            l0 = g[g.layer == 0]["mean"].mean()
            last = g[g.layer == depth - 1]["mean"].mean()
            parts.append(f"L{depth}: layer 0 {l0:.3f}, last layer {last:.3f}")
        out[point] = "; ".join(parts) + " (mean over widths)" if parts else ""
    return out


# ----------------------------------------------------------------------------- outputs

def _report(config, claims, tables):
    from ..viz import Report

    rep = Report("Reproducing Zuo et al. 2024: position in NoPE transformers")
    rep.paragraph(("--quick: " if config.quick else "--full: ") +
                  f"model preset {config.model_preset!r}, up to {config.train_steps} training "
                  f"steps, training seeds {list(config.train_seeds)}, task lengths "
                  f"{config.task_lengths}. Thresholds: {THRESHOLDS}.", note=True)
    rep.heading("Claims")
    rep.table(claims.drop(columns=["mean", "ci_low", "ci_high"]))
    rep.heading("Training (exact match on all held-out samples)")
    rep.table(tables["training"])
    rep.heading("Position probes (per layer, mean and 95% CI over seeds)")
    rep.table(tables["probes"])
    return rep


def _md_table(df: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(str(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _ci(r) -> str:
    return _fmt(r["mean"], r["ci_low"], r["ci_high"], int(r["n"]))


QUICK_COMMAND = ("posinterp reproduce zuo2024 --quick --out posinterp-zuo2024 "
                 "--markdown docs/reproductions/zuo2024.md")


def _digit_range(lengths) -> str:
    if not lengths:
        return "task-length"
    lo, hi = lengths
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def render_markdown(out_dir) -> str:
    """The Zuo et al. reproduction page of a finished run, from its CSVs and ``run.json``.

    Reads ``claims.csv``, ``training.csv``, ``init_grid.csv``, ``depth_width.csv``,
    ``probes.csv`` and ``run.json`` in ``out_dir``; tests check that the committed
    docs/reproductions/zuo2024.md equals this function applied to the committed data.

    Raises:
        FileNotFoundError: if one of those files is missing.
    """
    out = Path(out_dir)
    run = json.loads((out / "run.json").read_text())
    cfg = run["config"]
    claims = pd.read_csv(out / "claims.csv", keep_default_na=False, na_values=[""])
    training = pd.read_csv(out / "training.csv")
    grid = pd.read_csv(out / "init_grid.csv")
    dw = pd.read_csv(out / "depth_width.csv")
    probes = pd.read_csv(out / "probes.csv")
    th = run["thresholds"]
    mode = "--quick" if cfg["quick"] else "--full"
    p = ["# Reproducing Zuo et al. (2024)\n",
         "<!-- Generated by posinterp.experiments.zuo2024.render_markdown from "
         "docs/reproductions/data/zuo2024 (the run's own outputs); "
         "tests/test_docs_reproductions.py checks it. Do not edit by hand. -->\n",
         "Zuo, Guerzhoy & Guerzhoy, \"Position Information Emerges in Causal Transformers "
         "Without Positional Encodings via Similarity of Nearby Embeddings\", COLING 2025, "
         "arXiv 2501.00073. Definitions: docs/concepts.md.\n",
         "## How it was run\n",
         f"```bash\n{run.get('command') or QUICK_COMMAND}\n```\n",
         f"Mode `{mode}`: model preset `{cfg['model_preset']}`, training seeds "
         f"{cfg['train_seeds']} (up to {cfg['train_steps']} steps, stopping early at "
         f"{th['target_accuracy']} exact match), init seeds {cfg['init_seeds']}, grid seeds "
         f"{cfg['grid_seeds']}, {cfg['n_sequences']} sequences of {cfg['n_tokens']} random "
         f"tokens, task lengths {cfg['task_lengths']}. Compute time of all cells: "
         + (f"{run['cell_seconds'] / 60:.1f} min" if run.get("cell_seconds") is not None
            else "not recorded")
         + f" (the invocation that wrote this page took {run['seconds'] / 60:.1f} min of wall "
         "time" + (", reading back cells that earlier invocations computed"
                   if (run.get("cell_seconds") or 0) > run["seconds"] + 60 else "")
         + ") on this machine (2 CPU "
         f"cores shared with other jobs, one torch thread, torch "
         f"{run['versions'].get('torch', '?')}). Data: "
         "`docs/reproductions/data/zuo2024`.\n",
         "**Figures and verdicts.** Every figure is the mean over seeds with a 95% "
         "t-interval `[low, high]` and the number of seeds n. A verdict is *yes* or *no* "
         "only when the whole interval is on one side of its threshold, else *CI spans*. "
         f"Thresholds (ours; the paper states ranges): chance = 0.5 ± {th['chance']}, high "
         f"= ≥ {th['high']}, vanishes = ≤ {th['vanishes']}, matters little = a paired "
         f"difference within ± {th['matters_little']}, no leak at the embedding = cosine "
         f"and mask-only probes' NRMSE within ± {th.get('no_leak', 'n/a')}, trained = ≥ "
         f"{th['target_accuracy']} exact match on all held-out samples (a task no seed "
         "trains to that target is *not tested* after training, never scored as trained).\n",
         "**Two measurement points.** `attn_out` is the first attention output alone "
         "(`blocks.0.hook_attn_out`), the object of the paper's argument; `resid_mid` is the "
         "residual stream after it (embedding + attention output), whose score also depends "
         "on the ratio of the two norms (docs/concepts.md, \"Where the adjacency pattern is "
         "measured\").\n",
         "## Claims\n"]
    c = claims.assign(figure=claims.figure.fillna(""), detail=claims.detail.fillna(""))
    p.append(_md_table(c[["claim", "point", "figure", "holds", "detail"]]) + "\n")
    both = c[c.point.isin(list(POINTS))].pivot_table(index="claim", columns="point",
                                                     values="holds", aggfunc="first", sort=False)
    differ = both[both.nunique(axis=1) > 1] if len(both) else both
    p.append("**Verdicts that differ between the two points:** " + (
        "; ".join(f"{claim} (attn_out: {r.get('attn_out', '')}, resid_mid: "
                  f"{r.get('resid_mid', '')})" for claim, r in differ.iterrows())
        if len(differ) else "none") + ".\n")
    p.append("## Training\n")
    p.append("Exact match on every held-out sample; `steps` is where training stopped "
             "(early at the target). Adjacency at layer 0 on held-out task strings, before "
             "(init) and after training.\n")
    t = pd.DataFrame({
        "task": training.task, "seed": training.seed, "steps": training.steps,
        "accuracy": training.accuracy.map(lambda v: f"{v:.3f}"),
        "trained to target": training.reached_target.map(lambda v: "yes" if v else "no"),
        **{f"{s} {pt}": training[f"{s}:{h}"].map(lambda v: f"{v:.3f}")
           for s in ("init", "trained") for pt, h in POINTS.items()}})
    p.append(_md_table(t) + "\n")
    p.append("## Init mean × std (layer 0, random tokens)\n")
    g = grid[grid.layer.isin([-1, 0])]
    rows = []
    for (mean, std), gg in g.groupby(["init_mean", "init_std"], sort=True):
        r = {"init mean": f"{mean:g}", "init std": f"{std:g}"}
        for hook, name in ((EMBED, "embedding"), *((h, pt) for pt, h in POINTS.items())):
            rr = gg[gg.hook == hook]
            r[name] = _ci(rr.iloc[0]) if len(rr) else ""
        rows.append(r)
    p.append(_md_table(pd.DataFrame(rows)) + "\n")
    p.append("## Depth × width at init (independent seeds per cell)\n")
    p.append("Layer 0 and the last layer at both points; d_head 64, so width 64 has one "
             "head and width 192 three. Width 64 is outside the paper's grid and is not in "
             "the verdict.\n")
    rows = []
    for (depth, width), gg in dw.groupby(["depth", "width"], sort=True):
        r = {"depth": depth, "width": width}
        for layer, lname in ((0, "layer 0"), (depth - 1, "last layer")):
            for pt, site in (("attn_out", "hook_attn_out"), ("resid_mid", "hook_resid_mid")):
                rr = gg[(gg.layer == layer) & gg.hook.str.endswith(site)]
                r[f"{lname} {pt}"] = _ci(rr.iloc[0]) if len(rr) else ""
        rows.append(r)
    p.append(_md_table(pd.DataFrame(rows)) + "\n")
    p.append("## Position probes\n")
    p.append("NRMSE (RMSE / position range, lower is better) per layer, at `resid_post` "
             "(layer -1 is the embedding, the baseline row). Each seed is its own model "
             "and its own split by sequence. `random_tokens`: BOS + uniform tokens, "
             "variable lengths (right-padded), no template; `reversal_strings`: reversal "
             f"strings of {_digit_range(cfg.get('probe_lengths'))} digits (variable length; "
             f"the models trained on {_digit_range(cfg['task_lengths']['reversal'])} digits). "
             "Features: `cosine` (the window of cosines to "
             "the previous w tokens + validity mask), `mask_only` (the validity mask alone), "
             "`cosine_shuffled` (the cosine window taken from another token: same feature "
             "count, no position link beyond the mask), `variance` (Var of resid_post and "
             "attn_out at k: 2 features), `variance_window` (those variances at k..k-w + "
             "mask: at least as many features as `cosine`).\n")
    rev = training[training.task == "reversal"]
    trained_label = (f"reversal model after training ({int(rev.reached_target.sum())}/"
                     f"{len(rev)} seeds at the accuracy target)")
    for (dataset, state), gg in probes.groupby(["dataset", "state"], sort=False):
        who = "init model" if state == "init" else trained_label
        for metric, label in (("nrmse", "NRMSE"), ("pearson_r", "Pearson r")):
            p.append(f"### {dataset}, {who}: {label}\n")
            wide = {}
            for r in gg[gg.metric == metric].itertuples():
                wide.setdefault(r.layer, {"layer": r.layer})[r.feature] = _ci(r._asdict())
            p.append(_md_table(pd.DataFrame(list(wide.values()))) + "\n")
    return "\n".join(p)
