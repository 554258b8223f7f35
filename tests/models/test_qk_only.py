"""Weights-only QK spectra (read_qk_weights): the same numbers as the fully loaded model."""

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.analysis import qk_spectrum, spectral_measures
from posinterp.models import load_model
from posinterp.models.qk_only import read_qk_weights
from tests.helpers import parity_cases, save_tiny_checkpoint

CASES = ("llama-gqa", "llama3-scaling", "qwen2")


def _checkpoint(name, folder, **save_kw):
    arch, make, _ = parity_cases()[name]
    model = save_tiny_checkpoint(arch, make(), folder)
    with torch.no_grad():  # non-trivial norm gains, so folding them matters
        gen = torch.Generator().manual_seed(1)
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(0.5 + torch.rand(layer.input_layernorm.weight.shape,
                                                                generator=gen))
    model.save_pretrained(folder, **save_kw)
    return model


def _same(a: pd.DataFrame, b: pd.DataFrame, key, cols, rtol=1e-6):
    assert len(a) == len(b) > 0
    m = a.merge(b, on=key, suffixes=("_full", "_weights"))
    assert len(m) == len(a)
    for c in cols:
        x, y = m[f"{c}_full"].to_numpy(float), m[f"{c}_weights"].to_numpy(float)
        assert np.allclose(x, y, rtol=rtol, atol=rtol * np.abs(x).max()), c


@pytest.mark.parametrize("name", CASES)
def test_weights_only_spectrum_equals_full_load(name, tmp_path):
    folder = tmp_path / name
    _checkpoint(name, folder)
    model, _ = load_model(folder, device="cpu")
    qk = read_qk_weights(folder)
    assert qk.source["tensors"] == 3 * model.cfg.n_layers
    key = ["layer", "head", "offset", "rank"]
    _same(qk_spectrum(model), qk_spectrum(qk), key, ["real", "imag", "abs"])
    _same(spectral_measures(model), spectral_measures(qk), ["layer", "head", "offset", "metric"],
          ["value"])


def test_sharded_checkpoint_is_read_through_its_index(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    _checkpoint("llama-gqa", one)
    _checkpoint("llama-gqa", many, max_shard_size="20KB")
    # the first save's single file (unit gains) would win over the index, as in HF's loader
    (many / "model.safetensors").unlink()
    assert (many / "model.safetensors.index.json").is_file()
    a, b = qk_spectrum(read_qk_weights(one)), qk_spectrum(read_qk_weights(many))
    pd.testing.assert_frame_equal(a, b)


def test_other_architectures_are_refused_by_name(tmp_path):
    arch, make, _ = parity_cases()["bert"]
    save_tiny_checkpoint(arch, make(), tmp_path / "g")
    with pytest.raises(ValueError, match="BertModel"):
        read_qk_weights(tmp_path / "g")
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        read_qk_weights(tmp_path / "absent")


def test_cli_weights_only_writes_the_same_spectrum(tmp_path, capsys):
    import json

    from posinterp.cli import main

    folder = tmp_path / "llama-gqa"
    _checkpoint("llama-gqa", folder)
    out = tmp_path / "out"
    assert main(["spectrum", str(folder), "--weights-only", "--out", str(out), "--no-progress"]) == 0
    got = pd.read_csv(out / "spectrum.csv")
    want = qk_spectrum(load_model(folder, device="cpu")[0])
    _same(want, got.astype({"offset": "Int64"}), ["layer", "head", "offset", "rank"], ["real", "imag"])
    heads = pd.read_csv(out / "heads.csv")
    assert {"rotational_mass", "rotational_mass_null_percentile"} <= set(heads.columns)
    assert "previous_token_score" not in heads.columns
    assert json.loads((out / "run.json").read_text())["weights_only"] is True
    assert main(["spectrum", str(folder), "--weights-only", "--dynamics", "--out",
                 str(tmp_path / "o2")]) == 2
    assert "--weights-only reads no activations" in capsys.readouterr().err


def test_weights_only_tables_equal_the_public_functions(tmp_path):
    """run_weights_only solves each head once for both tables: its spectrum and measures
    are exactly qk_spectrum's and spectral_measures' (offset 0 for RoPE)."""
    from posinterp.experiments.spectrum import run_weights_only

    folder = tmp_path / "llama-gqa"
    _checkpoint("llama-gqa", folder)
    qk = read_qk_weights(folder)
    heads = run_weights_only([str(folder)], tmp_path / "out", progress=False)
    spec = pd.read_csv(tmp_path / "out" / "spectrum.csv")
    want = qk_spectrum(qk)
    np.testing.assert_array_equal(spec[["real", "imag", "abs"]].to_numpy(),
                                  want[["real", "imag", "abs"]].to_numpy())
    meas = spectral_measures(qk, offset=0)
    for metric in ("rotational_mass", "phase", "antisymmetric_energy"):
        got = heads.sort_values(["layer", "head"])[metric].to_numpy()
        ref = meas[meas.metric == metric].sort_values(["layer", "head"])["value"].to_numpy()
        np.testing.assert_array_equal(got, ref)


# --- every layout against the HF module's own q/k (issue 36 item 3) ---------------------

def _layout_configs():
    import transformers as T

    small = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=64,
                 max_position_embeddings=64)
    return {
        "gpt2-c_attn": ("GPT2LMHeadModel", T.GPT2Config(n_layer=2, n_head=4, n_embd=32,
                                                        vocab_size=64, n_positions=64)),
        "neox-partial-rotary": ("GPTNeoXForCausalLM", T.GPTNeoXConfig(
            **small, num_attention_heads=4, rotary_pct=0.5)),
        "bloom": ("BloomForCausalLM", T.BloomConfig(n_layer=2, n_head=4, hidden_size=32,
                                                    vocab_size=64)),
        "falcon-per-head": ("FalconForCausalLM", T.FalconConfig(
            num_hidden_layers=2, num_attention_heads=4, hidden_size=32, vocab_size=64,
            new_decoder_architecture=False, multi_query=False, bias=True)),
        "falcon-multi-query": ("FalconForCausalLM", T.FalconConfig(
            num_hidden_layers=2, num_attention_heads=4, hidden_size=32, vocab_size=64,
            new_decoder_architecture=False, multi_query=True)),
        "falcon-new-arch-gqa": ("FalconForCausalLM", T.FalconConfig(
            num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, hidden_size=32,
            vocab_size=64, new_decoder_architecture=True)),
        "falcon-alibi": ("FalconForCausalLM", T.FalconConfig(
            num_hidden_layers=2, num_attention_heads=4, hidden_size=32, vocab_size=64,
            new_decoder_architecture=False, multi_query=False, alibi=True)),
        "phi-partial-rotary-gqa": ("PhiForCausalLM", T.PhiConfig(
            **small, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5)),
        "gptj-rotary-dim-4": ("GPTJForCausalLM", T.GPTJConfig(n_layer=2, n_head=4, n_embd=32,
                                                              rotary_dim=4, vocab_size=64)),
        "gpt-neo": ("GPTNeoForCausalLM", T.GPTNeoConfig(
            num_layers=2, num_heads=4, hidden_size=32, vocab_size=64,
            attention_types=[[["global", "local"], 1]], window_size=8)),
        "opt": ("OPTForCausalLM", T.OPTConfig(num_hidden_layers=2, num_attention_heads=4,
                                              hidden_size=32, ffn_dim=64, word_embed_proj_dim=32,
                                              vocab_size=64)),
        "qwen2-biases": ("Qwen2ForCausalLM", T.Qwen2Config(
            **small, num_attention_heads=4, num_key_value_heads=2)),
        "llama-mqa": ("LlamaForCausalLM", T.LlamaConfig(
            **small, num_attention_heads=4, num_key_value_heads=1)),
    }


def _hf_qk(model, architecture, x_ids):
    """Per layer ``(x, q, k)``: the attention module's input ``[b, d_model]`` and the q, k
    ``[b, heads, d_head]`` HF's own code forms from it at position 0 (where RoPE is the
    identity): through the attention function for models that call one, else the
    module's own head split (BLOOM ``_reshape``, Falcon ``_split_heads``, GPT-Neo's
    projections and ``_split_heads``)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    got, handles = {}, []
    layers = [m for m in model.modules() if type(m).__name__.endswith(("Attention", "SelfAttention"))
              and not type(m).__name__.startswith("GPTNeoAttention")]

    def pre(i):
        def hook(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            got.setdefault(i, {})["x"] = x[:, 0].detach().clone()
        return hook

    for i, m in enumerate(layers):
        handles.append(m.register_forward_pre_hook(pre(i), with_kwargs=True))

    def capture(module, query, key, value, attention_mask, **kw):
        # OPT multiplies q by 1/sqrt(d_head) before the call (and passes scaling=1): the
        # score's scale, not part of W_Q
        q = query / module.scaling if kw.get("scaling") == 1.0 else query
        got[layers.index(module)].update(q=q[:, :, 0].clone(), k=key[:, :, 0].clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    # transformers 5.25's Falcon calls the attention function (its _split_heads is gone);
    # earlier releases split the fused rows in the module
    own_split = architecture == "BloomForCausalLM" or (
        architecture == "FalconForCausalLM" and hasattr(layers[0], "_split_heads"))
    if own_split:
        for i, m in enumerate(layers):
            split = m._reshape if architecture == "BloomForCausalLM" else m._split_heads

            def fused(mod, inp, out, i=i, split=split):
                q, k, _ = split(out)
                if architecture == "BloomForCausalLM":  # [b, heads, s, d_head]
                    q, k = q[:, :, 0], k[:, :, 0]
                else:  # [b, s, heads, d_head]
                    q, k = q[:, 0], k[:, 0]
                got[i].update(q=q.clone(), k=k.clone())
            handles.append(m.query_key_value.register_forward_hook(fused))
    elif architecture == "GPTNeoForCausalLM":
        for i, m in enumerate(layers):
            def proj(name, i=i, m=m):
                def hook(mod, inp, out):
                    got[i][name] = m._split_heads(out, m.num_heads, m.head_dim)[:, :, 0].clone()
                return hook
            handles.append(m.q_proj.register_forward_hook(proj("q")))
            handles.append(m.k_proj.register_forward_hook(proj("k")))
    else:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register("posinterp_capture", capture)
        # the masks sdpa takes (Falcon's ALiBi is added onto that mask)
        AttentionMaskInterface.register("posinterp_capture", sdpa_mask)
        model.set_attn_implementation("posinterp_capture")
    try:
        with torch.no_grad():
            model(input_ids=x_ids)
    finally:
        for h in handles:
            h.remove()
    return [got[i] for i in range(len(layers))]


@pytest.mark.parametrize("name", sorted(_layout_configs()))
def test_every_layout_reads_the_q_k_hf_forms(name, tmp_path):
    """read_qk_weights' stored W_Q, W_K (per head, K expanded over its query heads) map the
    attention input to exactly the q, k HF's own module forms: (x_i - x_0) W_Q[h] equals
    q_i - q_0 (biases cancel) for every head of every layer, in float64."""
    from tests.helpers import set_norm_gains

    arch, config = _layout_configs()[name]
    model = save_tiny_checkpoint(arch, config, tmp_path / name)
    set_norm_gains(model)
    model.save_pretrained(tmp_path / name)
    qk = read_qk_weights(tmp_path / name)
    assert qk.architecture == arch and qk.n_layers == 2
    model = model.double().eval()
    ids = torch.arange(40).reshape(40, 1) % 64
    per_layer = _hf_qk(model, arch, ids)
    assert len(per_layer) == qk.n_layers
    for layer, got in enumerate(per_layer):
        dx = got["x"] - got["x"][:1]
        for kind, W in (("q", qk.W_Q[layer]), ("k", qk.W_K[layer])):
            hf = got[kind]  # [b, heads, d_head]
            hf = hf.repeat_interleave(qk.n_heads // hf.shape[1], dim=1)
            want = hf - hf[:1]
            pred = torch.einsum("bd,hde->bhe", dx, W)
            torch.testing.assert_close(pred, want, rtol=1e-9, atol=1e-9,
                                       msg=f"{name} layer {layer} {kind}")
        # the gain read is the norm's own weight (the one whose output attention reads)
        assert qk.gain[layer].shape == (qk.d_model,)


def test_layout_facts_follow_the_config(tmp_path):
    """Scheme, partial rotary, pair layout and LayerNorm centring per architecture."""
    want = {"gpt2-c_attn": ("absolute", None, None, True),
            "bloom": ("alibi", None, None, True),
            "falcon-alibi": ("alibi", None, None, True),
            "falcon-per-head": ("rotary", 8, False, True),
            "neox-partial-rotary": ("rotary", 4, False, True),
            "phi-partial-rotary-gqa": ("rotary", 4, False, True),
            "gptj-rotary-dim-4": ("rotary", 4, True, True),
            "qwen2-biases": ("rotary", 8, False, False)}
    for name, facts in want.items():
        arch, config = _layout_configs()[name]
        save_tiny_checkpoint(arch, config, tmp_path / name)
        qk = read_qk_weights(tmp_path / name)
        assert (qk.pe, qk.rotary_dim, qk.adjacent_pairs, qk.center) == facts, name


def test_settings_a_layout_cannot_honour_are_refused_by_name(tmp_path):
    import transformers as T

    opt = T.OPTConfig(num_hidden_layers=1, num_attention_heads=4, hidden_size=32, ffn_dim=64,
                      word_embed_proj_dim=32, vocab_size=64, do_layer_norm_before=False)
    save_tiny_checkpoint("OPTForCausalLM", opt, tmp_path / "opt")
    with pytest.raises(ValueError, match="do_layer_norm_before=False"):
        read_qk_weights(tmp_path / "opt")
    phi = T.PhiConfig(num_hidden_layers=1, num_attention_heads=4, hidden_size=32,
                      intermediate_size=64, vocab_size=64, qk_layernorm=True)
    save_tiny_checkpoint("PhiForCausalLM", phi, tmp_path / "phi")
    with pytest.raises(ValueError, match="qk_layernorm=True"):
        read_qk_weights(tmp_path / "phi")


@pytest.mark.parametrize("name", ["gpt2", "neox-linear-scaling", "bloom-12-heads",
                                  "gptj-rotary-dim-4", "opt", "gptneo-local"])
def test_fused_and_other_layouts_equal_the_full_load(name, tmp_path):
    """Where posinterp also loads the model whole, the weights-only spectrum and measures
    are the loaded model's (norm gains folded, LayerNorm centred)."""
    from tests.helpers import set_norm_gains

    arch, make, _ = parity_cases()[name]
    model = save_tiny_checkpoint(arch, make(), tmp_path / name)
    set_norm_gains(model)
    model.save_pretrained(tmp_path / name)
    full, _ = load_model(tmp_path / name, device="cpu")
    qk = read_qk_weights(tmp_path / name)
    key = ["layer", "head", "offset", "rank"]
    _same(qk_spectrum(full), qk_spectrum(qk), key, ["real", "imag", "abs"])
    _same(spectral_measures(full), spectral_measures(qk), ["layer", "head", "offset", "metric"],
          ["value"])
