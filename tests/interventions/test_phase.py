"""Removing RoPE from heads: against the NoPE model with the same weights (an invariance:
toy models of every scheme share every weight but the positions, posinterp.models.toy)."""

import pytest
import torch

from posinterp.interventions.phase import rope_removed_hooks
from posinterp.models import build_model, preset
from tests.helpers import random_tokens


def test_rope_removed_everywhere_is_the_nope_model():
    rotary = build_model(preset("tiny", pe="rotary", seed=3, init_std=0.3))  # non-uniform attention
    nope = build_model(preset("tiny", pe="nope", seed=3, init_std=0.3))
    toks = random_tokens(rotary, 3, 12)
    hooks = [h for layer in range(rotary.cfg.n_layers)
             for h in rope_removed_hooks(rotary, layer, range(rotary.cfg.n_heads))]
    with torch.no_grad():
        removed = rotary.run_with_hooks(toks, fwd_hooks=hooks)
        assert torch.allclose(removed, nope(toks), atol=1e-5)
        assert not torch.allclose(rotary(toks), nope(toks), atol=1e-3)  # RoPE matters here


def test_only_the_chosen_head_changes():
    model = build_model(preset("tiny", pe="rotary", seed=1))
    toks = random_tokens(model, 2, 10)
    _, clean = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    with model.hooks(fwd_hooks=rope_removed_hooks(model, 0, [1])):
        _, cut = model.run_with_cache(toks, names_filter=lambda n: n.endswith("hook_pattern"))
    a, b = clean["blocks.0.attn.hook_pattern"], cut["blocks.0.attn.hook_pattern"]
    others = [h for h in range(model.cfg.n_heads) if h != 1]
    assert torch.allclose(a[:, others], b[:, others], atol=1e-6)
    assert not torch.allclose(a[:, 1], b[:, 1], atol=1e-4)


def test_refusals_name_the_parameter():
    with pytest.raises(ValueError, match="rotary model is needed"):
        rope_removed_hooks(build_model(preset("tiny", pe="alibi")), 0, [0])
    model = build_model(preset("tiny", pe="rotary"))
    with pytest.raises(ValueError, match="heads must be integers"):
        rope_removed_hooks(model, 0, [9])
    with pytest.raises(ValueError, match="layer must be integers"):
        rope_removed_hooks(model, 5, [0])


def test_unrotated_qk_come_from_verified_hooks_only(monkeypatch):
    """hook_q/hook_k are read only where the probe verified them as q, k before RoPE."""
    from posinterp.models import backend
    from tests.helpers import without_verified_query_hooks

    model = build_model(preset("tiny", pe="rotary"))
    without_verified_query_hooks(monkeypatch)
    with pytest.raises(backend.MissingFeatureError, match="unrotated query and key"):
        rope_removed_hooks(model, 0, [1])
