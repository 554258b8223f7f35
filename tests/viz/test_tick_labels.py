"""Heatmap tick labels of the demo's similarity panels are legible and never overlap."""

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from posinterp.viz.figures import TICK_FONT, similarity_grid


def _labels(ax, axis: str):
    ticks = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [t for t in ticks if t.get_visible() and t.get_text()]


def _overlap(boxes, axis: str) -> bool:
    """Do any two label boxes overlap along the axis they are laid out on?"""
    spans = sorted((b.x0, b.x1) if axis == "x" else (b.y0, b.y1) for b in boxes)
    return any(a1 > b0 + 0.5 for (_, a1), (b0, _) in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize("n", [21, 40])
def test_similarity_panels_print_readable_labels_that_do_not_overlap(n):
    # the demo's layout: 9 hooks in rows of 5, one test sample's tokens
    tokens = [f"t{i}" for i in range(n)]
    sims = {f"L{i} resid": torch.eye(n) for i in range(9)}
    fig = similarity_grid(sims, tokens=tokens)
    FigureCanvasAgg(fig)  # a canvas of the test's own: posinterp never picks a backend
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[:9]:
        for axis in ("x", "y"):
            labels = _labels(ax, axis)
            assert len(labels) >= 2
            assert all(t.get_fontsize() >= TICK_FONT for t in labels)
            assert not _overlap([t.get_window_extent(renderer) for t in labels], axis)
            # every label names a real position and, with tokens, its token
            texts = [t.get_text() for t in labels]
            assert all(s.split()[-1] in tokens for s in texts)
