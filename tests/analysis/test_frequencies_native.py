"""The positional/symbolic score reads only hooks verified on the loaded model: on TL 4
native attention (no pre-softmax hook, hook_rot_q never fires) it checks the verified
hook_q/hook_k against the verified pattern hook (issue 28 item 5)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posinterp.analysis.frequencies import (
    _check_logits,
    _rotated_logits,
    pair_indices,
    positional_symbolic_score,
    rotate,
)
from posinterp.models import backend, build_model, preset
from tests.helpers import patch_backend, random_tokens


def _native_constructed():
    """A TL 4 native RoPE model (boot, not posinterp's attention), base 1e12 so θ = 1, 1e-3,
    1e-6, 1e-9 on adjacent pairs. Head 0: q, k constant in the fastest pair with k = q R(1),
    so its logits depend on the offset only (positional); head 1: constant q and a key that
    reads the token in the slowest pair, so its logits depend on the key token only
    (symbolic)."""
    from transformer_lens import TransformerBridgeConfig
    from transformer_lens.model_bridge.sources.native import boot

    model = boot(TransformerBridgeConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, n_ctx=16,
                                         d_vocab=11, positional_embedding_type="rotary", seed=0,
                                         rotary_base=10**12))
    attn = model.original_model.layers[0].attn
    q, k = attn.q, attn.k
    with torch.no_grad():
        for lin in (q, k):
            lin.weight[:16].zero_()
            lin.bias[:16].zero_()
        q.bias[0] = 4.0  # head 0, pair 0 = dims (0, 1)
        k.bias[0], k.bias[1] = 4.0 * math.cos(1.0), 4.0 * math.sin(1.0)
        q.bias[8 + 6] = 4.0  # head 1, pair 3 = dims (6, 7)
        k.weight[8 + 6] = torch.randn(16, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.skipif(backend.TL_MAJOR < 4, reason="a TransformerLens 4 native model")
def test_native_model_scores_positional_and_symbolic_heads():
    model = _native_constructed()
    meaning = backend.hook_meaning(model, 0)
    assert meaning.scores is None and meaning.pattern is not None  # no pre-softmax hook
    toks = torch.randint(0, 11, (6, 14), generator=torch.Generator().manual_seed(1))
    df = positional_symbolic_score(model, toks, seed=0)
    res = df.set_index(["metric", "head"]).value
    assert res["positional_score", 0] == pytest.approx(1.0, abs=1e-9)
    assert res["positional_residual", 0] < 1e-9 * res["symbolic_residual", 0]
    assert res["positional_score", 1] < 1e-6
    assert res["symbolic_residual", 1] < 1e-6 * res["positional_residual", 1]


@pytest.mark.parametrize("kind", ["toy", "native"])
def test_padding_on_either_side_gives_the_unpadded_score(kind):
    """A pad is never a position: right- and left-padded sequences score as unpadded ones
    (the same permutations are drawn: one sequence after the other, of the same length)."""
    if kind == "native" and backend.TL_MAJOR < 4:
        pytest.skip("a TransformerLens 4 native model")
    model = _native_constructed() if kind == "native" else build_model(
        preset("tiny", pe="rotary", init_std=0.3))
    toks = random_tokens(model, 2, 8, seed=5)
    want = positional_symbolic_score(model, toks, seed=0)
    padded = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    padded[0, :8], mask[0, :8] = toks[0], 1  # right padding
    padded[1, 4:], mask[1, 4:] = toks[1], 1  # left padding
    got = positional_symbolic_score(model, padded, attention_mask=mask, seed=0)
    for col in ("value", "ci_low", "ci_high"):
        torch.testing.assert_close(torch.tensor(got[col].to_numpy()), torch.tensor(want[col].to_numpy()),
                                   rtol=1e-5, atol=1e-6)


def test_pattern_route_gives_the_scores_route_on_a_toy(monkeypatch):
    """Where no pre-softmax hook is verified, the pattern hook checks the reconstruction: on a
    model that has both, the pattern route reports exactly what the scores route reports."""
    model = build_model(preset("tiny", pe="rotary", init_std=0.3))
    toks = random_tokens(model, 3, 12)
    want = positional_symbolic_score(model, toks, seed=4)
    real = backend.hook_meaning

    def without_scores(m, layer):
        v = real(m, layer)
        return dataclasses.replace(v, scores=None, pattern=f"blocks.{layer}.attn.hook_pattern")

    patch_backend(monkeypatch, "hook_meaning", without_scores)
    got = positional_symbolic_score(model, toks, seed=4)
    assert got.equals(want)


def test_pattern_check_catches_logits_it_cannot_reproduce():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 2, 4, generator=gen) * 2, torch.randn(1, 6, 2, 4, generator=gen) * 2
    first, second, _ = pair_indices(4, 4, True)
    inv = torch.tensor([1.0, 0.01], dtype=torch.float64)
    pos = torch.arange(6)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()

    def pattern(qq, kk):
        s = torch.einsum("bihd,bjhd->bhij", qq.double(), kk.double()) / 2.0
        return s.masked_fill(~causal, float("-inf")).softmax(-1)

    right = pattern(rotate(q, pos[None, :, None], first, second, inv),
                    rotate(k, pos[None, :, None], first, second, inv))
    _check_rotated(q, k, right, first, second, inv, 2.0, 1e-9, 0, ValueError, is_pattern=True)
    with pytest.raises(ValueError, match="do not reproduce its pattern"):
        _check_rotated(q, k, pattern(q, k), first, second, inv, 2.0, 1e-3, 0, ValueError,
                              is_pattern=True)


def test_unverified_query_hooks_are_refused_by_name(monkeypatch):
    """No hook is read by its name: where the probe found no unrotated q/k, the score refuses."""
    from tests.helpers import without_verified_query_hooks

    model = build_model(preset("tiny", pe="rotary"))
    without_verified_query_hooks(monkeypatch)
    with pytest.raises(backend.MissingFeatureError, match="unrotated query and key"):
        positional_symbolic_score(model, random_tokens(model, 2, 8))


def test_half_precision_probe_verifies_query_hooks_and_still_tells_rotations_apart():
    """A bf16 model's RoPE tables keep bf16 rounding in the float32 probe; its looser tolerance
    accepts the rotated hook_q/hook_k and still rejects them unrotated."""
    low = build_model(preset("tiny", pe="rotary", init_std=0.3), dtype=torch.bfloat16)
    assert backend.query_hooks(low, 0) == ("blocks.0.attn.hook_q", "blocks.0.attn.hook_k")
    toks = backend._probe_tokens(low)
    with backend._in_float32(low) as half, torch.no_grad():
        _, cache = low.run_with_cache(toks)
    assert half
    q, k = backend._qk(cache, "blocks.0.attn.hook_q", "blocks.0.attn.hook_k", low.cfg.n_heads)
    allowed = backend._allowed(low, toks.shape[1])
    pattern = cache["blocks.0.attn.hook_pattern"]
    scale = backend.attn_scale(low, 0)
    spec, pos = backend.rotary_spec(low, 0), torch.arange(toks.shape[1])[None].expand(2, -1)
    rotated = backend._content(backend.rope_rotate(q, spec, pos), backend.rope_rotate(k, spec, pos), scale)
    assert backend._explains(pattern, rotated, allowed, 3e-2)
    assert not backend._explains(pattern, backend._content(q, k, scale), allowed, 3e-2)


def _check_rotated(q, k, scores, first, second, inv, scale, tol, layer, error, is_pattern=False):
    """The model check of positional_symbolic_score on ``[batch, pos, head, d_head]`` q, k."""
    logits = _rotated_logits(q.transpose(1, 2), k.transpose(1, 2), first, second, inv, scale)[2]
    _check_logits(logits, scores, tol, layer, error, is_pattern=is_pattern)
