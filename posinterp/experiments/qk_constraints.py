"""``posinterp experiment qk-constraints``: how much learning slows under QK constraints.

2-layer attention-only toy models learn *induction at random offsets*: each sequence is
random tokens repeating with a period p drawn per sequence (n/4 <= p <= n/2), and the
loss and accuracy are on the repeated part. A fixed period (or previous-token copying)
is solved by one positional head in a few dozen steps, too coarse to resolve a 2-3x
slow-down; a random period needs content-based routing (a previous-token head feeding
an induction head), which is what QK constraints act on.

Cells: pe x constraint x seed. Constraints: ``none`` (untied), ``tied`` (the control of
the tied family), and the banned channels of :mod:`posinterp.interventions.constraints`.
Each cell records the steps to reach ``target`` accuracy (evaluated every
``eval_every`` steps); a run that hits ``max_steps`` is censored at the cap and
reported as such, never dropped. Per (pe, constraint): median steps, the ratio of
medians to the control (``tied``; ``none`` for ``tied`` itself) with a bootstrap 95% CI,
a one-sided Mann-Whitney test (slower than the control), and Benjamini-Hochberg q-values
across cells.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats

from ..interventions.constraints import constrain_qk
from ..io import atomic_path, atomic_write_json, versions
from ..models.toy import ToyModelConfig, build_model
from ..train import TrainConfig, fit

__all__ = ["ConstraintGrid", "induction_batch", "run_qk_constraints"]


@dataclass(frozen=True)
class ConstraintGrid:
    """The experiment's grid and budget.

    Calibration (seed 0, this cap): untied absolute reaches 90% at ~450 steps, untied
    rotary at ~1,600, tied and symmetric rotary at ~650 and ~1,000, while tied and
    symmetric absolute were still at ~65% at 2,000 (censored). Cells take 10-40 s, so
    the default grid takes about an hour on 2 cores.
    """

    pes: tuple[str, ...] = ("absolute", "rotary", "nope", "alibi")
    constraints: tuple[str, ...] = ("none", "tied", "symmetric", "antisymmetric",
                                    "no_positive_real", "no_negative_real")
    seeds: int = 5
    n_ctx: int = 32
    d_vocab: int = 32
    d_model: int = 64
    n_heads: int = 4
    batch_size: int = 32
    lr: float = 3e-3
    max_steps: int = 2000
    eval_every: int = 50
    target: float = 0.9

    @classmethod
    def quick(cls) -> ConstraintGrid:
        return cls(pes=("absolute", "rotary"), constraints=("none", "tied", "symmetric"),
                   seeds=2, max_steps=200)


def induction_batch(gen: torch.Generator, batch: int, n_ctx: int, d_vocab: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Periodic random sequences ``[batch, n_ctx]`` and the mask of predictable targets.

    Sequence b repeats with period p_b in [n_ctx/4, n_ctx/2]; ``target_mask[b, t]`` is 1
    where token t is a repeat (t >= p_b), i.e. predictable from context by induction.
    """
    lo, hi = max(2, n_ctx // 4), n_ctx // 2
    periods = torch.randint(lo, hi + 1, (batch,), generator=gen)
    base = torch.randint(0, d_vocab, (batch, n_ctx), generator=gen)
    t = torch.arange(n_ctx)
    idx = t[None, :] % periods[:, None]
    tokens = torch.gather(base, 1, idx)
    return tokens, (t[None, :] >= periods[:, None]).long()


def _loss_and_accuracy(model, tokens, target_mask):
    logits = model(tokens)
    tgt = target_mask[:, 1:].bool()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1][tgt], tokens[:, 1:][tgt])
    acc = (logits[:, :-1].argmax(-1) == tokens[:, 1:])[tgt].float().mean()
    return loss, acc


def _run_cell(grid: ConstraintGrid, pe: str, constraint: str, seed: int) -> dict:
    cfg = ToyModelConfig(pe=pe, n_layers=2, d_model=grid.d_model, n_heads=grid.n_heads,
                         n_ctx=grid.n_ctx, tokenizer=None, d_vocab=grid.d_vocab, attn_only=True,
                         normalization="LN", seed=seed)
    model = build_model(cfg)
    if constraint != "none":
        torch.manual_seed(seed)  # X's initial noise
        constrain_qk(model, constraint)
    eval_gen = torch.Generator().manual_seed(10_000 + seed)
    eval_tokens, eval_mask = induction_batch(eval_gen, 256, grid.n_ctx, grid.d_vocab)

    @torch.no_grad()
    def evaluate(m):
        _, acc = _loss_and_accuracy(m, eval_tokens, eval_mask)
        return {"test_accuracy": acc.item()}

    train_cfg = TrainConfig(max_steps=grid.max_steps, batch_size=grid.batch_size, lr=grid.lr,
                            warmup_steps=10, min_lr_ratio=1.0, eval_every=grid.eval_every,
                            target_accuracy=grid.target, seed=seed, weight_decay=0.0)
    history, steps = fit(
        model, lambda g: induction_batch(g, grid.batch_size, grid.n_ctx, grid.d_vocab),
        lambda m, batch: _loss_and_accuracy(m, *batch)[0], evaluate, train_cfg,
        configs={}, progress=False)
    accs = history[history.metric == "test_accuracy"].value
    reached = bool(len(accs) and accs.iloc[-1] >= grid.target)
    return {"pe": pe, "constraint": constraint, "seed": seed, "steps": steps,
            "censored": not reached, "final_accuracy": float(accs.iloc[-1]) if len(accs) else 0.0}


def _summarize(runs: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    rows = []
    for (pe, constraint), g in runs.groupby(["pe", "constraint"], sort=False):
        control = "none" if constraint == "tied" else "tied"
        c = runs[(runs.pe == pe) & (runs.constraint == control)]
        row = dict(pe=pe, constraint=constraint, control=control if constraint != "none" else "",
                   n=len(g), censored=int(g.censored.sum()), median_steps=float(g.steps.median()),
                   ratio=np.nan, ci_low=np.nan, ci_high=np.nan, p_one_sided=np.nan)
        if constraint != "none" and len(c):
            a, b = g.steps.to_numpy(float), c.steps.to_numpy(float)
            row["ratio"] = np.median(a) / np.median(b)
            if len(a) >= 2 and len(b) >= 2:
                ci = stats.bootstrap((a, b), lambda x, y: np.median(x) / np.median(y),
                                     vectorized=False, n_resamples=2000, method="percentile",
                                     random_state=np.random.default_rng(seed)).confidence_interval
                row["ci_low"], row["ci_high"] = ci.low, ci.high
            row["p_one_sided"] = stats.mannwhitneyu(a, b, alternative="greater").pvalue
        rows.append(row)
    out = pd.DataFrame(rows)
    ok = out.p_one_sided.notna()
    out["q_bh"] = np.nan
    if ok.any():
        out.loc[ok, "q_bh"] = stats.false_discovery_control(out.loc[ok, "p_one_sided"], method="bh")
    return out


def run_qk_constraints(grid: ConstraintGrid = ConstraintGrid(), out_dir="posinterp-qk-constraints",
                       progress: bool = True) -> pd.DataFrame:
    """Run (or resume) every cell, then write ``runs.csv``, ``summary.csv``, ``report.html``.

    Censoring: a capped run enters the medians and tests at ``max_steps`` (a lower bound
    on its true time), which biases ratios toward 1; ``censored`` counts them per cell.

    Returns:
        The per-cell summary table.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cells = [(pe, c, s) for pe in grid.pes for c in grid.constraints for s in range(grid.seeds)]
    results = []
    for pe, c, s in tqdm(cells, disable=not progress, desc="qk-constraints"):
        path = out / "cells" / f"{pe}-{c}-seed{s}.json"
        if path.exists():
            results.append(json.loads(path.read_text()))
            continue
        res = _run_cell(grid, pe, c, s)
        atomic_write_json(path, res)
        results.append(res)
    runs = pd.DataFrame(results)
    summary = _summarize(runs)
    for name, df in (("runs.csv", runs), ("summary.csv", summary)):
        with atomic_path(out / name) as tmp:
            df.to_csv(tmp, index=False)
    atomic_write_json(out / "run.json", {"grid": asdict(grid), "versions": versions(),
                                         "seconds": round(time.time() - t0, 1)})
    _report(grid, summary, runs).save(out / "report.html")
    return summary


def _report(grid, summary, runs):
    import matplotlib.pyplot as plt

    from ..viz import Report

    rep = Report("QK constraints and learning speed (induction at random offsets)")
    rep.paragraph(f"2-layer attention-only models, d_model {grid.d_model}, {grid.n_heads} heads, "
                  f"{grid.seeds} seeds, cap {grid.max_steps} steps, target accuracy "
                  f"{grid.target}. Ratios are medians of steps-to-target over the control "
                  "(tied for constraints, untied for tied); censored runs count at the cap.",
                  note=True)
    rep.table(summary)
    d = summary[summary.ratio.notna()]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(d) + 1.2))
    y = np.arange(len(d))
    ax.errorbar(d.ratio, y, xerr=[d.ratio - d.ci_low.fillna(d.ratio),
                                  d.ci_high.fillna(d.ratio) - d.ratio], fmt="o")
    ax.axvline(1, color="grey", lw=0.8)
    ax.set_yticks(y)
    ax.set_yticklabels(d.pe + " / " + d.constraint, fontsize=7)
    ax.set_xlabel("steps to target, ratio of medians to control (95% bootstrap CI)")
    fig.tight_layout()
    rep.figure(fig, "ratios")
    return rep
