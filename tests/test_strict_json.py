"""Every JSON posinterp writes is strict: NaN and ±inf are null (issue 22, item 11)."""

import json

import numpy as np
import pytest

from posinterp.io import atomic_write_json


def _strict(text):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null(tmp_path):
    obj = {"nan": float("nan"), "inf": float("inf"), "ninf": -np.inf, "f32": np.float32("nan"),
           "ok": np.float64(0.25), "n": np.int64(3), "nested": [1.5, (float("-inf"), {"x": np.nan})]}
    path = atomic_write_json(tmp_path / "run.json", obj)
    got = _strict(path.read_text())
    assert got == {"nan": None, "inf": None, "ninf": None, "f32": None, "ok": 0.25, "n": 3,
                   "nested": [1.5, [None, {"x": None}]]}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_dumps_json_never_emits_a_non_json_constant(value):
    from posinterp.io import dumps_json, json_ready

    assert _strict(dumps_json({"v": value})) == {"v": None}
    assert json_ready([value]) == [None]
