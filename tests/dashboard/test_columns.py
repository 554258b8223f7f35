"""The inspection file's and page's table encoding (posinterp/dashboard/columns.py): exact
round trips for every dtype an inspection table holds, runs only where shorter, bad
objects refused by name, and the size it was made for."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.dashboard.columns import table_from_columns, table_to_columns
from posinterp.dashboard.export import _patterns_from_dict, _patterns_to_dict
from posinterp.io import json_value


def _table(n=200, seed=0):
    rng = np.random.default_rng(seed)
    value = rng.normal(size=n)
    value[[3, 7]] = np.nan
    value[5], value[6] = np.inf, -np.inf
    return pd.DataFrame({
        "model": pd.Series(["a/b.gguf"] * n, dtype="string"),
        "hook": pd.Series([f"blocks.{i // 50}.attn.hook_pattern" for i in range(n)], dtype="string"),
        "layer": np.repeat(np.arange(n // 50), 50).astype("int64"),
        "head": pd.array([None if i % 17 == 0 else i % 4 for i in range(n)], dtype="Int64"),
        "position": pd.array([None] * n, dtype="Int64"),
        "ablation": pd.Series([None] * (n - 1) + ["x"], dtype="string"),
        "metric": pd.Series(rng.choice(["kernel", "λ_real", "score"], n), dtype="string"),
        "value": value,
        "f32": rng.normal(size=n).astype("float32"),
        "flag": rng.random(n) > 0.5,
        "maybe": pd.array([None if i % 5 == 0 else i % 2 == 0 for i in range(n)], dtype="boolean"),
        "mixed": pd.Series([1, "a", None, 2.5] * (n // 4), dtype=object),
    })


def test_round_trip_is_exact_for_every_dtype():
    t = _table()
    enc = table_to_columns(t)
    back = table_from_columns(json.loads(json.dumps(enc, allow_nan=False)))
    pd.testing.assert_frame_equal(back, t, check_exact=True)
    assert back.dtypes.equals(t.dtypes)
    v = back.value.to_numpy()
    assert np.isposinf(v[5]) and np.isneginf(v[6]) and np.isnan(v[[3, 7]]).all()  # kept exactly


def test_runs_where_they_are_shorter_lists_elsewhere():
    data = table_to_columns(_table())["data"]
    assert data["model"]["code_runs"] == [[0, 200]] and data["layer"]["value_runs"][0] == [0, 50]
    assert data["position"]["value_runs"] == [[None, 200]]
    assert "codes" in data["metric"] and "values" in data["head"]  # random: runs would be longer
    assert set(data["value"]) == {"float64"}


def test_an_empty_table_round_trips():
    t = _table().iloc[:0]
    pd.testing.assert_frame_equal(table_from_columns(table_to_columns(t)), t.reset_index(drop=True))


@pytest.mark.parametrize("patch, match", [
    (lambda e: e.pop("data"), "must hold"),
    (lambda e: e["data"].pop("layer"), "'layer' has no data"),
    (lambda e: e["data"]["model"].update(code_runs=[[3, 200]]), "outside its 1 levels"),
    (lambda e: e["data"]["layer"].update(value_runs=[[0, -1]]), "count > 0"),
    (lambda e: e.update(n_rows=199), "n_rows is 199"),
    (lambda e: e["data"].update(layer={"zip": "x"}), "unknown encoding"),
])
def test_bad_objects_are_refused_by_name(patch, match):
    enc = json.loads(json.dumps(table_to_columns(_table()), allow_nan=False))
    patch(enc)
    with pytest.raises(ValueError, match=match):
        table_from_columns(enc)


def test_smaller_than_a_list_per_row_on_an_inspection_table():
    """What the encoding is for: an inspection's table, sorted by layer and head, repeats its
    strings on every row; as a list per row (schema 2) it is over twice the columns' size
    here (2.7x; 3.9x on SmolLM2's 270 heads, where the model spec is a long path)."""
    from posinterp.dashboard import inspect_heads
    from tests.helpers import random_tokens, tiny_model

    model = tiny_model("rotary")
    t = inspect_heads(model, random_tokens(model, 2, 16), n_null=20).table
    rows = json.dumps([[json_value(v) for v in r] for r in t.itertuples(index=False, name=None)])
    assert 2 * len(json.dumps(table_to_columns(t))) < len(rows)


def test_causal_patterns_keep_their_lower_triangle_only_and_load_exactly():
    g = torch.Generator().manual_seed(0)
    causal = torch.rand(3, 5, 5, generator=g).tril()
    full = torch.rand(3, 5, 5, generator=g)  # a bidirectional model's pattern
    enc = _patterns_to_dict({0: causal, 1: full})
    assert enc["0"]["triangle"] == "lower" and "triangle" not in enc["1"]
    assert len(enc["0"]["base64"]) < 0.7 * len(enc["1"]["base64"])
    back = _patterns_from_dict(json.loads(json.dumps(enc)))
    assert torch.equal(back[0], causal) and torch.equal(back[1], full)
    enc["0"]["triangle"] = "upper"
    with pytest.raises(ValueError, match="triangle"):
        _patterns_from_dict(enc)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_the_pages_decoder_reads_what_python_reads():
    """common.js's decodeTable (the page's) against table_from_columns, cell by cell; the
    page shows a non-finite float as missing."""
    from importlib.resources import files

    t = _table()
    enc = table_to_columns(t)
    common = files("posinterp.dashboard").joinpath("common.js").read_text(encoding="utf-8")
    code = (common + "\nconst t = " + json.dumps(enc, allow_nan=False) + ";\n"
            "console.log(JSON.stringify(decodeTable(t)));")
    out = subprocess.run([shutil.which("node"), "-e", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    want = [{c: json_value(v) for c, v in zip(t.columns, r, strict=True)}
            for r in t.itertuples(index=False, name=None)]
    assert rows == want
