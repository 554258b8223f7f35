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
reported as such, never dropped. Per (pe, constraint, control): median steps, the
ratio of medians to the control with a bootstrap 95% CI, a one-sided Mann-Whitney test
(slower than the control), and Benjamini-Hochberg q-values across all comparisons.
Each constraint is compared with ``tied``, its control from the same family (DESIGN
section 2: this isolates the channel from the tying), and also with the untied
``none`` model (the whole cost of the constraint, which is what a "symmetrizing slows
learning 2.9x" claim measures when it does not name a control).

Every cell runs with one torch thread, in-process or in one of ``workers`` processes,
so its numbers do not depend on ``workers``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats

from .._validate import require_at_least
from ..analysis.heads import previous_token_scores, random_tokens
from ..analysis.spectral import antisymmetric_energy, is_rotary, qk_weights
from ..interventions.constraints import CONSTRAINTS, constrain_qk
from ..io import atomic_path, atomic_write_json, check_out_dir, versions
from ..models.toy import PE_SCHEMES, ToyModelConfig, build_model
from ..train import TrainConfig, fit

__all__ = ["ConstraintGrid", "claims_table", "heads_table", "induction_batch",
           "run_qk_constraints"]


@dataclass(frozen=True)
class ConstraintGrid:
    """The experiment's grid and budget.

    Calibration (seed 0, this cap): untied absolute reaches 90% at ~450 steps, untied
    rotary at ~1,600, tied and symmetric rotary at ~650 and ~1,000, while tied and
    symmetric absolute were still at ~65% at 2,000 (censored). Cells take 10-40 s on
    one thread, so the default grid (120 cells) takes about 30-40 minutes with the
    default 2 workers on 2 cores.
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
    workers: int = 2

    def __post_init__(self):
        require_at_least(self, ("seeds", "max_steps", "eval_every", "workers"))
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target}")
        for name, allowed in (("pes", tuple(PE_SCHEMES)), ("constraints", ("none", *CONSTRAINTS))):
            values = getattr(self, name)
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{name} must be a non-empty tuple without repeats, got {values}")
            if set(values) - set(allowed):
                raise ValueError(f"{name} must be among {allowed}, got {values}")

    @classmethod
    def quick(cls) -> ConstraintGrid:
        """Smoke run (~1.5 min): absolute and rotary x none/tied/symmetric x 2 seeds, 200
        steps. Too short to reach the target, so every cell is censored by design."""
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


@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_cell(grid: ConstraintGrid, pe: str, constraint: str, seed: int) -> dict:
    with _one_thread():
        return _train_cell(grid, pe, constraint, seed)


def _train_cell(grid: ConstraintGrid, pe: str, constraint: str, seed: int) -> dict:
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
            "censored": not reached, "final_accuracy": float(accs.iloc[-1]) if len(accs) else float("nan"),
            **_previous_token_head(model, seed)}


@torch.no_grad()
def _previous_token_head(model, seed: int) -> dict:
    """The final model's strongest previous-token head and the symmetry of its M.

    Evidence for the claim that a RoPE head with a symmetric M(0) can still route by
    position: the head's previous-token score on random tokens next to a(M(0)) and
    a(M(-1)) (antisymmetric energy; M(-1) is what RoPE's phase makes of M(0) one
    position back).
    """
    tokens = random_tokens(model, 64, model.cfg.n_ctx, seed=20_000 + seed, bos=False)
    scores = previous_token_scores(model, tokens)
    best = scores.loc[scores.value.idxmax()]
    layer, head = int(best["layer"]), int(best["head"])
    out = {"prev_head": f"L{layer}H{head}", "prev_score": float(best["value"])}
    for off in ([0, -1] if is_rotary(model) else [0]):
        W_Q, W_K = qk_weights(model, layer, off)
        out[f"prev_head_antisymmetric_energy_offset{off}"] = float(
            antisymmetric_energy(W_Q[head], W_K[head]))
    return out


def _compare(a: np.ndarray, b: np.ndarray, seed: int) -> dict:
    row = dict(ratio=np.median(a) / np.median(b), ci_low=np.nan, ci_high=np.nan,
               p_one_sided=stats.mannwhitneyu(a, b, alternative="greater").pvalue)
    if len(a) >= 2 and len(b) >= 2:
        ci = stats.bootstrap((a, b), lambda x, y: np.median(x) / np.median(y),
                             vectorized=False, n_resamples=2000, method="percentile",
                             random_state=np.random.default_rng(seed)).confidence_interval
        row["ci_low"], row["ci_high"] = ci.low, ci.high
    return row


def _summarize(runs: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    rows = []
    for (pe, constraint), g in runs.groupby(["pe", "constraint"], sort=False):
        base = dict(pe=pe, constraint=constraint, n=len(g), censored=int(g.censored.sum()),
                    median_steps=float(g.steps.median()))
        controls = {"none": [], "tied": ["none"]}.get(constraint, ["tied", "none"])
        controls = [c for c in controls if (runs[runs.pe == pe].constraint == c).any()]
        if not controls:
            rows.append({**base, "control": "", "control_censored": np.nan, "ratio": np.nan,
                         "ci_low": np.nan, "ci_high": np.nan, "p_one_sided": np.nan})
        for control in controls:
            c = runs[(runs.pe == pe) & (runs.constraint == control)]
            rows.append({**base, "control": control, "control_censored": int(c.censored.sum()),
                         **_compare(g.steps.to_numpy(float), c.steps.to_numpy(float), seed)})
    out = pd.DataFrame(rows)
    ok = out.p_one_sided.notna()
    out["q_bh"] = np.nan
    if ok.any():
        out.loc[ok, "q_bh"] = stats.false_discovery_control(out.loc[ok, "p_one_sided"], method="bh")
    return out


BANNED_CHANNELS = ("symmetric", "no_positive_real", "no_negative_real")
CLAIMED_SLOWDOWN = 2.9
# previous-token score that counts as routing by position, fixed before the first full
# run; uniform causal attention scores mean(1/(i+1), i=1..31) = 0.10 at n_ctx 32
ROUTES_BY_POSITION = 0.5


def heads_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (pe, constraint): the final models' strongest previous-token heads.

    Columns: ``median_prev_score`` (attention on the previous token, [0, 1]),
    ``max_antisymmetric_energy_offset0`` (a(M(0)) of that head; 0 means symmetric) and,
    for rotary models, ``median_antisymmetric_energy_offset-1``.

    Raises:
        KeyError: if ``runs`` lacks the per-cell head columns.

    Source:
        DESIGN section 2 (antisymmetric energy a(M), previous-token score); the claim
        it serves is #3 of docs/reproductions/qk-constraints.md.
    """
    agg = {"censored": ("censored", "sum"), "n": ("censored", "size"),
           "median_prev_score": ("prev_score", "median"),
           "max_antisymmetric_energy_offset0": ("prev_head_antisymmetric_energy_offset0", "max")}
    if "prev_head_antisymmetric_energy_offset-1" in runs:
        agg["median_antisymmetric_energy_offset-1"] = (
            "prev_head_antisymmetric_energy_offset-1", "median")
    return runs.groupby(["pe", "constraint"], sort=False).agg(**agg).reset_index()


def _ratio_verdict(r, claimed: float) -> tuple[str, str]:
    """Does a ratio row support ``claimed``? Returns (verdict, bound prefix of the ratio).

    A fully censored side makes the ratio a bound, not an estimate: every constrained
    run censored gives a lower bound, which refutes the claim only if it already
    exceeds it; a fully censored control gives an upper bound, likewise.
    """
    lo = r.ci_low if np.isfinite(r.ci_low) else r.ratio
    hi = r.ci_high if np.isfinite(r.ci_high) else r.ratio
    all_cens, all_ctrl = r.censored == r.n, r.control_censored == r.n
    if all_cens and all_ctrl:
        return "undetermined", "? "
    if all_cens:
        return ("fails" if lo > claimed else "undetermined"), ">= "
    if all_ctrl:
        return ("fails" if hi < claimed else "undetermined"), "<= "
    return ("holds" if lo <= claimed <= hi else "fails"), ""


def claims_table(summary: pd.DataFrame, grid: ConstraintGrid,
                 heads: pd.DataFrame | None = None) -> pd.DataFrame:
    """The published claims set against a summary from :func:`run_qk_constraints`.

    Rows: symmetrizing slows absolute-PE learning ~2.9x (vs each control); each banned
    channel (``symmetric`` is the "no complex channel" ban in the tied family) slows
    learning (one-sided q <= 0.05 vs ``tied``) but never prevents it (no run censored
    at ``grid.max_steps``). A side whose runs are all censored turns the ratio into a
    bound, and the verdict into "undetermined" unless the bound already refutes the
    claim; when the ``tied`` control itself never reached the target, neither
    "slows" (if every constrained run is censored too) nor "prevents" can be judged.
    With ``heads`` (from :func:`heads_table`): a RoPE model
    whose M is symmetric still routes by position, i.e. its strongest previous-token
    head has a(M(0)) < 1e-6 and a median previous-token score >= 0.5. ``verdict`` is
    "holds", "fails" or "undetermined" (when censoring on both sides hides the ratio).

    Raises:
        KeyError: if ``summary`` lacks the columns :func:`run_qk_constraints` writes.

    Source:
        The claims as summarized in issue #5 and docs/reproductions/qk-constraints.md
        (the study itself is known to us only in summary); censoring per DESIGN
        section 2, "Learning speed".
    """
    rows = []
    summary = summary[summary.ratio.notna()]
    sym = summary[(summary.pe == "absolute") & (summary.constraint == "symmetric")]
    for _, r in sym.iterrows():
        verdict, bound = _ratio_verdict(r, CLAIMED_SLOWDOWN)
        rows.append(dict(claim=f"symmetric M slows absolute PE ~{CLAIMED_SLOWDOWN}x "
                               f"(vs {r.control})",
                         measured=f"{bound}{r.ratio:.2f}x [{r.ci_low:.2f}, {r.ci_high:.2f}], "
                                  f"censored {r.censored}/{r.n} vs {int(r.control_censored)}/{r.n}",
                         verdict=verdict))
    banned = summary[summary.constraint.isin(BANNED_CHANNELS) & (summary.control == "tied")]
    for _, r in banned.iterrows():
        # a control that never reached the target says nothing about what the ban costs
        blind = r.control_censored == r.n
        slower = "holds" if r.q_bh <= 0.05 else "fails"
        rows.append(dict(claim=f"{r.pe}: banning via {r.constraint} slows learning (q <= 0.05)",
                         measured=f"{r.ratio:.2f}x, q = {r.q_bh:.3g}, control censored "
                                  f"{int(r.control_censored)}/{r.n}",
                         verdict="undetermined" if blind and r.censored == r.n else slower))
        prevented = "holds" if r.censored == 0 else ("undetermined" if blind else "fails")
        rows.append(dict(claim=f"{r.pe}: {r.constraint} never prevents learning",
                         measured=f"{r.n - r.censored}/{r.n} runs reached {grid.target} "
                                  f"within {grid.max_steps} steps (control "
                                  f"{int(r.n - r.control_censored)}/{r.n})",
                         verdict=prevented))
    if heads is not None:
        for _, r in heads[(heads.pe == "rotary") & (heads.constraint == "symmetric")].iterrows():
            a0, score = r.max_antisymmetric_energy_offset0, r.median_prev_score
            rows.append(dict(
                claim="rotary: a head with symmetric M(0) still routes by position",
                measured=f"a(M(0)) <= {a0:.1e}, a(M(-1)) median "
                         f"{r.get('median_antisymmetric_energy_offset-1', np.nan):.2f}, "
                         f"previous-token score median {score:.2f}",
                verdict=("undetermined" if r.get("censored", 0) == r.get("n", -1)  # never learned
                         else "holds" if a0 < 1e-6 and score >= ROUTES_BY_POSITION else "fails")))
    return pd.DataFrame(rows, columns=["claim", "measured", "verdict"])


def run_qk_constraints(grid: ConstraintGrid = ConstraintGrid(), out_dir="posinterp-qk-constraints",
                       progress: bool = True) -> pd.DataFrame:
    """Run (or resume) every cell, then write ``runs.csv``, ``summary.csv``, ``report.html``.

    Each finished cell is written at once to ``cells/<pe>-<constraint>-seed<s>.json``
    (atomically), so an interrupted run resumes cell by cell. ``grid.workers`` processes
    share the cells; they are spawned, so a script that calls this with ``workers > 1``
    needs the usual ``if __name__ == "__main__":`` guard. Also writes ``heads.csv``,
    ``claims.csv``, ``grid.json`` (the budget, checked on resume) and ``run.json``. The
    tables describe this call's grid: a smaller grid into the same folder rewrites
    them for its own cells (the other cells stay on disk).

    Censoring: a capped run enters the medians and tests at ``max_steps`` (a lower bound
    on its true time), which biases ratios toward 1 when the constrained runs are
    censored and away from 1 when the control is; ``censored`` and
    ``control_censored`` count them per row.

    Args:
        grid: the cells and their budget.
        out_dir: output folder; its ``cells/`` are reused when the grid matches.
        progress: show a tqdm bar over cells.

    Returns:
        The summary table, one row per (pe, constraint, control): ``n``, ``censored``,
        ``median_steps`` (optimizer steps), ``ratio`` of medians to the control with its
        bootstrap 95% CI, one-sided Mann-Whitney ``p_one_sided`` and BH ``q_bh``.

    Raises:
        ValueError: if ``out_dir`` holds cells from a different grid (resuming them
            would mix budgets).

    Source:
        DESIGN section 2, "Learning speed"; the claims tested are summarized in
        docs/interventions.md.
    """
    from tqdm.auto import tqdm

    out = Path(out_dir)
    check_out_dir(out, "out_dir")
    (out / "cells").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cells = [(pe, c, s) for pe in grid.pes for c in grid.constraints for s in range(grid.seeds)]
    budget = {k: v for k, v in asdict(grid).items()
              if k not in ("pes", "constraints", "seeds", "workers")}
    grid_file = out / "grid.json"
    if grid_file.exists() and json.loads(grid_file.read_text()) != budget:
        old = json.loads(grid_file.read_text())
        diff = {k: (old.get(k), v) for k, v in budget.items() if old.get(k) != v}
        raise ValueError(f"out_dir {str(out)!r} holds cells from another grid budget "
                         f"(stored vs requested: {diff}); use a new out_dir")
    atomic_write_json(grid_file, budget)
    done, todo = {}, []
    for cell in cells:
        path = out / "cells" / "{}-{}-seed{}.json".format(*cell)
        if path.exists():
            done[cell] = json.loads(path.read_text())
        else:
            todo.append(cell)
    bar = tqdm(total=len(cells), initial=len(done), disable=not progress, desc="qk-constraints")

    def finish(cell, res):
        atomic_write_json(out / "cells" / "{}-{}-seed{}.json".format(*cell), res)
        done[cell] = res
        bar.update()

    if grid.workers == 1 or len(todo) <= 1:
        for cell in todo:
            finish(cell, _run_cell(grid, *cell))
    else:
        # spawn, not fork: forking a process that has used torch's thread pool can hang
        ctx = multiprocessing.get_context("spawn")
        # more one-thread workers than cores only adds contention
        n = min(grid.workers, len(todo), os.cpu_count() or 1)
        with ProcessPoolExecutor(max(n, 1), mp_context=ctx) as pool:
            futures = {pool.submit(_run_cell, grid, *cell): cell for cell in todo}
            for fut in as_completed(futures):
                finish(futures[fut], fut.result())
    bar.close()
    results = [done[cell] for cell in cells]
    runs = pd.DataFrame(results)
    # cells read back from JSON come with sorted keys; keep one column order
    first = ["pe", "constraint", "seed", "steps", "censored", "final_accuracy", "prev_head",
             "prev_score"]
    runs = runs[[c for c in first if c in runs] + sorted(c for c in runs if c not in first)]
    summary = _summarize(runs)
    heads = heads_table(runs)
    claims = claims_table(summary, grid, heads)
    for name, df in (("runs.csv", runs), ("summary.csv", summary), ("heads.csv", heads),
                     ("claims.csv", claims)):
        with atomic_path(out / name) as tmp:
            df.to_csv(tmp, index=False)
    atomic_write_json(out / "run.json", {"grid": asdict(grid), "versions": versions(),
                                         "seconds": round(time.time() - t0, 1)})
    _report(grid, summary, heads, claims).save(out / "report.html")
    return summary


def _report(grid, summary, heads, claims):
    import matplotlib.pyplot as plt

    from ..viz import Report

    rep = Report("QK constraints and learning speed (induction at random offsets)")
    rep.paragraph(f"2-layer attention-only models, d_model {grid.d_model}, {grid.n_heads} heads, "
                  f"{grid.seeds} seeds, cap {grid.max_steps} steps, target accuracy "
                  f"{grid.target}. Ratios are medians of steps-to-target over a control: "
                  "'tied' (same parametrization family, no ban) and 'none' (the untied "
                  "model). Censored runs count at the cap, so a ratio is a bound when "
                  "either side is censored.", note=True)
    rep.table(claims)
    rep.table(summary)
    rep.paragraph("Strongest previous-token head of each final model (random tokens), and "
                  "the antisymmetric energy a(M) of its QK circuit at offsets 0 and -1.",
                  note=True)
    rep.table(heads)
    d = summary[summary.ratio.notna()].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(7.5, 0.3 * len(d) + 1.4))
    for control, marker, colour in (("tied", "o", "C0"), ("none", "s", "C1")):
        sel = d[d.control == control]
        if not len(sel):
            continue
        lo = (sel.ratio - sel.ci_low.fillna(sel.ratio)).clip(lower=0)
        hi = (sel.ci_high.fillna(sel.ratio) - sel.ratio).clip(lower=0)
        ax.errorbar(sel.ratio, sel.index, xerr=[lo, hi], fmt=marker, color=colour,
                    label=f"vs {control}")
        cens, ctrl = sel.censored == sel.n, sel.control_censored == sel.n
        for mask, mark in ((cens & ctrl, "x"), (cens & ~ctrl, ">"), (~cens & ctrl, "<")):
            ax.scatter(sel.ratio[mask], sel.index[mask], marker=mark, s=60, color="k", zorder=3)
    ax.axvline(1, color="grey", lw=0.8)
    ax.set_xscale("log")
    ticks = [0.125, 0.25, 0.5, 1, 2, 4, 8]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.set_yticks(d.index)
    ax.set_yticklabels(d.pe + " / " + d.constraint + " vs " + d.control, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("steps to target: ratio of medians to control (95% bootstrap CI)\n"
                  "every run censored: > constrained side (a lower bound), < control "
                  "(an upper bound), x both (no information)", fontsize=8)
    if len(d):
        ax.legend(fontsize=7)
    fig.tight_layout()
    rep.figure(fig, "ratios")
    return rep
