"""The ``posinterp inspect`` page: a layer x head grid and one card per head, offline.

The page is drawn in the browser from one embedded JSON copy of the inspection's tidy
table (``<script type="application/json" id="inspect-data">``), so what a reader sees
is what :attr:`posinterp.dashboard.inspect.Inspection.table` holds. Attention patterns
are circuitsvis views whose bundle is inlined once (viz.circuits), rendered when a card
opens from one embedded copy of every pattern view (``id="pattern-data"``:
:func:`pattern_data`, a sequence picker chooses the view). Every string is escaped for
where it lands: ``html.escape`` for markup, and
:func:`~posinterp.viz.circuits.script_json` for data inside ``<script>``; the page's
own script builds text with ``textContent`` and never with ``innerHTML`` from data.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import numpy as np
import pandas as pd

from ..io import atomic_write_text, json_value
from ..viz.circuits import script_json, script_safe_js, split_local_src
from .columns import table_to_columns
from .explain import explain_block
from .schema import _UNIT_SCORES, _VECTOR_METRICS, head_wide

__all__ = ["colour_scale", "decode_pattern", "encode_pattern", "inspect_data", "inspect_page",
           "pattern_data", "save_inspect_page"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.2em 2em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; }
.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: 0.4em 1em; margin: 0.4em 0; }
.facts { color: #555; font-size: 0.9em; }
.controls { margin: 0.8em 0; display: flex; gap: 1.2em; flex-wrap: wrap; align-items: center; }
.controls label { font-size: 0.9em; }
#layout { display: flex; gap: 1.5em; align-items: flex-start; }
#left { flex: 0 1 auto; overflow-x: auto; max-width: 55%; }
.scroll { overflow-x: auto; max-width: 100%; }
#list th { white-space: nowrap; }
#card { flex: 1 1 0; min-width: 420px; border: 1px solid #ccc; border-radius: 6px; padding: 0.6em 1em; }
table { border-collapse: collapse; font-size: 0.82em; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; cursor: pointer; white-space: nowrap; }
#grid td { width: 3.2em; height: 1.9em; text-align: center; cursor: pointer; font-size: 0.78em; }
#grid td.sel { outline: 3px solid #e4572e; }
#grid td.off { color: #bbb; background: #fafafa !important; }
#list tr { cursor: pointer; }
#list tr:hover td { background: #eef4ff; }
.bar { display: inline-block; width: 140px; height: 10px; vertical-align: middle;
       background: linear-gradient(to right, #f7fbff, #08306b); border: 1px solid #999; }
.scores td:first-child { text-align: left; }
.plots { display: flex; flex-wrap: wrap; gap: 0.6em; }
svg text { font-size: 10px; fill: #333; }
.layer-adj { margin: 0.4em 0 1em 0; }
"""

def _script() -> str:
    """The page's script, kept in ``inspect.js`` next to this module (package data)."""
    from importlib.resources import files

    # export.js: the card's SVG/PNG download buttons (shared with the compare page)
    return "\n".join(files("posinterp.dashboard").joinpath(name).read_text(encoding="utf-8")
                     for name in ("common.js", "inspect.js", "export.js"))


def colour_scale(key: str, values, d_head: int | None = None) -> dict:
    """The grid's colour scale for one score column of the wide view.

    Scores with a fixed range get it (an **absolute** scale: the schema's unit scores,
    attention scores, rotational mass, phase and antisymmetric energy, on [0, 1]; null
    percentiles on [0, 100]; complex pairs on [0, d_head / 2]); any other score (loss
    changes, band edges, standard errors) spans the heads' own minimum to maximum, and says
    so (``absolute`` False).

    Args:
        key: a column name of :func:`~posinterp.dashboard.schema.head_wide`
            (``metric[ablation]@Δ=offset``).
        values: that column's values (NaN ignored).
        d_head: the model's d_head, for ``n_complex_pairs``.

    Returns:
        ``{"lo", "hi", "absolute"}``; ``lo == hi`` (one colour) when nothing varies.
    """
    metric = key.split("@")[0].split("[")[0]
    if metric.endswith("_null_percentile"):
        return {"lo": 0.0, "hi": 100.0, "absolute": True}
    if metric in _UNIT_SCORES:
        return {"lo": 0.0, "hi": 1.0, "absolute": True}
    if metric == "n_complex_pairs" and d_head:
        return {"lo": 0.0, "hi": float(d_head // 2), "absolute": True}
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    lo, hi = (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)
    return {"lo": lo, "hi": hi, "absolute": False}


def inspect_data(inspection) -> dict:
    """The JSON object the page embeds: ``meta``, the ``table`` (compact exact columns:
    :func:`~posinterp.dashboard.columns.table_to_columns`; the page shows a non-finite
    float as missing), the
    grid's ``colour_scales`` (:func:`colour_scale`, by score column) and
    ``vector_metrics``, the inspection schema's list of metrics with several rows per
    head (never a per-head score; the page's script reads it from here).

    Nothing is rounded.
    """
    t = inspection.table
    meta = {**{k: json_value(v) if not isinstance(v, list) else v for k, v in inspection.meta.items()},
            "rotary": inspection.meta.get("pe") == "rotary"}
    wide = head_wide(t)
    scales = {k: colour_scale(k, wide[k], inspection.meta.get("d_head"))
              for k in wide.columns if k not in ("layer", "head")}
    return {"meta": meta, "table": table_to_columns(t), "colour_scales": scales,
            "vector_metrics": list(_VECTOR_METRICS)}


#: Levels of the page's attention weights: a weight w in [0, 1] is stored as
#: round(w * PATTERN_LEVELS), an error of at most 1 / (2 * 65535) = 7.6e-6.
PATTERN_LEVELS = 65535


def encode_pattern(pattern) -> str:
    """One head's causal ``[m, m]`` attention for the page: the lower triangle (j <= i,
    row by row) as little-endian uint16 levels ``round(w * PATTERN_LEVELS)``, base64.

    Above the diagonal a causal (or pooled causal, :func:`~posinterp.analysis.kernels.
    pool_pattern`) pattern is 0, so nothing is lost there; weights are clipped to [0, 1].
    About 1.3 characters per cell, against about 5 for decimal text.
    """
    a = np.asarray(pattern, dtype=np.float64)
    rows, cols = np.tril_indices(a.shape[-1])
    levels = np.round(np.clip(a[rows, cols], 0.0, 1.0) * PATTERN_LEVELS).astype("<u2")
    return base64.b64encode(levels.tobytes()).decode("ascii")


def decode_pattern(text: str, m: int) -> np.ndarray:
    """:func:`encode_pattern`'s inverse, as the page's ``decodePattern`` computes it."""
    levels = np.frombuffer(base64.b64decode(text), dtype="<u2").astype(np.float64)
    out = np.zeros((m, m))
    out[np.tril_indices(m)] = levels / PATTERN_LEVELS
    return out


def pattern_data(inspection) -> dict:
    """The page's pattern views (``id="pattern-data"``): sequence 0 and every
    :attr:`~posinterp.dashboard.inspect.Inspection.pattern_views` entry, each
    ``{"label", "tokens", "block", "n_tokens", "heads": {"l-h": encode_pattern(...)}}``."""
    meta = inspection.meta
    views = [("sequence 0", inspection.str_tokens, inspection.patterns, meta.get("pattern_block", 1),
              meta.get("pattern_tokens", len(inspection.str_tokens)))]
    views += [(v.label, v.str_tokens, v.patterns, v.block, v.n_tokens)
              for v in getattr(inspection, "pattern_views", [])]
    out = []
    for label, tokens, patterns, block, n in views:
        heads = {}
        for layer, pat in patterns.items():
            ids = meta.get("heads") or range(pat.shape[0])  # an older inspection: every head
            for i, head in enumerate(ids):
                heads[f"{layer}-{head}"] = encode_pattern(pat[i].double().numpy())
        out.append({"label": label, "tokens": list(tokens), "block": int(block or 1),
                    "n_tokens": int(n or len(tokens)), "heads": heads})
    return {"views": out}


def _circuitsvis_bundle() -> tuple[str, str]:
    """circuitsvis's JavaScript bundle and its attention-pattern component name."""
    import circuitsvis as cv

    view = split_local_src(cv.attention.attention_pattern(tokens=["a", "b"],
                                                          attention=np.eye(2)).local_src)
    component = re.search(r"CircuitsVis\.(\w+),", view.render_call).group(1)
    return view.bundle, component


def _adjacency_table(table: pd.DataFrame) -> str:
    adj = table[(table.metric == "adjacency_score") & table["head"].isna()]
    if adj.empty:
        return ""

    def site(hook: str) -> str:
        return hook.split(".")[-1].removeprefix("hook_")

    view = adj.assign(site=[site(h) for h in adj.hook]).pivot_table(
        index="layer", columns="site", values="value", sort=False)
    order = [c for c in ("resid_pre", "attn_out", "resid_mid", "resid_post") if c in view.columns]
    view = view[order]
    view.columns.name = None  # else pandas prints "site" as an extra header cell
    view = view.reset_index()
    view["layer"] = ["embedding (-1)" if v == -1 else str(v) for v in view.layer]
    return view.to_html(index=False, float_format="{:.3f}".format, na_rep="", border=0, escape=True)


def inspect_page(inspection, title: str, facts: str = "") -> str:
    """The whole offline HTML page for one model's :class:`Inspection`.

    Args:
        inspection: from :func:`posinterp.dashboard.inspect.inspect_heads`.
        title: page title (escaped).
        facts: one line about the model and input (escaped).
    """
    pdata = pattern_data(inspection)
    bundle, component = _circuitsvis_bundle() if any(v["heads"] for v in pdata["views"]) else (None, "")
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for n in inspection.notes)
    esc = html.escape
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{esc(title)}</title><style>{_STYLE}</style></head>
<body>
<h1>{esc(title)}</h1>
<p class="facts">{esc(facts)}</p>
<p class="note">How to read this page: the grid colours every head by the chosen score (the
bar gives the scale). Click a head for its card: the positional kernel (how attention falls
with the key offset Δ = j − i; Δ = −1 is the previous token), its previous-token / self /
first-token scores, its QK eigenvalues against random heads, and, when measured, the loss
change when it or one of its spectral channels is removed. A positional head shows a kernel
peaked at a fixed offset; a rotational QK spectrum (RoPE) puts mass on complex eigenvalues.
On RoPE models the card also shows how the head's QK energy spreads over the rotary
frequencies, and the grid can be coloured by its positional/symbolic score.</p>
{notes}
<div class="controls">
 <label>colour by <select id="colour-key"></select></label>
 <span><span id="bar-lo"></span> <span class="bar"></span> <span id="bar-hi"></span>
   <span id="bar-kind" class="facts"></span></span>
 <label>show heads with <select id="filter-key"></select> &ge;
   <input id="filter-min" type="number" step="any" style="width:6em" placeholder="any"></label>
 <label><input id="cols-all" type="checkbox"> all percentile columns</label>
 <span id="count" class="facts"></span>
</div>
<div id="layout">
 <div id="left"><table id="grid"></table>
  <h3>Adjacency score per layer</h3>
  <p class="facts">Probability that a token is more cosine-similar to the nearer of two earlier
  tokens (0.5 = chance), at the embedding, the attention output, after attention
  (resid_mid) and after the block (resid_post).</p>
  <div class="layer-adj">{_adjacency_table(inspection.table)}</div>
 </div>
 <div id="card"></div>
</div>
<h3>Heads (click a column to sort)</h3>
<div class="scroll"><table id="list"></table></div>
<script type="application/json" id="inspect-data">{script_json(inspect_data(inspection))}</script>
<script type="application/json" id="pattern-data">{script_json(pdata)}</script>
{explain_block(inspection)}{f"<script>{chr(10)}{script_safe_js(bundle)}{chr(10)}</script>" if bundle else ""}
<script>
const PATTERN_COMPONENT = {script_json(component)};
{script_safe_js(_script())}
</script>
</body></html>
"""


def save_inspect_page(inspection, path: str | Path, title: str, facts: str = "") -> Path:
    """Write :func:`inspect_page` atomically to ``path``; returns the path."""
    return atomic_write_text(path, inspect_page(inspection, title, facts))
