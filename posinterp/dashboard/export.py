"""A versioned JSON file of a whole inspection, and its loader (docs/inspect.md, "Export").

The file holds everything an :class:`~posinterp.dashboard.inspect.Inspection` holds:
the tidy table (column names, pandas dtypes and rows), the attention patterns shown
on the page, the token labels, the notes and the model facts. It is strict JSON
(:func:`posinterp.io.dumps_json`): a missing or non-finite number is ``null`` and loads
back as NaN (float columns) or NA (integer and string columns). Written atomically.

Schema (``schema_version`` 2)::

    {"schema": "posinterp.inspection", "schema_version": 2, "posinterp_version": str,
     "meta": {...}, "notes": [str], "str_tokens": [str],
     "columns": [str], "dtypes": {column: pandas dtype name}, "rows": [[value, ...]],
     "patterns": {"<layer>": {"shape": [head, query, key], "dtype": "float32",
                              "base64": str}},   # little-endian float32 bytes, row-major
     "pattern_views": [{"label": str, "str_tokens": [str], "block": int, "n_tokens": int,
                        "patterns": {...as "patterns"}}]}

Version 2 added ``pattern_views`` (the page's sequence picker beyond sequence 0:
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

from ..io import POSINTERP_VERSION, atomic_write_text, dumps_json, json_value
from .inspect import Inspection, PatternView

__all__ = ["SCHEMA", "SCHEMA_VERSION", "export_inspection", "inspection_from_dict",
           "inspection_to_dict", "load_inspection"]

SCHEMA = "posinterp.inspection"
SCHEMA_VERSION = 2


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
        "columns": [str(c) for c in t.columns], "dtypes": {str(c): str(d) for c, d in t.dtypes.items()},
        "rows": [[json_value(v) for v in row] for row in t.itertuples(index=False, name=None)],
        "patterns": _patterns_to_dict(inspection.patterns),
        "pattern_views": [{"label": v.label, "str_tokens": list(v.str_tokens), "block": int(v.block),
                           "n_tokens": int(v.n_tokens), "patterns": _patterns_to_dict(v.patterns)}
                          for v in inspection.pattern_views],
    }


def _patterns_to_dict(patterns) -> dict:
    # exact float32 bytes: a quarter the size of decimal text, nothing rounded
    return {str(layer): {"shape": list(p.shape), "dtype": "float32",
                         "base64": base64.b64encode(p.detach().float().cpu().numpy()
                                                    .astype("<f4").tobytes()).decode("ascii")}
            for layer, p in patterns.items()}


def _patterns_from_dict(data: dict, where: str = "patterns") -> dict:
    patterns = {}
    for k, v in data.items():
        if not isinstance(v, dict) or v.get("dtype") != "float32":
            raise ValueError(f"{where}[{k!r}] must be {{'shape', 'dtype': 'float32', 'base64'}}, got "
                             f"{type(v).__name__ if not isinstance(v, dict) else v.get('dtype')!r}")
        flat = np.frombuffer(base64.b64decode(v["base64"]), dtype="<f4")
        patterns[int(k)] = torch.from_numpy(flat.astype(np.float32).reshape(v["shape"]))
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
            do not match the columns, or a pattern that is not float32.
    """
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"not a posinterp inspection file: 'schema' must be {SCHEMA!r}, got "
                         f"{data.get('schema') if isinstance(data, dict) else type(data).__name__!r}")
    version = data.get("schema_version")
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"schema_version must be an integer in 1..{SCHEMA_VERSION} (this posinterp "
                         f"reads up to {SCHEMA_VERSION}), got {version!r}")
    cols, dtypes = data["columns"], data["dtypes"]
    if any(len(r) != len(cols) for r in data["rows"]):
        raise ValueError(f"every row must have {len(cols)} values (one per column)")
    table = pd.DataFrame(data["rows"], columns=cols, dtype=object)
    for c in cols:
        d = dtypes[c]
        if d.startswith("float"):
            table[c] = pd.to_numeric(table[c].astype(object).where(table[c].notna(), np.nan)).astype(d)
        elif d == "object" or (d == "str" and int(pd.__version__.split(".")[0]) < 3):
            table[c] = table[c].astype(object)  # pandas 2 reads pandas 3's "str" as object
        else:  # int64, Int64, string, boolean: pandas parses its own names
            table[c] = table[c].astype(d)
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
