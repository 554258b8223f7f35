import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from posinterp.analysis.fingerprint import (
    dynamics_summary,
    exact_group_test,
    fingerprint_table,
    fingerprint_test,
    head_dynamics,
    head_table,
    scheme_group,
    trajectory_correlations,
    unit_table,
    unit_test,
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


@pytest.mark.parametrize("pes", [("rotary",), ("absolute", "alibi")])
def test_an_empty_group_is_named_not_given_a_nan_floor(pes):
    from posinterp.viz.report import fingerprint_summary

    heads = {f"m{i}": _heads([0.5], [0.9]) for i in range(len(pes))}
    res = fingerprint_test(fingerprint_table(heads, {f"m{i}": (pe, True) for i, pe in
                                                     enumerate(pes)}, K=1))
    assert res.min_possible_p.isna().all()  # no design: no floor
    empty = "other" if pes == ("rotary",) else "RoPE"
    assert f"no test: the {empty} group is empty" in res.note.iloc[0]
    assert "nan" not in res.note.iloc[0] and "nan" not in fingerprint_summary(res).reading.iloc[0]


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


def _unit_heads(unit, pe, scores, values):
    return pd.DataFrame({"unit": unit, "pe": pe, "layer": 0, "head": range(len(scores)),
                         "previous_token_score": scores, "rotational_mass_null_percentile": values})


@pytest.mark.parametrize("n_rope, n_other", [(4, 8), (2, 3), (1, 3), (3, 1)])
def test_unit_test_floor_is_one_over_n_choose_k_when_separated(n_rope, n_other):
    """Closed form: every RoPE unit above every other -> p = 1 / C(n, n_R), the floor."""
    heads = pd.concat([_unit_heads(f"r{i}", "rotary", [0.9, 0.5], [90 + i, 80])
                       for i in range(n_rope)]
                      + [_unit_heads(f"o{i}", ["absolute", "alibi"][i % 2], [0.9, 0.5], [10 + i, 5])
                         for i in range(n_other)])
    res = unit_test(unit_table(heads, k=2, threshold=0.3))
    floor = 1 / math.comb(n_rope + n_other, n_rope)
    assert res["n_rope"] == n_rope and res["n_other"] == n_other
    assert res["min_possible_p"] == pytest.approx(floor)
    assert res["p_permutation"] == pytest.approx(floor) and res["separated"]
    # reversed: the observed difference is the smallest of all relabellings -> p = 1
    flipped = heads.assign(rotational_mass_null_percentile=100 - heads.rotational_mass_null_percentile)
    assert unit_test(unit_table(flipped, k=2))["p_permutation"] == pytest.approx(1.0)


def test_exact_group_test_with_one_unit_matches_enumeration_by_rank():
    # 1 vs 3: the statistic orders relabellings as the single RoPE value's rank does
    assert exact_group_test([5.0], [1.0, 7.0, 3.0])["p_permutation"] == pytest.approx(2 / 4)
    assert exact_group_test([0.0], [1.0, 7.0, 3.0])["p_permutation"] == pytest.approx(1.0)


def test_unit_table_uses_the_top_k_heads_that_reach_the_threshold():
    heads = pd.concat([
        _unit_heads("a", "rotary", [0.1, 0.8, 0.35, 0.6], [1.0, 20.0, 99.0, 40.0]),
        _unit_heads("b", "absolute", [0.2, 0.1, 0.25, 0.05], [50.0, 50.0, 50.0, 50.0]),
        _unit_heads("c", "nope", [0.9, 0.8, 0.1, 0.1], [70.0, 30.0, 0.0, 0.0])])
    u = unit_table(heads, k=2, threshold=0.3).set_index("unit")
    assert u.loc["a", "value"] == pytest.approx(30.0)  # heads 1 and 3 (0.8, 0.6), not head 2
    assert u.loc["a", "heads_used"] == "L0H1 L0H3"
    k3 = unit_table(heads, k=3, threshold=0.3).set_index("unit")
    assert k3.loc["a", "value"] == pytest.approx((20 + 40 + 99) / 3)
    assert np.isnan(u.loc["b", "value"]) and u.loc["b", "n_heads_used"] == 0  # no head >= 0.3
    assert pd.isna(u.loc["c", "group"])  # NoPE apart by default
    assert unit_table(heads, k=2, nope="other").set_index("unit").loc["c", "group"] == "other"
    res = unit_test(u.reset_index())
    assert res["n_rope"] == 1 and res["n_other"] == 0 and res["left_out"] == "b (0.25)"
    with pytest.raises(ValueError, match="k must be"):
        unit_table(heads, k=0)
    with pytest.raises(ValueError, match="several schemes"):
        unit_table(heads.assign(unit="x"))


def test_head_table_ranks_on_given_tokens_and_adds_the_stored_convention():
    model = tiny_model("rotary", n_layers=1)
    toks = random_tokens(model, 4, 12, seed=3, bos=False)
    t = head_table(model, tokens=toks, weights=("effective", "stored"))
    prev = previous_token_scores(model, toks)
    assert np.allclose(t.previous_token_score, prev.value)
    assert {"stored_rotational_mass", "stored_rotational_mass_null_percentile"} <= set(t.columns)
    alone = head_table(model, tokens=toks, weights=("stored",))
    assert np.allclose(t.stored_rotational_mass, alone.rotational_mass)
