import pytest
import torch
import torch.nn.functional as F

from posinterp.analysis import compact_real_tokens, cosine_self_similarity, similarity_by_layer
from tests.helpers import random_tokens, tiny_model


def test_matches_torch_cosine_similarity_including_zero_vector():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 5, generator=gen, dtype=torch.float64)
    x[1, 3] = 0.0
    got = cosine_self_similarity(x)
    want = F.cosine_similarity(x[:, :, None, :], x[:, None, :, :], dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got[1, 3].abs().max() == 0


def test_mask_compacts_real_tokens_to_the_front():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 4, generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    got = cosine_self_similarity(x, mask)
    torch.testing.assert_close(got[0, :4, :4], cosine_self_similarity(x[:, 2:])[0])
    assert torch.isnan(got[0, 4:]).all() and torch.isnan(got[0, :, 4:]).all()


@pytest.mark.parametrize("trailing", [(), (3,), (2, 3)])
def test_compaction_matches_per_sequence_boolean_indexing(trailing):
    """The batched gather against the obvious per-sequence loop, on random masks (any side)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 9, *trailing, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=gen) < 0.6).long()
    mask[0] = 1
    mask[1] = 0
    got = compact_real_tokens(x, mask)
    for b in range(6):
        real = x[b][mask[b].bool()]
        n = real.shape[0]
        torch.testing.assert_close(got[b, :n], real, rtol=0, atol=0)
        assert torch.isnan(got[b, n:]).all()


def test_bad_input():
    with pytest.raises(ValueError, match="resid must have shape"):
        cosine_self_similarity(torch.zeros(5))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        cosine_self_similarity(torch.zeros(2, 4, 3), torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="only 0"):
        cosine_self_similarity(torch.zeros(1, 4, 3), torch.full((1, 4), 2))


def test_by_layer_does_not_touch_user_hooks():
    model = tiny_model("absolute")
    fired = []
    model.add_hook("blocks.0.hook_resid_mid", lambda act, hook: fired.append(1))
    sims = similarity_by_layer(model, random_tokens(model, 1, 8))
    assert len(sims) == 5 and all(s.shape == (1, 8, 8) for s in sims.values())
    assert fired == [1]
    model.reset_hooks()


def test_identical_vectors_get_exactly_equal_cosines():
    """Item 5 of issue 13: a matmul may round <u_k, u_i> and <u_k, u_j> differently for
    x_i == x_j; every such pair must read exactly equal (checked bit for bit), padding aside."""
    gen = torch.Generator().manual_seed(0)
    vocab = torch.randn(5, 384, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 5, (3, 40), generator=gen)
    x = vocab[ids]
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 30:] = 0
    C = cosine_self_similarity(x, mask)
    for b in range(3):
        n = int(mask[b].sum())
        for i in range(n):
            for j in range(n):
                if ids[b, i] == ids[b, j]:
                    assert torch.equal(C[b, :n, i], C[b, :n, j])
                    assert torch.equal(C[b, i, :n], C[b, j, :n])
    # and the values are the cosines (an independent route, to rounding)
    ref = F.cosine_similarity(x[:, :, None], x[:, None], dim=-1)
    assert torch.allclose(C[0], ref[0], atol=1e-12)
    assert torch.isnan(C[1, 30:]).all() and torch.isnan(C[1, :, 30:]).all()


def test_first_copy_is_exact_equality_on_zero_tiny_and_nearly_parallel_vectors():
    """Grouping must neither miss an exact copy (zero vectors, vectors below eps, -0.0 vs
    0.0) nor merge vectors that differ by one ulp: checked against a naive all-pairs scan."""
    from posinterp.analysis.similarity import _first_copy, _first_copy_exact

    gen = torch.Generator().manual_seed(1)
    base = torch.randn(4, 16, generator=gen, dtype=torch.float64)
    vocab = torch.stack([base[0], torch.zeros(16), base[1] * 1e-12, base[2],
                         torch.nextafter(base[2], base[2] + 1), -torch.zeros(16), base[3]])
    ids = torch.randint(0, len(vocab), (5, 30), generator=gen)
    x = vocab[ids]
    x[2, 20:] = float("nan")  # padding rows are their own copy
    for first_copy in (_first_copy, _first_copy_exact):
        got = first_copy(x)
        for b in range(5):
            for i in range(30):
                want = next(j for j in range(i + 1) if j == i or bool((x[b, i] == x[b, j]).all()))
                assert got[b, i] == want, (first_copy.__name__, b, i)


def test_first_copy_falls_back_to_exact_grouping_on_a_hash_collision(monkeypatch):
    """Two different rows forced onto one key must not be merged: the check sees it and
    the exact grouping answers."""
    import posinterp.analysis.similarity as sim_mod

    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]]], dtype=torch.float64)
    real_unique = torch.unique

    def colliding_unique(t, *args, **kwargs):  # every 1-D key collides
        if t.ndim == 1:
            return real_unique(torch.zeros_like(t), *args, **kwargs)
        return real_unique(t, *args, **kwargs)

    monkeypatch.setattr(sim_mod.torch, "unique", colliding_unique)
    assert sim_mod._first_copy(x).tolist() == [[0, 1, 0]]


def test_non_tensor_input_is_named():
    import numpy as np
    import pytest

    with pytest.raises(ValueError, match="resid must be a torch.Tensor"):
        cosine_self_similarity(np.zeros((2, 4, 8)))
