"""Static matplotlib figures: similarity heatmaps, adjacency by layer, training curves.

All functions return a ``matplotlib.figure.Figure`` built without pyplot: posinterp never
selects a backend or registers figures with pyplot, so a notebook user's own ``plt.show()``
and inline display keep working (a bare ``Figure`` draws with the Agg canvas, no display
needed). IPython has a formatter for a figure only once pyplot's inline backend has
registered one, so a figure made without pyplot would show as ``<Figure size ...>`` text:
posinterp's figures are a ``Figure`` subclass with ``_repr_png_``, shown as an image
wherever IPython displays them (issue 39).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib
import pandas as pd
import torch
from matplotlib.figure import Figure

__all__ = ["adjacency_plot", "dynamics_plot", "eigenvalue_planes", "export_figure", "fingerprint_plot",
           "grid_heatmap", "history_plot", "save_figure", "similarity_grid"]


def save_figure(fig, stem, formats=("png", "svg"), dpi: int = 150, close: bool = True) -> list:
    """Write ``fig`` as ``stem.png`` and ``stem.svg`` (atomically), closing it unless told.

    Returns:
        The written paths.

    Raises:
        ValueError: for a format matplotlib cannot write.
    """
    from pathlib import Path

    from ..io import atomic_path

    paths = []
    for fmt in formats:
        if fmt not in fig.canvas.get_supported_filetypes():
            raise ValueError(f"format must be one of {sorted(fig.canvas.get_supported_filetypes())}, "
                             f"got {fmt!r}")
        path = Path(f"{stem}.{fmt}")
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt, dpi=dpi, bbox_inches="tight")
        paths.append(path)
    if close:
        _release(fig)
    return paths


_FORMATS = ("png", "svg", "pdf")


def export_figure(fig, path: str | Path, dpi: int = 150) -> Path:
    """Write ``fig`` to ``path`` atomically, in the format its suffix names.

    Args:
        fig: a matplotlib ``Figure`` (posinterp's, or the user's).
        path: ``.png``, ``.svg`` or ``.pdf``.
        dpi: raster resolution (PNG).

    Returns:
        The path.

    Raises:
        ValueError: for another suffix, or a non-positive ``dpi``.
    """
    from ..io import atomic_path

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in _FORMATS:
        raise ValueError(f"path must end in one of {['.' + f for f in _FORMATS]}, got {path.name!r}")
    if not isinstance(dpi, int) or dpi < 1:
        raise ValueError(f"dpi must be a positive integer, got {dpi!r}")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, dpi=dpi, bbox_inches="tight")
    return path


class _DisplayFigure(Figure):
    """A standalone ``Figure`` that IPython and Jupyter display as a PNG image.

    Where a formatter is registered for ``Figure`` (pyplot's inline backend), IPython uses
    it instead of ``_repr_png_`` (type formatters come first), so a figure is shown once
    either way.
    """

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        # as the inline backend draws: the figure's own dpi, cropped to what is drawn
        self.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()


def _subplots(nrows: int = 1, ncols: int = 1, figsize=None, **kwargs):
    """pyplot's ``subplots`` without pyplot: a standalone figure (shown as an image in
    notebooks) and its axes."""
    layout = kwargs.pop("layout", None)
    fig = _DisplayFigure(figsize=figsize, layout=layout)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def _release(fig) -> None:
    """Close a figure in pyplot's registry once saved, if a user's pyplot figure was
    passed; standalone figures are in no registry and need nothing."""
    import sys

    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close(fig)


#: Smallest tick-label size (points) that prints legibly at a figure's natural size.
TICK_FONT = 7


def _position_ticks(ax, n: int, tokens: list[str] | None, fontsize: float = TICK_FONT) -> None:
    """Position ticks that can be read: token labels when every one fits along the axis at
    ``fontsize`` points, else every k-th token with its position ("12 x"), else integers.

    The room is the axes' size in the figure as it stands (call after the figure's size
    and panel grid are set); a label needs about 1.3 times its font size.
    """
    from matplotlib.ticker import MaxNLocator

    box = ax.get_position()
    width, height = ax.figure.get_size_inches()
    room = 72 * min(box.width * width, box.height * height)  # points along the shorter axis
    fit = max(2, int(room / (1.3 * fontsize)))
    if tokens is not None and len(tokens) == n:
        step = max(1, math.ceil(n / fit))
        at = list(range(0, n, step))
        labels = [tokens[i] if step == 1 else f"{i} {tokens[i]}" for i in at]
        ax.set_xticks(at)
        ax.set_xticklabels(labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(at)
        ax.set_yticklabels(labels, fontsize=fontsize)
        return
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=min(6, fit), integer=True))
    ax.tick_params(labelsize=fontsize)


def similarity_grid(sims: dict[str, torch.Tensor], title: str = "", ncols: int = 5,
                    tokens: list[str] | None = None):
    """Heatmaps of ``[pos, pos]`` cosine-similarity matrices, one panel per entry.

    Args:
        sims: ``{panel label: [pos, pos]}``; NaN entries (padding) are left blank.
        title: figure title.
        tokens: the ``pos`` token labels, at 7 points or more: every token when all fit
            along an axis, else every k-th with its position; without them, integer
            positions.

    Raises:
        ValueError: if ``sims`` is empty or a matrix is not square.
    """
    if not sims:
        raise ValueError("sims must hold at least one matrix")
    n = len(sims)
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = _subplots(nrows, ncols, figsize=(3.2 * ncols, 3.3 * nrows), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[n:]:
        ax.axis("off")
    im = None
    for idx, (ax, (label, mat)) in enumerate(zip(axes.flat, sims.items(), strict=False)):
        if mat.ndim != 2 or mat.shape[0] != mat.shape[1]:
            raise ValueError(f"matrix {label!r} must be [pos, pos], got {tuple(mat.shape)}")
        im = ax.imshow(mat.float().cpu().numpy(), vmin=-1, vmax=1, cmap="RdBu_r")
        ax.set_title(label, fontsize=9)
        _position_ticks(ax, mat.shape[0], tokens)
        # Axis names once per row/column: repeated on every panel they overlap.
        if idx // ncols == nrows - 1 or idx + ncols >= n:
            ax.set_xlabel("position j", fontsize=8)
        if idx % ncols == 0:
            ax.set_ylabel("position k", fontsize=8)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="cosine similarity")
    if title:
        fig.suptitle(title)
    return fig


def adjacency_plot(df: pd.DataFrame, by: str = "state"):
    """Adjacency score per residual hook, one line per value of column ``by``.

    Args:
        df: tidy rows with ``hook``, ``metric == "adjacency_score"``, ``value`` and ``by``.
    """
    d = df[df.metric == "adjacency_score"]
    hooks = list(dict.fromkeys(d.hook))
    fig, ax = _subplots(figsize=(max(5, 0.6 * len(hooks)), 3.2))
    for key, g in d.groupby(by, sort=False):
        vals = g.set_index("hook").value.reindex(hooks)
        ax.plot(range(len(hooks)), vals.values, marker="o", label=str(key))
    ax.axhline(0.5, color="grey", lw=0.8, ls="--", label="chance")
    ax.set_xticks(range(len(hooks)))
    ax.set_xticklabels([h.replace("blocks.", "").replace("hook_", "") for h in hooks],
                       rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("adjacency score")
    ax.set_ylim(0.3, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def history_plot(history: pd.DataFrame, target: float | None = None):
    """Test exact-match accuracy and train loss against optimizer steps.

    Args:
        history: tidy ``step, metric, value`` from :class:`posinterp.TrainResult`.
        target: draw the target accuracy as a dashed line.
    """
    fig, ax = _subplots(figsize=(6, 3.2))
    acc = history[history.metric == "test_accuracy"]
    ax.plot(acc.step, acc.value, marker="o", color="C0", label="test exact match")
    if target is not None:
        ax.axhline(target, color="C0", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("exact-match accuracy")
    ax.set_ylim(0, 1.02)
    ax2 = ax.twinx()
    loss = history[history.metric == "train_loss"]
    ax2.plot(loss.step, loss.value.rolling(20, min_periods=1).mean(), color="C1", alpha=0.7,
             label="train loss (20-step mean)")
    ax2.set_ylabel("loss (nats / answer token)")
    fig.legend(loc="upper center", fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def eigenvalue_planes(spectrum: pd.DataFrame, scores: pd.DataFrame | None = None,
                      title: str = "", max_layers: int = 12, max_heads: int = 16,
                      ncols: int = 8):
    """Each head's QK eigenvalues in the complex plane, one panel per head.

    Panels are laid out ``ncols`` to a row (a layer with more heads wraps onto
    several rows), so 12+ heads per layer stay readable; each panel is titled
    ``L<layer> H<head>``.

    Args:
        spectrum: rows of :func:`posinterp.analysis.spectral.qk_spectrum` for one offset.
        scores: optional ``layer, head, previous_token_score``; colours each panel's
            points (viridis, 0-1, with a colour bar) and prints the score in the corner.
        max_layers: larger models are cut, with a note in the title.
        max_heads: likewise for heads.
        ncols: panels per row.

    Raises:
        ValueError: if ``spectrum`` mixes offsets or is empty.
    """
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    if spectrum.empty:
        raise ValueError("spectrum is empty")
    if spectrum.offset.nunique(dropna=False) > 1:
        raise ValueError("spectrum mixes offsets; select one offset per figure")
    layers = sorted(spectrum.layer.unique())
    heads = sorted(spectrum["head"].unique())
    cut = len(layers) > max_layers or len(heads) > max_heads
    layers, heads = layers[:max_layers], heads[:max_heads]
    score = {} if scores is None else {(r.layer, r.head): r.previous_token_score
                                       for r in scores.itertuples()}
    cmap = matplotlib.colormaps["viridis"]
    ncols = max(1, min(ncols, len(heads)))
    rows_per_layer = math.ceil(len(heads) / ncols)
    nrows = rows_per_layer * len(layers)
    fig, axes = _subplots(nrows, ncols, figsize=(1.45 * ncols + (1.0 if scores is not None else 0),
                                                    1.55 * nrows + 0.5), squeeze=False,
                             layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for i, layer in enumerate(layers):
        for j, head in enumerate(heads):
            ax = axes[i * rows_per_layer + j // ncols, j % ncols]
            ax.axis("on")
            d = spectrum[(spectrum.layer == layer) & (spectrum["head"] == head)]
            s = score.get((layer, head))
            ax.scatter(d.real, d.imag, s=6, color=cmap(s) if s is not None else "C0")
            ax.axhline(0, color="grey", lw=0.4)
            ax.axvline(0, color="grey", lw=0.4)
            lim = max(d["abs"].max(), 1e-12) * 1.1
            ax.set_xlim(-lim, lim)
            ax.set_ylim(-lim, lim)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"L{layer} H{head}", fontsize=7, pad=2)
            if s is not None:
                ax.text(0.03, 0.97, f"{s:.2f}", transform=ax.transAxes, fontsize=TICK_FONT, va="top")
    off = spectrum.offset.iloc[0]
    label = "offset NA (not rotary)" if pd.isna(off) else f"offset Δ = {int(off)}"
    if scores is not None:
        fig.colorbar(ScalarMappable(Normalize(0, 1), cmap), ax=axes.ravel().tolist(), shrink=0.6,
                     label="previous-token score")
    fig.suptitle(f"{title} eigenvalues of W_K^T W_Q, {label}" + (" (grid cut)" if cut else ""),
                 fontsize=8)
    return fig


def fingerprint_plot(table: pd.DataFrame):
    """Mean measure of the top-k previous-token heads against k, one line per model.

    Each model has its own colour; the line style gives its group (solid RoPE,
    dashed other, dotted excluded), as the legend says.
    """
    fig, ax = _subplots(figsize=(6, 3.6))
    styles = {"rope": "-", "other": "--", None: ":"}
    names = {"rope": "RoPE", "other": "other", None: "excluded"}
    for i, (model, g) in enumerate(table.groupby("model", sort=False)):
        group = g.group.iloc[0] if g.group.notna().any() else None
        ax.plot(g.k, g.value, marker="o", color=f"C{i % 10}", ls=styles[group], alpha=0.9,
                label=f"{model} ({g.pe.iloc[0]}, {names[group]})")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("top-k previous-token heads")
    ax.set_ylabel(f"mean {table.metric.iloc[0]}")
    ax.legend(fontsize=TICK_FONT, ncol=1, loc="best")
    fig.tight_layout()
    return fig


def dynamics_plot(dynamics: pd.DataFrame, measure: str = "rotational_mass", title: str = ""):
    """A measure and the previous-token score of every head against training step."""
    fig, (a1, a2) = _subplots(1, 2, figsize=(9, 3.2))
    for (layer, head), g in dynamics.groupby(["layer", "head"]):
        g = g.sort_values("step")
        x = g.step.clip(lower=0.5)  # log axis: step 0 (init) drawn at 0.5
        a1.plot(x, g[measure], lw=0.8, alpha=0.7)
        a2.plot(x, g.previous_token_score, lw=0.8, alpha=0.7, label=f"L{layer}H{head}")
    for ax, lab in ((a1, measure), (a2, "previous-token score")):
        ax.set_xscale("log")
        ax.set_xlabel("step (init at 0.5)")
        ax.set_ylabel(lab)
    a2.legend(fontsize=TICK_FONT, ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def grid_heatmap(df: pd.DataFrame, row: str, col: str, title: str = ""):
    """Heatmap of ``value`` over two grid columns, annotated (e.g. init mean x std)."""
    table = df.pivot_table(index=row, columns=col, values="value")
    fig, ax = _subplots(figsize=(1.2 * table.shape[1] + 2, 0.8 * table.shape[0] + 1.5))
    im = ax.imshow(table.values, vmin=0.3, vmax=1.0, cmap="viridis")
    ax.set_xticks(range(table.shape[1]))
    ax.set_xticklabels(table.columns)
    ax.set_yticks(range(table.shape[0]))
    ax.set_yticklabels(table.index)
    ax.set_xlabel(col)
    ax.set_ylabel(row)
    for i in range(table.shape[0]):
        for j in range(table.shape[1]):
            ax.text(j, i, f"{table.values[i, j]:.2f}", ha="center", va="center", color="w",
                    fontsize=8)
    fig.colorbar(im, ax=ax, label="adjacency score")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
