"""Static matplotlib figures: similarity heatmaps, adjacency by layer, training curves.

All functions return a ``matplotlib.figure.Figure`` (Agg backend, no display needed).
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

__all__ = ["adjacency_plot", "history_plot", "similarity_grid"]


def similarity_grid(sims: dict[str, torch.Tensor], title: str = "", ncols: int = 5):
    """Heatmaps of ``[pos, pos]`` cosine-similarity matrices, one panel per entry.

    Args:
        sims: ``{panel label: [pos, pos]}``; NaN entries (padding) are left blank.
        title: figure title.

    Raises:
        ValueError: if ``sims`` is empty or a matrix is not square.
    """
    if not sims:
        raise ValueError("sims must hold at least one matrix")
    n = len(sims)
    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.6 * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    im = None
    for ax, (label, mat) in zip(axes.flat, sims.items(), strict=False):
        if mat.ndim != 2 or mat.shape[0] != mat.shape[1]:
            raise ValueError(f"matrix {label!r} must be [pos, pos], got {tuple(mat.shape)}")
        im = ax.imshow(mat.float().cpu().numpy(), vmin=-1, vmax=1, cmap="RdBu_r")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("key position j", fontsize=7)
        ax.set_ylabel("position k", fontsize=7)
        ax.tick_params(labelsize=6)
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
    fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(hooks)), 3.2))
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
    fig, ax = plt.subplots(figsize=(6, 3.2))
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
