"""inspect_heads: kernels, scores and ablations against closed forms and independent code."""

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.analysis.heads import previous_token_score
from posinterp.analysis.kernels import attention_kernel, head_scores, t_interval
from posinterp.dashboard.columns import table_from_columns
from posinterp.dashboard.inspect import inspect_heads
from posinterp.dashboard.inspect_html import inspect_data, inspect_page
from posinterp.dashboard.schema import head_wide
from posinterp.models import alibi_slopes
from tests.helpers import random_tokens, tiny_model


def uniform_causal(batch, heads, n):
    """A[i, j] = 1/(i+1) for j <= i: what a head with zero queries attends."""
    i = torch.arange(n)
    A = torch.where(i[None, :] <= i[:, None], 1.0 / (i[:, None] + 1.0), 0.0)
    return A.expand(batch, heads, n, n).clone()


def test_kernel_of_uniform_attention_is_the_closed_form():
    n = 9
    k = attention_kernel(uniform_causal(2, 3, n))  # [batch, head, lag]
    for lag in range(n):
        expected = np.mean([1 / (i + 1) for i in range(lag, n)])
        assert torch.allclose(k[..., lag], torch.tensor(expected, dtype=torch.float64))


def test_kernel_drops_pads_on_either_side():
    n, pad = 7, 3
    A = uniform_causal(1, 2, n)
    big = torch.zeros(2, 2, n + pad, n + pad)
    big[0, :, pad:, pad:] = A[0]           # left padding
    big[1, :, :n, :n] = A[0]               # right padding
    mask = torch.ones(2, n + pad, dtype=torch.long)
    mask[0, :pad] = 0
    mask[1, n:] = 0
    k = attention_kernel(big, mask)
    ref = attention_kernel(A)
    assert torch.allclose(k[:, :, :n], ref.expand(2, -1, -1))
    assert torch.isnan(k[:, :, n:]).all()  # no query that far back


def test_head_scores_of_a_constructed_pattern():
    n, a = 8, 0.7
    A = torch.zeros(1, 1, n, n)
    A[0, 0, 0, 0] = 1
    for i in range(1, n):
        A[0, 0, i, i - 1] = a
        A[0, 0, i, i] = 1 - a
    s = head_scores(A)
    assert s["previous_token_score"].item() == pytest.approx(a)
    assert s["self_score"].item() == pytest.approx(1 - a)
    # Only query 1 puts weight on token 0 (its previous token).
    assert s["first_token_score"].item() == pytest.approx(a / (n - 1))


def test_t_interval_matches_scipy():
    from scipy import stats

    x = torch.tensor([[0.1], [0.4], [0.35], [0.2]], dtype=torch.float64)
    mean, low, high, n = t_interval(x)
    lo, hi = stats.t.interval(0.95, 3, loc=x.mean().item(), scale=stats.sem(x.numpy()[:, 0]))
    assert (mean.item(), low.item(), high.item(), n.item()) == pytest.approx((x.mean().item(), lo, hi, 4))


def _zero_queries(model, layer):
    with torch.no_grad():
        model.blocks[layer].attn.W_Q.zero_()
        model.blocks[layer].attn.b_Q.zero_()


def test_model_kernel_of_a_zero_query_alibi_head_is_slope_times_offset():
    """With q = 0 the pre-softmax score is the ALiBi bias alone: m_h * Δ (Press et al. §3)."""
    model = tiny_model("alibi")
    _zero_queries(model, 0)
    toks = random_tokens(model, 3, 10)
    t = inspect_heads(model, toks).table
    rows = t[(t.metric == "kernel_score") & (t.layer == 0)]
    slopes = alibi_slopes(model.cfg.n_heads)
    expected = slopes[rows["head"].to_numpy().astype(int)].numpy() * rows.offset.to_numpy().astype(float)
    assert np.allclose(rows.value.to_numpy(), expected, atol=1e-5)
    # Every sequence sees the same scores: the interval has zero width.
    assert np.allclose(rows.ci_high - rows.ci_low, 0, atol=1e-5)


def test_model_kernel_of_a_zero_query_nope_head_is_uniform():
    model = tiny_model("nope")
    _zero_queries(model, 0)
    n = 10
    toks = random_tokens(model, 2, n)
    t = inspect_heads(model, toks).table
    att = t[(t.metric == "kernel_attention") & (t.layer == 0) & (t["head"] == 1)].sort_values("offset")
    expected = [np.mean([1 / (i + 1) for i in range(-o, n)]) for o in att.offset]
    assert np.allclose(att.value, expected, atol=1e-6)


def test_previous_token_score_equals_kernel_at_minus_one():
    model = tiny_model("rotary")
    toks = random_tokens(model, 4, 12)
    mask = torch.ones_like(toks)
    mask[1, :3] = 0  # left padding
    t = inspect_heads(model, toks, mask).table
    _, cache = model.run_with_cache(toks, attention_mask=mask)
    for layer in range(model.cfg.n_layers):
        ref = previous_token_score(cache[f"blocks.{layer}.attn.hook_pattern"], mask).mean(0)
        sel = t[(t.layer == layer)]
        prev = sel[sel.metric == "previous_token_score"].sort_values("head").value.to_numpy()
        kern = sel[(sel.metric == "kernel_attention") & (sel.offset == -1)].sort_values("head").value
        assert np.allclose(prev, ref.numpy())
        assert np.allclose(prev, kern.to_numpy())


def test_zero_head_loss_change_matches_zeroed_output_weights():
    model = tiny_model("absolute")
    toks = random_tokens(model, 3, 10)
    res = inspect_heads(model, toks, ablate=True)
    t = res.table
    row = t[(t.metric == "loss_change") & (t.ablation == "zero_head") & (t.layer == 1) & (t["head"] == 2)]

    def loss(m):
        logits = m(toks)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 toks[:, 1:].reshape(-1)).item()
    clean = loss(model)
    with torch.no_grad():
        model.blocks[1].attn.W_O[2].zero_()  # head output z W_O: same as z = 0
    assert row.value.item() == pytest.approx(loss(model) - clean, abs=1e-5)
    assert res.meta["clean_loss"] == pytest.approx(clean, abs=1e-5)
    kinds = set(t[t.metric == "loss_change"].ablation)
    assert kinds == {"zero_head", "remove_positive_real", "remove_negative_real", "remove_complex"}


def test_attribution_ablations_are_labelled_and_their_top_k_rerun_exactly():
    model = tiny_model("rotary")
    toks = random_tokens(model, 3, 10)
    exact = inspect_heads(model, toks, ablate="exact", n_null=50).table
    approx = inspect_heads(model, toks, ablate="attribution", exact_top_k=5, n_null=50)
    t = approx.table
    est = t[t.metric == "loss_change_attribution"]
    from posinterp.dashboard.inspect import _band_kinds

    # every head and kind: zero_head, 3 channels and, on RoPE, the fastest and slowest band
    per_head = 4 + len(_band_kinds(model, 0))
    assert per_head == 6 and len(est) == per_head * model.cfg.n_layers * model.cfg.n_heads
    rerun = t[t.metric == "loss_change"]
    assert len(rerun) == 5
    # the reruns are the 5 largest estimates by size, with the exact path's numbers
    key = ["layer", "head", "ablation"]
    top = est.assign(size=est.value.abs()).nlargest(5, "size")[key]
    assert sorted(map(tuple, top.to_numpy())) == sorted(map(tuple, rerun[key].to_numpy()))
    ref = exact[exact.metric == "loss_change"].merge(rerun, on=key, suffixes=("_exact", "_rerun"))
    np.testing.assert_allclose(ref.value_rerun, ref.value_exact, rtol=0, atol=1e-6)
    assert approx.meta["ablate"] == "attribution" and approx.meta["exact_top_k"] == 5
    assert any("attribution patching" in n and "5 largest" in n for n in approx.notes)
    with pytest.raises(ValueError, match="ablate must be"):
        inspect_heads(model, toks, ablate="approximate")
    with pytest.raises(ValueError, match="exact_top_k"):
        inspect_heads(model, toks, ablate="attribution", exact_top_k=-1)


def test_rotary_spectra_at_offsets_zero_and_minus_one_with_percentiles():
    model = tiny_model("rotary")
    t = inspect_heads(model, random_tokens(model, 2, 8), n_null=100).table
    pct = t[t.metric == "rotational_mass_null_percentile"]
    assert set(pct.offset) == {0, -1}
    assert pct.value.between(0, 100).all()
    assert len(pct) == 2 * model.cfg.n_layers * model.cfg.n_heads
    band = head_wide(t)
    assert (band.null_band_low < band.null_band_high).all()


def test_per_layer_adjacency_covers_residual_points_and_attention_output():
    model = tiny_model("nope")
    t = inspect_heads(model, random_tokens(model, 2, 8)).table
    hooks = set(t[(t.metric == "adjacency_score") & t["head"].isna()].hook)
    assert "blocks.0.hook_resid_pre" in hooks
    for layer in range(model.cfg.n_layers):
        assert {f"blocks.{layer}.hook_attn_out", f"blocks.{layer}.hook_resid_post"} <= hooks


def test_long_input_pools_the_pattern_view_with_a_note():
    model = tiny_model("nope", n_ctx=64)
    res = inspect_heads(model, random_tokens(model, 2, 40), max_pattern_tokens=16)
    # 40 tokens at most 16 cells a side: blocks of ceil(40 / 16) = 3 tokens, 14 cells
    assert res.meta["pattern_block"] == 3 and res.meta["pattern_tokens"] == 40
    assert res.patterns[0].shape == (model.cfg.n_heads, 14, 14)
    assert len(res.str_tokens) == 14 and res.str_tokens[-1].startswith("39-39 ")
    assert any("blocks of 3 tokens" in n and "all 40 tokens" in n for n in res.notes)
    # The kernel still uses every token.
    assert res.table[res.table.metric == "kernel_attention"].offset.min() == -39


def _page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="inspect-data">(.*?)</script>', page, re.S)
    return _strict(m.group(1))  # as the page's JSON.parse reads it


def test_page_embeds_exactly_the_table():
    model = tiny_model("rotary")
    res = inspect_heads(model, random_tokens(model, 2, 8), ablate=True, n_null=50)
    page = inspect_page(res, "t", "f")
    data = _page_data(page)
    assert data == json.loads(json.dumps(inspect_data(res)))
    table = table_from_columns(data["table"])
    assert len(table) == len(res.table)
    for col in ("layer", "head", "offset", "rank", "value", "ci_low", "ci_high"):
        a = pd.to_numeric(table[col], errors="coerce").to_numpy(dtype=float)
        b = pd.to_numeric(res.table[col], errors="coerce").to_numpy(dtype=float)
        assert np.array_equal(a, b, equal_nan=True), col
    assert list(table.metric) == list(res.table.metric)


def test_page_is_offline_and_escapes_token_text():
    model = tiny_model("nope")
    res = inspect_heads(model, random_tokens(model, 2, 6))
    res.str_tokens[:] = ["</script><b>x</b>", "<!--", "a&b", "d", "e", "f"][: len(res.str_tokens)]
    res.notes.append("<i>note</i>")
    page = inspect_page(res, "<title>", "<facts>")
    assert "<b>x</b>" not in page and "<i>note</i>" not in page and "<title><" not in page
    assert page.count("</script>") == page.count("<script")  # no script ended early
    # No src/href that leaves the file (the bundle's URL strings are text, not requests).
    assert not re.search(r'\s(?:src|href)\s*=\s*["\']?(?:https?:)?//', page)


def test_twelve_heads_per_layer():
    from posinterp.models import ToyModelConfig, build_model

    model = build_model(ToyModelConfig(n_layers=1, d_model=48, n_heads=12, d_head=4, n_ctx=16,
                                       tokenizer=None, d_vocab=20, attn_only=True))
    res = inspect_heads(model, torch.randint(0, 20, (2, 10), generator=torch.Generator().manual_seed(0)))
    wide = head_wide(res.table)
    assert len(wide) == 12 and list(wide["head"]) == list(range(12))
    assert res.patterns[0].shape[0] == 12


@pytest.mark.parametrize("bad", [dict(max_offset=0), dict(max_pattern_tokens=0), dict(n_null=0)])
def test_bad_arguments_are_named(bad):
    model = tiny_model("nope")
    with pytest.raises(ValueError, match=next(iter(bad))):
        inspect_heads(model, random_tokens(model, 2, 6), **bad)


def test_too_short_sequences_are_refused():
    model = tiny_model("nope")
    with pytest.raises(ValueError, match="at least 3 real tokens"):
        inspect_heads(model, random_tokens(model, 2, 2))


def test_a_failed_load_leaves_no_output_folder(tmp_path):
    from posinterp.experiments.inspect import run_inspect

    with pytest.raises(FileNotFoundError):
        run_inspect(str(tmp_path / "no-such-model"), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _strict(text: str):
    """json.loads that refuses NaN/Infinity/-Infinity, as the browser's JSON.parse does."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _sliding_window(model, window: int):
    """Local attention as Mistral's sliding_window / GPT-Neo's local layers compute it:
    scores of keys more than ``window`` tokens back are masked (-inf) before the softmax."""
    def mask(scores, hook):
        i = torch.arange(scores.shape[-1])
        far = (i[:, None] - i[None, :]) > window
        return scores.masked_fill(far, float("-inf"))
    for layer in range(model.cfg.n_layers):
        model.add_hook(f"blocks.{layer}.attn.hook_attn_scores", mask, is_permanent=True)


def test_scores_past_a_sliding_window_are_nan_in_tables_and_null_on_the_page():
    window = 2
    model = tiny_model("alibi")
    _sliding_window(model, window)
    res = inspect_heads(model, random_tokens(model, 3, 8), n_null=20)
    kern = res.table[res.table.metric == "kernel_score"]
    inside, past = kern[-kern.offset <= window], kern[-kern.offset > window]
    assert len(past) and past.value.isna().all() and np.isfinite(inside.value).all()
    # the attention kernel past the window is a real 0 (the probability exists)
    att = res.table[(res.table.metric == "kernel_attention") & (-res.table.offset > window)]
    assert (att.value == 0).all()
    data = _page_data(inspect_page(res, "t", "f"))
    table = table_from_columns(data["table"])
    past_rows = table[(table.metric == "kernel_score") & (-table.offset > window)]
    assert len(past_rows) == len(past) and past_rows.value.isna().all()


def test_kernel_averages_only_the_queries_whose_score_exists():
    """Some queries masked at a lag, others not: the mean is over those that exist."""
    scores = torch.arange(16.0).reshape(1, 1, 4, 4)
    scores[0, 0, 3, 2] = torch.finfo(torch.float32).min  # HF's mask value, not -inf
    got = attention_kernel(scores)[0, 0]
    lag1 = [scores[0, 0, 1, 0], scores[0, 0, 2, 1]]  # (3, 2) is masked
    assert got[1] == sum(lag1) / 2
    assert got[0] == torch.diagonal(scores[0, 0]).mean()
