"""Re-running committed cells and comparing them with their rows (``--verify K``; issue 37
item 1): one comparison and one summary for every reproduction that offers it."""

from __future__ import annotations

import math

import pandas as pd

__all__ = ["compare_rerun", "report", "verify_table"]


def compare_rerun(cell: str, committed: dict, rerun: dict, tolerances: dict[str, float]) -> list[dict]:
    """Rows ``cell, field, committed, rerun, tolerance, within`` for each field of
    ``tolerances`` that both sides hold (a missing or NaN committed value is skipped):
    ``within`` is |rerun − committed| ≤ tolerance, or equal truth values for booleans."""
    rows = []
    for field, tol in tolerances.items():
        old, new = committed.get(field), rerun.get(field)
        if old is None or new is None or (isinstance(old, float) and math.isnan(old)):
            continue
        if isinstance(old, bool) or isinstance(new, bool):
            within = bool(old) == bool(new)
        else:
            within = abs(float(new) - float(old)) <= tol
        rows.append(dict(cell=cell, field=field, committed=float(old), rerun=float(new),
                         tolerance=tol, within=within))
    return rows


def verify_table(rows: list[dict], noun: str = "cells") -> pd.DataFrame:
    """The rows as a table whose ``.attrs["summary"]`` says how many ``noun`` reproduce."""
    table = pd.DataFrame(rows, columns=["cell", "field", "committed", "rerun", "tolerance", "within"])
    per = table.groupby("cell", sort=False).within.all()
    table.attrs["summary"] = (f"{int(per.sum())} of {len(per)} {noun} reproduce within the "
                              "page's precision")
    return table


def report(cell: str, rows: list[dict], seconds: float) -> str:
    """One progress line for a re-run cell."""
    ok = all(r["within"] for r in rows if r["cell"] == cell)
    return f"[posinterp] verify {cell}: {'reproduces' if ok else 'DIFFERS'} ({seconds:.0f} s)"
