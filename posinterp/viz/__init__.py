"""Visualizations: circuitsvis head views, static figures and offline HTML reports."""

from .circuits import CircuitsView, attention_view
from .compare import compare_page, save_compare_page
from .export import comparison_card_figure, export_figure, head_card_figure
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

__all__ = ["CircuitsView", "Report", "adjacency_plot", "attention_view", "compare_page",
           "comparison_card_figure", "dynamics_plot", "eigenvalue_planes", "export_figure",
           "fingerprint_plot", "head_card_figure", "history_plot", "inspect_page", "save_compare_page",
           "save_figure", "save_inspect_page", "similarity_grid"]
