"""The comparison page of ``posinterp inspect A --compare B``: offline, one file.

Same conventions as :mod:`posinterp.dashboard.inspect_html`: the page is drawn in the
browser from one embedded JSON copy of the :class:`~posinterp.dashboard.compare.Comparison`'s tables
(``<script type="application/json" id="compare-data">``), every string is escaped for
where it lands, and the page's script sets text with ``textContent`` only. No
circuitsvis bundle (two models' patterns would double the page); each head card has the
SVG/PNG download buttons of ``export.js``.
"""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd

from ..io import atomic_write_text, json_value
from ..viz.circuits import script_json, script_safe_js
from .inspect_html import _STYLE
from .schema import _VECTOR_METRICS

__all__ = ["compare_data", "compare_page", "save_compare_page"]


def _records(df: pd.DataFrame) -> dict:
    return {"columns": [str(c) for c in df.columns],
            "rows": [[json_value(v) for v in row] for row in df.itertuples(index=False, name=None)]}


def compare_data(comparison) -> dict:
    """The JSON object the page embeds (missing values ``null``; nothing rounded).

    Drawn from the per-head rows as compared (:attr:`Comparison.compared`: across schemes
    a non-rotary side's spectra at Δ = 0). ``scores``: the per-head scalar rows of both
    sides, one per (side, layer, head, metric, offset, ablation); every metric of the
    inspection schema's vector list (``vector_metrics``: kernels, eigenvalues, frequency
    shares, several rows per head) is left out of them and has its own records:
    ``eig`` (by ``rank``) and ``frequency`` (``frequency_share`` by offset and rotary
    pair ``rank``; NA for a partial-rotary head's unrotated dims). ``skipped``: what only
    one side defines.
    """
    c = comparison
    tables = c.compared if c.compared is not None else (c.a.table, c.b.table)
    eig, scalar, freq = [], [], []
    for which, t in zip("ab", tables, strict=True):
        e = t[t.metric.isin(["eigenvalue_real", "eigenvalue_imag"])]
        if len(e):
            w = e.pivot_table(index=["layer", "head", "offset", "rank"], columns="metric", values="value",
                              dropna=False, sort=True).reset_index()
            eig.append(w.assign(which=which)[["which", "layer", "head", "offset", "rank",
                                              "eigenvalue_real", "eigenvalue_imag"]])
        s = t[t["head"].notna() & ~t.metric.isin(_VECTOR_METRICS)]
        scalar.append(s.assign(which=which)[["which", "layer", "head", "metric", "offset", "ablation",
                                             "value", "ci_low", "ci_high"]])
        f = t[t["head"].notna() & (t.metric == "frequency_share")]
        freq.append(f.assign(which=which)[["which", "layer", "head", "offset", "rank", "value"]])
    eig = (pd.concat(eig, ignore_index=True) if eig else
           pd.DataFrame(columns=["which", "layer", "head", "offset", "rank", "eigenvalue_real",
                                 "eigenvalue_imag"]))
    eig = eig.rename(columns={"eigenvalue_real": "re", "eigenvalue_imag": "im"})
    meta = {"names": list(c.names), "n_layers": c.a.meta.get("n_layers"),
            "n_heads": c.a.meta.get("n_heads"), "rotary": c.a.meta.get("pe") == "rotary",
            "pe": [c.a.meta.get("pe"), c.b.meta.get("pe")], "n_null": c.a.meta.get("n_null")}
    return {"meta": meta, "vector_metrics": list(_VECTOR_METRICS), "heads": _records(c.heads),
            "kernels": _records(c.kernels), "eig": _records(eig),
            "scores": _records(pd.concat(scalar, ignore_index=True)),
            "frequency": _records(pd.concat(freq, ignore_index=True)),
            "skipped": _records(c.skipped), "formed": _records(c.formed), "layers": _records(c.layers)}


def _script() -> str:
    from importlib.resources import files

    return "\n".join(files("posinterp.dashboard").joinpath(name).read_text(encoding="utf-8")
                     for name in ("common.js", "compare.js", "export.js"))


_EXTRA_STYLE = """
.a { color: #08519c; font-weight: bold; } .b { color: #e4572e; font-weight: bold; }
#formed td:first-child, #formed td:nth-child(3) { text-align: left; }
"""


def compare_page(comparison, title: str, facts: str = "") -> str:
    """The whole offline HTML page for a :class:`~posinterp.dashboard.compare.Comparison`.

    Args:
        comparison: from :func:`~posinterp.dashboard.compare.compare_inspections`.
        title: page title (escaped).
        facts: one line about the models and input (escaped).
    """
    esc = html.escape
    na, nb = (esc(n) for n in comparison.names)
    notes = "".join(f'<p class="note">{esc(n)}</p>'
                    for n in [*comparison.notes, *comparison.a.notes])
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{esc(title)}</title><style>{_STYLE}{_EXTRA_STYLE}</style></head>
<body>
<h1>{esc(title)}</h1>
<p class="facts">{esc(facts)}</p>
<p class="note">How to read this page: <span class="a">A = {na}</span> and
<span class="b">B = {nb}</span> were inspected on the same input. Every change is B − A.
A head's <b>change</b> is the largest of: the largest change of its attention kernel
(mean weight at any offset Δ), the change of its previous-token, self and first-token
scores and of its rotational mass, and its <b>spectrum change</b> (the distance between
its two sets of QK eigenvalues after the best matching, divided by their RMS sizes: 0 =
the same spectrum, 1 at most). All are on a 0–1 scale; heads are listed largest change
first. A head <b>formed</b> when a score crossed its threshold from A to B: rotational
mass beyond the 95th percentile of random heads, or a previous-token score of 0.5 or
more. Only what both models define is compared: across positional schemes a head without
rotation has one QK form, the raw W_Q W_K^T, compared with a rotary head's Δ = 0 form (the
same object); what only one side has (Δ = −1, frequency shares, ...) is named in a note
and not compared. Click a head for its card: A's and B's kernels and eigenvalues on the
same axes, and on RoPE models each rotary pair's share of the QK energy.</p>
{notes}
<div class="controls">
 <label>colour by <select id="colour-key"></select></label>
 <span><span id="bar-lo"></span> <span class="bar"></span> <span id="bar-hi"></span></span>
 <span id="count" class="facts"></span>
</div>
<div id="layout">
 <div id="left"><table id="grid"></table>
  <h3>Heads that formed or dissolved between A and B</h3><table id="formed"></table>
  <h3>Heads, largest change first (click a column to sort)</h3><table id="list"></table>
  <h3>Adjacency score per layer</h3><table id="layers"></table>
 </div>
 <div id="card"></div>
</div>
<script type="application/json" id="compare-data">{script_json(compare_data(comparison))}</script>
<script>
{script_safe_js(_script())}
</script>
</body></html>
"""


def save_compare_page(comparison, path: str | Path, title: str, facts: str = "") -> Path:
    """Write :func:`compare_page` atomically to ``path``; returns the path."""
    return atomic_write_text(path, compare_page(comparison, title, facts))
