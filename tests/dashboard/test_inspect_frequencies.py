"""RoPE heads on the ``posinterp inspect`` page (issue 28 item 5): the frequency profile as
bars on each card, the positional/symbolic score in the grid's score menu, band ablations
with ``--ablate``; non-RoPE models say why their cards have none."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.analysis.frequencies import (
    band_label,
    frequency_bands,
    parse_band_label,
    positional_symbolic_score,
    rope_frequency_profile,
)
from posinterp.dashboard.columns import table_from_columns
from posinterp.dashboard.inspect import _band_kinds, inspect_heads
from posinterp.dashboard.inspect_html import inspect_page
from posinterp.interventions import QKIntervention, intervene
from posinterp.models import backend
from tests.analysis.test_frequencies import _constructed_heads
from tests.dashboard.test_inspect import _page_data
from tests.helpers import random_tokens, tiny_model

VECTOR = {"kernel_attention", "kernel_score", "eigenvalue_real", "eigenvalue_imag", "frequency_share"}


def _page_table(res) -> pd.DataFrame:
    data = _page_data(inspect_page(res, "t", "f"))
    return table_from_columns(data["table"]), data["meta"]


@pytest.fixture(scope="module")
def rotary():
    model = tiny_model("rotary", init_std=0.3)
    toks = random_tokens(model, 3, 10)
    return model, toks, inspect_heads(model, toks, n_null=20, seed=3)


def test_profile_bars_sum_to_one_per_head_and_equal_the_profile(rotary):
    model, _, res = rotary
    table, meta = _page_table(res)  # what the page's script draws the bars from
    bars = table[table.metric == "frequency_share"]
    sums = bars.groupby(["layer", "head", "offset"]).value.sum()
    assert len(sums) == 2 * model.cfg.n_layers * model.cfg.n_heads  # offsets 0 and -1
    np.testing.assert_allclose(sums.to_numpy(), 1.0, atol=1e-12)
    prof = rope_frequency_profile(model, offsets=(0, -1))
    prof = prof[prof.metric == "qk"]
    want = prof.set_index(["layer", "head", "pair", "offset"]).value.sort_index()
    got = bars.astype({"rank": "int64", "head": "int64", "offset": "int64"}).set_index(
        ["layer", "head", "rank", "offset"]).value.sort_index()
    np.testing.assert_array_equal(got.to_numpy(), want.to_numpy())
    theta = table[table.metric == "rotary_frequency"]
    assert theta["head"].isna().all()
    for layer in range(model.cfg.n_layers):
        np.testing.assert_allclose(theta[theta.layer == layer].sort_values("rank").value.to_numpy(),
                                   backend.rotary_spec(model, layer).inv_freq.numpy())
    assert meta["frequency_note"] is None


def test_score_menu_holds_the_positional_score(rotary):
    model, toks, res = rotary
    table, _ = _page_table(res)
    scalar = table[table["head"].notna() & ~table.metric.isin(VECTOR)]
    keys = set(scalar.metric[scalar.ablation.isna() & scalar.offset.isna()])  # the menu's keys
    assert "positional_score" in keys
    got = scalar[scalar.metric == "positional_score"].sort_values(["layer", "head"])
    want = positional_symbolic_score(model, toks, seed=3)
    want = want[want.metric == "positional_score"].sort_values(["layer", "head"])
    for col in ("value", "ci_low", "ci_high"):
        np.testing.assert_array_equal(got[col].to_numpy(float), want[col].to_numpy(float))
    assert res.head_view().positional_score.between(0, 1).all()


@pytest.mark.parametrize("pe", ["absolute", "alibi", "nope"])
def test_non_rotary_cards_have_no_profile_and_say_why(pe):
    model = tiny_model(pe)
    res = inspect_heads(model, random_tokens(model, 2, 8), n_null=20)
    assert not res.table.metric.isin(["frequency_share", "rotary_frequency", "positional_score"]).any()
    table, meta = _page_table(res)
    assert "no rotary frequency pairs" in meta["frequency_note"]
    assert any("No frequency profile" in n for n in res.notes)
    assert "No frequency profile" in inspect_page(res, "t", "f")


def test_partial_rotary_heads_get_an_unrotated_bar(tmp_path):
    import posinterp as pi
    from tests.helpers import save_tiny_checkpoint, tiny_hf_configs

    folder = tmp_path / "neox-rotary-pct-0.25"
    save_tiny_checkpoint("GPTNeoXForCausalLM", tiny_hf_configs()["neox-rotary-pct-0.25"], folder)
    model, _ = pi.load_model(folder)
    res = inspect_heads(model, random_tokens(model, 2, 8), n_null=20)
    table, _ = _page_table(res)
    bars = table[table.metric == "frequency_share"]
    unrot = bars[bars["rank"].isna()]
    assert len(unrot) == 2 * model.cfg.n_layers * model.cfg.n_heads  # one per head and offset
    sums = bars.groupby(["layer", "head", "offset"]).value.sum()
    np.testing.assert_allclose(sums.to_numpy(), 1.0, atol=1e-12)


def test_bands_are_fastest_first_and_labels_round_trip():
    assert frequency_bands(torch.tensor([1.0, 0.1, 0.01, 0.001])) == [(0,), (1,), (2,), (3,)]
    bands = frequency_bands(10000.0 ** (-torch.arange(32.0) / 32))
    assert bands[0] == tuple(range(8)) and bands[-1] == tuple(range(24, 32))
    assert frequency_bands(torch.tensor([0.1, 1.0, 0.01]), 2) == [(1, 0), (2,)]
    for band in [(0,), (0, 1, 2), (0, 2), (24, 25)]:
        assert parse_band_label(band_label(band)) == tuple(sorted(band))
    assert band_label((3, 1, 2)) == "p1-3"
    for bad in ("q0", "p3-1", "p1+1", "p"):
        with pytest.raises(ValueError, match="band"):
            parse_band_label(bad)
    with pytest.raises(ValueError, match="n_bands"):
        frequency_bands(torch.ones(2), 0)


def test_fastest_band_ablation_makes_a_head_living_there_position_free():
    """Head 0 of the constructed model attends to offset -1 through constant q, k in the fastest
    pair; --ablate's fastest-band ablation of that head leaves it position-free (uniform over
    the causal window), and the loss change on the page is that of this intervention."""
    model = _constructed_heads()
    toks = random_tokens(model, 3, 12, seed=1)
    res = inspect_heads(model, toks, ablate=True, n_null=20)
    t = res.table
    loss = t[t.metric == "loss_change"]
    labels = set(loss.ablation)
    assert {"remove_band_p0", "remove_band_p3"} <= labels  # fastest and slowest of 4 pairs
    kinds = _band_kinds(model, 0)
    assert kinds[0] == "remove_band_p0"
    fastest = QKIntervention("remove_band", 0, heads=(0,),
                             band=parse_band_label(kinds[0].removeprefix("remove_band_")))
    name = "blocks.0.attn.hook_pattern"
    _, clean = model.run_with_cache(toks, names_filter=name)
    i = torch.arange(1, 12)
    assert (clean[name][:, 0, i].argmax(-1) == i - 1).all()  # positional before
    with intervene(model, fastest):
        logits, cut = model.run_with_cache(toks, names_filter=name)
    uniform = torch.ones(12, 12).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    torch.testing.assert_close(cut[name][:, 0].double(), uniform.double().expand(3, -1, -1),
                               atol=1e-6, rtol=0)

    def ce(lg):
        return torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]).double(),
                                                 toks[:, 1:].reshape(-1)).item()
    row = loss[(loss.ablation == "remove_band_p0") & (loss["head"] == 0)]
    assert row.value.item() == pytest.approx(ce(logits) - ce(model(toks)), abs=1e-5)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(apt-get install chromium); the browser check needs it")
def test_rendered_card_bars_and_menu_in_chromium(rotary, tmp_path):
    from tests.viz.test_browser import FLAGS

    model, _, res = rotary
    page = tmp_path / "inspect.html"
    page.write_text(inspect_page(res, "t", "f"), encoding="utf-8")
    out = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    dom = re.sub(r"<script.*?</script>", "", out.stdout, flags=re.S)
    layer, head = map(int, re.search(r"<h2>Layer (\d+), head (\d+)</h2>", dom).groups())
    prof = rope_frequency_profile(model, layers=layer, heads=head, offsets=(0, -1))
    for offset, svg in re.findall(r'<svg[^>]*class="freq-profile" data-offset="(-?\d+)"(.*?)</svg>',
                                  dom, re.S):
        shares = [float(v) for v in re.findall(r'data-share="([^"]+)"', svg)]
        pairs = [int(v) for v in re.findall(r'data-pair="(\d+)"', svg)]
        assert pairs == list(range(model.cfg.d_head // 2))
        assert sum(shares) == pytest.approx(1.0, abs=1e-12)
        want = prof[(prof.metric == "qk") & (prof.offset == int(offset))].sort_values("pair").value
        np.testing.assert_allclose(shares, want.to_numpy(), rtol=0, atol=1e-15)
    assert len(re.findall(r'class="freq-profile"', dom)) == 2
    menu = re.search(r'<select id="colour-key">(.*?)</select>', dom, re.S).group(1)
    assert 'value="positional_score"' in menu
