"""Frequency-band interventions on RoPE heads (issue 28 item 2): removing rotary pairs
removes exactly their terms of every score, at every offset."""

import pytest
import torch

from posinterp.interventions import QKIntervention, intervention_hooks
from posinterp.interventions.qk import band_dims
from posinterp.models import backend, build_model, preset
from tests.helpers import random_tokens


def _scores_and_rotated(model, toks, layer, fwd_hooks=()):
    names = [backend.scores_hook(model, layer), *backend.rotated_qk_hooks(model, layer)]
    with model.hooks(fwd_hooks=list(fwd_hooks)):
        _, cache = model.run_with_cache(toks, names_filter=lambda n: n in names)
    return [cache[n].double() for n in names]


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny", pe="rotary", seed=2, init_std=0.3))


def test_removed_pairs_contribute_nothing_and_other_heads_are_untouched(model):
    toks = random_tokens(model, 2, 10)
    layer, head, band = 1, 2, (0, 3)
    clean, q, k = _scores_and_rotated(model, toks, layer)
    iv = QKIntervention("remove_band", layer, heads=(head,), band=band)
    cut, _, _ = _scores_and_rotated(model, toks, layer, intervention_hooks(model, iv))
    keep = torch.ones(model.cfg.d_head, dtype=torch.float64)
    keep[band_dims(model, layer, band)] = 0
    scale = backend.attn_scale(model, layer)
    want = torch.einsum("bid,bjd->bij", q[:, :, head] * keep, k[:, :, head]) / scale
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    torch.testing.assert_close(cut[:, head][:, causal], want[:, causal], atol=1e-5, rtol=1e-5)
    others = [h for h in range(model.cfg.n_heads) if h != head]
    torch.testing.assert_close(cut[:, others], clean[:, others])


def test_remove_and_keep_a_band_split_the_content_score(model):
    """Full rotary, no bias: content = (content without the band) + (the band's alone)."""
    toks = random_tokens(model, 2, 9, seed=4)
    layer, band = 0, (1,)
    clean, _, _ = _scores_and_rotated(model, toks, layer)
    removed, _, _ = _scores_and_rotated(model, toks, layer, intervention_hooks(
        model, QKIntervention("remove_band", layer, band=band)))
    kept, _, _ = _scores_and_rotated(model, toks, layer, intervention_hooks(
        model, QKIntervention("keep_band", layer, band=band)))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close((removed + kept)[..., causal], clean[..., causal], atol=1e-5, rtol=1e-5)
    assert (kept[..., causal] - clean[..., causal]).abs().max() > 1e-3  # the band was not all


def test_band_pairs_follow_the_layers_layout(model):
    spec = backend.rotary_spec(model, 0)
    half = spec.rotary_dim // 2
    want = [1, half + 1] if not spec.adjacent_pairs else [2, 3]
    assert band_dims(model, 0, (1,)) == want


def test_bad_bands_are_named():
    with pytest.raises(ValueError, match="needs band"):
        QKIntervention("remove_band", 0)
    with pytest.raises(ValueError, match="band applies only"):
        QKIntervention("remove_complex", 0, band=(1,))
    rotary = build_model(preset("tiny", pe="rotary"))
    with pytest.raises(ValueError, match=r"band must hold rotary pair indices in \[0, 3\]"):
        intervention_hooks(rotary, QKIntervention("keep_band", 0, band=(4,)))
    with pytest.raises(ValueError, match="needs a RoPE model"):
        intervention_hooks(build_model(preset("tiny", pe="alibi")),
                           QKIntervention("remove_band", 0, band=(0,)))
