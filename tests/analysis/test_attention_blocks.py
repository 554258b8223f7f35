"""The query-block reductions against whole-tensor definitions written out here, on
padded batches (either side, gaps), masked scores (a sliding window), ties of block size
and low-precision input."""

import pytest
import torch

from posinterp.analysis import attention_kernel, head_scores, induction_score
from posinterp.analysis._attention_blocks import reduce_attention
from posinterp.analysis.kernels import pool_pattern


def _compact(values, mask):
    """[h, L, L] of each sequence's real tokens, float64 (the whole-tensor way)."""
    out = []
    for b in range(values.shape[0]):
        idx = mask[b].bool().nonzero().flatten() if mask is not None else torch.arange(values.shape[-1])
        out.append(values[b][:, idx][:, :, idx].double())
    return out


def _kernel_oracle(values, mask):
    b, h, n, _ = values.shape
    out = torch.full((b, h, n), torch.nan, dtype=torch.float64)
    for s, v in enumerate(_compact(values, mask)):
        masked = _compact(values[s:s + 1] <= torch.finfo(values.dtype).min,
                          None if mask is None else mask[s:s + 1])[0].bool()
        for lag in range(v.shape[-1]):
            d = torch.diagonal(v, offset=-lag, dim1=-2, dim2=-1)
            ok = ~torch.diagonal(masked, offset=-lag, dim1=-2, dim2=-1)
            cnt = ok.sum(-1)
            out[s, :, lag] = torch.where(cnt > 0, torch.where(ok, d, 0.0).sum(-1) / cnt.clamp_min(1),
                                         torch.nan)
    return out


def _scores_oracle(pattern, mask, tokens):
    res = {k: [] for k in ("previous_token_score", "self_score", "first_token_score", "induction")}
    for s, p in enumerate(_compact(pattern, mask)):
        L = p.shape[-1]
        res["previous_token_score"].append(torch.stack([p[:, i, i - 1] for i in range(1, L)], -1).mean(-1))
        res["self_score"].append(torch.stack([p[:, i, i] for i in range(1, L)], -1).mean(-1))
        res["first_token_score"].append(p[:, 1:, 0].mean(-1))
        tok = tokens[s][mask[s].bool()] if mask is not None else tokens[s]
        masses = []
        for i in range(L):
            js = [k + 1 for k in range(i) if tok[k] == tok[i]]
            if js:
                masses.append(p[:, i, js].sum(-1))
        res["induction"].append(torch.stack(masses, -1).mean(-1) if masses
                                else torch.full((p.shape[0],), torch.nan, dtype=torch.float64))
    return {k: torch.stack(v) for k, v in res.items()}


def _batch(n=23, h=3, window=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, h, n, n, generator=gen)
    i = torch.arange(n)
    masked = i[None, :] > i[:, None]
    if window is not None:
        masked |= (i[:, None] - i[None, :]) >= window
    scores = scores.masked_fill(masked, torch.finfo(torch.float32).min)
    pattern = scores.softmax(-1).to(dtype)
    scores = scores.to(dtype)
    mask = torch.ones(4, n, dtype=torch.long)
    mask[1, :5] = 0          # left padding
    mask[2, -7:] = 0         # right padding
    mask[3, [4, 9, 10]] = 0  # gaps
    tokens = torch.randint(0, 5, (4, n), generator=gen)  # small vocabulary: many repeats
    return scores, pattern, mask, tokens


@pytest.mark.parametrize("block_elements", [1, 7, 50, 1 << 20])
@pytest.mark.parametrize("window", [None, 6])
def test_kernel_equals_whole_tensor_definition(block_elements, window):
    scores, pattern, mask, _ = _batch(window=window)
    for values in (scores, pattern):
        for m in (mask, None):
            got = reduce_attention(values, m, block_elements=block_elements).kernel()
            # float32 partial sums of 8 queries: 1e-6 relative
            torch.testing.assert_close(got, _kernel_oracle(values, m), rtol=1e-6, atol=1e-7,
                                       equal_nan=True)


def test_public_kernel_and_scores_use_the_blocks():
    scores, pattern, mask, tokens = _batch(window=8)
    torch.testing.assert_close(attention_kernel(scores, mask), _kernel_oracle(scores, mask),
                               rtol=1e-6, atol=1e-7, equal_nan=True)
    want = _scores_oracle(pattern, mask, tokens)
    got = head_scores(pattern, mask)
    for k in ("previous_token_score", "self_score", "first_token_score"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(induction_score(pattern, tokens, mask), want["induction"],
                               rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("block_elements", [1, 13, 1 << 20])
def test_scores_induction_and_views_any_block_size(block_elements):
    _, pattern, mask, tokens = _batch(n=31, seed=1)
    want = _scores_oracle(pattern, mask, tokens)
    views = {0: 4, 1: 1, 3: 31}
    out = reduce_attention(pattern, mask, kernel=False, scores=True, tokens=tokens, views=views,
                           block_elements=block_elements)
    for k, v in out.scores().items():
        torch.testing.assert_close(v, want[k], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.induction_score(), want["induction"], rtol=1e-12, atol=1e-12,
                               equal_nan=True)
    compact = _compact(pattern, mask)
    for s, block in views.items():
        torch.testing.assert_close(out.views[s], pool_pattern(compact[s], block).float())


def test_low_precision_masks_are_read_in_their_dtype():
    """A bf16 sliding-window score tensor: finfo(bfloat16).min marks the mask (it is no
    mask in float64), so the masked lags are NaN, as in the whole-tensor definition."""
    scores, _, mask, _ = _batch(window=4, dtype=torch.float32)
    bf = scores.clamp_min(torch.finfo(torch.bfloat16).min).bfloat16()
    got = reduce_attention(bf, mask, block_elements=10).kernel()
    want = _kernel_oracle(bf, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert torch.isnan(got[0, :, 4:]).all() and not torch.isnan(got[0, :, :4]).any()


@pytest.mark.parametrize("cuts", [[0, 1, 5, 12, 23], [0, 8, 16, 23], [0, 23]])
def test_row_blocks_as_a_kv_cached_pass_makes_them(cuts):
    """Rows a..b-1 with keys 0..b-1 (what a chunked pass with a KV cache fires), added in
    any order, give the whole tensor's sums: padded batches, sliding-window masks."""
    from posinterp.analysis._attention_blocks import AttentionReduction

    scores, pattern, mask, tokens = _batch(window=6, seed=2)
    views = {0: 4, 2: 3}
    for values in (scores, pattern):
        for m in (mask, None):
            want = reduce_attention(values, m, scores=True, tokens=tokens, views=views)
            acc = AttentionReduction(4, 3, 23, m, scores=True, tokens=tokens, views=views,
                                     block_elements=11)
            spans = list(zip(cuts[:-1], cuts[1:], strict=True))
            for a, b in reversed(spans):
                acc.add(values[:, :, a:b, :b], a)
            got = acc.result()
            torch.testing.assert_close(got.kernel(), want.kernel(), rtol=1e-6, atol=1e-7,
                                       equal_nan=True)
            for k, v in got.scores().items():
                torch.testing.assert_close(v, want.scores()[k], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got.induction_score(), want.induction_score(),
                                       rtol=1e-12, atol=1e-12, equal_nan=True)
            for s in views if values is pattern else ():  # views pool patterns
                torch.testing.assert_close(got.views[s], want.views[s], rtol=1e-6, atol=1e-7)


def test_row_block_needs_its_keys():
    from posinterp.analysis._attention_blocks import AttentionReduction

    acc = AttentionReduction(1, 2, 10)
    with pytest.raises(ValueError, match="needs keys"):
        acc.add(torch.rand(1, 2, 3, 10), 2)


@pytest.mark.parametrize("n_lags,dense", [(1, 256), (256, 256), (257, 256), (8192, 256), (100, 8)])
def test_kernel_bins_cover_every_lag_once_log_spaced(n_lags, dense):
    from posinterp.analysis.kernels import kernel_bins

    bins = kernel_bins(n_lags, dense=dense)
    assert bins[0][0] == 0 and bins[-1][1] == n_lags
    assert all(a[1] == b[0] for a, b in zip(bins, bins[1:], strict=False))  # contiguous, no overlap
    assert all(hi - lo == 1 for lo, hi in bins if lo < dense)
    wide = [(lo, hi) for lo, hi in bins if lo >= dense][:-1]  # the last is cut at n_lags
    # log-spaced: each edge about 2^(1/16) times the last (rounded to whole lags)
    assert all(abs(hi / lo - 2 ** (1 / 16)) < 1.5 / lo + 1e-9 for lo, hi in wide if lo >= 64)
    with pytest.raises(ValueError, match="n_lags"):
        kernel_bins(0)


def test_binned_kernel_is_the_mean_over_the_bins_pairs():
    """A bin's value is the mean of the values of every (query, key) pair with its lag
    (the whole-tensor definition written out); one-lag bins are the kernel itself."""
    from posinterp.analysis.kernels import binned_kernel, kernel_bins

    scores, pattern, mask, _ = _batch(n=23, window=9, seed=3)
    bins = kernel_bins(23, dense=5, per_octave=2)
    assert len(bins) < 23
    for values in (scores, pattern):
        st = reduce_attention(values, mask)
        got = binned_kernel(st.kernel_sum, st.kernel_count, bins)
        for s, v in enumerate(_compact(values, mask)):
            bad = _compact(values[s:s + 1] <= torch.finfo(values.dtype).min, mask[s:s + 1])[0].bool()
            L = v.shape[-1]
            i, j = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
            for k, (lo, hi) in enumerate(bins):
                sel = (i - j >= lo) & (i - j < hi) & ~bad[0]
                want = v[:, sel].mean(-1) if sel.any() else torch.full((v.shape[0],), torch.nan,
                                                                        dtype=torch.float64)
                torch.testing.assert_close(got[s, :, k], want, rtol=1e-6, atol=1e-7, equal_nan=True)
        one = [k for k, (lo, hi) in enumerate(bins) if hi - lo == 1]
        torch.testing.assert_close(got[..., one], st.kernel()[..., [bins[k][0] for k in one]],
                                   rtol=1e-12, atol=0, equal_nan=True)
