"""The inspect page's "Explain one score" section: data and script (docs/inspect.md).

:func:`dashboard_score_parts` computes, in Python, the decomposition of every displayed
(query, key) cell of every head (:func:`posinterp.analysis.explain.score_parts`, up to a
stated bound); :func:`explain_data` packs that table into one JSON block for the page,
and ``explain.js`` draws a clickable pattern per head card and the parts of the clicked
cell. The browser only looks numbers up: nothing is recomputed there.
"""

from __future__ import annotations

import pandas as pd
from jaxtyping import Int
from torch import Tensor

from .._validate import is_int
from ..analysis.explain import BIAS_PARTS, CHANNEL_PARTS, score_parts
from ..io import json_value
from ..viz.circuits import script_json, script_safe_js

__all__ = ["DEFAULT_MAX_VALUES", "FORMULA", "dashboard_score_parts", "explain_block", "explain_data"]

DEFAULT_MAX_VALUES = 200_000  # the dashboard's bound: about 1.7 MB of JSON

FORMULA = ("score(i, j) = Σ_c u_i Π_c R(i)·v_j R(j) / s + u_i R(i)·b_K R(j) / s + b_Q R(i)·v_j R(j) / s "
           "+ b_Q R(i)·b_K R(j) / s + ALiBi m_h (j − i), with u = q − b_Q and v = k − b_K the "
           "weight parts of query and key, b_Q, b_K the biases (the attention norm's bias "
           "folded in), s = attn_scale, R(t) RoPE's rotation (identity otherwise) and Π_c the "
           "spectral projectors of B = W_Kᵀ W_Q (positive-real, negative-real, complex pairs, "
           "and the null remainder). For RoPE heads the same weight term is also split by "
           "rotary pair p: (u_i R(i))_p·(v_j R(j))_p / s. The parts of either view sum to the "
           "score. Source: docs/inspect.md, \"Explain one score\".")


def _num(v) -> float | None:
    """7 significant digits (the page's numbers), None for a missing value
    (:func:`posinterp.io.json_value`)."""
    v = json_value(v)
    return None if v is None else float(f"{float(v):.7g}")


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

    return files("posinterp.dashboard").joinpath("explain.js").read_text(encoding="utf-8")


def explain_block(inspection) -> str:
    """``<script>`` blocks to place before the page's own script: the data (or nothing)
    and ``explain.js``, which defines ``explainCard`` (called by each head card)."""
    data = explain_data(inspection)
    if data is None:
        return ""
    return (f'<script type="application/json" id="explain-data">{script_json(data)}</script>\n'
            f"<script>\n{script_safe_js(_script())}\n</script>\n")


def dashboard_score_parts(model, tokens: Int[Tensor, "pos"], max_tokens: int,
                          max_values: int = DEFAULT_MAX_VALUES, layers=None, heads=None
                          ) -> tuple[pd.DataFrame | None, str]:
    """The decompositions the inspect page embeds: every head, every cell of the first
    n_e tokens of ``tokens`` (real tokens of sequence 0), n_e the largest number
    <= ``max_tokens`` whose cells fit in ``max_values`` stored values.

    ``layers``/``heads``: the selected heads only (None: every one), as
    :func:`score_parts` takes them.

    Returns:
        ``(table of :func:`score_parts`, or None, a sentence for the page stating the
        bound or why nothing was computed)``.

    Raises:
        ValueError: for ``max_values < 0``.
    """
    from ..models.backend import positional_type

    if not is_int(max_values) or max_values < 0:
        raise ValueError(f"max_values must be an integer >= 0, got {max_values}")
    n_heads = (model.cfg.n_layers if layers is None else len(layers)) * (
        model.cfg.n_heads if heads is None else len(heads))
    rows = len(CHANNEL_PARTS) + len(BIAS_PARTS) + 3 + (positional_type(model) == "alibi")
    if positional_type(model) == "rotary":
        rows += model.cfg.d_head // 2 + 1
    n = min(int(tokens.shape[-1]), max_tokens)
    while n > 0 and n_heads * n * (n + 1) // 2 * rows > max_values:
        n -= 1
    if n < 1:
        return None, (f"Explain one score: no cell fits the bound of {max_values:,} stored values "
                      f"({n_heads} heads x {rows} numbers per cell).")
    try:
        df = score_parts(model, tokens[..., :n], layers=layers, heads=heads, queries=None, keys=None)
    except ValueError as err:  # MissingFeatureError included: the page says why, inspect goes on
        return None, f"Explain one score is not available for this model: {err}"
    cut = "" if n == min(int(tokens.shape[-1]), max_tokens) else (
        f", bounded to {max_values:,} stored values ({n_heads} heads x {rows} numbers per cell)")
    return df, (f"Explain one score: the decomposition is precomputed for every head and every "
                f"(query, key) cell of the first {n} tokens of sequence 0{cut}.")
