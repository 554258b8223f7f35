import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from posinterp.analysis.fingerprint import (
    fingerprint_table,
    fingerprint_test,
    head_dynamics,
    head_table,
    scheme_group,
)
from posinterp.analysis.heads import previous_token_scores, random_tokens
from tests.helpers import tiny_model


def _heads(values, scores):
    return pd.DataFrame({"layer": 0, "head": range(len(values)), "previous_token_score": scores,
                         "rotational_mass": values})


def test_perfect_separation_reaches_the_combinatorial_minimum():
    rng = np.random.default_rng(0)
    heads, schemes = {}, {}
    for i in range(4):
        heads[f"rope{i}"] = _heads(0.8 + 0.01 * i + rng.uniform(0, 0.01, 3), [0.9, 0.5, 0.1])
        schemes[f"rope{i}"] = ("rotary", True)
    for i, pe in enumerate(["absolute", "alibi", "absolute"]):
        heads[f"other{i}"] = _heads(0.2 + 0.01 * i + rng.uniform(0, 0.01, 3), [0.9, 0.5, 0.1])
        schemes[f"other{i}"] = (pe, True)
    heads["nope"] = _heads([0.99] * 3, [0.9, 0.5, 0.1])
    schemes["nope"] = ("nope", True)
    table = fingerprint_table(heads, schemes, K=3)
    assert table[table.model == "nope"].group.isna().all()
    res = fingerprint_test(table)
    assert list(res.k) == [1, 2, 3]
    assert np.allclose(res.p_permutation, 1 / math.comb(7, 4))
    assert np.allclose(res.min_possible_p, 1 / 35) and res.separated.all()
    np.testing.assert_allclose(res.q_bh, stats.false_discovery_control(res.p_permutation))
    assert "0.0286" in res.note.iloc[0]


def test_top_k_mean_uses_previous_token_ranking():
    heads = {"m": _heads([0.1, 0.9, 0.5], [0.2, 0.3, 0.9])}
    table = fingerprint_table(heads, {"m": ("rotary", True)}, K=3)
    assert table.value.tolist() == pytest.approx([0.5, 0.7, 0.5])


def test_reversed_groups_give_p_one_and_small_design_is_flagged():
    heads = {n: _heads([v], [1.0]) for n, v in [("r1", 0.1), ("r2", 0.2), ("o1", 0.8), ("o2", 0.9)]}
    schemes = {n: ("rotary" if n[0] == "r" else "absolute", True) for n in heads}
    res = fingerprint_test(fingerprint_table(heads, schemes, K=1))
    assert res.p_permutation.iloc[0] == 1.0 and not res.separated.iloc[0]
    assert res.p_mannwhitney.iloc[0] == 1.0
    assert "cannot reach p < 0.05" in res.note.iloc[0]


def test_scheme_groups():
    assert scheme_group("rotary") == "rope" and scheme_group("alibi") == "other"
    assert scheme_group("absolute", causal=False) is None
    assert scheme_group("nope") is None and scheme_group("nope", nope="other") == "other"


def test_head_table_on_a_model():
    model = tiny_model("rotary")
    table = head_table(model, n_sequences=4, n_tokens=12, n_null=200)
    assert len(table) == model.cfg.n_layers * model.cfg.n_heads
    assert {"previous_token_score", "rotational_mass", "rotational_mass_null_percentile",
            "antisymmetric_energy", "phase"} <= set(table.columns)
    assert (table.offset == 0).all()
    direct = previous_token_scores(model, random_tokens(model, 4, 12, seed=0, bos=True))
    np.testing.assert_allclose(table.previous_token_score, direct.value)
    dyn = head_dynamics([(0, model), (5, model)], n_sequences=2, n_tokens=8, n_null=50)
    assert set(dyn.step) == {0, 5} and len(dyn) == 2 * len(table)
