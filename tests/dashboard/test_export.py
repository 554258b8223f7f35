"""The versioned JSON export of an inspection round-trips to the same tables."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.dashboard.compare import compare_inspections
from posinterp.dashboard.export import SCHEMA_VERSION, export_inspection, load_inspection
from posinterp.dashboard.inspect import inspect_heads
from tests.helpers import random_tokens, tiny_model


def _strict(text):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def inspection():
    model = tiny_model("rotary")
    tokens = random_tokens(model, 3, 9)
    mask = torch.ones_like(tokens)
    mask[1, 7:] = 0  # a padded sequence: NA offsets, NaN kernels past its end
    return inspect_heads(model, tokens, mask, ablate=True, n_null=50)


def test_export_then_load_gives_equal_tables(inspection, tmp_path):
    res = inspection
    res.table.loc[3, "value"] = np.nan  # a score that does not exist survives as NaN
    path = export_inspection(res, tmp_path / "inspection.json")
    data = _strict(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["schema"] == "posinterp.inspection"
    back = load_inspection(path)
    pd.testing.assert_frame_equal(back.table, res.table)
    pd.testing.assert_frame_equal(back.head_view(), res.head_view())
    assert back.patterns.keys() == res.patterns.keys()
    assert all(torch.equal(back.patterns[k], res.patterns[k]) for k in res.patterns)
    assert (back.str_tokens, back.meta) == (res.str_tokens, res.meta)
    # everything but "Explain one score", whose table is not exported, and says so
    from posinterp.dashboard.export import NOT_EXPORTED

    assert res.score_parts is not None and back.score_parts is None
    assert back.notes == [NOT_EXPORTED if n.startswith("Explain one score") else n
                          for n in res.notes] and NOT_EXPORTED in back.notes
    # A loaded inspection is as good as the original for a comparison.
    cmp = compare_inspections(res, back)
    assert cmp.heads.drop(columns=["layer", "head"]).abs().max(axis=None) == 0


def test_other_files_and_newer_schemas_are_refused(inspection, tmp_path):
    path = export_inspection(inspection, tmp_path / "x.json")
    data = _strict(path.read_text())
    for patch, match in (({"schema_version": SCHEMA_VERSION + 1}, "schema_version"),
                         ({"schema": "something else"}, "not a posinterp inspection"),
                         ({"patterns": {"0": [[[1.0]]]}}, r"patterns\['0'\] must be")):
        (tmp_path / "bad.json").write_text(json.dumps({**data, **patch}))
        with pytest.raises(ValueError, match=match):
            load_inspection(tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text('{"schema": NaN}')
    with pytest.raises(ValueError, match="strict JSON"):
        load_inspection(tmp_path / "nan.json")
