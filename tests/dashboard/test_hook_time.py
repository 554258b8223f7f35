"""inspect_heads reduces each layer's attention at hook time; the reference is a
``run_with_cache`` of the same pass with the whole-tensor definitions written out in
tests/analysis/test_attention_blocks.py. Both TL lines run this file (CI), on toys and on
loaded HF models, padded either side and with gaps."""

import numpy as np
import pytest
import torch

from posinterp.analysis import positional_symbolic_score
from posinterp.analysis._checks import run_cached
from posinterp.analysis.kernels import pool_pattern
from posinterp.dashboard import inspect_heads
from posinterp.models.backend import scores_hook
from tests.analysis.test_attention_blocks import _compact, _kernel_oracle, _scores_oracle
from tests.helpers import parity_cases, save_tiny_checkpoint, tiny_model

N = 14


def _masks(batch):
    m = torch.ones(batch, N, dtype=torch.long)
    m[0, :3] = 0          # left padding
    m[1, -4:] = 0         # right padding
    m[2, [5, 6]] = 0      # a gap
    return m


def _means(per_seq):
    x = per_seq.numpy()
    n = (~np.isnan(x)).sum(0)
    return np.where(n > 0, np.nansum(x, 0) / np.maximum(n, 1), np.nan)


def _check(model, tokens, mask, heads=None):
    insp = inspect_heads(model, tokens, mask, n_null=20, explain_values=0, induction_tokens=0,
                         heads=heads)
    t = insp.table
    chosen = list(range(model.cfg.n_heads)) if heads is None else heads
    names = {f"blocks.{layer}.attn.hook_pattern" for layer in range(model.cfg.n_layers)}
    score_names = {}
    for layer in range(model.cfg.n_layers):
        try:
            score_names[layer] = scores_hook(model, layer)
        except Exception:  # noqa: BLE001 (no verified score hook on this model: no kernel)
            pass
    cache = run_cached(model, tokens, mask, lambda n: n in names | set(score_names.values()))
    compared = 0
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][:, chosen]
        kernels = {"kernel_attention": _kernel_oracle(pattern, mask)}
        if layer in score_names:
            kernels["kernel_score"] = _kernel_oracle(cache[score_names[layer]][:, chosen], mask)
        for metric, per_seq in kernels.items():
            rows = t[(t.metric == metric) & (t.layer == layer)]
            want = _means(per_seq)  # [head, lag]
            for r in rows.itertuples():
                w = want[chosen.index(r.head), -r.offset]
                assert (np.isnan(w) and np.isnan(r.value)) or abs(w - r.value) <= 1e-6, (metric, r)
                compared += 1
        scores = _scores_oracle(pattern, mask, tokens)
        scores["induction_score_input"] = scores.pop("induction")
        for metric, per_seq in scores.items():
            rows = t[(t.metric == metric) & (t.layer == layer)].set_index("head")
            want = _means(per_seq)
            for i, head in enumerate(chosen):
                got = rows.loc[head, "value"]
                assert (np.isnan(want[i]) and np.isnan(got)) or abs(want[i] - got) <= 1e-6, metric
                compared += 1
        view = pool_pattern(_compact(pattern, mask)[0], insp.meta["pattern_block"]).float()
        torch.testing.assert_close(insp.patterns[layer], view, atol=1e-6, rtol=0)
    assert compared > 0
    return insp


@pytest.mark.parametrize("pe", ["rotary", "absolute", "alibi"])
def test_hook_time_equals_the_cached_pass_on_toys(pe):
    model = tiny_model(pe)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 6, (3, N), generator=gen)  # a small alphabet: tokens repeat
    _check(model, tokens, _masks(3))
    _check(model, tokens, None, heads=[0, 2] if model.cfg.n_heads > 2 else [0])


@pytest.mark.parametrize("name", ["mistral-sliding-16", "qwen2", "gpt2", "gptneo-local"])
def test_hook_time_equals_the_cached_pass_on_loaded_hf_models(tmp_path, name):
    from posinterp.models import load_model

    arch, make, _ = parity_cases()[name]
    save_tiny_checkpoint(arch, make(), tmp_path / name)
    model, _ = load_model(str(tmp_path / name), device="cpu")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 12, (3, N), generator=gen)
    _check(model, tokens, _masks(3))


def test_positional_score_on_a_prefix_equals_the_prefix_input():
    """Cut to its first k real tokens, the positional score is the score of those k
    tokens alone (causal: their q, k and attention do not see the rest)."""
    model = tiny_model("rotary")
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 20, (3, N), generator=gen)
    k = 9
    insp = inspect_heads(model, tokens, None, n_null=20, explain_values=0, induction_tokens=0,
                         max_positional_tokens=k)
    got = insp.table[insp.table.metric == "positional_score"].sort_values(["layer", "head"])
    want = positional_symbolic_score(model, tokens[:, :k], seed=0)
    want = want[want.metric == "positional_score"].sort_values(["layer", "head"])
    np.testing.assert_allclose(got.value.to_numpy(), want.value.to_numpy(), atol=1e-9)
    assert any("first 9 real tokens" in n for n in insp.notes)
    full = inspect_heads(model, tokens, None, n_null=20, explain_values=0, induction_tokens=0)
    assert not any("real tokens of each sequence" in n for n in full.notes)
    with pytest.raises(ValueError, match="max_positional_tokens"):
        inspect_heads(model, tokens, max_positional_tokens=2)


@pytest.mark.parametrize("name", ["bert", "qwen2"])
def test_head_scores_reduced_at_hook_time_equal_the_cached_pass(tmp_path, name):
    """previous_token_scores and induction_scores reduce each layer's pattern as it
    fires; on a bidirectional BERT too (TL 3.9 HookedEncoder's mask argument, TL 4's
    bridge with its renamed hooks), padded."""
    from posinterp.analysis import induction_scores, previous_token_scores
    from posinterp.models import load_model

    arch, make, _ = parity_cases()[name]
    save_tiny_checkpoint(arch, make(), tmp_path / name)
    model, _ = load_model(str(tmp_path / name), device="cpu")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(4, 12, (3, N), generator=gen)
    mask = _masks(3)
    cache = run_cached(model, tokens, mask, lambda n: n.endswith("attn.hook_pattern"))
    prev = previous_token_scores(model, tokens, mask)
    ind = induction_scores(model, tokens, mask)
    for layer in range(model.cfg.n_layers):
        want = _scores_oracle(cache[f"blocks.{layer}.attn.hook_pattern"], mask, tokens)
        got = prev[prev.layer == layer].sort_values("head").value.to_numpy()
        np.testing.assert_allclose(got, want["previous_token_score"].mean(0).numpy(), atol=1e-9)
        got = ind[ind.layer == layer].sort_values("head").value.to_numpy()
        np.testing.assert_allclose(got, _means(want["induction"]), atol=1e-9)


def _same_tables(a, b, atol):
    key = ["metric", "hook", "layer", "head", "offset", "rank", "ablation"]
    key = [k for k in key if k in a.columns]
    a = a.sort_values(key, na_position="first").reset_index(drop=True)
    b = b.sort_values(key, na_position="first").reset_index(drop=True)
    assert len(a) == len(b) and (a.metric.to_numpy() == b.metric.to_numpy()).all()
    np.testing.assert_allclose(b.value.to_numpy(float), a.value.to_numpy(float), atol=atol,
                               rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("name", ["qwen2", "mistral-sliding-16", "toy-rotary", "toy-alibi"])
def test_inspect_in_query_blocks_equals_the_whole_pass(tmp_path, name):
    """inspect_heads and adjacency_by_layer run in blocks of query rows through the
    model's KV cache give the tables of the whole pass (float32 q.k in another order:
    1e-5); padded either side and with gaps. TL 4's native toys have no cache and are
    refused by name (query_block='auto' falls back to the whole pass)."""
    from posinterp.analysis import adjacency_by_layer
    from posinterp.models import backend, load_model

    if name.startswith("toy"):
        model = tiny_model(name.split("-")[1])
    else:
        arch, make, _ = parity_cases()[name]
        save_tiny_checkpoint(arch, make(), tmp_path / name)
        model, _ = load_model(str(tmp_path / name), device="cpu")
    tokens = torch.randint(4, 12, (3, N), generator=torch.Generator().manual_seed(4))
    mask = _masks(3)
    kw = dict(n_null=20, explain_values=0, induction_tokens=0)
    whole = inspect_heads(model, tokens, mask, query_block=None, **kw)
    try:
        backend.check_chunked_pass(model)
    except backend.MissingFeatureError:
        assert backend.is_bridge(model)  # TL 4 native toys only
        with pytest.raises(backend.MissingFeatureError, match="query-block pass"):
            inspect_heads(model, tokens, mask, query_block=4, **kw)
        return
    blocks = inspect_heads(model, tokens, mask, query_block=4, **kw)
    _same_tables(whole.table, blocks.table, atol=1e-5)
    for layer, view in whole.patterns.items():
        torch.testing.assert_close(blocks.patterns[layer], view, atol=1e-6, rtol=0)
    a = adjacency_by_layer(model, tokens, mask, query_block=None)
    b = adjacency_by_layer(model, tokens, mask, query_block=5)
    np.testing.assert_allclose(b.value.to_numpy(float), a.value.to_numpy(float), atol=1e-6)
    with pytest.raises(ValueError, match="query_block must be"):
        adjacency_by_layer(model, tokens, mask, query_block=0)


def test_a_long_input_s_kernel_is_binned_past_the_dense_lags(tmp_path):
    """Past DENSE_LAGS the kernel rows are log-spaced lag bins (the page and heads.csv
    stay a few hundred rows per head), each the pooled mean over its pairs: the binned
    row equals the whole pass's pairs averaged by hand."""
    from posinterp.analysis.kernels import DENSE_LAGS, kernel_bins
    from posinterp.models import load_model

    arch, make, _ = parity_cases()["qwen2"]
    save_tiny_checkpoint(arch, make(), tmp_path / "q")
    model, _ = load_model(str(tmp_path / "q"), device="cpu")
    n = DENSE_LAGS + 60
    tokens = torch.randint(4, 12, (2, n), generator=torch.Generator().manual_seed(5))
    insp = inspect_heads(model, tokens, None, n_null=20, explain_values=0, induction_tokens=0)
    bins = kernel_bins(n)
    t = insp.table[(insp.table.metric == "kernel_attention") & (insp.table.layer == 0)
                   & (insp.table["head"] == 1)].sort_values("offset", ascending=False)
    assert list(-t.offset) == [lo for lo, _ in bins] and len(bins) < n
    assert insp.meta["kernel_dense_lags"] == DENSE_LAGS
    assert any("log-spaced offset bins" in note for note in insp.notes)
    pattern = run_cached(model, tokens, None, "blocks.0.attn.hook_pattern")[
        "blocks.0.attn.hook_pattern"][:, 1].double()
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    lo, hi = bins[-2]
    sel = (i - j >= lo) & (i - j < hi)
    want = pattern[:, sel].mean(-1).mean().item()  # per sequence, then over sequences
    assert abs(t[t.offset == -lo].value.item() - want) < 1e-6
