"""A tidy table as compact, exact JSON columns: the inspection file's and page's encoding.

A row-per-list encoding repeated every string (the model spec, the hook name, the metric)
and wrote every float as up to 17 decimal digits: 166 bytes a row, 28 MB of page and
42 MB of file for SmolLM2 on two short paragraphs. Here each column is stored once:

- float columns: ``{"float64": base64}``, the little-endian float64 bytes (exact; NaN and
  ±inf kept as such; a float32 column is widened exactly and narrowed back on load);
- columns whose values are all strings (or missing): ``{"levels": [str], "codes": [int]}``,
  code -1 for a missing value;
- every other column (integers, nullable integers, booleans, mixed objects):
  ``{"values": [...]}``, a missing value as ``null`` (:func:`posinterp.io.json_value`).

Codes and values whose runs are long (a table sorted by layer and head: the model, the
hook, the layer, the all-missing columns) are stored as runs instead: ``"code_runs"`` /
``"value_runs"``: ``[[value, count], ...]``, where that is shorter than the list.

The page decodes it with ``decodeTable`` (common.js), which shows a non-finite float as
missing, as the page always has.
"""

from __future__ import annotations

import base64

import numpy as np
import pandas as pd

from ..io import json_value

__all__ = ["table_from_columns", "table_to_columns", "typed_column"]


def _strings(s: pd.Series) -> bool:
    values = s[s.notna()]
    return bool(len(values)) and all(isinstance(v, str) for v in values)


def _list(kind: str, values: list) -> dict:
    """``{kind + "s": values}``, or ``{kind + "_runs": [[v, count], ...]}`` where there are
    fewer than a quarter as many runs as values."""
    runs: list[list] = []
    for v in values:
        if runs and runs[-1][0] == v and type(runs[-1][0]) is type(v):
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return {f"{kind}_runs": runs} if 4 * len(runs) < len(values) else {f"{kind}s": values}


def _expand(enc: dict, kind: str, where: str, c: str) -> list:
    if f"{kind}s" in enc:
        return list(enc[f"{kind}s"])
    runs = enc[f"{kind}_runs"]
    if not all(isinstance(r, list) and len(r) == 2 and isinstance(r[1], int) and r[1] > 0
               for r in runs):
        raise ValueError(f"{where}: column {c!r}: each of {kind}_runs must be [value, count > 0]")
    return [v for v, k in runs for _ in range(k)]


def table_to_columns(table: pd.DataFrame) -> dict:
    """``table`` as ``{"n_rows": int, "columns": [str], "dtypes": {column: pandas dtype
    name}, "data": {column: encoding}}`` (the module docstring's encodings). Nothing is
    rounded: :func:`table_from_columns` gives back an equal table, dtypes included."""
    data = {}
    for c in table.columns:
        s = table[c]
        if pd.api.types.is_float_dtype(s.dtype):
            raw = s.to_numpy(dtype="<f8", na_value=np.nan).tobytes()
            data[str(c)] = {"float64": base64.b64encode(raw).decode("ascii")}
        elif not pd.api.types.is_bool_dtype(s.dtype) and _strings(s):
            codes, levels = pd.factorize(s, use_na_sentinel=True)
            data[str(c)] = {"levels": [str(v) for v in levels], **_list("code", codes.tolist())}
        else:
            data[str(c)] = _list("value", [json_value(v) for v in s.tolist()])
    return {"n_rows": int(len(table)), "columns": [str(c) for c in table.columns],
            "dtypes": {str(c): str(d) for c, d in table.dtypes.items()}, "data": data}


def table_from_columns(obj: dict, where: str = "table") -> pd.DataFrame:
    """:func:`table_to_columns`'s inverse.

    Raises:
        ValueError: ``obj`` is not that object (a missing key, a column of another length
            than ``n_rows``, a code outside its levels, an unknown encoding), naming
            ``where`` and the column.
    """
    try:
        n, cols, dtypes, data = obj["n_rows"], obj["columns"], obj["dtypes"], obj["data"]
    except (TypeError, KeyError) as err:
        raise ValueError(f"{where} must hold 'n_rows', 'columns', 'dtypes' and 'data'; "
                         f"missing {err}") from None
    out = {}
    for c in cols:
        enc, d = data.get(c), dtypes.get(c)
        if not isinstance(enc, dict) or d is None:
            raise ValueError(f"{where}: column {c!r} has no data or no dtype")
        if "float64" in enc:
            values = np.frombuffer(base64.b64decode(enc["float64"]), dtype="<f8")
            col = pd.Series(values.copy()).astype(d)
        elif "levels" in enc and ("codes" in enc or "code_runs" in enc):
            levels = list(enc["levels"])
            codes = np.asarray(_expand(enc, "code", where, c), dtype=np.int64)
            if codes.size and (codes.min() < -1 or codes.max() >= len(levels)):
                raise ValueError(f"{where}: column {c!r} has a code outside its {len(levels)} levels")
            col = pd.Series(np.array([None if k < 0 else levels[k] for k in codes], dtype=object))
            col = typed_column(col, d)
        elif "values" in enc or "value_runs" in enc:
            col = typed_column(pd.Series(_expand(enc, "value", where, c), dtype=object), d)
        else:
            raise ValueError(f"{where}: column {c!r} has an unknown encoding {sorted(enc)}")
        if len(col) != n:
            raise ValueError(f"{where}: column {c!r} has {len(col)} values, n_rows is {n}")
        out[c] = col
    return pd.DataFrame(out, columns=cols)


def typed_column(col: pd.Series, d: str) -> pd.Series:
    """An object column from JSON as pandas dtype ``d`` (a missing value as NaN in a float
    column, NA in integer and string ones).

    Raises:
        ValueError, TypeError: from pandas, for values that ``d`` cannot hold.
    """
    if d.startswith("float"):
        return pd.to_numeric(col.where(col.notna(), np.nan)).astype(d)
    if d == "object" or (d == "str" and int(pd.__version__.split(".")[0]) < 3):
        return col.astype(object)  # pandas 2 reads pandas 3's "str" as object
    return col.astype(d)  # int64, Int64, string, boolean: pandas parses its own names
