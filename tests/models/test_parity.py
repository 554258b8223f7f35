"""Every architecture posinterp lists loads at HF parity, or its setting is refused by name.

The cases (tests/helpers.parity_cases) carry non-default RoPE/ALiBi/head settings; each is
checked unpadded, left- and right-padded and with a gap inside the mask, at 8, 64 and 512
tokens (ALiBi also past its n_ctx), against HF transformers itself.
"""

import json

import pytest
import torch

from posinterp.models import ARCHITECTURE_SCHEMES, backend, load_model
from posinterp.models.hf_config import UnsupportedConfigError
from posinterp.models.parity import hf_parity
from tests.helpers import parity_cases, save_tiny_checkpoint

CASES = parity_cases()
TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    built = {}

    def get(name):
        if name not in built:
            architecture, make_config, _ = CASES[name]
            save_tiny_checkpoint(architecture, make_config(), root / name)
            built[name] = root / name
        return built[name]
    return get


def test_every_listed_architecture_has_a_parity_case():
    covered = {arch for arch, _, refusal in CASES.values() if refusal is None}
    assert set(ARCHITECTURE_SCHEMES) == covered


def _unhonoured(name) -> list[str]:
    """Settings of case ``name`` that this TransformerLens line ignores when it runs the
    model (TL 4.3's bridge: GPT-2's scale_attn_weights), which the load must refuse."""
    architecture, make_config, _ = CASES[name]
    config = make_config()
    return [attr for attr, assumed, _ in backend.unhonoured_settings(architecture)
            if getattr(config, attr, assumed) != assumed]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is None])
def test_parity_with_hf(folders, name, no_network):
    """HF parity, or, for a setting this TL line cannot run, a refusal naming it."""
    unhonoured = _unhonoured(name)
    if unhonoured:
        with pytest.raises(UnsupportedConfigError, match=f"{unhonoured[0]}=.*not supported on "
                                                         "TransformerLens"):
            load_model(folders(name))
        return
    table = hf_parity(folders(name), lengths=(8, 64, 512))
    assert len(table) == 12
    worst = table.loc[table.value.idxmax()]
    assert worst.value <= TOL, f"{name}: {worst.to_dict()}"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is not None])
def test_unsupported_settings_are_refused_by_name(folders, name, no_network):
    with pytest.raises(UnsupportedConfigError, match=CASES[name][2]):
        load_model(folders(name))


def test_neox_reads_base_and_partial_rotary(folders, no_network):
    """Case 1 of issue 11: TL's NeoX converter ran at base 10000 whatever the config said."""
    _, info = load_model(folders("neox-pct-0.25-base-5e5"))
    assert info.rotary_base == 500000.0 and info.rotary_dim == 4 and info.d_head == 16
    assert info.rope_parameters["partial_rotary_factor"] == 0.25


def test_llama_explicit_head_dim(folders, no_network):
    _, info = load_model(folders("llama-head-dim-16"))
    assert (info.d_head, info.n_heads, info.n_kv_heads, info.rotary_dim) == (16, 4, 2, 16)


def test_gpt2_config_without_n_ctx(folders, no_network):
    """transformers 5.x writes GPT-2 configs without n_ctx; n_positions is the length."""
    folder = folders("gpt2")
    assert "n_ctx" not in json.loads((folder / "config.json").read_text())
    model, _ = load_model(folder)
    assert model.cfg.n_ctx == json.loads((folder / "config.json").read_text())["n_positions"]


def test_alibi_past_n_ctx_keeps_hf_slopes(folders, no_network):
    """BLOOM has no length limit; TL's cap (2048) must not switch the slopes."""
    folder = folders("bloom-12-heads")
    model, _ = load_model(folder)
    n = model.cfg.n_ctx + 52
    table = hf_parity(folder, lengths=(n,), paddings=("none", "gap"))
    assert table.value.max() <= TOL, table.to_dict("records")


def test_unlisted_architecture_is_refused(tmp_path, no_network):
    import transformers

    cfg = transformers.GemmaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   hidden_size=16, head_dim=8, intermediate_size=32, vocab_size=50)
    transformers.GemmaForCausalLM(cfg).save_pretrained(tmp_path / "gemma")
    with pytest.raises(ValueError, match="GemmaForCausalLM.*no known positional scheme"):
        load_model(tmp_path / "gemma")


def test_processing_records_what_tl_did(folders, no_network):
    """TL centres writing weights only for LayerNorm models; RMSNorm models skip it."""
    model, info = load_model(folders("llama-gqa"), center_writing_weights=True)
    assert info.processing["center_writing_weights"] is False
    assert info.processing["fold_ln"] is True
    W_out = model.blocks[0].mlp.W_out.detach()
    assert W_out.mean(-1).abs().max() > 1e-4  # really not centred
    model, info = load_model(folders("gpt2"), center_writing_weights=True)
    assert info.processing["center_writing_weights"] is True
    assert model.blocks[0].mlp.W_out.detach().mean(-1).abs().max() < 1e-6


def test_rotary_input_past_n_ctx_is_refused_or_matches_hf(folders, no_network):
    """Past n_ctx a RoPE model is never silently wrong: TL 3.9 keeps cos/sin tables of
    n_ctx rows and refuses longer inputs by name; a TL 4 bridge runs HF's rotary
    embedding, which computes any position (backend.position_limit says which), and must
    then match HF there."""
    folder = folders("llama-gqa")
    model, _ = load_model(folder)
    n = model.cfg.n_ctx + 8
    if backend.position_limit(model) is not None:
        with pytest.raises(ValueError, match="longer than this RoPE model's n_ctx"):
            model(torch.zeros(1, n, dtype=torch.long))
        with pytest.raises(ValueError, match="past this model's n_ctx"):
            hf_parity(folder, lengths=(n,))
        return
    table = hf_parity(folder, lengths=(n,), paddings=("none", "left"))
    assert table.value.max() <= TOL, table.to_dict("records")


def test_spectra_rotate_with_the_frequencies_the_model_uses(folders, no_network):
    """M(Δ) for a loaded NeoX (base 5e5, partial rotary) uses base 5e5, not TL's 1e4:
    checked against R built from the config's own numbers, and against the scores."""
    from posinterp.analysis.spectral import qk_weights, rotary_matrix

    model, info = load_model(folders("neox-pct-0.25-base-5e5"), fold_ln=False,
                             center_writing_weights=False)
    inv = 1.0 / 500000.0 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    R = rotary_matrix(info.d_head, info.rotary_dim, 1.0, inv_freq=inv)
    W_Q, W_K1 = qk_weights(model, 0, offset=-1, weights="stored")  # raw load: stored matrices
    torch.testing.assert_close(W_K1, model.blocks[0].attn.W_K.detach().double() @ R.T)
    # the model's own rotated keys at position 1 are k R(1), read from the hooks the
    # backend verified (TL 3.9: hook_rot_k; TL 4.3's bridged NeoX never fires it, so
    # hook_k rotated with the hook_cos/hook_sin tables of the call)
    toks = torch.randint(0, 97, (1, 3))
    names = backend.content_qk_hooks(model, 0)
    _, cache = model.run_with_cache(toks, names_filter=lambda x: x in names + ("blocks.0.attn.hook_k",))
    _, k_rot = backend.content_qk_from(names, cache, model.cfg.n_heads)
    k = cache["blocks.0.attn.hook_k"][0, 1].double()
    torch.testing.assert_close(k_rot[0, 1], k @ R, rtol=1e-5, atol=1e-5)


def test_default_lengths_fit_the_model_and_longer_ones_are_refused(tmp_path, no_network):
    import transformers

    from tests.helpers import HF_VOCAB

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=40, vocab_size=HF_VOCAB)
    save_tiny_checkpoint("GPT2LMHeadModel", cfg, tmp_path / "short")
    table = hf_parity(tmp_path / "short", paddings=("none",))
    assert sorted(table.length) == [8] and table.value.max() <= TOL
    with pytest.raises(ValueError, match=r"lengths \[64\] are past this model's n_ctx=40"):
        hf_parity(tmp_path / "short", lengths=(8, 64))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2] is None and "bert" not in n])
def test_residual_hooks_mean_what_analyses_read(folders, name, no_network):
    """The residual hooks analyses read keep TL 3.9's meanings on every listed decoder, on
    both lines (never trusted by name): resid_mid = resid_pre + attn_out, resid_post =
    resid_mid + mlp_out (parallel attention: resid_pre + attn_out + mlp_out, and no
    resid_mid), and each block's resid_post is the next block's resid_pre."""
    from posinterp.models.backend import run_cached
    from tests.helpers import random_tokens

    if _unhonoured(name):  # refused on this line (test_parity_with_hf checks the refusal)
        with pytest.raises(UnsupportedConfigError):
            load_model(folders(name))
        return
    model, _ = load_model(folders(name))
    sites = ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
    cache = run_cached(model, random_tokens(model, 2, 8, seed=1), None,
                       lambda n: n.startswith("blocks.") and n.endswith(sites))
    cache = {k: cache[k].double() for k in cache.keys()}
    for layer in range(model.cfg.n_layers):
        p = f"blocks.{layer}."
        pre, attn, mlp, post = (cache[p + s] for s in ("hook_resid_pre", "hook_attn_out",
                                                        "hook_mlp_out", "hook_resid_post"))
        if p + "hook_resid_mid" in cache:
            assert (pre + attn - cache[p + "hook_resid_mid"]).abs().max() < TOL
            assert (cache[p + "hook_resid_mid"] + mlp - post).abs().max() < TOL
        else:
            assert getattr(model.cfg, "parallel_attn_mlp", False) or name.startswith("neox")
        assert (pre + attn + mlp - post).abs().max() < TOL
        if layer + 1 < model.cfg.n_layers:
            assert torch.equal(cache[p + "hook_resid_post"], cache[f"blocks.{layer + 1}.hook_resid_pre"])
