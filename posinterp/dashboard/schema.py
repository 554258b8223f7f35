"""The inspection's schema: one home for what its table holds and how scores are named.

:class:`~posinterp.dashboard.inspect.Inspection` tables (and ``heads.csv``, and the rows
of ``inspection.json``) have the columns :data:`COLUMNS`; per head, every metric outside
:data:`_VECTOR_METRICS` is one scalar score, named in the wide view by :func:`score_key`
(``metric[ablation]@Δ=offset``). The pages embed :data:`_VECTOR_METRICS` in their data
(``vector_metrics``), so their scripts never keep a copy of it.
"""

from __future__ import annotations

import pandas as pd

__all__ = ["COLUMNS", "head_wide", "score_key"]

COLUMNS = ["model", "hook", "layer", "head", "position", "offset", "rank", "ablation", "metric",
           "value", "ci_low", "ci_high", "n_sequences"]

def score_key(metric: str, offset, ablation) -> str:
    """Column name of a scalar per-head row in the wide view (e.g. ``rotational_mass@Δ=-1``)."""
    key = metric
    if isinstance(ablation, str) and ablation:
        key += f"[{ablation}]"
    if offset is not None and not pd.isna(offset):
        key += f"@Δ={int(offset)}"
    return key


#: Metrics whose ``offset`` is the key offset Δ = j - i (the positional kernels); every other
#: offset in the table is a RoPE offset (spectral rows, frequency shares).
_KERNEL_METRICS = ("kernel_attention", "kernel_score")
#: Metrics with several rows per head at one offset and ablation (by key offset, eigenvalue
#: ``rank`` or rotary pair ``rank``): never one per-head score. The one list: the wide view,
#: the comparison and both pages read it (the pages from their embedded data).
_VECTOR_METRICS = (*_KERNEL_METRICS, "eigenvalue_real", "eigenvalue_imag", "frequency_share")


def head_wide(table: pd.DataFrame) -> pd.DataFrame:
    """The scalar per-head rows of an inspection table, one column per score."""
    t = table[table["head"].notna() & ~table.metric.isin(_VECTOR_METRICS)]
    keys = [score_key(m, o, a) for m, o, a in zip(t.metric, t.offset, t.ablation, strict=True)]
    wide = t.assign(score=keys).pivot_table(index=["layer", "head"], columns="score", values="value",
                                            sort=False)
    wide.columns.name = None
    return wide.reset_index().astype({"layer": "int64", "head": "int64"})


#: Scores on a fixed [0, 1] scale (attention weights, rotational mass, phase,
#: antisymmetric energy): the inspect grid colours them on that absolute scale, so heads
#: compare across pages and a range of 0.059-0.060 is drawn as the near-equal values it is.
_UNIT_SCORES = ("previous_token_score", "self_score", "first_token_score", "induction_score",
                "induction_score_input", "rotational_mass", "phase", "antisymmetric_energy")
#: The unit scores whose absolute change enters a comparison's ``change``, as docs/inspect.md
#: defines it (:mod:`posinterp.dashboard.compare`): the input's previous-token, self and
#: first-token scores and the rotational mass. A subset of :data:`_UNIT_SCORES`, so every
#: part of ``change`` is on a 0-1 scale; the other unit scores are compared score by score
#: (``delta_<score>``) but do not enter ``change``.
_CHANGE_SCORES = ("previous_token_score", "self_score", "first_token_score", "rotational_mass")
