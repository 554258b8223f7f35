"""The model surface on either TransformerLens version (posinterp.models.backend, docs/tl4.md).

Each test checks a property that must hold on TL 3.9 and TL 4 alike, or, marked, a TL 4
refusal. Cross-version equality of the numbers is benchmarks/tl_parity.py's job (two
processes); here the references are independent: the pure weight generator, HF's own
weights, and the softmax of the scores.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from posinterp.interventions import QKIntervention, intervention_hooks
from posinterp.models import backend
from posinterp.models.toy import toy_state_dict
from tests.helpers import parity_cases, random_tokens, save_tiny_checkpoint, tiny_hf_configs, tiny_model

PES = ("nope", "absolute", "rotary", "alibi")
tl4_only = pytest.mark.skipif(backend.TL_MAJOR < 4, reason="a TransformerLens 4 behaviour")


@pytest.mark.parametrize("pe", PES)
def test_toy_weights_are_the_pure_generator_s(pe):
    model = tiny_model(pe)
    sd = toy_state_dict(model.posinterp_config)
    for layer in range(model.cfg.n_layers):
        w = backend.attention_weights(model, layer)
        for name in ("W_Q", "W_K", "W_V", "W_O", "b_Q"):
            assert torch.equal(w[name], sd[f"blocks.{layer}.attn.{name}"].double()), name
    assert torch.equal(model.W_E, sd["embed.W_E"])
    assert torch.equal(model.W_U, sd["unembed.W_U"])


@pytest.mark.parametrize("pe", PES)
def test_scores_hook_is_pre_softmax_and_edits_take_effect(pe):
    model = tiny_model(pe)
    toks = random_tokens(model, 2, 9, seed=1)
    name = backend.scores_hook(model, 0)
    logits, cache = model.run_with_cache(toks)
    scores, pattern = cache[name], cache["blocks.0.attn.hook_pattern"]
    torch.testing.assert_close(scores.softmax(-1), pattern)
    assert torch.isneginf(scores[..., ~torch.ones(9, 9, dtype=torch.bool).tril()]).all()
    edited = model.run_with_hooks(toks, fwd_hooks=[(name, lambda s, hook: s * 3.0)])
    assert not torch.allclose(edited, logits)


def test_rotated_q_and_k_hooks_fire_for_rope_toys():
    model = tiny_model("rotary")
    toks = random_tokens(model, 1, 7, seed=2)
    q_name, k_name = backend.rotated_qk_hooks(model, 0)
    _, cache = model.run_with_cache(toks)
    q, q_rot = cache["blocks.0.attn.hook_q"], cache[q_name]
    assert q_rot.shape == q.shape
    torch.testing.assert_close(q_rot[:, 0], q[:, 0])  # position 0 is not rotated
    assert not torch.allclose(q_rot[:, 1:], q[:, 1:])
    # RoPE rotates, so it keeps each head's norm at every position.
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1))
    assert cache[k_name].shape == cache["blocks.0.attn.hook_k"].shape


def test_alibi_toy_reports_its_scheme():
    model = tiny_model("alibi")
    assert backend.positional_type(model) == "alibi"
    assert backend.attn_scale(model) == pytest.approx(model.cfg.d_head ** 0.5)


def test_grouped_query_keys_expand_as_hf_shares_them(tmp_path):
    save_tiny_checkpoint("LlamaForCausalLM", tiny_hf_configs()["llama-gqa"], tmp_path / "ck")
    import posinterp as pi

    model, info = pi.load_model(tmp_path / "ck", fold_ln=False, center_writing_weights=False,
                                center_unembed=False, fold_value_biases=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ck"), local_files_only=True)
    H, kv, dh = info.n_heads, info.n_kv_heads, info.d_head
    assert kv < H
    w = backend.attention_weights(model, 0)
    k_proj = hf.model.layers[0].self_attn.k_proj.weight.detach().double()  # [kv * dh, d_model]
    for h in range(H):
        g = h // (H // kv)
        torch.testing.assert_close(w["W_K"][h], k_proj[g * dh:(g + 1) * dh].T)


@tl4_only
def test_raw_native_models_refuse_what_their_hooks_cannot_give():
    from transformer_lens import TransformerBridgeConfig
    from transformer_lens.model_bridge.sources.native import boot

    model = boot(TransformerBridgeConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, n_ctx=8,
                                         d_vocab=11, positional_embedding_type="rotary", seed=0))
    with pytest.raises(backend.MissingFeatureError, match="post-softmax pattern"):
        backend.scores_hook(model, 0)
    with pytest.raises(backend.MissingFeatureError, match="hook_rot_q"):
        backend.rotated_qk_hooks(model, 0)
    # the content variant needs the rotated q/k (tests/interventions/test_hook_meaning.py
    # checks the offset variant and NoPE-style native models, which work through the pattern)
    with pytest.raises(backend.MissingFeatureError, match="hook_rot_q"):
        intervention_hooks(model, QKIntervention("symmetric", 0))
    # Its RoPE pairs adjacent dims, whatever its config says.
    assert backend.rotary_spec(model).adjacent_pairs and not model.cfg.rotary_adjacent_pairs


@tl4_only
def test_weight_processing_that_changes_outputs_is_reverted(tmp_path):
    """TL 4.3's processing moves GPT-NeoX's log-probs; the load keeps the unprocessed
    model (which matches HF), warns, and records that no processing was applied."""
    import posinterp as pi
    from posinterp.models.parity import hf_parity

    arch, make, _ = parity_cases()["neox"]
    save_tiny_checkpoint(arch, make(), tmp_path / "neox")
    with pytest.warns(UserWarning, match="weight processing .* moves GPTNeoXForCausalLM"):
        _, info = pi.load_model(tmp_path / "neox")
    assert not any(info.processing.values())
    assert "loaded without it" in info.hf_check["processing_reverted"]
    assert info.hf_check["max_abs_logprob_diff"] <= 1e-5
    with pytest.warns(UserWarning, match="weight processing"):
        assert hf_parity(tmp_path / "neox", lengths=(8, 32)).value.max() <= 1e-5


@tl4_only
def test_a_setting_the_bridge_ignores_is_refused_by_name_and_by_the_hf_check(tmp_path, monkeypatch):
    """TL 4.3's bridge ignores GPT-2's scale_attn_weights=False: the load refuses it by
    name; and were it not listed, the load's comparison with HF's own model would refuse."""
    import transformers

    from posinterp.models import load_model
    from posinterp.models.hf_config import UnsupportedConfigError
    from tests.helpers import parity_cases, save_tiny_checkpoint

    arch, make, _ = parity_cases()["gpt2-no-attn-scale-n-inner-40"]
    save_tiny_checkpoint(arch, make(), tmp_path / "g")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "g").scale_attn_weights is False
    with pytest.raises(UnsupportedConfigError, match="scale_attn_weights=False is not supported on "
                                                     "TransformerLens 4.*JointQKVAttentionBridge"):
        load_model(tmp_path / "g")
    monkeypatch.setattr(backend.version, "_BRIDGE_ASSUMES", {})
    with pytest.raises(UnsupportedConfigError, match="differ from HF's"):
        load_model(tmp_path / "g")


@pytest.mark.parametrize("name", ["gpt2-absolute", "llama-gqa", "neox-rotary-pct-0.25"])
def test_cached_generation_gives_the_uncached_tokens_or_is_refused(tmp_path, name, no_network):
    """Greedy generation with a KV cache (TransformerLens's default) gives the tokens HF's
    own generate gives: TL 4.3's bridges over transformers 5.x look for the cache under
    ``past_key_values`` in the attention they rebuild (GPT-2, Llama), which transformers 5
    passes as ``cache``; the load detects it and repairs the argument
    (backend.guard_kv_cache), so every one of these has a working cache."""
    import posinterp as pi

    arch = {"gpt2-absolute": "GPT2LMHeadModel", "llama-gqa": "LlamaForCausalLM",
            "neox-rotary-pct-0.25": "GPTNeoXForCausalLM"}[name]
    # unsharpened weights: greedy argmax far from ties, so rounding cannot flip a token
    hf = save_tiny_checkpoint(arch, tiny_hf_configs()[name], tmp_path / name, sharpen=1.0)
    model, _ = pi.load_model(tmp_path / name, fold_ln=False, center_writing_weights=False,
                             center_unembed=False, fold_value_biases=False)
    toks = torch.randint(4, model.cfg.d_vocab, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=6, verbose=False, do_sample=False, stop_at_eos=False)
    want = hf.generate(toks, attention_mask=torch.ones_like(toks), max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(toks, use_past_kv_cache=False, **kw), want)
    assert backend.has_kv_cache(model)
    assert torch.equal(model.generate(toks, use_past_kv_cache=True, **kw), want)


def test_gptj_rotates_by_its_config_s_frequencies(tmp_path, no_network):
    """GPT-J keeps no inv_freq buffer (TL 4 bridges read RoPE from one elsewhere): its
    frequencies are base 10000 over the config's rotary_dim, on adjacent pairs, on either
    line, and hook_q/hook_k rotated with them explain the model's own pattern (the probe
    behind backend.query_hooks). HF parity: tests/models/test_parity.py."""
    import posinterp as pi

    arch, make, _ = parity_cases()["gptj-rotary-dim-4"]
    save_tiny_checkpoint(arch, make(), tmp_path / "gptj")
    model, info = pi.load_model(tmp_path / "gptj")
    spec = backend.rotary_spec(model)
    assert (spec.rotary_dim, spec.adjacent_pairs) == (4, True)
    assert (info.rotary_dim, info.rotary_adjacent_pairs, info.rotary_base) == (4, True, 10000.0)
    want = 1.0 / 10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    torch.testing.assert_close(spec.inv_freq, want, rtol=1e-7, atol=0)
    assert backend.query_hooks(model, 0) == ("blocks.0.attn.hook_q", "blocks.0.attn.hook_k")


@tl4_only
def test_a_gptj_table_that_is_not_its_config_s_is_refused(tmp_path, no_network):
    import posinterp as pi

    arch, make, _ = parity_cases()["gptj-rotary-dim-4"]
    save_tiny_checkpoint(arch, make(), tmp_path / "gptj")
    model, _ = pi.load_model(tmp_path / "gptj")
    table = dict(model.original_model.named_buffers())["transformer.rotary_emb.embed_positions"]
    with torch.no_grad():
        table[:, :2] = table[:, :2].roll(1, dims=0)  # sines of another position
    with pytest.raises(backend.MissingFeatureError, match="embed_positions"):
        backend.rotary_spec(model)


def test_fold_ln_is_recorded_where_the_loader_did_it(tmp_path, no_network):
    """TL 4's processing leaves folded LayerNorm gains in place at 1 and its config says LN
    either way; the record must still say the loader folded them, as on TL 3.9."""
    import posinterp as pi

    save_tiny_checkpoint("GPT2LMHeadModel", tiny_hf_configs()["gpt2-absolute"], tmp_path / "g")
    _, folded = pi.load_model(tmp_path / "g")
    _, raw = pi.load_model(tmp_path / "g", fold_ln=False)
    assert folded.processing["fold_ln"] and folded.qk_convention["norm_gain"] == "folded by the loader"
    assert raw.qk_convention["norm_gain"] == "folded by posinterp.spectral"
