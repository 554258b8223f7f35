"""compare across positional schemes, and what the compare page draws per head.

A rotary and an absolute toy of one shape: the Δ = 0 spectra (the raw W_Q W_K^T on both
sides) are compared, Δ = -1 is named as skipped, and no value is missing without a note.
Two RoPE toys: the card keeps every rotary pair's frequency share apart.
"""

import itertools
import json
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest

import posinterp
from posinterp.analysis.spectral import qk_weights
from posinterp.dashboard.compare import compare_inspections, compare_models
from posinterp.dashboard.compare_html import compare_data, compare_page
from posinterp.dashboard.inspect import inspect_heads
from posinterp.dashboard.inspect_html import inspect_data
from posinterp.dashboard.schema import _VECTOR_METRICS, head_wide
from tests.helpers import random_tokens

N_NULL = 20
NODE = shutil.which("node")


def _js_function(src: str, name: str) -> str:
    """The source of ``function name(...)`` in a page script: its line when it closes there,
    else up to the first line that is a lone ``}``."""
    start = re.search(rf"^function {name}\(", src, re.M)
    assert start, f"no function {name} in the page's script"
    line_end = src.index("\n", start.start())
    if src[start.start():line_end].rstrip().endswith("}"):
        return src[start.start():line_end]
    return src[start.start():src.index("\n}\n", start.start()) + 2]


def _node(code: str) -> str:
    out = subprocess.run([NODE, "-e", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def page_script_head() -> str:
    """The inspect page's script up to its data and score keys, after the helpers
    (common.js) the page loads first."""
    from importlib.resources import files

    js = files("posinterp.dashboard").joinpath("inspect.js").read_text(encoding="utf-8")
    common = files("posinterp.dashboard").joinpath("common.js").read_text(encoding="utf-8")
    return common + "\n" + js[:js.index("// A score column's value as text")]


def _toy(pe, seed=0):
    return posinterp.build_model(posinterp.preset("tiny", pe=pe, seed=seed))


def _raw_spectra(model) -> dict:
    """{(layer, head): eigenvalues of B = W_K^T W_Q}, numpy float64, from the weights."""
    out = {}
    for layer in range(model.cfg.n_layers):
        W_Q, W_K = (w.numpy() for w in qk_weights(model, layer))  # [head, d_model, d_head]
        for h in range(model.cfg.n_heads):
            out[(layer, h)] = np.linalg.eigvals(W_K[h].T @ W_Q[h])
    return out


def _matching_distance(lam, mu) -> float:
    """The documented spectrum_change, by brute force over every matching (d_head = 8:
    8! = 40320 of them): min_σ sqrt(mean |λ_i − μ_σ(i)|²) / (RMS|λ| + RMS|μ|)."""
    perms = np.array(list(itertools.permutations(range(len(mu)))))
    cost = np.abs(lam[:, None] - mu[None, :]) ** 2
    best = cost[np.arange(len(lam)), perms].mean(axis=1).min()
    return float(np.sqrt(best) / (np.sqrt(np.mean(np.abs(lam) ** 2)) + np.sqrt(np.mean(np.abs(mu) ** 2))))


def _rotational_mass(lam, eps=1e-8) -> float:
    """docs: Σ|λ|·1[complex] / Σ|λ|, complex when |Im λ| > eps · max|λ|."""
    mod = np.abs(lam)
    return float(mod[np.abs(lam.imag) > eps * mod.max()].sum() / mod.sum())


@pytest.fixture(scope="module")
def rotary_vs_absolute():
    rot, ab = _toy("rotary"), _toy("absolute", seed=1)  # same shape, different weights
    assert (rot.cfg.n_layers, rot.cfg.n_heads, rot.cfg.d_head) == (ab.cfg.n_layers, ab.cfg.n_heads,
                                                                    ab.cfg.d_head)
    tokens = random_tokens(rot, 3, 10)
    a, b = (inspect_heads(m, tokens, n_null=N_NULL) for m in (rot, ab))
    return rot, ab, a, b


def test_a_rotary_and_an_absolute_toy_compare_their_delta_0_spectra(rotary_vs_absolute):
    rot, ab, a, b = rotary_vs_absolute
    sa, sb = _raw_spectra(rot), _raw_spectra(ab)
    for names, (x, y), (lx, ly) in ((("rope", "abs"), (a, b), (sa, sb)),
                                    (("abs", "rope"), (b, a), (sb, sa))):
        cmp = compare_inspections(x, y, names)
        assert len(cmp.heads) == rot.cfg.n_layers * rot.cfg.n_heads
        got = cmp.heads.set_index(["layer", "head"])["spectrum_change"]
        assert np.isfinite(got.to_numpy(float)).all()
        for key, value in got.items():
            assert value == pytest.approx(_matching_distance(lx[key], ly[key]), rel=1e-9, abs=1e-12)
        assert got.min() > 0.1  # different weights: the spectra differ
        # the rotational mass is compared at Δ = 0 too: B - A from the eigenvalues alone
        delta = cmp.heads.set_index(["layer", "head"])["delta_rotational_mass@Δ=0"]
        for key, value in delta.items():
            assert value == pytest.approx(_rotational_mass(ly[key]) - _rotational_mass(lx[key]), abs=1e-9)
        # every value is there; what only the rotary side has is named, not compared
        assert not cmp.heads.isna().any(axis=None)
        rope = names[0] if x is a else names[1]
        skipped = cmp.skipped
        assert set(skipped.only_in) == {rope}
        assert "eigenvalues@Δ=-1" in set(skipped.quantity)
        assert "rotational_mass@Δ=-1" in set(skipped.quantity)
        assert set(skipped[skipped.metric == "eigenvalues"].offset) == {-1}
        assert not any(c.endswith("@Δ=-1") for c in cmp.heads.columns)
        note = next(n for n in cmp.notes if n.startswith("Not compared"))
        assert f"only {rope} defines them" in note and "at Δ = -1: " in note and "eigenvalues" in note
        assert any("is rotary and" in n and "Δ = 0" in n for n in cmp.notes)
        # the saved long form: a row without a B − A value is one that skipped lists
        long = cmp.table[cmp.table.value.isna()]
        keys = {posinterp.dashboard.schema.score_key(m, o, ab_)
                for m, o, ab_ in zip(long.metric, long.offset, long.ablation, strict=True)}
        assert keys <= set(skipped.quantity)


def test_the_compare_page_draws_both_delta_0_spectra_and_names_what_was_skipped(rotary_vs_absolute):
    _, _, a, b = rotary_vs_absolute
    cmp = compare_inspections(a, b, ("rope", "abs"))
    data = compare_data(cmp)
    eig = pd.DataFrame(data["eig"]["rows"], columns=data["eig"]["columns"])
    by_side = eig.groupby("which").offset.apply(lambda o: set(o.dropna()))
    assert by_side["a"] == {0, -1} and by_side["b"] == {0}  # B's one form sits at Δ = 0
    page = compare_page(cmp, "t")
    assert "Not compared, as only rope defines them" in page
    assert "at Δ = -1: " in page


def _scores(data) -> pd.DataFrame:
    return pd.DataFrame(data["scores"]["rows"], columns=data["scores"]["columns"])


@pytest.fixture(scope="module")
def two_ropes():
    m1, m2 = _toy("rotary"), _toy("rotary", seed=1)
    tokens = random_tokens(m1, 3, 10)
    a, b = (inspect_heads(m, tokens, n_null=N_NULL) for m in (m1, m2))
    return a, b, compare_inspections(a, b)


def _shares(insp, which) -> pd.DataFrame:
    t = insp.table[insp.table.metric == "frequency_share"]
    return pd.DataFrame({"which": which, "layer": t.layer.astype(int), "head": t["head"].astype(int),
                         "offset": t.offset.astype(int), "rank": t["rank"].astype("Int64"),
                         "value": t.value.astype(float)})


def test_the_compare_card_keeps_every_rotary_pair_apart(two_ropes):
    a, b, cmp = two_ropes
    data = compare_data(cmp)
    # one per-head score per key: no vector metric of the schema among the card's scores
    scores = _scores(data)
    assert not scores.metric.isin(_VECTOR_METRICS).any()
    keys = ["which", "layer", "head", "metric", "offset", "ablation"]
    assert not scores[keys].astype(str).duplicated().any()
    assert data["vector_metrics"] == list(_VECTOR_METRICS)
    # the frequency shares, pair by pair, are inspect_heads' own rows on each side
    freq = pd.DataFrame(data["frequency"]["rows"], columns=data["frequency"]["columns"])
    freq = freq.astype({"rank": "Int64"})
    keys = ["which", "layer", "head", "offset", "rank"]
    want = pd.concat([_shares(a, "a"), _shares(b, "b")], ignore_index=True)
    assert len(want) and want.groupby(["which", "layer", "head", "offset"]).size().min() > 1  # pairs
    merged = want.merge(freq, on=keys, how="outer", suffixes=("_want", "_got"), indicator=True)
    assert (merged["_merge"] == "both").all()
    assert np.array_equal(merged.value_want.to_numpy(), merged.value_got.to_numpy())


@pytest.mark.skipif(NODE is None, reason="node is not installed (apt-get install nodejs); the "
                    "card's table is checked by running the page's own script")
def test_the_compare_card_shows_one_row_per_rotary_pair(two_ropes):
    from importlib.resources import files

    a, b, cmp = two_ropes
    js = {n: files("posinterp.dashboard").joinpath(n).read_text(encoding="utf-8")
          for n in ("common.js", "compare.js")}
    funcs = "\n".join(_js_function(js[src], name) for src, name in (
        ("common.js", "el"), ("common.js", "fmt"), ("compare.js", "records"),
        ("compare.js", "frequencyTable"), ("compare.js", "defined"), ("compare.js", "side")))
    stub = """
    function node(tag) { return {tag, attrs: {}, children: [], textContent: '',
      setAttribute(a, v) { this.attrs[a] = String(v); },
      appendChild(c) { this.children.push(c); return c; }, append(...cs) { this.children.push(...cs); }}; }
    const document = {createElement: node};
    """
    layer, h = 1, 2
    code = (stub + funcs + f"\nconst DATA = {json.dumps(compare_data(cmp))};\nconst NAMES = DATA.meta.names;"
            "\nconst FREQ = records(DATA.frequency);"
            f"\nconst t = frequencyTable({layer}, {h});"
            "\nconsole.log(JSON.stringify(t.children.slice(1).map(r => [r.attrs['data-offset'], "
            "r.attrs['data-pair'], ...r.children.map(c => c.textContent)])));")
    rows = json.loads(_node(code))
    shares = {w: s[(s.layer == layer) & (s["head"] == h)]
              for w, s in (("a", _shares(a, "a")), ("b", _shares(b, "b")))}
    want = {(str(o), "unrotated" if pd.isna(r) else str(r)): v
            for o, r, v in zip(shares["a"].offset, shares["a"]["rank"], shares["a"].value, strict=True)}
    assert len(rows) == len(want) and {(r[0], r[1]) for r in rows} == set(want)  # one row per pair
    bval = {(str(o), "unrotated" if pd.isna(r) else str(r)): v
            for o, r, v in zip(shares["b"].offset, shares["b"]["rank"], shares["b"].value, strict=True)}
    for off, pair, _, _, va, vb, d in rows:
        assert float(va) == pytest.approx(want[(off, pair)], abs=5e-4)
        assert float(vb) == pytest.approx(bval[(off, pair)], abs=5e-4)
        assert float(d) == pytest.approx(bval[(off, pair)] - want[(off, pair)], abs=5e-4)


def test_every_missing_value_of_a_comparison_has_a_note():
    model = _toy("nope")
    tokens = random_tokens(model, 3, 10)
    a = inspect_heads(model, tokens, n_null=N_NULL)
    t = a.table
    # B: no score kernel in layer 1 (as a model whose hook carries no pre-softmax scores),
    # and no previous-token score for L0H2
    drop = ((t.metric == "kernel_score") & (t.layer == 1)) | \
        ((t.metric == "previous_token_score") & (t.layer == 0) & (t["head"] == 2))
    b = type(a)(t[~drop].reset_index(drop=True), a.patterns, a.str_tokens, a.notes, dict(a.meta))
    cmp = compare_inspections(a, b, criteria=(("previous_token_score", 0.5), ("no_such_score", 1.0)))
    assert cmp.heads.isna().any(axis=None)
    for col in cmp.heads.columns:
        for layer, h in cmp.heads.loc[cmp.heads[col].isna(), ["layer", "head"]].itertuples(index=False):
            assert any(n.startswith(f"{col} has no value") and f"L{layer}H{h}" in n for n in cmp.notes), col
    assert set(cmp.heads.loc[cmp.heads.kernel_score_change.isna(), "layer"]) == {1}
    assert any("delta_previous_token_score" in n and "B has no value" in n for n in cmp.notes)
    assert any(n.startswith("Formation criterion previous_token_score is not evaluated for 1 heads (L0H2)")
               for n in cmp.notes)
    assert any(n.startswith("Formation criterion no_such_score") for n in cmp.notes)


def test_comparing_one_scheme_skips_nothing():
    for pe in ("rotary", "absolute"):
        model = _toy(pe)
        cmp = compare_models(model, _toy(pe, seed=1), random_tokens(model, 2, 8), n_null=N_NULL)
        assert cmp.skipped.empty and cmp.notes == []
        assert not cmp.heads.isna().any(axis=None)


@pytest.mark.skipif(NODE is None, reason="node is not installed (apt-get install nodejs); the "
                    "page's score keys are checked by running its own script")
def test_the_inspect_page_reads_its_vector_metrics_from_its_data():

    model = _toy("rotary")
    res = inspect_heads(model, random_tokens(model, 2, 8), n_null=N_NULL)
    data = inspect_data(res)
    assert data["vector_metrics"] == list(_VECTOR_METRICS)
    head = page_script_head()

    def score_keys(payload) -> list:
        code = ("const document = {getElementById: () => ({textContent: " + json.dumps(json.dumps(payload))
                + "})};\n" + head + "\nconsole.log(JSON.stringify(SCORE_KEYS));")
        return json.loads(_node(code))

    wide = [c for c in head_wide(res.table).columns if c not in ("layer", "head")]
    assert sorted(score_keys(data)) == sorted(wide)
    # the page's list is the data's list: without frequency_share in it, the shares become keys
    fewer = {**data, "vector_metrics": [m for m in _VECTOR_METRICS if m != "frequency_share"]}
    assert "frequency_share@Δ=0" in score_keys(fewer)
