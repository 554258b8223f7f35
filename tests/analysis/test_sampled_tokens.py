"""sampled_tokens: the model's own seeded samples from BOS (natural input without a tokenizer)."""

import pytest
import torch

from posinterp.analysis import sampled_tokens
from tests.helpers import tiny_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("rotary").eval()


def test_seeded_and_starts_at_bos(model):
    a = sampled_tokens(model, 3, 10, bos_id=5, seed=1)
    assert a.shape == (3, 10) and a.dtype == torch.long and (a[:, 0] == 5).all()
    assert torch.equal(a, sampled_tokens(model, 3, 10, bos_id=5, seed=1))
    assert not torch.equal(a, sampled_tokens(model, 3, 10, bos_id=5, seed=2))


def test_low_temperature_is_an_independent_greedy_loop(model):
    got = sampled_tokens(model, 2, 12, bos_id=3, seed=0, temperature=1e-6)
    toks = torch.full((2, 1), 3)
    with torch.no_grad():
        for _ in range(11):
            toks = torch.cat([toks, model(toks)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, toks)


def test_first_sampled_token_follows_the_models_distribution(model):
    n = 4000
    first = sampled_tokens(model, n, 2, bos_id=0, seed=0)[:, 1]
    with torch.no_grad():
        p = model(torch.zeros(1, 1, dtype=torch.long))[0, -1].double().softmax(-1)
    freq = torch.bincount(first, minlength=p.numel()).double() / n
    # every frequency within 5 binomial standard deviations of its probability
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-9).all()


@pytest.mark.parametrize("kw, match", [
    (dict(batch=0, pos=4, bos_id=0), "batch"), (dict(batch=1, pos=10_000, bos_id=0), "n_ctx"),
    (dict(batch=1, pos=4, bos_id=-1), "bos_id"),
    (dict(batch=1, pos=4, bos_id=0, temperature=0), "temperature"),
])
def test_bad_arguments_are_named(model, kw, match):
    with pytest.raises(ValueError, match=match):
        sampled_tokens(model, **kw)
