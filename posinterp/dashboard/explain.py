"""The inspect page's "Explain one score" section: data and script (docs/inspect.md).

:func:`posinterp.analysis.explain.dashboard_score_parts` computes, in Python, the
decomposition of every displayed (query, key) cell of every head (up to a stated bound);
this module packs that table into one JSON block for the page, and ``explain.js`` draws
a clickable pattern per head card and the parts of the clicked cell. The browser only
looks numbers up: nothing is recomputed there.
"""

from __future__ import annotations

import math

import pandas as pd

from ..analysis.explain import BIAS_PARTS, CHANNEL_PARTS
from .circuits import script_json, script_safe_js

__all__ = ["FORMULA", "explain_block", "explain_data"]

FORMULA = ("score(i, j) = Σ_c u_i Π_c R(i)·v_j R(j) / s + u_i R(i)·b_K R(j) / s + b_Q R(i)·v_j R(j) / s "
           "+ b_Q R(i)·b_K R(j) / s + ALiBi m_h (j − i), with u = q − b_Q and v = k − b_K the "
           "weight parts of query and key, b_Q, b_K the biases (the attention norm's bias "
           "folded in), s = attn_scale, R(t) RoPE's rotation (identity otherwise) and Π_c the "
           "spectral projectors of B = W_Kᵀ W_Q (positive-real, negative-real, complex pairs, "
           "and the null remainder). For RoPE heads the same weight term is also split by "
           "rotary pair p: (u_i R(i))_p·(v_j R(j))_p / s. The parts of either view sum to the "
           "score. Source: docs/inspect.md, \"Explain one score\".")


def _num(v) -> float | None:
    """7 significant digits (the page's numbers), None for a missing value."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return float(f"{float(v):.7g}")


def explain_data(inspection) -> dict | None:
    """The JSON object the page embeds for "Explain one score", or None without a table.

    ``parts``: one entry per part, ``group`` ``channel`` (spectral channels), ``bias``
    (bias and ALiBi parts, shared by both views) or ``rotary_pair``; ``heads["l-h"]``
    holds one list per part and ``total``, ``model_score``, ``pattern``, each over the
    cells of the lower triangle in row-major order (query 0 key 0, query 1 key 0, query 1
    key 1, ...), null where a cell is masked.
    """
    df = getattr(inspection, "score_parts", None)
    if df is None or df.empty:
        return None
    n = int(df["query"].max()) + 1
    cells = pd.MultiIndex.from_tuples([(i, j) for i in range(n) for j in range(i + 1)],
                                      names=["query", "key"])
    # one column per (metric, view, part, pair), one row per (layer, head, query, key)
    d = df.assign(view=df.view.fillna(""), part=df.part.fillna(""), pair=df.pair.fillna(-1))
    wide = d.set_index(["layer", "head", "query", "key", "metric", "view", "part", "pair"]).value
    wide = wide.unstack(["metric", "view", "part", "pair"])
    chan = [c for c in wide.columns if c[0] == "score_part" and c[1] == "channel"]
    rot = [c for c in wide.columns if c[0] == "score_part" and c[1] == "rotary_pair"
           and c[2] in ("pair", "unrotated")]
    freq = df[df.part.isin(["pair", "unrotated"])].assign(pair=lambda x: x.pair.fillna(-1)) \
        .groupby(["part", "pair"]).frequency.first()
    order = [*CHANNEL_PARTS, *BIAS_PARTS, "alibi"]
    chan.sort(key=lambda c: order.index(c[2]))
    rot.sort(key=lambda c: (c[2] == "unrotated", c[3]))
    parts = [{"group": "channel" if c[2] in CHANNEL_PARTS else "bias", "part": c[2], "pair": None,
              "frequency": None} for c in chan]
    parts += [{"group": "rotary_pair", "part": c[2], "pair": None if c[3] < 0 else int(c[3]),
               "frequency": _num(freq.get((c[2], c[3])))} for c in rot]
    summary = {m: (m, "", "", -1) for m in ("score_total", "model_score", "pattern")}
    heads = {}
    for layer, head in wide.index.droplevel(["query", "key"]).unique():
        block = wide.loc[(layer, head)].reindex(cells)
        heads[f"{layer}-{head}"] = {
            "parts": [[_num(v) for v in block[c].to_numpy()] for c in chan + rot],
            **{m: [_num(v) for v in block[c].to_numpy()] for m, c in summary.items()}}
    notes = [x for x in inspection.notes if x.startswith("Explain one score")]
    return {"n": n, "tokens": list(inspection.str_tokens[:n]), "parts": parts, "heads": heads,
            "formula": FORMULA, "bound": notes[0] if notes else ""}


def _script() -> str:
    from importlib.resources import files

    return files("posinterp.viz").joinpath("explain.js").read_text(encoding="utf-8")


def explain_block(inspection) -> str:
    """``<script>`` blocks to place before the page's own script: the data (or nothing)
    and ``explain.js``, which defines ``explainCard`` (called by each head card)."""
    data = explain_data(inspection)
    if data is None:
        return ""
    return (f'<script type="application/json" id="explain-data">{script_json(data)}</script>\n'
            f"<script>\n{script_safe_js(_script())}\n</script>\n")
