"""The inspect page's "Explain one score" data is the score_parts table, cell by cell."""

import json
import re

import numpy as np

import posinterp as pi
from posinterp.dashboard.explain import explain_data
from posinterp.dashboard.inspect_html import inspect_page


def test_page_data_equals_the_score_parts_table():
    model = pi.build_model(pi.preset("tiny", pe="rotary", init_std=0.25))
    res = pi.inspect_heads(model, pi.random_tokens(model, batch=2, pos=8, seed=1), n_null=20)
    html = inspect_page(res, "t")
    block = re.search(r'<script type="application/json" id="explain-data">(.*?)</script>', html, re.S)
    data = json.loads(block.group(1))
    assert data == json.loads(json.dumps(explain_data(res)))
    n = data["n"]
    assert n == 8 and data["tokens"] == res.str_tokens[:8]
    df = res.score_parts
    for key, head in data["heads"].items():
        layer, h = map(int, key.split("-"))
        sub = df[(df.layer == layer) & (df["head"] == h)]
        cells = [(i, j) for i in range(n) for j in range(i + 1)]
        for k, part in enumerate(data["parts"]):
            view = "channel" if part["group"] != "rotary_pair" else "rotary_pair"
            rows = sub[(sub.metric == "score_part") & (sub.view == view) & (sub.part == part["part"])]
            if part["pair"] is not None:
                rows = rows[rows.pair == part["pair"]]
            want = rows.set_index(["query", "key"]).value.reindex(cells).to_numpy()
            np.testing.assert_allclose(head["parts"][k], want, rtol=1e-6, atol=1e-12)
        # the parts of each view add up to the page's total, and the total to the model's score
        groups = [p["group"] for p in data["parts"]]
        for view in ("channel", "rotary_pair"):
            idx = [k for k, g in enumerate(groups) if g in (view, "bias")]
            np.testing.assert_allclose(np.sum([head["parts"][k] for k in idx], 0), head["score_total"],
                                       atol=1e-5)
        np.testing.assert_allclose(head["score_total"], head["model_score"], atol=1e-5)
    assert any("first 8 tokens" in note for note in res.notes)
