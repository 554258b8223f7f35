"""Offline loading of tiny HF checkpoints built on the fly, checked against HF itself."""

import pytest
import torch

from posinterp.models import ARCHITECTURE_SCHEMES, load_model, scheme_for_architecture
from posinterp.models.backend import attn_scale, positional_type  # noqa: F401
from tests.helpers import HF_VOCAB as VOCAB
from tests.helpers import future_warnings_of, tiny_hf_configs

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


# --- incomplete, sharded and half-precision checkpoints (issue 22 items 3, 8, 9, 12) ----------

def _gpt2(**kw):
    return transformers.GPT2Config(**{**dict(n_layer=2, n_head=4, n_embd=32, n_positions=64,
                                             vocab_size=VOCAB), **kw})


def _llama(**kw):
    return transformers.LlamaConfig(**{**dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
        intermediate_size=64, max_position_embeddings=64, vocab_size=VOCAB), **kw})


def _saved(folder, config, seed=0):
    """A random checkpoint with non-unit norm gains (so fold_ln is not a no-op)."""
    from tests.helpers import set_norm_gains

    torch.manual_seed(seed)
    model = set_norm_gains(transformers.AutoModelForCausalLM.from_config(config).eval())
    model.save_pretrained(folder)
    return model


def _log_probs(model, toks):
    with torch.no_grad():
        out = model(toks)
    return getattr(out, "logits", out).double().log_softmax(-1)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_checkpoints_load_and_record_every_file(tmp_path, no_network, fmt):
    from tests.helpers import save_sharded

    hf = _saved(tmp_path / "single", _gpt2())
    weight_map = save_sharded(hf, tmp_path / "sharded", fmt)
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 2 and all(s.endswith(f".{fmt}") for s in shards)
    model, info = load_model(tmp_path / "sharded")
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    assert info.weights["files"] == [index, *shards]
    single, _ = load_model(tmp_path / "single")
    toks = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_log_probs(model, toks), _log_probs(single, toks), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_a_checkpoint_missing_a_weight_is_refused_naming_it(tmp_path, no_network, fmt):
    """An interrupted download: one tensor gone from one shard. HF would fill it with random
    values, and the HF check, loading the same broken folder, could not see it."""
    import json

    from safetensors.torch import load_file, save_file

    from posinterp.models.pretrained import IncompleteCheckpointError
    from tests.helpers import save_sharded

    hf = _saved(tmp_path / "x", _llama())
    weight_map = save_sharded(hf, tmp_path / "broken", fmt)
    key = "model.layers.1.mlp.down_proj.weight"
    shard = tmp_path / "broken" / weight_map[key]
    state = load_file(shard) if fmt == "safetensors" else torch.load(shard, weights_only=True)
    del state[key]
    save_file(state, shard) if fmt == "safetensors" else torch.save(state, shard)
    with pytest.raises(IncompleteCheckpointError, match=key.replace(".", r"\.")):
        load_model(tmp_path / "broken")
    # A shard the index names but the folder lacks is named too.
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(tmp_path / "broken")
    index = next((tmp_path / "broken").glob("*.index.json"))
    json.loads(index.read_text())  # still a valid index: the refusal is about the shard


def test_single_file_missing_a_weight_is_refused(tmp_path, no_network):
    from safetensors.torch import load_file, save_file

    from posinterp.models.pretrained import IncompleteCheckpointError

    _saved(tmp_path / "g", _gpt2())
    state = load_file(tmp_path / "g" / "model.safetensors")
    del state["transformer.h.0.attn.c_attn.weight"]
    save_file(state, tmp_path / "g" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(IncompleteCheckpointError, match=r"transformer\.h\.0\.attn\.c_attn\.weight"):
        load_model(tmp_path / "g")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_half_precision_loads_within_hf_own_rounding(tmp_path, no_network, dtype, config):
    """bf16/fp16 loads (default processing) are compared with HF in the same dtype, with a
    tolerance of 4x HF's own half-vs-float32 difference; checked here on other tokens."""
    from posinterp.models.pretrained import HALF_TOL_FACTOR

    _saved(tmp_path / "m", config())
    model, info = load_model(tmp_path / "m", dtype=dtype)
    check = info.hf_check
    assert next(model.parameters()).dtype == dtype and check["dtype"] == str(dtype)[6:]
    assert check["tolerance"] == max(1e-4, HALF_TOL_FACTOR * check["hf_half_vs_float32"])
    assert check["max_abs_logprob_diff"] <= check["tolerance"]
    assert info.processing["fold_ln"] is True and "processing_reverted" not in check
    toks = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m",
                                                             attn_implementation="eager").eval()
    want32 = _log_probs(hf32, toks)
    want = _log_probs(hf32.to(dtype), toks)
    noise = (want - want32).abs().max().item()
    assert (_log_probs(model, toks) - want).abs().max().item() <= HALF_TOL_FACTOR * noise


def _skew_logits(monkeypatch, factor: float) -> None:
    """Make every HF-folder build (either TL line's builder) return logits ``factor`` x the
    true ones: a model that is not the checkpoint's, for the refusal tests."""
    from posinterp.models.sources import hf_folder

    for name in ("_bridge_builder", "_tl3_builder"):
        original = getattr(hf_folder, name)

        def skewed(*args, original=original):
            build = original(*args)

            def run(processing, dtype):
                model, extra = build(processing, dtype)
                model.register_forward_hook(lambda module, inputs, out: out * factor)
                return model, extra
            return run
        monkeypatch.setattr(hf_folder, name, skewed)


def test_half_precision_check_still_refuses_a_wrong_model(tmp_path, no_network, monkeypatch):
    """The scaled tolerance is not a blanket pass: a model off by more is refused, and the
    message says precision or config can explain it and how to tell them apart."""
    from posinterp.models.hf_config import UnsupportedConfigError

    _saved(tmp_path / "m", _gpt2())
    _skew_logits(monkeypatch, 1.5)  # a setting not honoured
    off = dict(fold_ln=False, center_writing_weights=False, center_unembed=False,
               fold_value_biases=False)
    with pytest.raises(UnsupportedConfigError, match="precision or a config setting.*float32"):
        load_model(tmp_path / "m", dtype=torch.bfloat16, **off)
    with pytest.raises(UnsupportedConfigError, match="with and without weight processing"):
        load_model(tmp_path / "m", dtype=torch.bfloat16)


@pytest.mark.parametrize("config", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_float32_tolerance_scales_with_hf_own_float32_rounding(tmp_path, no_network, monkeypatch,
                                                               config):
    """A deep float32 model can round by more than the 1e-4 floor (SmolLM2-135M: 1.25e-4
    nats between HF's own float32 and float64 runs), so past the floor the tolerance is
    HALF_TOL_FACTOR x HF's float32-vs-float64 difference. With the floor pushed below any
    float32 rounding, every load takes that path: the recorded rounding must be HF's own
    (computed here independently) and the load within that tolerance, processed, unwarned."""
    import warnings

    from posinterp.models.sources import hf_folder

    monkeypatch.setattr(hf_folder, "PROCESSING_TOL", 1e-12)
    _saved(tmp_path / "m", config())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model, info = load_model(tmp_path / "m")
    check = info.hf_check
    toks = hf_folder._probe_tokens(VOCAB, 64)
    hf32, hf64 = (transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "m", dtype=dtype, attn_implementation="eager").eval()
        for dtype in (torch.float32, torch.float64))
    with torch.no_grad():
        rounding = (_log_probs(hf64, toks) - _log_probs(hf32, toks)).abs().max().item()
    assert 0 < check["hf_float32_vs_float64"] == pytest.approx(rounding, rel=1e-6)
    assert check["tolerance"] == hf_folder.HALF_TOL_FACTOR * check["hf_float32_vs_float64"]
    assert check["max_abs_logprob_diff"] <= check["tolerance"]
    assert info.processing["fold_ln"] is True and "processing_reverted" not in check


def test_float32_rounding_tolerance_still_refuses_a_wrong_model(tmp_path, no_network, monkeypatch):
    """The rounding-scaled float32 tolerance is no blanket pass: logits 1.0001x HF's are
    refused, the message naming HF's own rounding."""
    from posinterp.models.hf_config import UnsupportedConfigError
    from posinterp.models.sources import hf_folder

    monkeypatch.setattr(hf_folder, "PROCESSING_TOL", 1e-12)
    _saved(tmp_path / "m", _llama())
    _skew_logits(monkeypatch, 1.0001)
    with pytest.raises(UnsupportedConfigError,
                       match="float32-vs-float64 difference.*with and without weight processing"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("config", [lambda: _gpt2(n_inner=32), lambda: _llama(intermediate_size=32)],
                         ids=["gpt2-n-inner-eq-n-embd", "llama-intermediate-eq-hidden"])
def test_square_mlp_loads_exactly_processing_reverted_where_tl_gets_it_wrong(tmp_path, no_network,
                                                                              config):
    """TL's fold_ln picks the MLP's orientation from its shape, so d_mlp == d_model folds
    along the wrong axis (TL 3.9: GPT-2 and Llama; TL 4.3: GPT-2). The load is exact either
    way: processed where TL processes correctly, else unprocessed, warned and recorded."""
    import warnings

    hf = _saved(tmp_path / "sq", config())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = load_model(tmp_path / "sq")
    reverted = "processing_reverted" in info.hf_check
    assert reverted == any("weight processing" in str(w.message) for w in caught)
    assert info.processing["fold_ln"] is (not reverted)
    if reverted:
        assert not any(info.processing.values())
    toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    diff = (_log_probs(model, toks) - _log_probs(hf, toks)).abs().max().item()
    assert diff <= 1e-4


def test_processing_record_follows_what_tl_did_and_spectra_agree(tmp_path, no_network, monkeypatch):
    """TL 4 skips fold_ln with only a warning for adapters with supports_fold_ln = False;
    ModelInfo.processing must say so, and the effective W_Q, W_K of spectra are the same
    matrices whether the gains were folded or not (tiny OPT, non-unit LayerNorms)."""
    from posinterp.analysis.spectral import qk_weights
    from posinterp.models.backend import TL_MAJOR
    from tests.helpers import _opt

    _saved(tmp_path / "opt", _opt(max_position_embeddings=64))
    folded, info_f = load_model(tmp_path / "opt", fold_ln=True)
    raw, info_r = load_model(tmp_path / "opt", fold_ln=False)
    assert info_f.processing["fold_ln"] is True and info_r.processing["fold_ln"] is False
    eff = [qk_weights(m, 1) for m in (folded, raw)]
    for a, b in zip(*eff, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if TL_MAJOR >= 4:
        from transformer_lens.model_bridge.supported_architectures.opt import OptArchitectureAdapter

        monkeypatch.setattr(OptArchitectureAdapter, "supports_fold_ln", False, raising=False)
        with pytest.warns(UserWarning, match="does not support fold_ln"):
            skipped, info_s = load_model(tmp_path / "opt", fold_ln=True)
        assert info_s.processing["fold_ln"] is False  # asked True; TL did not fold
        ln1 = skipped.blocks[1].ln1
        gain = getattr(ln1, "w", None)
        assert gain is not None and (gain - 1).abs().max() > 0.1  # really unfolded
        for a, b in zip(qk_weights(skipped, 1), eff[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("architecture", ["BertModel", "BertForMaskedLM"])
def test_bert_folder_missing_an_encoder_weight_is_refused(tmp_path, no_network, architecture):
    """A BERT folder may lack its pre-training heads (seeded and recorded) but not a weight
    of the encoder itself: HF would fill it with random values and every hook would carry
    numbers of a model nobody trained. A folder lacking only its pooler still loads."""
    from safetensors.torch import load_file, save_file

    from posinterp.models.pretrained import IncompleteCheckpointError
    from tests.helpers import _bert

    torch.manual_seed(0)
    cls = getattr(transformers, architecture)
    cls(_bert(architectures=[architecture])).save_pretrained(tmp_path / "full")
    full = load_file(tmp_path / "full" / "model.safetensors")
    prefix = "bert." if architecture == "BertForMaskedLM" else ""
    key = f"{prefix}encoder.layer.1.attention.self.key.weight"
    assert key in full
    for name, drop in [("broken", key), ("no_pooler", f"{prefix}pooler.dense.weight")]:
        folder = tmp_path / name
        cls(_bert(architectures=[architecture])).save_pretrained(folder)
        save_file({k: v for k, v in full.items() if k != drop}, folder / "model.safetensors",
                  metadata={"format": "pt"})
    with pytest.raises(IncompleteCheckpointError, match=r"encoder\.layer\.1\.attention\.self\.key"):
        load_model(tmp_path / "broken")
    load_model(tmp_path / "no_pooler")


def test_a_tokenizer_without_a_bos_gives_none_on_both_lines(tmp_path, no_network):
    """TL 4's bridge gives BERT's tokenizer the stand-in BOS '<|endoftext|>', which BERT's
    vocabulary maps to [UNK]; TL 3.9 leaves it None. posinterp reads None on both, so
    random and sampled inputs do not start with [UNK] on one line only."""
    import transformers

    from posinterp.analysis.heads import random_tokens as head_random_tokens
    from posinterp.models import load_model
    from posinterp.models.backend import bos_token_id
    from tests.helpers import _bert

    folder = tmp_path / "bert"
    transformers.BertForMaskedLM(_bert(architectures=["BertForMaskedLM"])).save_pretrained(folder)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(folder)
    model, _ = load_model(str(folder), device="cpu")
    assert model.tokenizer is not None
    assert bos_token_id(model) is None
    with pytest.raises(ValueError, match="bos_token_id"):
        head_random_tokens(model, 2, 8, bos=True)


def test_bos_token_id_reads_a_real_bos_and_refuses_unknown_stand_ins():
    from types import SimpleNamespace

    from posinterp.models.backend import bos_token_id

    assert bos_token_id(SimpleNamespace(tokenizer=SimpleNamespace(bos_token_id=5, unk_token_id=1))) == 5
    assert bos_token_id(SimpleNamespace(tokenizer=SimpleNamespace(bos_token_id=1, unk_token_id=1))) is None
    assert bos_token_id(SimpleNamespace(tokenizer=None)) is None
    assert bos_token_id(SimpleNamespace()) is None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_load_emits_no_future_warning(checkpoints, name, no_network):
    """A load prints no FutureWarning of posinterp's own making: the KV-cache probe run at
    load (backend.guard_kv_cache) passed the cache as ``past_key_values``, which
    transformers 5.x deprecates, so every HF and GGUF load printed that warning (issue 39)."""
    folder, _ = checkpoints[name]
    assert future_warnings_of(lambda: load_model(folder)) == []
