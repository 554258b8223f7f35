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
    cells = [(i, j) for i in range(n) for j in range(i + 1)]
    index = pd.MultiIndex.from_tuples(cells, names=["query", "key"])
    sp = df[df.metric == "score_part"]
    chan = sp[sp.view == "channel"]
    rot = sp[(sp.view == "rotary_pair") & sp.part.isin(["pair", "unrotated"])]
    parts = []
    for part in dict.fromkeys(chan.part):
        parts.append({"group": "channel" if part in ("positive_real", "negative_real", "complex", "null")
                      else "bias", "part": part, "pair": None, "frequency": None,
                      "select": ("channel", part, None)})
    for (part, pair), g in rot.groupby(["part", "pair"], dropna=False, sort=False):
        pair = None if pd.isna(pair) else int(pair)
        parts.append({"group": "rotary_pair", "part": part, "pair": pair,
                      "frequency": _num(g.frequency.iloc[0]), "select": ("rotary_pair", part, pair)})
    parts.sort(key=lambda p: (p["group"] == "rotary_pair", p["pair"] if p["pair"] is not None else 1e9))

    def column(sub: pd.DataFrame) -> list:
        s = sub.set_index(["query", "key"]).value.reindex(index)
        return [_num(v) for v in s.to_numpy()]

    heads = {}
    for (layer, head), g in df.groupby(["layer", "head"], sort=True):
        gp = g[g.metric == "score_part"]
        values = []
        for p in parts:
            view, part, pair = p["select"]
            sel = gp[(gp.view == view) & (gp.part == part)]
            if pair is not None:
                sel = sel[sel.pair == pair]
            values.append(column(sel))
        heads[f"{layer}-{head}"] = {"parts": values,
                                    **{m: column(g[g.metric == m])
                                       for m in ("score_total", "model_score", "pattern")}}
    for p in parts:
        del p["select"]
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
