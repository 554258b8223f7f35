"""Visualizations: circuitsvis head views, static figures and offline HTML reports."""

from .circuits import CircuitsView, attention_view
from .figures import (
    adjacency_plot,
    dynamics_plot,
    eigenvalue_planes,
    fingerprint_plot,
    history_plot,
    save_figure,
    similarity_grid,
)
from .inspect import inspect_page, save_inspect_page
from .report import Report

__all__ = ["CircuitsView", "Report", "adjacency_plot", "attention_view", "dynamics_plot",
           "eigenvalue_planes", "fingerprint_plot", "history_plot", "inspect_page", "save_figure",
           "save_inspect_page",
           "similarity_grid"]
