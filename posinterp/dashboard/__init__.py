"""The ``posinterp inspect`` product in one package: inspect every head of a model, compare
two inspections, explain one score, write ``inspection.json`` and the offline pages.

Modules (docs/architecture.md):

* :mod:`.schema`: the inspection table's columns, vector metrics, unit scores, score keys;
* :mod:`.inspect`: :func:`inspect_heads` and :class:`Inspection` (runs the model; the pure
  kernels and scores are :mod:`posinterp.analysis.kernels`);
* :mod:`.compare`: :func:`compare_inspections`, :func:`compare_models`, :class:`Comparison`;
* :mod:`.explain`: "Explain one score" on the page (the bounded
  :func:`posinterp.analysis.explain.score_parts` table and its page data);
* :mod:`.export`: the versioned ``inspection.json`` and its loader;
* :mod:`.inspect_html`, :mod:`.compare_html`: the pages (with ``common.js``,
  ``inspect.js``, ``compare.js``, ``explain.js``, ``export.js``);
* :mod:`.cards`: a head card as a matplotlib figure.

Names are imported on first use (PEP 562), as in :mod:`posinterp`: importing the package
loads neither torch nor the pages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

# public name -> submodule that defines it
_EXPORTS = {
    **dict.fromkeys(("Inspection", "PatternView", "inspect_heads"), ".inspect"),
    **dict.fromkeys(("FORMATION_CRITERIA", "Comparison", "compare_inspections", "compare_models",
                     "spectrum_distance"), ".compare"),
    **dict.fromkeys(("SCHEMA_VERSION", "export_inspection", "inspection_from_dict",
                     "inspection_to_dict", "load_inspection"), ".export"),
    **dict.fromkeys(("COLUMNS", "head_wide", "score_key"), ".schema"),
    **dict.fromkeys(("inspect_data", "inspect_page", "save_inspect_page"), ".inspect_html"),
    **dict.fromkeys(("compare_data", "compare_page", "save_compare_page"), ".compare_html"),
    **dict.fromkeys(("comparison_card_figure", "head_card_figure"), ".cards"),
    **dict.fromkeys(("dashboard_score_parts",), ".explain"),
}

__all__ = [*_EXPORTS]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # for type checkers and IDEs; never runs
    from .cards import comparison_card_figure, head_card_figure  # noqa: F401
    from .compare import (  # noqa: F401
        FORMATION_CRITERIA,
        Comparison,
        compare_inspections,
        compare_models,
        spectrum_distance,
    )
    from .compare_html import compare_data, compare_page, save_compare_page  # noqa: F401
    from .explain import dashboard_score_parts  # noqa: F401
    from .export import (  # noqa: F401
        SCHEMA_VERSION,
        export_inspection,
        inspection_from_dict,
        inspection_to_dict,
        load_inspection,
    )
    from .inspect import Inspection, PatternView, inspect_heads  # noqa: F401
    from .inspect_html import inspect_data, inspect_page, save_inspect_page  # noqa: F401
    from .schema import COLUMNS, head_wide, score_key  # noqa: F401
