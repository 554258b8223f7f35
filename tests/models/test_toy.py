import pytest
import torch

from posinterp.models import PRESETS, ToyModelConfig, alibi_slopes, build_model, preset
from posinterp.models.backend import attn_scale, positional_type  # noqa: F401
from posinterp.tasks import CHAR_VOCAB
from tests.helpers import random_tokens, tiny_model


def test_paper_preset_is_baby_gpt_size():
    cfg = PRESETS["paper"]
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model) == (6, 6, 384)
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert n == cfg.n_params and 10.4e6 < n < 10.8e6
    # anything else is a frozen zero table that carries nothing (TL 4's native model keeps
    # a position table for NoPE; TL 3.9's model has none)
    assert all((p == 0).all() for p in model.parameters() if not p.requires_grad)
    assert PRESETS["small"].d_model >= 192


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pe="sinusoidal"), "pe must be one of"),
        (dict(d_model=100, n_heads=6), "not divisible by n_heads"),
        (dict(normalization="batch"), "normalization must be one of"),
        (dict(pe="rotary", d_model=30, n_heads=2, d_head=15), "even d_head"),
        (dict(init_std=-1.0), "init_std"),
        (dict(n_layers=0), "n_layers"),
    ],
)
def test_config_errors_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ToyModelConfig(**kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset must be one of"):
        preset("huge")


def test_nope_survives_hooks_reset_save_load_and_weight_decay(tmp_path):
    model = tiny_model("nope")
    assert "pos_embed.W_pos" not in dict(model.named_parameters())
    toks = random_tokens(model, 2, 10)
    model.reset_hooks()
    _, cache = model.run_with_cache(toks)
    assert cache["hook_pos_embed"].abs().max() == 0
    # Train with strong weight decay on every parameter the user could hand an optimizer.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1.0)
    for _ in range(3):
        opt.zero_grad()
        model(toks, return_type="loss").backward()
        opt.step()
    assert model.pos_embed.W_pos.abs().max() == 0
    torch.save(model.state_dict(), tmp_path / "m.pt")
    fresh = tiny_model("nope")
    fresh.load_state_dict(torch.load(tmp_path / "m.pt"))
    torch.testing.assert_close(fresh(toks), model(toks))
    assert fresh.pos_embed.W_pos.abs().max() == 0


def test_nope_one_layer_is_permutation_invariant_in_its_prefix():
    """Without positions, causal attention at the last query sees a multiset of keys."""
    model = build_model(preset("tiny", pe="nope", n_layers=1))
    toks = random_tokens(model, 1, 12, seed=5)
    perm = torch.cat([torch.randperm(11, generator=torch.Generator().manual_seed(0)),
                      torch.tensor([11])])
    out = model(toks)[0, -1]
    out_perm = model(toks[:, perm])[0, -1]
    torch.testing.assert_close(out, out_perm, rtol=1e-5, atol=1e-5)
    # ...while an absolute-PE model is not.
    absolute = build_model(preset("tiny", pe="absolute", n_layers=1, init_std=0.5))
    assert not torch.allclose(absolute(toks)[0, -1], absolute(toks[:, perm])[0, -1], atol=1e-4)


def test_init_statistics_follow_the_config():
    model = build_model(preset("small", init_mean=0.5, init_std=0.2, seed=3))
    w = model.blocks[0].mlp.W_in.detach()
    assert abs(w.mean().item() - 0.5) < 0.01 and abs(w.std().item() - 0.2) < 0.01
    assert model.blocks[0].attn.b_Q.abs().max() == 0
    assert (model.blocks[0].ln1.w == 1).all() and (model.blocks[0].ln1.b == 0).all()
    again = build_model(preset("small", init_mean=0.5, init_std=0.2, seed=3))
    assert torch.equal(again.blocks[0].mlp.W_in, model.blocks[0].mlp.W_in)


@pytest.mark.parametrize("n_heads", [1, 4, 6, 8, 12, 16, 20])
def test_alibi_slopes_match_hf_bloom(n_heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.ones(1, 5)
    # HF computes the slopes in float32, hence the float32 tolerance.
    hf = build_alibi_tensor(mask, n_heads, torch.float64)  # [heads, 1, 5] = slope * pos
    torch.testing.assert_close(hf[:, 0, 1], alibi_slopes(n_heads), rtol=1e-6, atol=0)


def _alibi_scores_check(model, toks, mask=None):
    """hook_attn_scores == q.k/scale + m_h (pos_j - pos_i) on every unmasked entry, with
    positions counting real tokens; an independent recomputation from hook_q/hook_k."""
    _, cache = model.run_with_cache(toks, attention_mask=mask)
    n = toks.shape[1]
    mask = torch.ones_like(toks) if mask is None else mask
    for b in range(toks.shape[0]):
        q, k = cache["blocks.0.attn.hook_q"][b], cache["blocks.0.attn.hook_k"][b]  # [pos, head, d]
        content = torch.einsum("ihd,jhd->hij", q, k) / attn_scale(model)
        pos = mask[b].cumsum(0) - 1
        slopes = alibi_slopes(model.cfg.n_heads)[:, None, None].float()
        bias = slopes * (pos[None, :] - pos[:, None]).float()
        scores = cache["blocks.0.attn.hook_attn_scores"][b]
        real = mask[b].bool()
        keep = torch.tril(torch.ones(n, n, dtype=torch.bool)) & real[None, :] & real[:, None]
        torch.testing.assert_close(scores[:, keep], (content + bias)[:, keep], rtol=1e-5, atol=1e-5)


def test_alibi_model_uses_paper_slopes_in_scores():
    model = tiny_model("alibi", n_heads=6, d_model=36, n_layers=1)
    _alibi_scores_check(model, random_tokens(model, 1, 8))


def test_alibi_past_n_ctx_and_with_mask_gaps():
    """Issue 11, cases 5-6: past n_ctx TL rebuilt the bias with its own slopes, and it
    measured distance in indices, so a gap in the mask shifted every later key."""
    model = tiny_model("alibi", n_heads=6, d_model=36, n_layers=1, n_ctx=16)
    toks = random_tokens(model, 2, 17)
    _alibi_scores_check(model, toks)
    mask = torch.ones_like(toks)
    mask[1, 5:8] = 0
    _alibi_scores_check(model, toks, mask)
    # causal invariance: the first 16 logits do not depend on a 17th token
    with torch.no_grad():
        torch.testing.assert_close(model(toks)[:, :16], model(toks[:, :16]), rtol=1e-5, atol=1e-5)


def test_tokenizer_round_trip_as_transformerlens_users_expect():
    model = tiny_model("rotary")
    toks = model.to_tokens("rev(123)=321")
    assert toks[0, 0].item() == CHAR_VOCAB.bos_id
    assert toks[0, 1:].tolist() == CHAR_VOCAB.encode("rev(123)=321")
    assert model.to_str_tokens("rev(1)=")[1:] == list("rev(1)=")
    assert model.to_string(toks[0, 1:]) == "rev(123)=321"


@torch.no_grad()
def test_alibi_with_a_kv_cache_equals_the_full_forward_or_is_refused():
    """The per-call bias must place cached keys and new queries at their true positions.
    Where TransformerLens has no KV cache for the model (TL 4's native model, which would
    ignore the cache and run the new tokens alone from position 0), the cache is refused
    by name instead."""
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    from posinterp.models import backend

    model = tiny_model("alibi", n_heads=6, d_model=36, n_layers=1, n_ctx=32)
    toks = random_tokens(model, 2, 12)
    cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, 2)
    if not backend.has_kv_cache(model):
        for name in ("past_kv_cache", "past_key_values"):
            with pytest.raises(backend.MissingFeatureError, match="native model .* has no KV cache"):
                model(toks[:, :7], **{name: cache})
        return
    stepped = torch.cat([model(toks[:, :7], past_kv_cache=cache), model(toks[:, 7:], past_kv_cache=cache)], 1)
    torch.testing.assert_close(stepped, model(toks), rtol=1e-5, atol=1e-5)
