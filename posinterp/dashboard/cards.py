"""A head card as a figure, from Python (the pages have their own download buttons).

A head card here is a matplotlib ``Figure`` built without pyplot (as
:mod:`posinterp.viz.figures`: the user's backend is never touched): the head's
positional kernels with their 95% intervals, its QK eigenvalues on the null band, and
its scores in the title. :func:`comparison_card_figure` draws A and B of a
:class:`~posinterp.dashboard.compare.Comparison` on the same axes. Save either with
:func:`posinterp.viz.export_figure`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.patches import Circle

from ..viz.figures import _subplots

__all__ = ["comparison_card_figure", "head_card_figure"]

def _check_head(meta: dict, layer: int, head: int) -> None:
    nl, nh = meta.get("n_layers"), meta.get("n_heads")
    if not (isinstance(layer, int | np.integer) and 0 <= layer < nl):
        raise ValueError(f"layer must be an integer in [0, {nl}), got {layer!r}")
    if not (isinstance(head, int | np.integer) and 0 <= head < nh):
        raise ValueError(f"head must be an integer in [0, {nh}), got {head!r}")


def _head_rows(table: pd.DataFrame, layer: int, head: int) -> pd.DataFrame:
    return table[(table.layer == layer) & (table["head"] == head)]


def _kernel(ax, rows: pd.DataFrame, metric: str, colour: str, label: str | None) -> None:
    k = rows[rows.metric == metric].sort_values("offset")
    if k.empty:
        return
    x = k.offset.astype(float).to_numpy()
    ax.plot(x, k.value.to_numpy(), marker="o", ms=2, lw=1.2, color=colour, label=label)
    lo, hi = k.ci_low.to_numpy(dtype=float), k.ci_high.to_numpy(dtype=float)
    if np.isfinite(lo).any():
        ax.fill_between(x, lo, hi, color=colour, alpha=0.25, lw=0)


def _eigen(ax, rows: pd.DataFrame, offset, colour: str, label: str | None, band: bool) -> None:
    sel = rows[rows.offset.isna()] if offset is None else rows[rows.offset == offset]
    re = sel[sel.metric == "eigenvalue_real"].sort_values("rank").value.to_numpy()
    im = sel[sel.metric == "eigenvalue_imag"].sort_values("rank").value.to_numpy()
    if band:
        lo = rows[rows.metric == "null_band_low"].value
        hi = rows[rows.metric == "null_band_high"].value
        if len(lo) and len(hi):
            ax.add_patch(Circle((0, 0), float(hi.iloc[0]), color="#dddddd", zorder=0))
            ax.add_patch(Circle((0, 0), float(lo.iloc[0]), color="white", zorder=0))
    ax.scatter(re, im, s=12, color=colour, label=label, zorder=2)
    r = max(float(np.hypot(re, im).max()) if len(re) else 0.0,
            float(rows[rows.metric == "null_band_high"].value.max()) if band else 0.0, 1e-12)
    lim = max(1.1 * r, getattr(ax, "_posinterp_lim", 0.0))  # A and B share the axes
    ax._posinterp_lim = lim
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_aspect("equal")
    ax.axhline(0, color="#999", lw=0.6)
    ax.axvline(0, color="#999", lw=0.6)
    ax.set_xlabel("Re λ", fontsize=7)
    ax.set_ylabel("Im λ", fontsize=7)
    ax.set_title("QK eigenvalues" + ("" if offset is None else f", Δ = {offset}"), fontsize=8)


def _offsets(table: pd.DataFrame) -> list:
    offs = table[table.metric == "eigenvalue_real"].offset
    return [None] if offs.isna().all() else sorted({int(o) for o in offs.dropna()}, reverse=True)


def _score_line(rows: pd.DataFrame) -> str:
    parts = []
    for k, short in (("previous_token_score", "prev"), ("self_score", "self"),
                     ("first_token_score", "first")):
        v = rows[(rows.metric == k)].value
        if len(v):
            parts.append(f"{short} {float(v.iloc[0]):.3f}")
    rm = rows[rows.metric == "rotational_mass"]
    if len(rm):
        rm = rm.sort_values("offset", ascending=False, na_position="first")
        parts.append(f"rot. mass {float(rm.value.iloc[0]):.3f}")
    return ", ".join(parts)


def head_card_figure(inspection, layer: int, head: int):
    """One head's card as a figure: kernels with 95% intervals, QK eigenvalues, scores.

    Args:
        inspection: an :class:`~posinterp.dashboard.inspect.Inspection` (or a loaded one).
        layer: the head's layer.
        head: the head's index in that layer.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot); save it with
        :func:`posinterp.viz.export_figure`.

    Raises:
        ValueError: for a layer or head outside the model.
    """
    _check_head(inspection.meta, layer, head)
    rows = _head_rows(inspection.table, layer, head)
    offs = _offsets(inspection.table)
    fig, axes = _subplots(1, 2 + len(offs), figsize=(3.3 * (2 + len(offs)), 3.1), layout="constrained")
    _kernel(axes[0], rows, "kernel_attention", "#08519c", None)
    axes[0].set_title("mean attention weight A[i, i+Δ]", fontsize=8)
    _kernel(axes[1], rows, "kernel_score", "#08519c", None)
    axes[1].set_title("mean pre-softmax score", fontsize=8)
    for ax in axes[:2]:
        ax.set_xlabel("key offset Δ = j − i", fontsize=7)
    for ax, off in zip(axes[2:], offs, strict=True):
        _eigen(ax, rows, off, "#e4572e", None, band=True)
    for ax in axes:
        ax.tick_params(labelsize=6)
    model = inspection.table["model"].iloc[0] if len(inspection.table) else ""
    fig.suptitle(f"{model}  L{layer}H{head}: {_score_line(rows)}", fontsize=9)
    return fig


def comparison_card_figure(comparison, layer: int, head: int):
    """One head of a comparison: A and B's kernels and QK eigenvalues on shared axes.

    Args:
        comparison: a :class:`~posinterp.dashboard.compare.Comparison`.
        layer: the head's layer.
        head: the head's index in that layer.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot).

    Raises:
        ValueError: for a layer or head outside the models.
    """
    _check_head(comparison.a.meta, layer, head)
    na, nb = comparison.names
    ra = _head_rows(comparison.a.table, layer, head)
    rb = _head_rows(comparison.b.table, layer, head)
    offs = _offsets(comparison.a.table)
    fig, axes = _subplots(1, 2 + len(offs), figsize=(3.3 * (2 + len(offs)), 3.1), layout="constrained")
    for rows, colour, name in ((ra, "#08519c", na), (rb, "#e4572e", nb)):
        _kernel(axes[0], rows, "kernel_attention", colour, name)
        _kernel(axes[1], rows, "kernel_score", colour, name)
        for ax, off in zip(axes[2:], offs, strict=True):
            _eigen(ax, rows, off, colour, name, band=False)
    axes[0].set_title("mean attention weight A[i, i+Δ]", fontsize=8)
    axes[1].set_title("mean pre-softmax score", fontsize=8)
    for ax in axes[:2]:
        ax.set_xlabel("key offset Δ = j − i", fontsize=7)
    for ax in axes:
        ax.tick_params(labelsize=6)
    axes[0].legend(fontsize=6)
    row = comparison.heads[(comparison.heads.layer == layer) & (comparison.heads["head"] == head)]
    change = float(row["change"].iloc[0]) if len(row) else float("nan")
    fig.suptitle(f"L{layer}H{head}: {na} (blue) vs {nb} (red); change {change:.3f}", fontsize=9)
    return fig
