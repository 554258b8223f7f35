"""The checkpoint-series view of ``posinterp spectrum --weights-only --revisions``.

Plain data in (the dict :func:`posinterp.experiments.weights_only.run_weights_only`
builds from ``series.parquet``), an offline HTML page out: per model, each head's
rotational mass R, its null percentile and max |λ| against training step (one line per
head; the heads whose R changed most are drawn first, in colour, and named), a table of
every revision's status, and a model-vs-model table at each model's last revision.
"""

from __future__ import annotations

import math

import pandas as pd

from .figures import TICK_FONT, _subplots
from .report import Report

__all__ = ["series_page", "series_plot"]

PANELS = (("rotational_mass", "rotational mass R"),
          ("rotational_mass_null_percentile", "null percentile of R"),
          ("abs_max", "max |λ|"))
N_NAMED = 8  # heads drawn in colour and named in the legend


def _change(values) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return max(vals) - min(vals) if vals else 0.0


def changed_most(heads: dict, metric: str = "rotational_mass") -> list[str]:
    """Head names ordered by how far ``metric`` moved over the series (max - min), most
    first; ties by name."""
    return sorted(heads, key=lambda h: (-_change(heads[h].get(metric, [])), h))


def series_plot(model: dict, title: str = ""):
    """One figure: the three :data:`PANELS` against step (or revision order where a
    revision has no step), one line per head, the :data:`N_NAMED` that changed most in
    colour. ``model``: ``{"revisions", "steps", "heads": {name: {metric: [value per
    revision]}}}``."""
    steps = model["steps"]
    by_step = all(s is not None for s in steps)
    x = steps if by_step else list(range(len(steps)))
    order = changed_most(model["heads"])
    fig, axes = _subplots(1, 3, figsize=(12, 3.4))
    for rank, name in enumerate(reversed(order)):  # the most changed drawn last, on top
        named = len(order) - 1 - rank < N_NAMED
        for ax, (metric, _) in zip(axes, PANELS, strict=True):
            ys = [math.nan if v is None else v for v in model["heads"][name].get(metric, [])]
            if named:
                ax.plot(x, ys, lw=1.2, marker="o", ms=2.5, label=name)
            else:
                ax.plot(x, ys, lw=0.6, color="0.75", zorder=0)
    for ax, (_, label) in zip(axes, PANELS, strict=True):
        ax.set_ylabel(label)
        ax.set_xlabel("training step" if by_step else "revision (in order)")
        if not by_step:
            ax.set_xticks(x, model["revisions"], rotation=45, ha="right", fontsize=TICK_FONT)
    axes[0].legend(fontsize=TICK_FONT, ncol=2, title=f"changed most (of {len(order)})",
                   title_fontsize=TICK_FONT)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _last(values):
    for v in reversed(values):
        if v is not None and math.isfinite(v):
            return v
    return math.nan


def series_page(data: dict) -> str:
    """The series page's HTML: ``data`` = ``{"models": {model: ...}, "report": {model:
    {revision: {"status", "step", "commit", "qk_sha256"}}}}``."""
    rep = Report("Weights-only spectra over checkpoints")
    rep.paragraph("QK spectra of each revision's W_Q, W_K alone (posinterp spectrum "
                  "--weights-only --revisions). R: rotational mass of M = W_Q W_K^T (offset "
                  "0 for RoPE heads); its percentile in a product-Ginibre null of the "
                  "model's shape; max |λ| of the head's small form W_K^T W_Q. Revisions whose "
                  "q/k bytes equal an earlier one's are left out and named below.")
    rows = []
    for model, m in data["models"].items():
        heads = m["heads"]
        last = {metric: [_last(h.get(metric, [])) for h in heads.values()] for metric, _ in PANELS}
        status = data["report"].get(model, {})
        rows.append({"model": model, "heads": len(heads), "revisions analysed": len(m["revisions"]),
                     "duplicates left out": sum(s["status"].startswith("duplicate")
                                                for s in status.values()),
                     "missing": sum(s["status"].startswith("missing") for s in status.values()),
                     "damaged": sum(s["status"].startswith("damaged") for s in status.values()),
                     "last revision": m["revisions"][-1] if m["revisions"] else "",
                     "mean R": pd.Series(last["rotational_mass"]).mean(),
                     "mean null percentile": pd.Series(last["rotational_mass_null_percentile"]).mean(),
                     "max |λ|": pd.Series(last["abs_max"]).max(),
                     "head that changed most": (changed_most(heads) or [""])[0]})
    rep.heading("Model against model (at each model's last revision)")
    rep.table(pd.DataFrame(rows))
    for model, m in data["models"].items():
        rep.heading(model)
        if m["revisions"]:
            rep.figure(series_plot(m, model),
                       f"{model}: one line per head; the {N_NAMED} whose R moved most in colour")
        status = data["report"].get(model, {})
        rep.table(pd.DataFrame([{"revision": r, "step": s.get("step"), "status": s["status"],
                                 "commit": (s.get("commit") or "")[:12],
                                 "q/k sha256": (s.get("qk_sha256") or "")[:16]}
                                for r, s in status.items()]))
    for model, status in data["report"].items():  # models with no revision analysed
        if model not in data["models"]:
            rep.heading(model)
            rep.table(pd.DataFrame([{"revision": r, "status": s["status"]}
                                    for r, s in status.items()]))
    return rep.html()
