"""Visualizations of plain data: circuitsvis head views, static figures, offline HTML reports.

Everything here takes DataFrames, dicts or arrays and imports only posinterp's
foundations; the ``posinterp inspect`` pages and head cards, which take inspections, are
in :mod:`posinterp.dashboard` (``inspect_page``, ``save_inspect_page``, ``compare_page``,
``save_compare_page``, ``head_card_figure``, ``comparison_card_figure``).
"""

from .circuits import CircuitsView, attention_view
from .figures import (
    adjacency_plot,
    dynamics_plot,
    eigenvalue_planes,
    export_figure,
    fingerprint_plot,
    history_plot,
    save_figure,
    similarity_grid,
)
from .report import Report

__all__ = ["CircuitsView", "Report", "adjacency_plot", "attention_view", "dynamics_plot",
           "eigenvalue_planes", "export_figure", "fingerprint_plot", "history_plot", "save_figure",
           "similarity_grid"]

from .._lazy import moved_names  # noqa: E402

# moved with the dashboard (issue 35); refused by name, pointing at the new home
__getattr__ = moved_names(__name__, {
    "compare_page": "posinterp.dashboard.compare_html",
    "comparison_card_figure": "posinterp.dashboard.cards",
    "head_card_figure": "posinterp.dashboard.cards",
    "inspect_page": "posinterp.dashboard.inspect_html",
    "save_compare_page": "posinterp.dashboard.compare_html",
    "save_inspect_page": "posinterp.dashboard.inspect_html",
})
