"""Architecture features that change what an analysis means: each is exact or refused by
name (issue 34 items 7-10; docs/models.md, "Architecture features").

* attention soft-capping (Gemma-2 ``attn_logit_softcapping``, TL's ``attn_scores_soft_cap``):
  symmetrization and q edits exact through the cap, additive score splits refused by name;
* bidirectional masks (``is_causal=False``): refused by name before any weight is read;
* half precision on either line: the analyses run and agree with float32;
* multi-head latent attention (DeepSeek-V2/V3): refused by name, pattern analyses run.

Every expected number is a closed form or HF's own module output, never posinterp's.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from posinterp.interventions.qk import QKIntervention, intervene
from posinterp.models import backend
from tests.helpers import rotary_model

CAP = 2.0  # small against the heads' |q.k| / scale (about 3-10 here), so tanh bends the scores


# --- soft-capping ----------------------------------------------------------------------------

def _gemma2_folder(tmp_path_factory):
    """A tiny random Gemma-2 (GQA, attn_logit_softcapping = CAP) saved with save_pretrained;
    q/k weights scaled so the capped scores are far from linear."""
    folder = tmp_path_factory.mktemp("gemma2-softcap")
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        attn_logit_softcapping=CAP, final_logit_softcapping=30.0, sliding_window=64,
        query_pre_attn_scalar=8)
    hf = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(20.0)
    hf.save_pretrained(folder)
    return folder


def _boot(folder):
    """A TransformerBridge a user boots over an HF folder (both TL lines ship the bridge)."""
    from transformer_lens.model_bridge import TransformerBridge

    from posinterp.tasks.tokenizer import build_byte_tokenizer

    bridge = TransformerBridge.boot_transformers(str(folder), device="cpu",
                                                 tokenizer=build_byte_tokenizer())
    bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    return bridge.eval()


def _softcap_model(kind, tmp_path_factory):
    """(model, q hook, k hook, attn_scale, the setting's name as the refusal gives it)."""
    if kind == "hooked":
        if backend.TL_MAJOR >= 4:
            pytest.skip("TransformerLens 4 has no HookedTransformer (its soft-cap models are the "
                        "Gemma-2 bridge and the native model, tested below)")
        model = rotary_model(attn_scores_soft_cap=CAP)  # TL 3.9 HookedTransformer, LN + biases
        return (model, "blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k",
                math.sqrt(model.cfg.d_head), f"cfg.attn_scores_soft_cap={CAP:g}")
    if kind == "native":
        if backend.TL_MAJOR < 4:
            pytest.skip("TransformerLens 3.9 has no native model source (its soft-cap models are "
                        "HookedTransformer and the Gemma-2 bridge, tested here)")
        from transformer_lens import TransformerBridgeConfig
        from transformer_lens.model_bridge.sources.native import boot

        torch.manual_seed(0)
        model = boot(TransformerBridgeConfig(n_layers=1, d_model=32, n_heads=4, d_head=8, n_ctx=16,
                                             d_vocab=50, positional_embedding_type="standard",
                                             attn_scores_soft_cap=CAP, seed=0))
        with torch.no_grad():
            for lin in (model.original_model.layers[0].attn.q, model.original_model.layers[0].attn.k):
                lin.weight.mul_(8.0)
        return (model, "blocks.0.attn.hook_q", "blocks.0.attn.hook_k", math.sqrt(8),
                f"cfg.attn_scores_soft_cap={CAP:g}")
    model = _boot(_gemma2_folder(tmp_path_factory))
    # Gemma-2 divides q.k by sqrt(query_pre_attn_scalar) = sqrt(8)
    return (model, "blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k", math.sqrt(8),
            f"attn_logit_softcapping={CAP:g}")


SOFTCAP_KINDS = ("hooked", "native", "gemma2")


def _capped_pattern(q, k, scale, content=lambda c: c):
    """softmax over keys j <= i of CAP tanh(content(q_i.k_j / scale) / CAP): the closed form of
    a soft-capped head without positional bias ([batch, head, query, key], float64)."""
    c = content(torch.einsum("bihd,bjhd->bhij", q, k) / scale)
    s = CAP * torch.tanh(c / CAP)
    n = s.shape[-1]
    return s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def _qk(cache, q_name, k_name, H):
    q, k = cache[q_name].double(), cache[k_name].double()
    return q, torch.repeat_interleave(k, H // k.shape[2], dim=2)


@pytest.mark.parametrize("kind", SOFTCAP_KINDS)
def test_softcap_symmetrization_and_query_edits_are_exact(kind, tmp_path_factory):
    """Symmetrization of a soft-capped head acts inside the cap: the pattern it leaves is
    softmax(T tanh(((c + c^T)/2) / T)) over the causal keys, with c = q.k / scale from the
    model's own q/k (checked first to reproduce the model's clean pattern through the cap);
    removing every channel (q -> 0, an edit the model's own cap sees) leaves T tanh(0) = 0,
    so a uniform causal pattern. On main both were refused ("no hook carrying the q and k")."""
    model, q_name, k_name, scale, _ = _softcap_model(kind, tmp_path_factory)
    H = model.cfg.n_heads
    toks = torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    _, cache = model.run_with_cache(toks)
    q, k = _qk(cache, q_name, k_name, H)
    clean = cache["blocks.0.attn.hook_pattern"].double()
    assert float((torch.einsum("bihd,bjhd->bhij", q, k) / scale).abs().max()) > 2 * CAP  # the cap bends
    assert torch.allclose(_capped_pattern(q, k, scale), clean, atol=1e-5)  # the test's own q/k are right
    assert backend.hook_meaning(model, 0).soft_cap == CAP

    want = _capped_pattern(q, k, scale, lambda c: 0.5 * (c + c.transpose(-1, -2)))
    with intervene(model, QKIntervention("symmetric", 0)):
        _, got = model.run_with_cache(toks)
    assert torch.allclose(got["blocks.0.attn.hook_pattern"].double(), want, atol=1e-5)
    assert not torch.allclose(want, clean, atol=1e-3)  # the intervention did something

    with intervene(model, QKIntervention("remove_all", 0)):
        _, got = model.run_with_cache(toks)
    n = toks.shape[1]
    uniform = torch.ones(n, n).tril() / torch.arange(1, n + 1)[:, None]
    assert torch.allclose(got["blocks.0.attn.hook_pattern"].double(),
                          uniform.double().expand_as(want), atol=1e-5)


@pytest.mark.parametrize("kind", SOFTCAP_KINDS)
def test_softcap_refuses_additive_score_splits_by_name(kind, tmp_path_factory):
    """score_parts and the positional/symbolic score split each score into terms that add up
    to it; T tanh(c / T) has no such terms, so both refuse naming the soft-cap setting and
    its value (on main: "no hook carrying the unrotated query and key")."""
    from posinterp.analysis import positional_symbolic_score, score_parts

    model, *_, setting = _softcap_model(kind, tmp_path_factory)
    toks = torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=rf"score_parts .*soft-caps its attention scores \({setting}"):
        score_parts(model, toks[0])
    if backend.positional_type(model) == "rotary":
        with pytest.raises(ValueError, match=rf"positional_symbolic_score .*soft-caps.*{setting}"):
            positional_symbolic_score(model, toks)
    if kind == "gemma2":  # the inspector goes on without them and says why
        from posinterp.dashboard import inspect_heads

        notes = inspect_heads(model, toks, n_null=20).notes
        assert any(n.startswith("Explain one score is not available") and setting in n for n in notes)
        assert any(n.startswith("No positional/symbolic score") and setting in n for n in notes)


@pytest.mark.skipif(backend.TL_MAJOR < 4, reason="posinterp's own attention runs only on TL 4")
def test_posinterp_attention_refuses_a_soft_cap_it_would_drop():
    """posinterp's TL 4 attention has no soft-cap: building it from a config with one is
    refused (it ran uncapped on main, unlike the same weights on TL 3.9)."""
    with pytest.raises(ValueError, match="attn_scores_soft_cap=2 is not supported"):
        rotary_model(attn_scores_soft_cap=CAP)


# --- bidirectional masks ----------------------------------------------------------------------

def test_bidirectional_llama_refused_by_name_before_the_hf_check(tmp_path, monkeypatch):
    """A Llama folder with is_causal=False runs bidirectionally in transformers; TL builds it
    causal. The refusal names the setting and the way out, before HF's model is read (on main:
    "log-probabilities differ from HF's by 1.76e-01 nats", after the parity check)."""
    from posinterp import load_model
    from posinterp.models.hf_config import UnsupportedConfigError
    from posinterp.models.parity import hf_parity
    from posinterp.models.sources import hf_folder

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, is_causal=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)

    def reached(*args, **kwargs):
        raise AssertionError("the HF comparison ran before the refusal")
    monkeypatch.setattr(hf_folder, "_hf_expected", reached)
    for load in (load_model, hf_parity):
        with pytest.raises(UnsupportedConfigError,
                           match=r"is_causal=False runs with a bidirectional attention mask.*remove "
                                 r"'is_causal' from config.json"):
            load(tmp_path)


# --- half precision ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def half_folders(tmp_path_factory):
    """Tiny GPT-2 and Llama (GQA) folders with sharpened attention (tests.helpers)."""
    from tests.helpers import save_tiny_checkpoint

    out = {}
    for name, arch, cfg in (
            ("gpt2", "GPT2LMHeadModel", transformers.GPT2Config(
                n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=97)),
            ("llama", "LlamaForCausalLM", transformers.LlamaConfig(
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                intermediate_size=64, max_position_embeddings=64, vocab_size=97))):
        folder = tmp_path_factory.mktemp(name)
        save_tiny_checkpoint(arch, cfg, folder, sharpen=4.0)
        out[name] = folder
    return out


# unit roundoff u of each dtype (half the spacing of numbers in [1, 2))
ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _half_results(model, toks):
    from posinterp.analysis import positional_symbolic_score, previous_token_scores, score_parts
    from posinterp.dashboard import inspect_heads

    out = {"previous_token": previous_token_scores(model, toks).value.to_numpy()}
    parts = score_parts(model, toks[0], check_tol=0.05)
    out["score_total"] = parts[parts.metric == "score_total"].value.to_numpy()
    table = inspect_heads(model, toks, explain_values=0).table
    out["inspect_kernel"] = table[table.metric == "kernel_attention"].value.to_numpy()
    if backend.positional_type(model) == "rotary":
        ps = positional_symbolic_score(model, toks)
        out["positional_residual"] = ps[ps.metric == "positional_residual"].value.to_numpy()
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("how", ["load", "to"])
def test_half_precision_analyses_match_float32(arch, dtype, how, half_folders):
    """inspect_heads, previous_token_scores, score_parts and the positional/symbolic score run
    on a bf16/fp16 model (loaded in that dtype, or a float32 load moved with model.to) and agree
    with the float32 model. On main TL 3.9 raised "mat1 and mat2 must have the same dtype"
    (the hook probe upcast the weights but TL 3.9's folded norms cast back to cfg.dtype).

    Tolerance: 10 u, with u the dtype's unit roundoff (2^-8 bf16, 2^-11 fp16). The half model
    rounds each weight once and each activation after every operation to relative error <= u;
    a score passes about five rounded steps per layer (embedding sum, norm, q and k
    projections, dot product) through two layers, so it carries a relative error of about
    10 u (compared relative to max(1, |score|)), and softmax, whose Jacobian has entries of
    magnitude <= 1, moves probabilities (previous-token scores, kernels) and the positional
    residual by no more in absolute terms. Measured on both lines: at most 1.6 u (bf16 and
    fp16 GPT-2 score totals), 0.1 u on probabilities."""
    from posinterp import load_model

    folder = half_folders[arch]
    ref_model, _ = load_model(folder, device="cpu")
    if how == "load":
        model, _ = load_model(folder, device="cpu", dtype=dtype)
    else:
        model, _ = load_model(folder, device="cpu")
        model = model.to(dtype)
    assert next(model.parameters()).dtype == dtype
    toks = torch.randint(4, 97, (3, 12), generator=torch.Generator().manual_seed(2))
    want, got = _half_results(ref_model, toks), _half_results(model, toks)
    tol = 10 * ROUNDOFF[dtype]
    assert want.keys() == got.keys()
    for name in want:
        w, g = torch.as_tensor(want[name]), torch.as_tensor(got[name])
        assert w.shape == g.shape, name
        scale = w.abs().clamp_min(1.0) if name == "score_total" else 1.0
        assert bool(((w - g).abs() / scale).max() <= tol), (name, float((w - g).abs().max()))


# --- multi-head latent attention ----------------------------------------------------------------

@pytest.fixture(scope="module")
def mla_folder(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA: q_lora_rank 16, kv_lora_rank 8, nope 8 + rope 4 dims, v 8),
    its decompression weights scaled so the attention is not near uniform."""
    folder = tmp_path_factory.mktemp("deepseek-v3")
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=16,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=64, n_group=1, topk_group=1)
    hf = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "q_b_proj" in name or "kv_b_proj" in name:
                p.mul_(10.0)
    hf.save_pretrained(folder)
    return folder


MLA_NAMED = r"multi-head latent attention \(MLA.*kv_lora_rank=8.*qk_rope_head_dim=4"


def test_mla_detected_from_configs():
    """One detector (backend.mla_settings) for HF configs, config.json dicts and models; a
    standard attention config has none."""
    ds = transformers.DeepseekV2Config(q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                                       qk_nope_head_dim=8, v_head_dim=8)
    got = backend.mla_settings(ds)
    assert got["kv_lora_rank"] == 8 and got["q_lora_rank"] is None and got["qk_rope_head_dim"] == 4
    assert backend.mla_settings(ds.to_dict())["qk_nope_head_dim"] == 8
    assert backend.mla_settings(transformers.LlamaConfig()) is None
    assert backend.mla_settings(transformers.LlamaConfig().to_dict()) is None


def test_mla_load_and_weights_only_refused_by_name(mla_folder, monkeypatch):
    """load_model and weights-only spectra name MLA and its config fields, before any weight is
    read (on main: "architecture 'DeepseekV3ForCausalLM' has no known positional scheme" and
    "weights-only spectra support [...]; load the whole model instead")."""
    from posinterp import load_model
    from posinterp.models.qk_only import read_qk_weights
    from posinterp.models.sources import hf_folder

    def reached(*args, **kwargs):
        raise AssertionError("weights were read before the refusal")
    monkeypatch.setattr(hf_folder, "_hf_expected", reached)
    with pytest.raises(ValueError, match=MLA_NAMED):
        load_model(mla_folder)
    with pytest.raises(ValueError, match=MLA_NAMED):
        read_qk_weights(mla_folder)


def test_mla_bridge_qk_analyses_refused_pattern_analyses_exact(mla_folder):
    """On a TransformerBridge a user boots over a DeepSeek-V3 folder, every analysis that
    reads W_Q/W_K, q/k hooks or a RoPE layout raises a ValueError naming MLA and its fields
    (on main: TL's NotImplementedError, or shape errors from inside posinterp); the
    previous-token score, which reads the pattern only, equals HF's own eager attention."""
    import posinterp.analysis as A
    import posinterp.dashboard as pi_dashboard
    from posinterp.interventions.constraints import constrain_qk
    from posinterp.interventions.head_ablation import head_ablation_losses

    model = _boot(mla_folder)
    toks = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    refused = {
        "qk_spectrum": lambda: A.qk_spectrum(model),
        "spectral_measures": lambda: A.spectral_measures(model),
        "qk_geometry": lambda: A.qk_geometry(model),
        "rope_frequency_profile": lambda: A.rope_frequency_profile(model),
        "score_parts": lambda: A.score_parts(model, toks[0]),
        "positional_symbolic_score": lambda: A.positional_symbolic_score(model, toks),
        "inspect_heads": lambda: pi_dashboard.inspect_heads(model, toks),
        "symmetric": lambda: intervene(model, QKIntervention("symmetric", 0)).__enter__(),
        "remove_complex": lambda: intervene(model, QKIntervention("remove_complex", 0)).__enter__(),
        "zero_head": lambda: head_ablation_losses(model, toks, None, [(0, 0, "zero_head")]),
        "constrain_qk": lambda: constrain_qk(model, "symmetric"),
    }
    for _name, call in refused.items():
        with pytest.raises(ValueError, match=MLA_NAMED):
            call()
    hf = transformers.AutoModelForCausalLM.from_pretrained(mla_folder, attn_implementation="eager")
    with torch.no_grad():
        attn = hf.eval()(toks, output_attentions=True).attentions
    df = A.previous_token_scores(model, toks)
    for layer in range(2):
        want = attn[layer].double().diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, 2))
        got = torch.tensor(df[df.layer == layer].sort_values("head").value.to_numpy())
        assert torch.allclose(got, want, atol=1e-5), (layer, got, want)
