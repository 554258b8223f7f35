"""GGUF files: SmolLM2-135M (a real Q4_1 checkpoint) against transformers' own reading of it,
and the refusals (truncated file, unsupported architecture, missing gguf package) on tiny files
written with the gguf package's own writer."""

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from posinterp.models import load_model
from posinterp.models.pretrained import HALF_TOL_FACTOR

SMOL = (Path(__file__).resolve().parents[2].parent / "shared" / "models"
        / "SmolLM2-135M-Instruct.Q4_1.gguf")
needs_smol = pytest.mark.skipif(
    not SMOL.is_file(), reason=f"{SMOL} not present (the shared test models are only on the "
    "developers' machines)")
PROMPT = "Once upon a time, there was a little girl named Lily. One day, she"


# gguf_cache and smol (the loaded model, read-only) are tests/conftest.py's session fixtures:
# one load for every module that reads SmolLM2.


@pytest.fixture(scope="module")
def reference():
    """transformers' own model and tokenizer, read from the same file (independent of posinterp)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(SMOL.parent), gguf_file=SMOL.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name)
    return hf, tok


@needs_smol
def test_info_records_the_file_and_its_quantization(smol):
    model, info = smol
    assert info.source == "gguf" and info.pe == "rotary" and info.architecture == "LlamaForCausalLM"
    assert (model.cfg.n_layers, info.n_heads, info.n_kv_heads, info.d_head) == (30, 9, 3, 64)
    assert info.rotary_base == 100000.0 and info.rotary_adjacent_pairs is False
    w = info.weights
    assert w["path"] == str(SMOL.resolve()) and w["format"] == "gguf" and w["dequantized"] is True
    assert w["file_type"] == "MOSTLY_Q4_1" and w["tensor_types"]["Q4_1"] > 0
    assert w["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@needs_smol
def test_greedy_continuation_and_log_probs_match_transformers(smol, reference):
    model, _ = smol
    hf, tok = reference
    prompt = tok(PROMPT, return_tensors="pt")["input_ids"]
    # The tokenizer came with the model: it tokenizes text exactly as transformers' does
    # (TransformerLens may make it prepend a BOS; that is its convention, not the text).
    plain = dict(add_special_tokens=False)
    assert model.tokenizer(PROMPT, **plain)["input_ids"] == tok(PROMPT, **plain)["input_ids"]
    n_new = 16
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=n_new, do_sample=False)[0].tolist()
        toks = prompt
        for _ in range(len(want) - prompt.shape[1]):
            toks = torch.cat([toks, model(toks)[:, -1].argmax(-1, keepdim=True)], 1)
        assert toks[0].tolist() == want
        got = model(toks).double().log_softmax(-1)
        ref = hf(toks).logits.double().log_softmax(-1)
        exact = copy.deepcopy(hf).double()(toks).logits.log_softmax(-1)
    # Both float32 runs stray from the exact (float64) function; over 30 layers HF's own
    # rounding can pass 1e-4 nats, so the bound is the loader's (docs/models.md, step 8).
    rounding = (ref - exact).abs().max().item()
    assert (got - ref).abs().max() <= max(1e-4, HALF_TOL_FACTOR * rounding)
    assert len(tok.decode(want[prompt.shape[1]:]).split()) >= 5  # fluent text, not pads


@needs_smol
def test_converted_folder_is_reused(smol, gguf_cache, monkeypatch):
    from posinterp.models.sources import gguf as g

    _, info = smol
    monkeypatch.setattr(g, "_convert", lambda *a: pytest.fail("converted again"))
    folder, meta = g.gguf_folder(SMOL, gguf_cache / "gguf")
    assert str(folder) == info.weights["folder"] and meta["sha256"] == info.weights["sha256"]
    assert (folder / "tokenizer.json").is_file() and (folder / "model.safetensors").is_file()


@needs_smol
def test_text_input_uses_the_files_tokenizer(smol, reference):
    from posinterp.experiments.inspect import text_batch

    model, _ = smol
    _, tok = reference
    text = f"{PROMPT}\n\nThe sun was warm and the birds sang in the tall trees."
    tokens, mask, _ = text_batch(model, text)
    special = set(tok.all_special_ids)
    real = [t for t, m in zip(tokens[0].tolist(), mask[0].tolist(), strict=True) if m and t not in special]
    assert real == tok(PROMPT, add_special_tokens=False)["input_ids"]


@needs_smol
def test_tokenize_texts_is_the_files_tokenizer_not_tls_bos_copy(smol, reference):
    """Issue 39 item 6: the getting-started recipe ``model.tokenizer(texts)`` gave one token
    more than ``inspect --text`` on this file. ``pi.tokenize_texts`` is the CLI's
    tokenization and equals transformers' own tokenizer of the file (its defaults)."""
    import posinterp as pi
    from posinterp.experiments.inspect import text_batch

    model, _ = smol
    _, tok = reference
    texts = [PROMPT, "The sun was warm and the birds sang in the tall trees."]
    tokens, mask = pi.tokenize_texts(model, texts)
    cli_tokens, cli_mask, _ = text_batch(model, "\n\n".join(texts))
    assert torch.equal(tokens, cli_tokens) and torch.equal(mask, cli_mask)
    for row, text in enumerate(texts):
        assert tokens[row][mask[row].bool()].tolist() == tok(text)["input_ids"]
    # what the old recipe did: TransformerLens's copy prepends a BOS the file's tokenizer does not
    forced = model.tokenizer(PROMPT)["input_ids"]
    assert len(forced) == int(mask[0].sum()) + 1 and forced[1:] == tok(PROMPT)["input_ids"]


# --- refusals, on tiny files written with gguf's own writer (no shared file needed) ----------

def _tiny_gguf(path: Path, arch: str) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones((64,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_llama_gguf(path: Path, drop: str | None = None) -> Path:
    """A complete 2-layer llama GGUF (f32, grouped-query, a toy tokenizer), less ``drop``."""
    gguf = pytest.importorskip("gguf")
    V, D, F, L, H, KV = 32, 16, 32, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(L)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(D // H)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([1] * V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(L):
        shapes |= {f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.ffn_norm.weight": (D,),
                   f"blk.{i}.attn_q.weight": (D, D), f"blk.{i}.attn_k.weight": (D * KV // H, D),
                   f"blk.{i}.attn_v.weight": (D * KV // H, D),
                   f"blk.{i}.attn_output.weight": (D, D), f"blk.{i}.ffn_gate.weight": (F, D),
                   f"blk.{i}.ffn_up.weight": (F, D), f"blk.{i}.ffn_down.weight": (D, F)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name != drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_file_missing_a_tensor_is_refused(tmp_path, monkeypatch):
    """transformers fills a tensor the GGUF file lacks with random values; the converted
    folder would then look complete. The conversion refuses it by name and caches nothing;
    the same file with the tensor loads."""
    from posinterp.models.pretrained import IncompleteCheckpointError

    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    broken = _tiny_llama_gguf(tmp_path / "broken.gguf", drop="blk.1.attn_k.weight")
    with pytest.raises(IncompleteCheckpointError, match=r"broken\.gguf.*layers\.1\.self_attn\.k_proj"):
        load_model(broken, device="cpu")
    cached = tmp_path / "home" / "gguf"
    assert not cached.exists() or not any(p.glob("config.json") for p in cached.iterdir())
    model, info = load_model(_tiny_llama_gguf(tmp_path / "whole.gguf"), device="cpu")
    assert info.source == "gguf" and model.cfg.n_layers == 2


def test_a_gguf_load_emits_no_future_warning(tmp_path, monkeypatch):
    """As an HF folder's load (tests/models/test_pretrained.py): no FutureWarning from
    posinterp's own KV-cache probe (issue 39)."""
    from tests.helpers import future_warnings_of

    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    assert future_warnings_of(lambda: load_model(path, device="cpu")) == []


def test_truncated_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path / "home"))
    whole = _tiny_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    for keep in (len(whole) - 40, 200, 40):  # inside the last tensor, the first, the header
        bad = tmp_path / f"cut{keep}.gguf"
        bad.write_bytes(whole[:keep])
        with pytest.raises(ValueError, match=r"cut\d+\.gguf.*(truncated|corrupt)"):
            load_model(bad, device="cpu")
    assert not (tmp_path / "home" / "gguf").exists() or not any((tmp_path / "home" / "gguf").iterdir())


def test_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="model.gguf is not a GGUF file"):
        load_model(bad, device="cpu")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_model(tmp_path / "absent.gguf", device="cpu")


def test_unsupported_architecture_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path / "home"))
    path = _tiny_gguf(tmp_path / "odd.gguf", "posinterp-test-arch")
    with pytest.raises(ValueError, match="architecture 'posinterp-test-arch' is not supported"):
        load_model(path, device="cpu")


def test_missing_gguf_package_names_the_extra(tmp_path, monkeypatch, capsys):
    from posinterp.cli import main

    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    hint = r'pip install "gguf>=0.10" \(in a clone of posinterp: pip install "\.\[gguf\]"\)'
    with pytest.raises(ImportError, match=hint):
        load_model(path, device="cpu")
    assert main(["inspect", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert 'pip install "gguf>=0.10"' in err and 'pip install ".[gguf]"' in err


@needs_smol
def test_weights_only_spectrum_equals_the_full_load(smol):
    from posinterp.analysis import qk_spectrum
    from posinterp.models.qk_only import read_qk_weights

    model, _ = smol
    qk = read_qk_weights(SMOL)  # q/k/attn_norm tensors only, from the GGUF memory map
    assert qk.source["format"] == "gguf" and qk.source["bytes"] < SMOL.stat().st_size / 5
    layers = [0, 29]
    full, alone = qk_spectrum(model, layers=layers), qk_spectrum(qk, layers=layers)
    m = full.merge(alone, on=["layer", "head", "offset", "rank"], suffixes=("_full", "_weights"))
    assert len(m) == len(full) == len(alone) == 2 * 9 * 64 * 2
    scale = full["abs"].max()
    for c in ("real", "imag"):
        assert np.allclose(m[f"{c}_full"], m[f"{c}_weights"], rtol=1e-5, atol=1e-5 * scale), c
