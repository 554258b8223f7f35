"""A versioned JSON file of a whole inspection, and its loader (docs/inspect.md, "Export").

The file holds everything an :class:`~posinterp.dashboard.inspect.Inspection` holds:
the tidy table (column names, pandas dtypes and rows), the attention patterns shown
on the page, the token labels, the notes and the model facts. It is strict JSON
(:func:`posinterp.io.dumps_json`): a missing or non-finite number is ``null`` and loads
back as NaN (float columns) or NA (integer and string columns). Written atomically.

Schema (``schema_version`` 3)::

    {"schema": "posinterp.inspection", "schema_version": 3, "posinterp_version": str,
     "meta": {...}, "notes": [str], "str_tokens": [str],
     "table": {"n_rows": int, "columns": [str], "dtypes": {column: pandas dtype name},
               "data": {column: ...}},          # posinterp.dashboard.columns
     "patterns": {"<layer>": {"shape": [head, query, key], "dtype": "float32",
                              "triangle": "lower" (optional), "base64": str}},
     "pattern_views": [{"label": str, "str_tokens": [str], "block": int, "n_tokens": int,
                        "patterns": {...as "patterns"}}]}

A pattern's base64 holds its little-endian float32 bytes, row-major; with ``"triangle":
"lower"`` only the entries j <= i of each [query, key] square, the rest being exactly 0
(a causal pattern: half the bytes, nothing lost).

Version 3 stored the table as columns (:mod:`posinterp.dashboard.columns`: a row per
list repeated every string and wrote floats as decimals, 42 MB for SmolLM2 on two short
paragraphs) and causal patterns as their lower triangles; versions 1 and 2 (``columns``,
``dtypes``, ``rows``: ``[[value, ...]]``) still load. Version 2 added ``pattern_views``
(the page's sequence picker beyond sequence 0:
:class:`~posinterp.dashboard.inspect.PatternView`) and the table rows
``induction_score``/``induction_score_input`` (rows, not columns: the columns are
unchanged); a version 1 file loads with no pattern views. A loader refuses a file of
another ``schema`` or of a newer ``schema_version`` by name.

"Explain one score" (``Inspection.score_parts``) is not exported: its long table ran
to 31 MB as CSV for stories260K. Its note is replaced by one saying so, and
:func:`posinterp.inspect_heads` on the same input recomputes it.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..io import POSINTERP_VERSION, atomic_write_text, dumps_json
from .columns import table_from_columns, table_to_columns, typed_column
from .inspect import Inspection, PatternView

__all__ = ["SCHEMA", "SCHEMA_VERSION", "export_inspection", "inspection_from_dict",
           "inspection_to_dict", "load_inspection"]

SCHEMA = "posinterp.inspection"
SCHEMA_VERSION = 3


NOT_EXPORTED = ("Explain one score: not in this file (the decomposition is not exported); "
                "inspect_heads on the same input recomputes it")


def exported_notes(notes) -> list[str]:
    """``notes`` as the file holds them: the "Explain one score" note, which describes a
    table the file does not carry, becomes :data:`NOT_EXPORTED`."""
    return [NOT_EXPORTED if n.startswith("Explain one score") else n for n in notes]


def inspection_to_dict(inspection: Inspection) -> dict:
    """The JSON-ready object of the module's schema (nothing rounded)."""
    t = inspection.table
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "posinterp_version": POSINTERP_VERSION,
        "meta": inspection.meta, "notes": exported_notes(inspection.notes),
        "str_tokens": list(inspection.str_tokens),
        "table": table_to_columns(t),
        "patterns": _patterns_to_dict(inspection.patterns),
        "pattern_views": [{"label": v.label, "str_tokens": list(v.str_tokens), "block": int(v.block),
                           "n_tokens": int(v.n_tokens), "patterns": _patterns_to_dict(v.patterns)}
                          for v in inspection.pattern_views],
    }


def _patterns_to_dict(patterns) -> dict:
    # exact float32 bytes: a quarter the size of decimal text, nothing rounded; a causal
    # pattern's upper triangle (exactly 0) is left out
    out = {}
    for layer, p in patterns.items():
        a = p.detach().float().cpu().numpy().astype("<f4")
        m = a.shape[-1]
        entry = {"shape": list(a.shape), "dtype": "float32"}
        if a.ndim >= 2 and a.shape[-2] == m and not np.triu(a, 1).any():
            rows, cols = np.tril_indices(m)
            a = a[..., rows, cols]
            entry["triangle"] = "lower"
        entry["base64"] = base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")
        out[str(layer)] = entry
    return out


def _patterns_from_dict(data: dict, where: str = "patterns") -> dict:
    patterns = {}
    for k, v in data.items():
        if not isinstance(v, dict) or v.get("dtype") != "float32":
            raise ValueError(f"{where}[{k!r}] must be {{'shape', 'dtype': 'float32', 'base64'}}, got "
                             f"{type(v).__name__ if not isinstance(v, dict) else v.get('dtype')!r}")
        flat = np.frombuffer(base64.b64decode(v["base64"]), dtype="<f4").astype(np.float32)
        shape = list(v["shape"])
        if v.get("triangle") == "lower":
            m = shape[-1]
            rows, cols = np.tril_indices(m)
            full = np.zeros(shape, dtype=np.float32)
            full[..., rows, cols] = flat.reshape(*shape[:-2], len(rows))
            flat = full
        elif v.get("triangle") is not None:
            raise ValueError(f"{where}[{k!r}]['triangle'] must be 'lower' or absent, got "
                             f"{v.get('triangle')!r}")
        patterns[int(k)] = torch.from_numpy(flat.reshape(shape))
    return patterns


def export_inspection(inspection: Inspection, path: str | Path) -> Path:
    """Write ``inspection`` as versioned strict JSON to ``path`` (atomically).

    Returns:
        The path.

    Raises:
        OSError: the file cannot be written (the old file, if any, is left as it was).
    """
    return atomic_write_text(path, dumps_json(inspection_to_dict(inspection)) + "\n")


def inspection_from_dict(data: dict) -> Inspection:
    """Rebuild an :class:`Inspection` from :func:`inspection_to_dict`'s object.

    Raises:
        ValueError: not a posinterp inspection, a newer ``schema_version``, rows that
            do not match the columns (a column of another length), or a pattern that is
            not float32.
    """
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"not a posinterp inspection file: 'schema' must be {SCHEMA!r}, got "
                         f"{data.get('schema') if isinstance(data, dict) else type(data).__name__!r}")
    version = data.get("schema_version")
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"schema_version must be an integer in 1..{SCHEMA_VERSION} (this posinterp "
                         f"reads up to {SCHEMA_VERSION}), got {version!r}")
    if version >= 3:
        table = table_from_columns(data["table"])
    else:  # versions 1 and 2: a list per row
        cols, dtypes = data["columns"], data["dtypes"]
        if any(len(r) != len(cols) for r in data["rows"]):
            raise ValueError(f"every row must have {len(cols)} values (one per column)")
        rows = pd.DataFrame(data["rows"], columns=cols, dtype=object)
        table = pd.DataFrame({c: typed_column(rows[c], dtypes[c]) for c in cols}, columns=cols)
    patterns = _patterns_from_dict(data["patterns"])
    views = [PatternView(str(v["label"]), list(v["str_tokens"]),
                         _patterns_from_dict(v["patterns"], f"pattern_views[{i}].patterns"),
                         int(v["block"]), int(v["n_tokens"]))
             for i, v in enumerate(data.get("pattern_views", []))]  # version 1: none
    return Inspection(table, patterns, list(data["str_tokens"]), list(data["notes"]), dict(data["meta"]),
                      pattern_views=views)


def load_inspection(path: str | Path) -> Inspection:
    """Read a file written by :func:`export_inspection`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not strict JSON, or as :func:`inspection_from_dict`.
    """
    text = Path(path).read_text(encoding="utf-8")

    def refuse(name):
        raise ValueError(f"{path}: not strict JSON ({name})")
    try:
        data = json.loads(text, parse_constant=refuse)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    return inspection_from_dict(data)
