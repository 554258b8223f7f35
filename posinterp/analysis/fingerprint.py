"""Positional-encoding fingerprints: do RoPE models' previous-token heads rotate?

Per model, rank heads by their previous-token score on random tokens, take the mean
rotational measure (offset 0 for rotary heads) of the top-k heads, k = 1..K, and compare
RoPE with non-RoPE models at each k with an exact one-sided permutation test, then
Benjamini-Hochberg across k (docs/concepts.md, "PE-scheme statistics").

**Power.** With n_R RoPE and n_O other models the smallest reachable p is
1 / C(n_R + n_O, n_R): 4 vs 3 models give 1/35 = 0.029. Every table says so.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

from .heads import previous_token_scores, random_tokens
from .spectral import MEASURES, NULL_HEADS, ginibre_null, null_percentiles, spectral_measures

__all__ = ["fingerprint_table", "fingerprint_test", "head_dynamics", "head_table", "scheme_group"]


def _has_bos(model) -> bool:
    tok = getattr(model, "tokenizer", None)
    return tok is not None and getattr(tok, "bos_token_id", None) is not None


def head_table(model, *, n_sequences: int = 16, n_tokens: int = 64, seed: int = 0,
               k_e: int | None = None, n_null: int = NULL_HEADS, null_std: float = 0.02) -> pd.DataFrame:
    """One row per head: previous-token score, rotational measures, null percentiles.

    The previous-token score is measured on ``n_sequences`` uniform random token
    sequences of ``min(n_tokens, n_ctx)`` tokens (BOS first when the tokenizer has one;
    every query i >= 1 counts). Measures use offset 0 for rotary heads (the raw
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
    n_tok = min(n_tokens, model.cfg.n_ctx)
    toks = random_tokens(model, n_sequences, n_tok, seed=seed, bos=_has_bos(model))
    prev = previous_token_scores(model, toks)[["layer", "head", "value"]]
    prev = prev.rename(columns={"value": "previous_token_score"})
    offset = 0 if model.cfg.positional_embedding_type == "rotary" else None
    meas = spectral_measures(model, offset=offset, k_e=k_e)
    null = ginibre_null(model.cfg.d_model, model.cfg.d_head, n_heads=n_null, std=null_std,
                        k_e=k_e, seed=seed)
    long = pd.concat([meas, null_percentiles(meas, null)], ignore_index=True)
    wide = long.pivot_table(index=["layer", "head"], columns="metric", values="value").reset_index()
    wide.columns.name = None
    wide["offset"] = pd.array([offset] * len(wide), dtype="Int64")
    return prev.merge(wide, on=["layer", "head"])


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
                      K: int = 5, measure: str = "rotational_mass", nope: str = "exclude"
                      ) -> pd.DataFrame:
    """Mean ``measure`` over each model's top-k previous-token heads, k = 1..K.

    Args:
        heads: model name -> :func:`head_table`.
        schemes: model name -> (pe, causal).
        K: largest k (capped at each model's head count).

    Returns:
        Tidy rows ``model, pe, group, k, metric, value`` (``metric`` = ``measure``).

    Raises:
        ValueError: for an unknown measure, K < 1 or a model without a scheme.
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
        for k in range(1, min(K, len(ranked)) + 1):
            rows.append(dict(model=name, pe=pe, group=scheme_group(pe, causal, nope), k=k,
                             metric=measure, value=float(ranked[measure].iloc[:k].mean())))
    return pd.DataFrame(rows)


def fingerprint_test(table: pd.DataFrame) -> pd.DataFrame:
    """RoPE > other at each k: exact one-sided permutation test, BH across k.

    The statistic is the difference of group means; all C(n, n_R) relabellings are
    enumerated (``scipy.stats.permutation_test``). Also reports Mann-Whitney's exact
    one-sided p and the smallest p the design can reach.

    Returns:
        One row per k: ``k, n_rope, n_other, mean_rope, mean_other, p_permutation,
        q_bh, p_mannwhitney, min_possible_p, separated`` (``separated``: every RoPE
        value above every other) and a ``note`` on power.
    """
    rows = []
    for k, g in table[table.group.notna()].groupby("k"):
        rope = g[g.group == "rope"].value.to_numpy()
        other = g[g.group == "other"].value.to_numpy()
        n_r, n_o = len(rope), len(other)
        row = dict(k=k, n_rope=n_r, n_other=n_o,
                   mean_rope=rope.mean() if n_r else np.nan,
                   mean_other=other.mean() if n_o else np.nan,
                   p_permutation=np.nan, p_mannwhitney=np.nan,
                   min_possible_p=1 / math.comb(n_r + n_o, n_r) if n_r and n_o else np.nan,
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
    if len(out) and out.p_permutation.notna().any():
        ok = out.p_permutation.notna()
        out.loc[ok, "q_bh"] = stats.false_discovery_control(out.loc[ok, "p_permutation"], method="bh")
    else:
        out["q_bh"] = np.nan
    if len(out):
        min_p = out.min_possible_p.iloc[0]
        out["note"] = (f"{int(out.n_rope.iloc[0])} RoPE vs {int(out.n_other.iloc[0])} other "
                       f"models: the smallest reachable p is {min_p:.3g}"
                       + ("; this design cannot reach p < 0.05" if not min_p < 0.05 else ""))
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
