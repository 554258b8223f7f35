"""Offline loading of tiny HF checkpoints built on the fly, checked against HF itself."""

import pytest
import torch

from posinterp.models import ARCHITECTURE_SCHEMES, load_model, scheme_for_architecture
from posinterp.models.backend import attn_scale, positional_type  # noqa: F401
from tests.helpers import HF_VOCAB as VOCAB
from tests.helpers import tiny_hf_configs

transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    for name, cfg in tiny_hf_configs().items():
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        hf.save_pretrained(root / name)
        out[name] = (root / name, hf)
    return out


EXPECTED = {"gpt2-absolute": ("absolute", None, 4), "neox-rotary-pct-0.25": ("rotary", 2, 4),
            "llama-gqa": ("rotary", 8, 2), "bloom-12-heads": ("alibi", None, 12)}


def _hf_logits(name, hf, toks, mask=None):
    kw = {}
    if mask is not None:
        kw["attention_mask"] = mask
        if not name.startswith("bloom"):
            # HF GPT-2 (and friends) do not derive positions from the mask (docs/models.md).
            kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf(toks, **kw).logits


@pytest.mark.parametrize("name", list(EXPECTED))
def test_logits_match_hf_unpadded_and_left_padded(checkpoints, no_network, name):
    folder, hf = checkpoints[name]
    # Raw weights (no folding/centering) so logits, not just log-probs, are comparable.
    model, info = load_model(folder, fold_ln=False, center_writing_weights=False,
                             center_unembed=False, fold_value_biases=False)
    assert (info.pe, info.rotary_dim, info.n_kv_heads) == EXPECTED[name]
    assert info.source == "local-hf" and info.processing["fold_ln"] is False
    gen = torch.Generator().manual_seed(1)
    toks = torch.randint(0, VOCAB, (3, 12), generator=gen)
    with torch.no_grad():
        got = model(toks)
    assert (got - _hf_logits(name, hf, toks)).abs().max() < 1e-4
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    with torch.no_grad():
        got = model(toks, attention_mask=mask)
    diff = (got - _hf_logits(name, hf, toks, mask)).abs()[mask.bool()]
    assert diff.max() < 1e-4


@pytest.mark.parametrize("name", ["gpt2-absolute", "bloom-12-heads"])
def test_default_processing_preserves_log_probs(checkpoints, no_network, name):
    folder, hf = checkpoints[name]
    model, info = load_model(folder)
    assert info.processing == dict(fold_ln=True, center_writing_weights=True,
                                   center_unembed=True, fold_value_biases=True)
    toks = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(toks).log_softmax(-1)
    assert (got - _hf_logits(name, hf, toks).log_softmax(-1)).abs().max() < 1e-4


def test_bloom_slopes_are_hf_not_tl(checkpoints, no_network):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    model, info = load_model(checkpoints["bloom-12-heads"][0])
    hf = build_alibi_tensor(torch.ones(1, 3), 12, torch.float32)[:, 0, 1]
    torch.testing.assert_close(torch.tensor(info.alibi_slopes, dtype=torch.float32), hf)


def test_missing_and_corrupt_local_checkpoints(tmp_path, checkpoints, no_network):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder or file: .*does-not-exist"):
        load_model(tmp_path / "does-not-exist")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(bad)
    (bad / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(FileNotFoundError, match="has no weights"):
        load_model(bad)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    truncated = tmp_path / "trunc"
    src = checkpoints["gpt2-absolute"][0]
    truncated.mkdir()
    (truncated / "config.json").write_bytes((src / "config.json").read_bytes())
    (truncated / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:500])
    with pytest.raises(ValueError, match="could not read the weights"):
        load_model(truncated)
    after = sorted(p.name for p in tmp_path.rglob("*"))
    assert set(after) - set(before) == {"trunc", "config.json", "model.safetensors"} - set(before)


def test_scheme_registry():
    assert scheme_for_architecture("GPT2LMHeadModel") == "absolute"
    assert scheme_for_architecture("GPTNeoXForCausalLM") == "rotary"
    assert scheme_for_architecture("BloomForCausalLM") == "alibi"
    assert set(ARCHITECTURE_SCHEMES.values()) <= {"absolute", "rotary", "alibi"}
    with pytest.raises(ValueError, match="no known positional scheme"):
        scheme_for_architecture("MambaForCausalLM")


def test_hub_names_are_delegated_to_transformerlens(monkeypatch):
    """No network here: check the thin delegation with stand-ins for the hub calls."""
    from transformer_lens import HookedTransformer

    from tests.helpers import tiny_model

    calls = {}

    def fake_from_pretrained(name, **kwargs):
        calls[name] = kwargs
        m = tiny_model("alibi", n_heads=6, d_model=36)
        m.cfg.original_architecture = "BloomForCausalLM"
        return m

    config = transformers.BloomConfig(n_layer=2, n_head=6, hidden_size=48)  # d_head 8, as the stand-in
    config.architectures = ["BloomForCausalLM"]
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", staticmethod(lambda name, **kw: config))
    monkeypatch.setattr(HookedTransformer, "from_pretrained", staticmethod(fake_from_pretrained))
    model, info = load_model("bigscience/bloom-560m", fold_ln=False)
    assert calls["bigscience/bloom-560m"]["fold_ln"] is False
    assert info.source == "hub" and info.pe == "alibi" and len(info.alibi_slopes) == 6
    # the stand-in already had posinterp's ALiBi: loading must not add the bias twice
    toks = torch.randint(4, model.cfg.d_vocab, (1, 5))
    _, cache = model.run_with_cache(toks)
    q, k = cache["blocks.0.attn.hook_q"][0], cache["blocks.0.attn.hook_k"][0]
    content = torch.einsum("ihd,jhd->hij", q, k) / attn_scale(model)
    pos = torch.arange(5)
    bias = torch.tensor(info.alibi_slopes)[:, None, None] * (pos[None, :] - pos[:, None])
    scores = cache["blocks.0.attn.hook_attn_scores"][0]
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(scores[:, causal], (content + bias.float())[:, causal])


SITES = ("hook_pattern", "hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out",
         "hook_resid_post", "hook_normalized_resid_post")


def test_minilm_encoder_matches_hf_offline(no_network):
    """all-MiniLM-L6-v2 on either line: attention patterns, the residual stream at every
    hook posinterp reads (TL 3.9 ``HookedEncoder`` meanings, which on TL 4 backend.run_cached
    maps to the bridge's hooks) and the effective QK weights' norm, against HF to 1e-5."""
    from posinterp.models.backend import attention_input_norm_module, run_cached
    from posinterp.models.encoder import minilm_path

    try:
        folder = minilm_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    model, info = load_model("all-MiniLM-L6-v2")
    assert info.causal is False and info.pe == "absolute" and info.n_heads == 12
    assert info.processing["mlm_head"] == "random (seeded)"
    hf = transformers.BertModel.from_pretrained(str(folder), local_files_only=True,
                                                attn_implementation="eager").eval()
    enc = model.tokenizer(["the cat sat on the mat", "hello"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf(**enc, output_attentions=True, output_hidden_states=True)
        cache = run_cached(model, enc["input_ids"], enc["attention_mask"],
                           lambda n: n.split(".")[-1] in SITES)
    real = enc["attention_mask"].bool()
    L = model.cfg.n_layers
    for layer in range(L):
        p = f"blocks.{layer}."
        diff = cache[p + "attn.hook_pattern"] - out.attentions[layer]
        assert diff.abs().max() < 1e-5
        # HookedEncoder's meanings: resid_pre is the block input, resid_mid = resid_pre +
        # attn_out (before ln1), resid_post = ln1(resid_mid) + mlp_out (before ln2),
        # normalized_resid_post the block output
        assert (cache[p + "hook_resid_pre"] - out.hidden_states[layer])[real].abs().max() < 1e-5
        mid = cache[p + "hook_resid_pre"] + cache[p + "hook_attn_out"]
        assert (cache[p + "hook_resid_mid"] - mid)[real].abs().max() < 1e-5
        ln1 = hf.encoder.layer[layer].attention.output.LayerNorm
        post = ln1(cache[p + "hook_resid_mid"]) + cache[p + "hook_mlp_out"]
        assert (cache[p + "hook_resid_post"] - post)[real].abs().max() < 1e-5
        hf_out = out.hidden_states[layer + 1]
        assert (cache[p + "hook_normalized_resid_post"] - hf_out)[real].abs().max() < 1e-5
        ln2 = hf.encoder.layer[layer].output.LayerNorm
        assert (ln2(cache[p + "hook_resid_post"]) - hf_out)[real].abs().max() < 1e-5
    # the attention of layer l reads the norm HF applies last before it
    norm, where = attention_input_norm_module(model, 1)
    assert where == "blocks.0.ln2"
    torch.testing.assert_close(norm.w.detach(), hf.encoder.layer[0].output.LayerNorm.weight.detach())
    norm0, _ = attention_input_norm_module(model, 0)
    torch.testing.assert_close(norm0.w.detach(), hf.embeddings.LayerNorm.weight.detach())


def test_empty_spec():
    with pytest.raises(ValueError, match="empty string"):
        load_model("")
