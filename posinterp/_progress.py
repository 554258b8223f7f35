"""Progress bars: tqdm's own choice of bar, without its "IProgress not found" warning."""

from __future__ import annotations

import warnings

__all__ = ["tqdm"]


def _import_tqdm():
    # tqdm.auto draws the widget bar inside a Jupyter kernel that has ipywidgets, else the
    # text bar; without ipywidgets it first warns "IProgress not found. Please update
    # jupyter and ipywidgets" on import (issue 39: every notebook showed it). posinterp's
    # bars are no reason to ask for ipywidgets, and the bar is the same text bar either
    # way, so that one warning is dropped. Imported once here, tqdm.auto stays cached, so a
    # later ``from tqdm.auto import tqdm`` anywhere is quiet too.
    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        from tqdm.auto import tqdm
    return tqdm


tqdm = _import_tqdm()
