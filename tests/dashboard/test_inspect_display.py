"""What the inspect page shows: pooled long patterns, clipped bands, scales and notes."""

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from posinterp.analysis.kernels import block_labels, head_scores, pool_pattern, t_interval
from posinterp.analysis.spectral import NULL_HEADS
from posinterp.dashboard.inspect import NULL_BAND_HEADS, inspect_heads, uniform_guess_loss
from posinterp.dashboard.inspect_html import colour_scale, inspect_data, inspect_page
from posinterp.models.backend import run_cached
from tests.helpers import random_tokens, tiny_model


def _causal_softmax(n: int, heads: int = 3, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(heads, n, n, generator=gen, dtype=torch.float64)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return s.softmax(-1)


@pytest.mark.parametrize("n, block", [(12, 3), (13, 4), (7, 1), (5, 8)])
def test_pooling_keeps_rows_summing_to_one_and_matches_a_loop(n, block):
    a = _causal_softmax(n)
    p = pool_pattern(a, block)
    m = -(-n // block)
    assert p.shape == (3, m, m)
    assert torch.allclose(p.sum(-1), torch.ones(3, m, dtype=torch.float64), atol=1e-12)
    # independent: each tile by hand, mean over its queries of the sum over its keys
    for bi in range(m):
        for bj in range(m):
            qs, ks = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            ref = a[:, qs, ks].sum(-1).mean(-1)
            assert torch.allclose(p[:, bi, bj], ref, atol=1e-12)
    # weighted by block sizes, the pooled mass per key block is the original's
    sizes = torch.tensor([len(range(n)[i * block:(i + 1) * block]) for i in range(m)],
                         dtype=torch.float64)
    per_key_block = torch.stack([a[..., i * block:(i + 1) * block].sum((-1, -2)) for i in range(m)], -1)
    assert torch.allclose((p * sizes[:, None]).sum(-2), per_key_block, atol=1e-10)
    assert (p.triu(1) == 0).all()  # still causal above the diagonal tiles


def test_pooling_refuses_bad_blocks():
    with pytest.raises(ValueError, match="block"):
        pool_pattern(torch.ones(2, 2), 0)
    with pytest.raises(ValueError, match="n, n"):
        pool_pattern(torch.ones(2, 3), 2)


def test_block_labels_cover_every_position():
    toks = [f"t{i}" for i in range(10)]
    assert block_labels(toks, 1) == toks
    assert block_labels(toks, 4) == ["0-3 t0", "4-7 t4", "8-9 t8"]


def test_long_pattern_on_the_page_is_the_pooled_full_pattern_with_its_scale_stated():
    model = tiny_model("nope", n_ctx=64, n_layers=1)
    toks = random_tokens(model, 2, 50)
    res = inspect_heads(model, toks, max_pattern_tokens=10, n_null=20)
    full = inspect_heads(model, toks, max_pattern_tokens=64, n_null=20)  # not pooled
    assert full.meta["pattern_block"] == 1 and full.patterns[0].shape[-1] == 50
    assert torch.allclose(res.patterns[0], pool_pattern(full.patterns[0].double(), 5).float(),
                          atol=1e-6)
    assert torch.allclose(res.patterns[0].sum(-1), torch.ones(model.cfg.n_heads, 10), atol=1e-5)
    page = inspect_page(res, "t")
    assert "blocks of 5 tokens (scale 1:5" in page  # the note
    data = inspect_data(res)
    assert data["meta"]["pattern_block"] == 5 and data["meta"]["pattern_tokens"] == 50


def test_attention_bands_stay_inside_zero_one():
    # sharp attention (queries and keys scaled up) on two random sequences: a weight is
    # near 0 in one and near 1 in the other, and the t-interval (t = 12.7 at one degree
    # of freedom) reaches far past [0, 1]
    model = tiny_model("nope", n_layers=1)
    with torch.no_grad():
        model.blocks[0].attn.W_Q.mul_(30)
        model.blocks[0].attn.W_K.mul_(30)
    toks = random_tokens(model, 2, 6)
    raw = head_scores(run_cached(model, toks, None, "blocks.0.attn.hook_pattern")
                      ["blocks.0.attn.hook_pattern"])
    _, low, high, _ = t_interval(raw["first_token_score"])
    assert (low < 0).any() and (high > 1).any()  # the raw band does leave [0, 1]
    t = inspect_heads(model, toks, n_null=20).table
    att = t[t.metric.isin(["kernel_attention", "previous_token_score", "self_score",
                           "first_token_score"])]
    assert (att.ci_low.dropna() >= 0).all() and (att.ci_high.dropna() <= 1).all()
    assert ((att.ci_low <= att.value) & (att.value <= att.ci_high)).all()
    # a score kernel is not a weight: its band is left as it is
    score = t[t.metric == "kernel_score"]
    assert (score.ci_low < 0).any()


def test_scores_with_a_fixed_range_use_it_not_the_heads_range():
    near = np.array([0.059, 0.0595, 0.060])
    assert colour_scale("previous_token_score", near) == {"lo": 0.0, "hi": 1.0, "absolute": True}
    assert colour_scale("rotational_mass@Δ=-1", near)["hi"] == 1.0
    assert colour_scale("rotational_mass_null_percentile@Δ=0", near)["hi"] == 100.0
    assert colour_scale("n_complex_pairs", [1, 2], d_head=8)["hi"] == 4.0
    rel = colour_scale("loss_change[zero_head]", [0.5, np.nan, -0.25])
    assert rel == {"lo": -0.25, "hi": 0.5, "absolute": False}
    # every wide column of a real inspection has a scale on the page
    model = tiny_model("rotary")
    res = inspect_heads(model, random_tokens(model, 2, 8), n_null=20)
    data = inspect_data(res)
    wide = res.head_view()
    assert set(data["colour_scales"]) == set(wide.columns) - {"layer", "head"}
    for k, sc in data["colour_scales"].items():
        v = wide[k].dropna()
        assert sc["lo"] <= v.min() + 1e-12 and v.max() <= sc["hi"] + 1e-12, k


def test_null_heads_default_is_the_fingerprints_and_the_docs_say_that_number():
    model = tiny_model("nope", n_layers=1)
    res = inspect_heads(model, random_tokens(model, 2, 6))
    assert res.meta["n_null"] == NULL_HEADS  # the page prints META.n_null
    se = res.table[res.table.metric == "rotational_mass_null_percentile_se"]
    # the binomial SE of a percentile from NULL_HEADS heads is at most 1 point
    assert (se.value <= 100 * 0.5 / math.sqrt(NULL_HEADS) + 1e-9).all()
    docs = Path(__file__).resolve().parents[2] / "docs"
    for page in ("inspect.md", "spectra.md"):
        assert re.search(f"{NULL_HEADS:,} (random )?heads", (docs / page).read_text()), page
    said = re.findall(r"([\d,]+) random heads", (docs / "inspect.md").read_text())
    assert said and {int(n.replace(",", "")) for n in said} <= {NULL_HEADS, NULL_BAND_HEADS}


def test_loss_ablations_on_unpredictable_input_carry_a_warning():
    model = tiny_model("nope", n_layers=1)
    toks = random_tokens(model, 2, 8)
    res = inspect_heads(model, toks, ablate=True, n_null=20)
    # an untrained model on uniform random tokens: no better than a uniform guess
    assert res.meta["clean_loss"] >= uniform_guess_loss(model) == pytest.approx(
        math.log(model.cfg.d_vocab))
    assert any("log(d_vocab)" in n for n in res.notes)
    # a model that predicts its input well gets no such note: repeat one token
    with torch.no_grad():
        model.unembed.b_U.zero_()
        model.unembed.b_U[5] = 50.0
    easy = inspect_heads(model, torch.full((2, 8), 5), ablate=True, n_null=20)
    assert easy.meta["clean_loss"] < uniform_guess_loss(model)
    assert not any("log(d_vocab)" in n for n in easy.notes)


def test_ablation_progress_goes_to_stderr_and_counts_every_ablation(capsys):
    model = tiny_model("nope", n_layers=1)
    inspect_heads(model, random_tokens(model, 2, 6), ablate=True, n_null=20, progress=True)
    err = capsys.readouterr().err
    total = model.cfg.n_layers * model.cfg.n_heads * 4  # zero_head and 3 channels (NoPE: no bands)
    assert f"{total}/{total}" in err
    inspect_heads(model, random_tokens(model, 2, 6), ablate=True, n_null=20)
    assert "ablations" not in capsys.readouterr().err  # quiet unless asked


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed (apt-get install nodejs); the "
                    "page's number formatting is checked by running its own script")
def test_page_formats_percentiles_as_points_and_rounding_noise_as_zero():
    from importlib.resources import files

    js = "\n".join(files("posinterp.dashboard").joinpath(name).read_text(encoding="utf-8")
                   for name in ("common.js", "inspect.js"))
    funcs = "\n".join(re.search(rf"function {name}\(.*?\n}}\n", js, re.S).group(0)
                      for name in ("fmt", "fmtKey"))
    cases = [["x", 4.82e-17], ["x", -3e-13], ["x", 0.0123], ["x", 2.5e-5],
             ["rotational_mass_null_percentile@Δ=0", 66.37], ["phase_null_percentile", 99.6],
             ["rotational_mass_null_percentile_se@Δ=0", 0.94], ["previous_token_score", 0.5]]
    code = funcs + f"\nconsole.log(JSON.stringify({json.dumps(cases)}.map(c => fmtKey(c[0], c[1]))));"
    out = subprocess.run([NODE, "-e", code], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == ["0", "0", "0.012", "2.50e-5", "66", "100", "0.9", "0.500"]


def test_heads_table_spans_the_page_and_scrolls_instead_of_being_cut():
    model = tiny_model("nope", n_layers=1)
    page = inspect_page(inspect_heads(model, random_tokens(model, 2, 6), n_null=20), "t")
    # below the grid and card, full width, in a container that scrolls sideways
    assert re.search(r'<div class="scroll"><table id="list"></table></div>', page)
    assert re.search(r"\.scroll \{[^}]*overflow-x: auto", page)
    left = page[page.index('<div id="left">'):page.index('<div id="card">')]
    assert 'id="list"' not in left  # not squeezed into the grid's 55% column
