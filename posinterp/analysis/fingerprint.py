"""Positional-encoding fingerprints: do RoPE models' previous-token heads rotate?

Per model, rank heads by their previous-token score on random tokens, take the mean
rotational measure (offset 0 for rotary heads) of the top-k heads, k = 1..K, and compare
RoPE with non-RoPE models at each k with an exact one-sided permutation test, then
Benjamini-Hochberg across k (docs/concepts.md, "PE-scheme statistics").

**Units.** The test counts independent models, one value per unit: zoo models that
differ only in their seed are one unit (``units="family"``, the default: their values
are averaged first), since they share data, architecture and code; ``units="model"``
counts each seed. A model whose best previous-token score (random tokens) is below
``min_prev_score`` has no previous-token head to fingerprint: it is flagged and left
out of the test (still tabulated).

**Power.** With n_R RoPE and n_O other units the smallest reachable p is
1 / C(n_R + n_O, n_R): 4 vs 3 give 1/35 = 0.029. Every table says so.

**Dynamics.** :func:`head_dynamics` tabulates heads at every training snapshot; the
test of co-emergence is by onset times (:mod:`posinterp.analysis.onset`).
:func:`trajectory_correlations` correlates, within each head, its previous-token score
and its rotational mass over the snapshots (Spearman, one value per head;
:func:`dynamics_summary` one row per model): descriptive only, not a test, since any two
quantities that drift during training correlate.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pandas as pd
from scipy import stats

from ..stats import bh_qvalues, permutation_p_floor
from .heads import _has_bos, previous_token_scores, random_tokens
from .spectral import (
    MEASURES,
    NULL_HEADS,
    ginibre_null,
    is_rotary,
    null_percentiles,
    spectral_measures,
)

__all__ = ["MIN_PREV_SCORE", "PRIMARY_K", "dynamics_summary", "exact_group_test", "unit_table",
           "unit_test", "fingerprint_table", "fingerprint_test",
           "head_dynamics", "head_table", "model_unit", "scheme_group", "trajectory_correlations"]

# A model's best previous-token score must reach this to count as having a previous-token
# head: a head that puts a third of its attention on the previous token is well clear of
# uniform causal attention (mean(1/(i+1)) = 0.099 over 32 tokens, 0.059 over 64). Set in
# 2897f91 after the first, withdrawn fingerprint page had been seen (the page lists it under
# "Choices made after seeing results"); unchanged since, before every zoo family trained.
MIN_PREV_SCORE = 0.3
UNITS = ("family", "model")
# The unit-level test's primary k (docs/reproductions/fingerprints.md, "Design"): a unit's
# value is the mean over its top-2 previous-token heads that reach MIN_PREV_SCORE. Fixed
# before the zoo families were trained; k = 1 and 3 are sensitivity rows.
PRIMARY_K = 2


def model_unit(spec: str, units: str = "family") -> str:
    """The independent unit a model spec belongs to.

    ``family``: ``zoo:<pe>[:<seed>][@<step>]`` -> ``zoo:<pe>`` (seeds of one zoo scheme
    share data, architecture and code: one unit); anything else is its own unit.
    ``model``: every spec (without ``@step``) is its own unit.

    Raises:
        ValueError: for ``units`` not in ``("family", "model")``.
    """
    if units not in UNITS:
        raise ValueError(f"units must be one of {UNITS}, got {units!r}")
    body = str(spec).split("@")[0]
    if units == "family" and body.startswith("zoo:"):
        return ":".join(body.split(":")[:2])
    return body


@functools.lru_cache(maxsize=8)
def _null(d_model: int, d_head: int, n_null: int, std: float, k_e, seed: int) -> pd.DataFrame:
    # the same null serves every snapshot and every model of one shape (read-only)
    return ginibre_null(d_model, d_head, n_heads=n_null, std=std, k_e=k_e, seed=seed)


def head_table(model, *, n_sequences: int = 16, n_tokens: int = 64, seed: int = 0,
               k_e: int | None = None, n_null: int = NULL_HEADS, null_std: float = 0.02,
               tokens=None, weights: tuple[str, ...] = ("effective",)) -> pd.DataFrame:
    """One row per head: previous-token score, rotational measures, null percentiles.

    The previous-token score is measured on ``tokens`` (``[batch, pos]`` ids; every
    query i >= 1 counts) or, when None, on ``n_sequences`` uniform random token
    sequences of ``min(n_tokens, n_ctx)`` tokens (BOS first when the tokenizer has
    one). ``weights``: the conventions whose measures are tabulated (:func:`~posinterp.
    analysis.spectral.qk_weights`); the first is unprefixed, any other adds its columns
    with the prefix ``<convention>_`` (``stored_rotational_mass_null_percentile``, ...).
    Measures use offset 0 for rotary heads (the raw
    W_Q W_K^T) and are compared with a product-Ginibre null of the same d_model and
    d_head (measures are scale-free, so ``null_std`` only matters for reproducibility).

    Returns:
        Wide DataFrame: ``layer, head, previous_token_score``, the measures,
        ``<measure>_null_percentile`` (0-100) with ``<measure>_null_percentile_se`` (its
        Monte Carlo standard error, percentile points; <= 1 with the default
        ``n_null``), and ``offset``.

    Raises:
        ValueError: as :func:`~posinterp.analysis.spectral_measures`.
    """
    if tokens is None:
        n_tok = min(n_tokens, model.cfg.n_ctx)
        tokens = random_tokens(model, n_sequences, n_tok, seed=seed, bos=_has_bos(model))
    prev = previous_token_scores(model, tokens)[["layer", "head", "value"]]
    prev = prev.rename(columns={"value": "previous_token_score"})
    offset = 0 if is_rotary(model) else None
    null = _null(model.cfg.d_model, model.cfg.d_head, n_null, null_std, k_e, seed)
    out = prev
    for i, convention in enumerate(weights):
        meas = spectral_measures(model, offset=offset, k_e=k_e, weights=convention)
        long = pd.concat([meas, null_percentiles(meas, null)], ignore_index=True)
        wide = long.pivot_table(index=["layer", "head"], columns="metric",
                                values="value").reset_index()
        wide.columns.name = None
        if i:
            wide = wide.rename(columns={c: f"{convention}_{c}" for c in wide.columns
                                        if c not in ("layer", "head")})
        else:
            wide["offset"] = pd.array([offset] * len(wide), dtype="Int64")
        out = out.merge(wide, on=["layer", "head"])
    return out


def scheme_group(pe: str, causal: bool = True, nope: str = "exclude") -> str | None:
    """Which side of the test a model joins: ``rope``, ``other`` or None (excluded).

    Bidirectional encoders are excluded (their heads see both directions). NoPE models
    are excluded by default (``nope="other"`` puts them with the non-RoPE models).
    """
    if not causal:
        return None
    if pe == "rotary":
        return "rope"
    if pe == "nope":
        return "other" if nope == "other" else None
    return "other"


def fingerprint_table(heads: dict[str, pd.DataFrame], schemes: dict[str, tuple[str, bool]],
                      K: int = 5, measure: str = "rotational_mass", nope: str = "exclude",
                      units: str = "family", min_prev_score: float = MIN_PREV_SCORE
                      ) -> pd.DataFrame:
    """Mean ``measure`` over each model's top-k previous-token heads, k = 1..K.

    Args:
        heads: model name -> :func:`head_table`.
        schemes: model name -> (pe, causal).
        K: largest k (capped at each model's head count).
        units: how models group into independent units (:func:`model_unit`).
        min_prev_score: a model whose best previous-token score is below this is
            flagged (``has_prev_head`` False) and left out of :func:`fingerprint_test`.

    Returns:
        Tidy rows ``model, unit, pe, group, has_prev_head, best_prev_score, k, metric,
        value`` (``metric`` = ``measure``).

    Raises:
        ValueError: for an unknown measure or ``units``, K < 1 or a model without a scheme.
    """
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    if K < 1:
        raise ValueError(f"K must be >= 1, got {K}")
    rows = []
    for name, table in heads.items():
        if name not in schemes:
            raise ValueError(f"no (pe, causal) given for model {name!r}")
        pe, causal = schemes[name]
        ranked = table.sort_values("previous_token_score", ascending=False, kind="stable")
        best = float(ranked.previous_token_score.iloc[0])
        for k in range(1, min(K, len(ranked)) + 1):
            rows.append(dict(model=name, unit=model_unit(name, units), pe=pe,
                             group=scheme_group(pe, causal, nope),
                             has_prev_head=best >= min_prev_score, best_prev_score=best, k=k,
                             metric=measure, value=float(ranked[measure].iloc[:k].mean())))
    return pd.DataFrame(rows)


def fingerprint_test(table: pd.DataFrame) -> pd.DataFrame:
    """RoPE > other at each k over independent units: exact one-sided permutation test,
    BH across k.

    Rows of models without a previous-token head (``has_prev_head`` False) or outside
    both groups are left out; the remaining models' values are averaged within each
    ``unit`` (one value per unit). The statistic is the difference of group means; all
    C(n, n_R) relabellings are enumerated (``scipy.stats.permutation_test``). Also
    reports Mann-Whitney's exact one-sided p and the smallest p the design can reach.

    Returns:
        One row per k: ``k, n_rope, n_other`` (units), ``mean_rope, mean_other,
        p_permutation, q_bh, p_mannwhitney, min_possible_p, separated`` (every RoPE
        value above every other) and a ``note`` on power and exclusions; empty (with
        the note) when no unit is left.
    """
    table = table.copy()
    if "has_prev_head" not in table:
        table["has_prev_head"] = True
    if "unit" not in table:
        table["unit"] = table.model
    used = table[table.group.notna() & table.has_prev_head.astype(bool)]
    flagged = sorted(set(table[~table.has_prev_head.astype(bool)].model))
    used = used.groupby(["unit", "group", "k"], as_index=False).value.mean()
    rows = []
    for k, g in used.groupby("k"):
        rope = g[g.group == "rope"].value.to_numpy()
        other = g[g.group == "other"].value.to_numpy()
        n_r, n_o = len(rope), len(other)
        row = dict(k=k, n_rope=n_r, n_other=n_o,
                   mean_rope=rope.mean() if n_r else np.nan,
                   mean_other=other.mean() if n_o else np.nan,
                   p_permutation=np.nan, p_mannwhitney=np.nan,
                   min_possible_p=permutation_p_floor(n_r, n_o) if n_r and n_o else np.nan,
                   separated=bool(n_r and n_o and rope.min() > other.max()))
        if n_r and n_o:
            row["p_mannwhitney"] = float(stats.mannwhitneyu(rope, other, alternative="greater",
                                                            method="exact").pvalue)
        if n_r >= 2 and n_o >= 2:  # scipy's permutation_test needs two per sample
            res = stats.permutation_test(
                (rope, other), lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
                permutation_type="independent", alternative="greater", n_resamples=np.inf,
                vectorized=True)
            row["p_permutation"] = float(res.pvalue)
        rows.append(row)
    out = pd.DataFrame(rows)
    out["q_bh"] = bh_qvalues(out.p_permutation) if len(out) else np.nan
    left_out = (f"; left out (no previous-token head): {', '.join(flagged)}" if flagged else "")
    if len(out):
        min_p = out.min_possible_p.iloc[0]
        n_r, n_o = int(out.n_rope.iloc[0]), int(out.n_other.iloc[0])
        # an empty group has no floor to print: say which group is empty, not "p is nan"
        power = (f"the smallest reachable p is {min_p:.3g}"
                 + ("; this design cannot reach p < 0.05" if not min_p < 0.05 else "")
                 if n_r and n_o else
                 "no test: the " + ("RoPE and other groups are" if not (n_r or n_o) else
                                    "RoPE group is" if not n_r else "other group is") + " empty")
        out["note"] = f"{n_r} RoPE vs {n_o} other units: {power}{left_out}"
    else:
        out = pd.DataFrame(columns=["k", "n_rope", "n_other", "mean_rope", "mean_other",
                                    "p_permutation", "p_mannwhitney", "min_possible_p",
                                    "separated", "q_bh", "note"])
        out.attrs["note"] = "no unit left to test" + left_out
    return out


def head_dynamics(snapshots, **head_table_kwargs) -> pd.DataFrame:
    """:func:`head_table` at every training step: how spectra and behaviour co-evolve.

    Args:
        snapshots: iterable of ``(step, model)``, e.g. a zoo model's log-spaced snapshots.

    Returns:
        The head tables stacked with a ``step`` column.
    """
    frames = [head_table(model, **head_table_kwargs).assign(step=step) for step, model in snapshots]
    return pd.concat(frames, ignore_index=True)


def trajectory_correlations(dynamics: pd.DataFrame, x: str = "previous_token_score",
                            y: str = "rotational_mass") -> pd.DataFrame:
    """Within-head Spearman correlation of ``x`` and ``y`` over training snapshots.

    One value per head (model, layer, head), from that head's own trajectory: heads and
    snapshots are never pooled. A head whose ``x`` or ``y`` is constant over its
    snapshots gets NaN.

    Args:
        dynamics: :func:`head_dynamics` output stacked over models, with a ``model`` column
            (one is added if missing).

    Returns:
        ``model, layer, head, n_steps, rho, final_<x>`` rows.

    Raises:
        ValueError: if a head has fewer than 3 snapshots (no correlation to speak of).

    Source: issue 14 (the dynamics statistic as committed code); Spearman via
    ``scipy.stats.spearmanr``.
    """
    dyn = dynamics if "model" in dynamics else dynamics.assign(model="model")
    rows = []
    for (model, layer, head), g in dyn.groupby(["model", "layer", "head"], sort=False):
        g = g.sort_values("step")
        if len(g) < 3:
            raise ValueError(f"head {model} L{layer}H{head} has {len(g)} snapshots; need >= 3")
        const = g[x].nunique() < 2 or g[y].nunique() < 2
        rho = np.nan if const else float(stats.spearmanr(g[x], g[y]).statistic)
        rows.append({"model": model, "layer": int(layer), "head": int(head), "n_steps": len(g),
                     "rho": rho, f"final_{x}": float(g[x].iloc[-1])})
    return pd.DataFrame(rows)


def dynamics_summary(corr: pd.DataFrame, x: str = "previous_token_score") -> pd.DataFrame:
    """One row per model from :func:`trajectory_correlations`.

    Columns: ``n_heads``, ``median_rho`` (over heads), ``share_negative`` (heads with
    rho < 0 among those with a value), and ``rho_top_head``: rho of the head with the
    highest final ``x`` (the model's strongest previous-token head at the end).
    """
    rows = []
    for model, g in corr.groupby("model", sort=False):
        ok = g.rho.dropna()
        top = g.loc[g[f"final_{x}"].idxmax()]
        rows.append({"model": model, "n_heads": len(g), "median_rho": float(ok.median()) if len(ok)
                     else np.nan, "share_negative": float((ok < 0).mean()) if len(ok) else np.nan,
                     "top_head": f"L{int(top.layer)}H{int(top['head'])}",
                     "rho_top_head": float(top.rho)})
    return pd.DataFrame(rows)


def unit_table(heads: pd.DataFrame, column: str = "rotational_mass_null_percentile", *,
               k: int = PRIMARY_K, threshold: float = MIN_PREV_SCORE,
               nope: str = "exclude") -> pd.DataFrame:
    """One value per independent unit: the mean ``column`` over the unit's top-k
    previous-token heads that reach ``threshold``.

    Heads are ranked by ``previous_token_score`` (ties by table order); of the top ``k``,
    those scoring below ``threshold`` are dropped, and a unit with none left has no
    previous-token head (``value`` NaN, left out of :func:`unit_test`).

    Args:
        heads: one row per head with ``unit, pe, previous_token_score`` and ``column``
            (e.g. :func:`head_table` rows with a ``unit`` column; a unit is one model or
            the heads of models averaged in advance, never several seeds pooled here).
        column: the per-head measure, e.g. ``rotational_mass_null_percentile`` (0-100).
        nope: as :func:`scheme_group`.

    Returns:
        ``unit, pe, group, best_prev_score, n_heads_used, heads_used, value`` (one row per
        unit, in first-seen order).

    Raises:
        ValueError: for k < 1, a missing column, or a unit with two schemes.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    missing = {"unit", "pe", "previous_token_score", column} - set(heads.columns)
    if missing:
        raise ValueError(f"heads lacks columns {sorted(missing)}")
    rows = []
    for unit, g in heads.groupby("unit", sort=False):
        if g.pe.nunique() != 1:
            raise ValueError(f"unit {unit!r} has several schemes: {sorted(g.pe.unique())}")
        top = g.sort_values("previous_token_score", ascending=False, kind="stable").head(k)
        used = top[top.previous_token_score >= threshold]
        names = [f"L{int(r.layer)}H{int(r.head)}" for r in used.itertuples()] \
            if {"layer", "head"} <= set(used.columns) else []
        pe = g.pe.iloc[0]
        rows.append(dict(unit=unit, pe=pe, group=scheme_group(pe, True, nope),
                         best_prev_score=float(top.previous_token_score.iloc[0]),
                         n_heads_used=len(used), heads_used=" ".join(names),
                         value=float(used[column].mean()) if len(used) else np.nan))
    return pd.DataFrame(rows)


def exact_group_test(rope, other) -> dict:
    """RoPE > other: exact one-sided permutation test of the difference of means.

    All C(n_R + n_O, n_R) relabellings are enumerated (``scipy.stats.permutation_test``
    with ``n_resamples=inf``; by hand when a group has one unit, which scipy refuses),
    so with every RoPE value above every other the p-value is the design's floor
    ``1 / C(n_R + n_O, n_R)``.

    Returns:
        ``n_rope, n_other, mean_rope, mean_other, p_permutation, p_mannwhitney,
        min_possible_p, separated`` (NaN p-values when a group is empty).
    """
    rope, other = np.asarray(rope, float), np.asarray(other, float)
    n_r, n_o = len(rope), len(other)
    row = dict(n_rope=n_r, n_other=n_o, mean_rope=rope.mean() if n_r else np.nan,
               mean_other=other.mean() if n_o else np.nan, p_permutation=np.nan,
               p_mannwhitney=np.nan,
               min_possible_p=permutation_p_floor(n_r, n_o) if n_r and n_o else np.nan,
               separated=bool(n_r and n_o and rope.min() > other.max()))
    if not (n_r and n_o):
        return row
    row["p_mannwhitney"] = float(stats.mannwhitneyu(rope, other, alternative="greater",
                                                    method="exact").pvalue)
    if n_r >= 2 and n_o >= 2:
        res = stats.permutation_test(
            (rope, other), lambda x, y, axis: np.mean(x, axis=axis) - np.mean(y, axis=axis),
            permutation_type="independent", alternative="greater", n_resamples=np.inf,
            vectorized=True)
        row["p_permutation"] = float(res.pvalue)
    else:  # one unit on a side: n relabellings, which scipy does not enumerate
        both = np.concatenate([rope, other])
        stat = rope.mean() - other.mean()
        hits = 0
        for idx in itertools.combinations(range(len(both)), n_r):
            mask = np.zeros(len(both), bool)
            mask[list(idx)] = True
            hits += both[mask].mean() - both[~mask].mean() >= stat - 1e-12 * max(1, abs(stat))
        row["p_permutation"] = hits / math.comb(len(both), n_r)
    return row


def unit_test(units: pd.DataFrame) -> dict:
    """:func:`exact_group_test` over the units of :func:`unit_table` that have a
    previous-token head and a group; also lists the units left out.

    Returns:
        The test's fields plus ``left_out`` (units without a previous-token head, as
        ``"unit (best score)"``, comma-separated).
    """
    ok = units[units.group.notna() & units.value.notna()]
    row = exact_group_test(ok[ok.group == "rope"].value, ok[ok.group == "other"].value)
    gone = units[units.group.notna() & units.value.isna()]
    row["left_out"] = ", ".join(f"{u} ({s:.2f})" for u, s in
                                zip(gone.unit, gone.best_prev_score, strict=True))
    return row
