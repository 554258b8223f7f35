import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from posinterp.analysis.fingerprint import (
    dynamics_summary,
    fingerprint_table,
    fingerprint_test,
    head_dynamics,
    head_table,
    scheme_group,
    trajectory_correlations,
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


def test_units_pool_zoo_seeds_and_models_without_a_previous_token_head_are_left_out():
    heads = {
        "zoo:rotary:0": _heads([0.9, 0.1], [0.8, 0.1]),
        "zoo:rotary:1": _heads([0.7, 0.1], [0.8, 0.1]),
        "stories.bin": _heads([0.99, 0.99], [0.09, 0.05]),  # no previous-token head
        "zoo:absolute:0": _heads([0.2, 0.1], [0.8, 0.1]),
        "gpt2": _heads([0.3, 0.1], [0.8, 0.1]),
    }
    schemes = {n: ("rotary" if "rotary" in n or "stories" in n else "absolute", True)
               for n in heads}
    table = fingerprint_table(heads, schemes, K=1)
    assert set(table.unit) == {"zoo:rotary", "stories.bin", "zoo:absolute", "gpt2"}
    assert not table.set_index("model").has_prev_head["stories.bin"]
    res = fingerprint_test(table)
    # one RoPE unit (mean of the two seeds, 0.8) vs two others: 1 / C(3, 1)
    assert (res.n_rope.iloc[0], res.n_other.iloc[0]) == (1, 2)
    assert res.mean_rope.iloc[0] == pytest.approx(0.8)
    assert res.min_possible_p.iloc[0] == pytest.approx(1 / 3)
    assert "stories.bin" in res.note.iloc[0]
    per_model = fingerprint_test(fingerprint_table(heads, schemes, K=1, units="model"))
    assert per_model.n_rope.iloc[0] == 2
    nothing = fingerprint_test(fingerprint_table({"stories.bin": heads["stories.bin"]},
                                                 {"stories.bin": ("rotary", True)}, K=1))
    assert len(nothing) == 0 and "no unit left" in nothing.attrs["note"]
    with pytest.raises(ValueError, match="units must be one of"):
        fingerprint_table(heads, schemes, units="seed")


def test_trajectory_correlations_are_within_head():
    # two heads whose score and mass move in opposite directions over training, but the
    # head with the higher scores also has the higher masses: pooled over heads and
    # snapshots the correlation is positive, within each head it is -1
    steps = [0, 10, 100, 1000]
    rows = []
    for head, (s0, m0) in enumerate([(0.0, 0.0), (1.0, 1.0)]):
        for i, step in enumerate(steps):
            rows.append(dict(model="m", layer=0, head=head, step=step,
                             previous_token_score=s0 + 0.1 * i, rotational_mass=m0 - 0.1 * i))
    dyn = pd.DataFrame(rows)
    pooled = stats.spearmanr(dyn.previous_token_score, dyn.rotational_mass).statistic
    assert pooled > 0
    corr = trajectory_correlations(dyn)
    assert corr.rho.tolist() == pytest.approx([-1.0, -1.0]) and (corr.n_steps == 4).all()
    summ = dynamics_summary(corr)
    assert summ.median_rho.iloc[0] == pytest.approx(-1.0) and summ.share_negative.iloc[0] == 1.0
    assert summ.top_head.iloc[0] == "L0H1"
    with pytest.raises(ValueError, match="snapshots"):
        trajectory_correlations(dyn[dyn.step < 100])
