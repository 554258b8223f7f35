"""QK circuits of qk-norm heads (Qwen3; TL 3.9's ``use_qk_norm``; OLMo-2's norm over all heads).

The reference never comes from posinterp: W_Q diag(γ_q) and W_K diag(γ_k) are read off the
model's own q/k norm modules (HF's ``Qwen3RMSNorm``, TL 3.9's ``RMSNorm``) by feeding them the
projections of basis vectors and undoing the per-token scale, and RoPE is applied with the
model's own rotary code. Eigenvalues are compared as multisets, relative to max |λ|.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import transformers

import posinterp as pi
from posinterp.analysis.spectral import qk_convention
from posinterp.models.backend import TL_MAJOR, MissingFeatureError
from posinterp.models.qk_only import read_qk_weights
from tests.helpers import HF_VOCAB, set_norm_gains

N_HEADS, N_KV, D_HEAD, D_MODEL = 4, 2, 16, 32


def _qwen3_config():
    # non-default: GQA 4 over 2, head_dim 16 != hidden/heads = 8, rope_theta 12345.5
    return transformers.Qwen3Config(
        num_hidden_layers=2, num_attention_heads=N_HEADS, num_key_value_heads=N_KV,
        hidden_size=D_MODEL, head_dim=D_HEAD, intermediate_size=64, max_position_embeddings=64,
        vocab_size=HF_VOCAB, rope_theta=12345.5)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3 folder whose norm gains (input, q and k norms) are not 1, and its HF model."""
    folder = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(_qwen3_config()).eval()
    set_norm_gains(hf)  # q_norm/k_norm gains 1 + U(0, 0.5): each pair's two gains differ
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 2 and any(s in name for s in ("q_proj", "k_proj")):
                p.mul_(20.0)
    hf.save_pretrained(folder)
    return folder, hf.double()


def _multiset_error(got: np.ndarray, want: np.ndarray) -> float:
    """max over want of the distance to the nearest got, relative to max |want|."""
    return float(max(np.abs(got - w).min() for w in want) / np.abs(want).max())


def _spectrum_of(df: pd.DataFrame, layer: int, head: int, offset) -> np.ndarray:
    sel = (df["layer"] == layer) & (df["head"] == head)
    sel &= df["offset"].isna() if offset is None else (df["offset"] == offset)
    rows = df[sel.fillna(False).astype(bool)]
    return rows["real"].to_numpy() + 1j * rows["imag"].to_numpy()


def _hf_effective(hf, layer: int):
    """W_Q diag(γ_q), W_K diag(γ_k) as HF's modules compute them, on the normalized residual
    (the input norm's gain applied): ``[heads, d_model, d_head]``, K per KV head."""
    layer_mod = hf.model.layers[layer]
    at = layer_mod.self_attn
    x = torch.diag(layer_mod.input_layernorm.weight.double())  # rows g_i e_i
    out = []
    for proj, norm, n in ((at.q_proj, at.q_norm, N_HEADS), (at.k_proj, at.k_norm, N_KV)):
        with torch.no_grad():
            raw = proj(x).reshape(D_MODEL, n, D_HEAD)
            normed = norm(raw).double()
        scale = (raw.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
        out.append((normed * scale).permute(1, 0, 2))
    return out


def _hf_rotated(hf, W, pos: int):
    """Rows of ``W`` (``[heads, d_model, d_head]``) rotated as HF rotates a query at ``pos``."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    cos, sin = hf.model.rotary_emb(W.new_zeros(1, 1, D_MODEL), torch.tensor([[pos]]))
    rotated, _ = apply_rotary_pos_emb(W[None], W[None], cos.double(), sin.double(), unsqueeze_dim=1)
    return rotated[0]


def _hf_reference(hf, layer: int, head: int, offset: int) -> np.ndarray:
    Q, K = _hf_effective(hf, layer)
    i = 7
    Qr, Kr = _hf_rotated(hf, Q, i), _hf_rotated(hf, K, i + offset)
    B = Kr[head // (N_HEADS // N_KV)].T @ Qr[head]  # key offset Δ = j - i
    return np.linalg.eigvals(B.numpy())


# HF's RMSNorm computes in float32 whatever the model's dtype, so the reference W diag(γ)
# carries float32 rounding (~6e-8 per entry; 4e-7 of max |λ| seen after forming B): 1e-6.
HF_TOL = 1e-6


@pytest.mark.parametrize("weights_only", [False, True])
def test_qwen3_spectra_equal_hf_normed_qk(qwen3, weights_only, no_network):
    """qk_spectrum of a Qwen3 model, fully loaded or weights-only, at Δ = 0 and Δ = -1, is
    the spectrum of HF's own normed (and rotated) q/k form."""
    folder, hf = qwen3
    source = read_qk_weights(folder) if weights_only else pi.load_model(str(folder))[0]
    df = pi.qk_spectrum(source)
    for layer in range(2):
        for head in range(N_HEADS):
            for offset in (0, -1):
                want = _hf_reference(hf, layer, head, offset)
                got = _spectrum_of(df, layer, head, offset)
                assert _multiset_error(got, want) < HF_TOL, (layer, head, offset)


def test_qwen3_spectra_without_the_gains_differ(qwen3, no_network):
    """The control that can fail: the same comparison with the q/k-norm gains left out (what
    posinterp computed before) is far outside the tolerance, so the test above sees them."""
    folder, hf = qwen3
    model, _ = pi.load_model(str(folder))
    df = pi.qk_spectrum(model, weights="stored", layers=0, offset=0)
    errors = [_multiset_error(_spectrum_of(df, 0, h, 0), _hf_reference(hf, 0, h, 0))
              for h in range(N_HEADS)]
    assert min(errors) > 100 * HF_TOL


def test_qwen3_frequency_profile_equals_hf_pair_energies(qwen3, no_network):
    """rope_frequency_profile's "qk" shares are ||Q_p R_p(-Δθ_p) K_p^T||_F² over their sum,
    with Q = W_Q diag(γ_q), K = W_K diag(γ_k) from HF's modules and R from HF's rotation."""
    folder, hf = qwen3
    model, _ = pi.load_model(str(folder))
    prof = pi.rope_frequency_profile(model, layers=1, offsets=(0, -1))
    Q, K = _hf_effective(hf, 1)
    half = D_HEAD // 2
    for offset in (0, -1):
        Kr = _hf_rotated(hf, K, offset)  # keys at j = Δ, queries at 0: M(Δ) = Q R(-Δ) K^T
        for head in range(N_HEADS):
            q, k = Q[head].numpy(), Kr[head // (N_HEADS // N_KV)].numpy()
            energy = np.array([np.linalg.norm(q[:, [p, p + half]] @ k[:, [p, p + half]].T) ** 2
                               for p in range(half)])
            rows = prof[(prof["metric"] == "qk") & (prof["offset"] == offset) & (prof["head"] == head)]
            got = rows.sort_values("pair")["value"].to_numpy()
            np.testing.assert_allclose(got, energy / energy.sum(), rtol=0, atol=HF_TOL)


def test_qwen3_convention_is_recorded(qwen3, no_network):
    folder, _ = qwen3
    model, info = pi.load_model(str(folder))
    assert "diag(γ_q)" in qk_convention(model)["qk_norm"]
    plain = pi.build_model(pi.preset("tiny", pe="rotary"))
    assert qk_convention(plain)["qk_norm"] == "none"


def test_qwen3_channel_features_refuse_naming_qk_norm(qwen3, no_network):
    """Features that edit q before RoPE have no hook on qk-norm models: refused by name."""
    from posinterp.interventions import constrain_qk

    folder, _ = qwen3
    model, _ = pi.load_model(str(folder))
    tokens = torch.randint(4, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(MissingFeatureError, match="qk-norm"):
        pi.score_parts(model, tokens)
    with pytest.raises(MissingFeatureError, match="qk-norm"):
        constrain_qk(model, "ban_complex")


# --- TL 3.9's own qk-norm models: float64, so the reference is exact --------------------------

needs_tl3 = pytest.mark.skipif(TL_MAJOR >= 4, reason="TL 4 has no HookedTransformerConfig with "
                               "use_qk_norm; the Qwen3 bridge tests above cover TL 4")


def _tl3_model(**cfg):
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    base = dict(n_layers=1, d_model=D_MODEL, n_heads=N_HEADS, d_head=8, n_ctx=32, d_vocab=50,
                act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
                rotary_dim=8, dtype=torch.float64, seed=0)
    model = HookedTransformer(HookedTransformerConfig(**{**base, **cfg}))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w"):  # ln1 and the q/k norms
                p.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype))
    return model


def _tl3_reference(model, offset: int) -> list[np.ndarray]:
    """Per head: eig of K'^T Q' from TL's own norm modules and TL's own rotary."""
    attn = model.blocks[0].attn
    H, dh, D = model.cfg.n_heads, model.cfg.d_head, model.cfg.d_model
    x = torch.diag(model.blocks[0].ln1.w.detach())  # rows g_i e_i: the normalized residual
    out = []
    with torch.no_grad():
        for W, norm in ((attn.W_Q, attn.q_norm), (attn.W_K, attn.k_norm)):
            raw = torch.einsum("nd,hde->nhe", x, W)  # [d_model, head, d_head]
            if norm.w.numel() == dh:
                normed = attn._apply_qk_norm(raw[None], norm)[0]
                scale = (raw.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
            else:  # OLMo-2: one norm over all heads' entries
                normed = norm(raw.reshape(D, H * dh)).reshape(D, H, dh)
                scale = (raw.reshape(D, -1).pow(2).mean(-1) + norm.eps).sqrt()[:, None, None]
            out.append(normed * scale)
        i = 5
        q = attn.apply_rotary(out[0][:, None].expand(D, i + 1, H, dh).contiguous())[:, i]
        k = attn.apply_rotary(out[1][:, None].expand(D, i + 1, H, dh).contiguous())[:, i + offset]
    return [np.linalg.eigvals((k[:, h].T @ q[:, h]).numpy()) for h in range(H)]


@needs_tl3
@pytest.mark.parametrize("arch", [None, "Olmo2ForCausalLM"])
def test_tl39_qk_norm_spectra_equal_tl_modules(arch):
    """TL 3.9 ``use_qk_norm`` (per head) and its OLMo-2 layout (one norm over all heads)."""
    cfg = {"use_qk_norm": True} if arch is None else {"original_architecture": arch}
    model = _tl3_model(**cfg)
    df = pi.qk_spectrum(model)
    for offset in (0, -1):
        for head, want in enumerate(_tl3_reference(model, offset)):
            assert _multiset_error(_spectrum_of(df, 0, head, offset), want) < 1e-10


def test_a_q_norm_that_is_not_rms_is_refused():
    """A LayerNorm over q centres it: no diagonal gain can stand for it, so it is refused."""
    model = pi.build_model(pi.preset("tiny", pe="rotary"))
    attn = model.blocks[0].attn
    d_head = model.cfg.d_head
    attn.q_norm, attn.k_norm = torch.nn.LayerNorm(d_head), torch.nn.LayerNorm(d_head)
    with pytest.raises(MissingFeatureError, match="q_norm.*not an RMSNorm"):
        pi.qk_spectrum(model)


def test_qwen3_with_qk_norm_gains_at_hf_parity(qwen3, no_network):
    """The parity cases keep HF's unit gains, which a loader that dropped the q/k norms would
    also match; this checkpoint's gains are not 1 (padding on either side and a mask gap)."""
    from posinterp.models.parity import hf_parity

    folder, _ = qwen3
    table = hf_parity(folder, lengths=(8, 60))
    assert len(table) == 8 and table["value"].max() <= 1e-5


def test_qwen3_symmetrization_is_half_the_sum_of_its_content_scores(qwen3, no_network):
    """Content-symmetric symmetrization reads the normed, rotated q/k (hook_rot_q/k, verified
    against the pattern on the loaded model): its scores are (c_ij + c_ji)/2."""
    from posinterp.interventions import QKIntervention
    from posinterp.models.backend import attn_scale, rotated_qk_hooks
    from tests.interventions.test_qk import _hooked_scores

    folder, _ = qwen3
    model, _ = pi.load_model(str(folder))
    toks = torch.randint(4, 90, (1, 7), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(toks)
    q_name, k_name = rotated_qk_hooks(model, 1)
    q = cache[q_name].double()
    k = torch.repeat_interleave(cache[k_name].double(), N_HEADS // cache[k_name].shape[2], dim=2)
    c = torch.einsum("bihd,bjhd->bhij", q, k) / attn_scale(model, 1)
    got = _hooked_scores(model, toks, QKIntervention("symmetric", 1), layer=1)
    lower = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(got[..., lower], (0.5 * (c + c.mT))[..., lower], rtol=1e-5, atol=1e-5)


def test_qwen3_previous_token_scores_equal_hf_attention(qwen3, no_network):
    """Pattern scores read hook_pattern: on a qk-norm model they equal HF's own eager
    attention weights (mean over i >= 1 of A[i, i-1])."""
    folder, hf = qwen3
    model, _ = pi.load_model(str(folder))
    toks = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(1))
    df = pi.previous_token_scores(model, toks)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        att = hf(toks, output_attentions=True).attentions  # per layer [batch, head, q, k]
    for layer, A in enumerate(att):
        want = A.diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, -1)).numpy()
        got = df[df["layer"] == layer].sort_values("head")["value"].to_numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
