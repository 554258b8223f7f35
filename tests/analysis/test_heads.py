import pytest
import torch

from posinterp.analysis import previous_token_score, previous_token_scores, random_tokens
from tests.helpers import tiny_model


def loop_score(pattern, start=1):
    """The definition, one entry at a time."""
    b, h, n, _ = pattern.shape
    out = torch.zeros(b, h, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            vals = [pattern[bi, hi, i, i - 1].item() for i in range(start, n)]
            out[bi, hi] = sum(vals) / len(vals)
    return out


def test_constructed_patterns():
    n = 8
    prev = torch.zeros(1, 1, n, n)
    prev[0, 0, 0, 0] = 1
    for i in range(1, n):
        prev[0, 0, i, i - 1] = 1
    assert previous_token_score(prev).item() == 1.0
    uniform = torch.tril(torch.ones(n, n))
    uniform = (uniform / uniform.sum(-1, keepdim=True))[None, None]
    want = sum(1 / (i + 1) for i in range(1, n)) / (n - 1)
    assert previous_token_score(uniform).item() == pytest.approx(want)
    want2 = sum(1 / (i + 1) for i in range(2, n)) / (n - 2)
    assert previous_token_score(uniform, start=2).item() == pytest.approx(want2)


def test_matches_loop_and_ignores_left_padding():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 3, 6, 6, generator=gen), -1)
    torch.testing.assert_close(previous_token_score(p), loop_score(p))
    padded = torch.zeros(2, 3, 9, 9)
    padded[:, :, 3:, 3:] = p
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]] * 2)
    torch.testing.assert_close(previous_token_score(padded, mask), loop_score(p))


def test_model_scores_and_cache_untouched():
    model = tiny_model("rotary")
    toks = random_tokens(model, 4, 16, seed=1)
    df = previous_token_scores(model, toks)
    assert len(df) == model.cfg.n_layers * model.cfg.n_heads
    assert df.value.between(0, 1).all()
    _, cache = model.run_with_cache(toks)
    before = cache["blocks.1.attn.hook_pattern"].clone()
    direct = previous_token_score(cache["blocks.1.attn.hook_pattern"]).mean(0)
    torch.testing.assert_close(torch.tensor(df[df.layer == 1].value.values), direct)
    assert torch.equal(cache["blocks.1.attn.hook_pattern"], before)


def test_bad_input():
    with pytest.raises(ValueError, match="pattern must have shape"):
        previous_token_score(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="start must be"):
        previous_token_score(torch.zeros(1, 1, 3, 3), start=0)
    with pytest.raises(ValueError, match="more than start"):
        previous_token_score(torch.zeros(1, 1, 2, 2), start=2)
