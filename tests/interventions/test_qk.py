import numpy as np
import pytest
import torch

from posinterp.analysis.spectral import qk_weights
from posinterp.interventions import (
    CHANNELS,
    KINDS,
    QKIntervention,
    channel_decomposition,
    channel_projectors,
    intervene,
    intervention_hooks,
    top_k_projector,
)
from posinterp.models.backend import attn_scale, positional_type  # noqa: F401
from tests.helpers import gqa_model, random_tokens, tiny_model

PES = ["nope", "absolute", "rotary", "alibi"]


def _random_B(seed=0, d_model=32, d_head=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d_model, d_head, generator=g, dtype=torch.float64)
    k = torch.randn(d_model, d_head, generator=g, dtype=torch.float64)
    return q, k, k.T @ q


@pytest.mark.parametrize("seed", range(5))
def test_channels_reconstruct_m_and_carry_their_eigenvalues(seed):
    q, k, B = _random_B(seed)
    P = channel_projectors(B)
    total = sum(P[c] for c in CHANNELS)
    M = q @ k.T
    assert (q @ total @ k.T - M).abs().max() < 1e-10 * M.abs().max()  # nothing removed
    lam = np.linalg.eigvals(B.numpy())
    for c in CHANNELS:
        assert (P[c] @ P[c] - P[c]).abs().max() < 1e-10
        assert (P[c] @ B - B @ P[c]).abs().max() < 1e-10 * B.abs().max()
        got = np.linalg.eigvals((q @ P[c] @ k.T).numpy())
        got = np.sort_complex(got[np.abs(got) > 1e-8 * np.abs(lam).max()])
        if c == "complex":
            want = lam[np.abs(lam.imag) > 1e-8 * np.abs(lam).max()]
        else:
            real = lam[np.abs(lam.imag) <= 1e-8 * np.abs(lam).max()].real
            want = real[real > 0] if c == "positive_real" else real[real < 0]
        np.testing.assert_allclose(got, np.sort_complex(want.astype(complex)), atol=1e-8)


def test_null_channel_of_a_singular_b():
    q, k, _ = _random_B(1, d_head=6)
    k[:, 0] = 0  # B's first row is zero: one zero eigenvalue
    P = channel_projectors(k.T @ q)
    assert torch.linalg.matrix_rank(P["null"]).item() == 1
    torch.testing.assert_close(sum(P.values()), torch.eye(6, dtype=torch.float64))


def test_top_k_keeps_conjugate_pairs_whole():
    B = torch.tensor([[0.0, -2.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    assert torch.linalg.matrix_rank(top_k_projector(B, 1)).item() == 2  # ±2i together
    with pytest.raises(ValueError, match="k must be"):
        top_k_projector(B, 0)


def _scores_and_content(model, toks, layer=0):
    _, cache = model.run_with_cache(toks)
    rot = positional_type(model) == "rotary"
    q = cache[f"blocks.{layer}.attn.hook_{'rot_' if rot else ''}q"].double()
    k = cache[f"blocks.{layer}.attn.hook_{'rot_' if rot else ''}k"].double()
    content = torch.einsum("bihd,bjhd->bhij", q, k) / attn_scale(model)
    return cache[f"blocks.{layer}.attn.hook_attn_scores"].double(), content


def _hooked_scores(model, toks, iv, layer=0):
    seen = {}
    hooks = intervention_hooks(model, iv) + [
        (f"blocks.{layer}.attn.hook_attn_scores", lambda x, hook: seen.setdefault("s", x))]
    model.run_with_hooks(toks, fwd_hooks=hooks)
    return seen["s"].double()


@pytest.mark.parametrize("pe", PES)
@pytest.mark.parametrize("kind", ["symmetric", "antisymmetric"])
def test_symmetrized_scores_equal_half_sum_plus_unchanged_bias(pe, kind):
    model = tiny_model(pe)
    toks = random_tokens(model, 2, 9, seed=4)
    original, content = _scores_and_content(model, toks)
    bias = original - content  # ALiBi (or 0) on the allowed entries
    sign = 1 if kind == "symmetric" else -1
    want = 0.5 * (content + sign * content.transpose(-1, -2)) + bias
    got = _hooked_scores(model, toks, QKIntervention(kind, layer=0))
    lower = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(got[..., lower], want[..., lower], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(got[..., ~lower]).all()


def test_offset_symmetric_rope_matches_weight_space():
    model = tiny_model("rotary")
    toks = random_tokens(model, 1, 7, seed=2)
    _, cache = model.run_with_cache(toks)
    x = cache["blocks.0.ln1.hook_normalized"][0].double()
    got = _hooked_scores(model, toks, QKIntervention("symmetric", 0, rope_variant="offset"))[0]
    for i in range(7):
        for j in range(i + 1):
            W_Q, W_K = qk_weights(model, 0, offset=j - i)
            M = W_Q @ W_K.mT
            sym = 0.5 * (M + M.mT)
            want = torch.einsum("d,hde,e->h", x[i], sym, x[j]) / attn_scale(model)
            torch.testing.assert_close(got[:, i, j], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pe", ["nope", "absolute", "alibi"])
def test_removing_every_channel_zeroes_the_content_term(pe):
    model = tiny_model(pe)
    toks = random_tokens(model, 2, 8, seed=5)
    original, content = _scores_and_content(model, toks)
    got = _hooked_scores(model, toks, QKIntervention("remove_all", layer=0))
    lower = torch.ones(8, 8, dtype=torch.bool).tril()
    bias = (original - content)[..., lower]
    torch.testing.assert_close(got[..., lower], bias, rtol=0, atol=1e-5)
    if pe != "alibi":  # no biases, no ALiBi: uniform attention over the allowed keys
        _, cache = model.run_with_cache(toks)
        with intervene(model, QKIntervention("remove_all", layer=0)):
            _, cache = model.run_with_cache(toks)
        pattern = cache["blocks.0.attn.hook_pattern"]
        uniform = lower.double() / lower.sum(-1, keepdim=True)
        torch.testing.assert_close(pattern.double(), uniform.expand_as(pattern), atol=1e-5, rtol=0)


def _nilpotent_head():
    """W_Q = [e1, e2], W_K = [e1, e3]: B = diag(1, 0), M = e1 e1^T + e2 e3^T (issue 14)."""
    eye = torch.eye(3, dtype=torch.float64)
    return eye[:, [0, 1]], eye[:, [0, 2]]


def test_decomposition_reports_the_null_remainder_in_closed_form():
    W_Q, W_K = _nilpotent_head()
    d = channel_decomposition(W_Q, W_K)
    # M_pos = e1 e1^T (norm 1), M_null = e2 e3^T (norm 1, eigenvalues 0 yet it scores)
    assert d["positive_real"] == pytest.approx(1.0, abs=1e-12)
    assert d["null"] == pytest.approx(1.0, abs=1e-12)
    assert d["negative_real"] == pytest.approx(0.0, abs=1e-12)
    assert d["complex"] == pytest.approx(0.0, abs=1e-12)
    assert d["total"] == pytest.approx(np.sqrt(2), abs=1e-12)
    # against the d_model x d_model form built directly
    q, k, _ = _random_B(3, d_model=10, d_head=4)
    k[:, 0] = 0
    P = channel_projectors(k.T @ q)
    d = channel_decomposition(q, k)
    for c, p in P.items():
        assert d[c] == pytest.approx(float(torch.linalg.norm(q @ p @ k.T)), rel=1e-9, abs=1e-12)


def test_remove_all_removes_the_nilpotent_part_too():
    from posinterp.models.backend import qk_slots

    model = tiny_model("nope", normalization="RMS")  # RMS: no centering, B stays diag(1, 0)
    W_Q, W_K = _nilpotent_head()
    slots = qk_slots(model, 0)  # the stored parameters, viewed per head (a bridge's attn.W_Q is a copy)
    q, k = (s.to_tl(getattr(s.module, s.name)) for s in (slots["W_Q"], slots["W_K"]))
    with torch.no_grad():
        q[0].zero_()
        k[0].zero_()
        q[0, :3, :2] = W_Q.float()
        k[0, :3, :2] = W_K.float()
    toks = random_tokens(model, 2, 8, seed=5)
    _, content = _scores_and_content(model, toks)
    lower = torch.ones(8, 8, dtype=torch.bool).tril()
    pos = _hooked_scores(model, toks, QKIntervention("remove_positive_real", 0, heads=(0,)))
    # only e1 e1^T went: the e2 e3^T part still scores
    _, cache = model.run_with_cache(toks)
    x = cache["blocks.0.ln1.hook_normalized"].double()
    nil = torch.einsum("bi,bj->bij", x[..., 1], x[..., 2]) / attn_scale(model)
    torch.testing.assert_close(pos[:, 0][:, lower], nil[:, lower], atol=1e-5, rtol=1e-4)
    assert nil[:, lower].abs().max() > 1e-2
    got = _hooked_scores(model, toks, QKIntervention("remove_all", 0, heads=(0,)))
    assert got[:, 0][:, lower].abs().max() < 1e-6
    assert content[:, 0][:, lower].abs().max() > 1e-2


def test_context_manager_restores_exactly_and_keeps_user_hooks():
    model = tiny_model("rotary")
    toks = random_tokens(model, 2, 10, seed=6)
    fired = []
    model.add_hook("blocks.1.hook_resid_post", lambda x, hook: fired.append(1))
    before = model(toks)
    with intervene(model, [QKIntervention("symmetric", 0), QKIntervention("remove_complex", 1)]):
        during = model(toks)
    after = model(toks)
    assert torch.equal(before, after) and not torch.equal(before, during)
    assert len(fired) == 3  # the user's hook fired before, during and after
    model.reset_hooks()


def test_bad_interventions():
    model = tiny_model("nope")
    with pytest.raises(ValueError, match="kind must be one of"):
        QKIntervention("rotate", 0)
    with pytest.raises(ValueError, match="keep_top_k needs k"):
        QKIntervention("keep_top_k", 0)
    with pytest.raises(ValueError, match="layer must be in"):
        intervention_hooks(model, QKIntervention("symmetric", 7))
    with pytest.raises(ValueError, match="heads must be in"):
        intervention_hooks(model, QKIntervention("remove_complex", 0, heads=(9,)))
    with pytest.raises(ValueError, match="layer must be >= 0"):
        QKIntervention("symmetric", -1)
    with pytest.raises(ValueError, match="k applies only"):
        QKIntervention("symmetric", 0, k=3)
    assert QKIntervention("symmetric", 0, heads=1).heads == (1,)


def test_grouped_query_symmetrization():
    from posinterp.models.backend import rotated_qk_hooks

    model = gqa_model()
    toks = torch.randint(0, 10, (1, 6), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(toks)
    q_name, k_name = rotated_qk_hooks(model, 0)  # verified on the model, not trusted by name
    q = cache[q_name].double()
    k = torch.repeat_interleave(cache[k_name].double(), 2, dim=2)
    c = torch.einsum("bihd,bjhd->bhij", q, k) / attn_scale(model)
    got = _hooked_scores(model, toks, QKIntervention("symmetric", 0))
    lower = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(got[..., lower], (0.5 * (c + c.mT))[..., lower], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("source", ["toy", "hf-gpt2"])
def test_symmetrization_refuses_a_kv_cache(source, tmp_path, no_network):
    """Symmetrization needs the full square score matrix: where the model runs with a KV
    cache (backend.has_kv_cache: TL 3.9 models), generate with it is refused by name.
    Without a working cache (TL 4's native model has none and generate runs the whole
    sequence; TL 4.3's HF bridges ignore the cached keys, which the load detects) a cached
    generate gives what generate without a cache gives, or is refused naming the cache."""
    from posinterp.models import backend, load_model
    from tests.helpers import save_tiny_checkpoint, tiny_hf_configs

    if source == "toy":
        model = tiny_model("nope")
    else:
        save_tiny_checkpoint("GPT2LMHeadModel", tiny_hf_configs()["gpt2-absolute"], tmp_path / "g")
        model, _ = load_model(tmp_path / "g")
    toks = random_tokens(model, 1, 5, seed=0)
    kw = dict(max_new_tokens=3, verbose=False, do_sample=False, stop_at_eos=False)
    with intervene(model, QKIntervention("symmetric", 0)):
        plain = model.generate(toks, use_past_kv_cache=False, **kw)
        if backend.has_kv_cache(model):
            with pytest.raises(ValueError, match="KV cache"):
                model.generate(toks, use_past_kv_cache=True, **kw)
        else:
            try:
                cached = model.generate(toks, use_past_kv_cache=True, **kw)
            except backend.MissingFeatureError as err:
                assert "KV cache" in str(err)
            else:
                assert torch.equal(cached, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("user_first", [True, False])
@pytest.mark.parametrize("kind", ["symmetric", "antisymmetric"])
def test_a_users_finfo_min_knockout_stays_masked(kind, user_first, dtype):
    """Issue 11 case 7: HF-style knockouts write finfo(dtype).min, not -inf (was 0.48)."""
    model = tiny_model("nope").to(dtype)
    toks = random_tokens(model, 2, 8, seed=3)

    def knockout(scores, hook):  # the HF convention for a masked score
        scores = scores.clone()
        scores[:, 1, 5, 2] = torch.finfo(scores.dtype).min
        return scores

    user = ("blocks.0.attn.hook_attn_scores", knockout)
    ours = intervention_hooks(model, QKIntervention(kind, layer=0))
    with model.hooks(fwd_hooks=[user, *ours] if user_first else [*ours, user]):
        _, cache = model.run_with_cache(toks, names_filter="blocks.0.attn.hook_pattern")
    pattern = cache["blocks.0.attn.hook_pattern"].double()
    assert pattern[:, 1, 5, 2].abs().max() < 1e-6
    torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))
    lower = torch.ones(8, 8, dtype=torch.bool).tril()
    assert (pattern[..., ~lower] == 0).all()


def _kwargs(kind):
    return {"k": 2} if kind == "keep_top_k" else {"band": (0,)} if kind.endswith("_band") else {}


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_range_layer_or_head_is_a_value_error_for_every_kind(kind):
    """Issue 11 case 13: remove_complex at layer 5 of a 2-layer model raised IndexError."""
    model = tiny_model("rotary")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    with pytest.raises(ValueError, match=rf"layer must be in \[0, {n_layers - 1}\], got 5"):
        intervention_hooks(model, QKIntervention(kind, 5, **_kwargs(kind)))
    with pytest.raises(ValueError, match=rf"heads must be in \[0, {n_heads - 1}\]"):
        intervention_hooks(model, QKIntervention(kind, 0, heads=(0, n_heads), **_kwargs(kind)))
    # A bad intervention later in a list fails before any hook is built or weight read.
    with pytest.raises(ValueError, match="layer must be in"), intervene(
            model, [QKIntervention(kind, 0, **_kwargs(kind)),
                    QKIntervention(kind, n_layers, **_kwargs(kind))]):
        pass
    assert not model.hook_dict["blocks.0.attn.hook_q"].fwd_hooks  # nothing left behind


@pytest.mark.parametrize("bad", [1.5, True, "1"])
def test_non_integer_layers_and_heads_are_refused(bad):
    with pytest.raises(ValueError, match="layer must be an int"):
        QKIntervention("symmetric", bad)
    with pytest.raises(ValueError, match="heads must be ints"):
        QKIntervention("symmetric", 0, heads=(0, bad))


def test_symmetrized_alibi_keeps_the_bias_of_mask_positions():
    """With a gap in the mask, ALiBi counts real tokens; symmetrization adds that bias,
    computed independently here from the slopes and cumsum(mask) - 1."""
    from posinterp.models import alibi_slopes

    model = tiny_model("alibi", n_heads=6, d_model=36, n_layers=1, n_ctx=16)
    toks = random_tokens(model, 2, 18, seed=5)  # also past n_ctx
    mask = torch.ones_like(toks)
    mask[1, 6:9] = 0
    _, cache = model.run_with_cache(toks, attention_mask=mask)
    q, k = cache["blocks.0.attn.hook_q"].double(), cache["blocks.0.attn.hook_k"].double()
    content = torch.einsum("bihd,bjhd->bhij", q, k) / attn_scale(model)
    pos = (mask.cumsum(-1) - 1).double()
    bias = alibi_slopes(6)[None, :, None, None] * (pos[:, None, None, :] - pos[:, None, :, None])
    want = 0.5 * (content + content.transpose(-1, -2)) + bias
    seen = {}
    hooks = intervention_hooks(model, QKIntervention("symmetric", layer=0)) + [
        ("blocks.0.attn.hook_attn_scores", lambda x, hook: seen.setdefault("s", x))]
    model.run_with_hooks(toks, attention_mask=mask, fwd_hooks=hooks)
    real = mask.bool()
    keep = torch.ones(18, 18, dtype=torch.bool).tril()[None] & real[:, None, :] & real[:, :, None]
    keep = keep[:, None].expand_as(want)
    torch.testing.assert_close(seen["s"].double()[keep], want[keep], rtol=1e-5, atol=1e-5)


def _projector_by_sorted_schur(B: np.ndarray, channel: str, eps=1e-8, null_tol=1e-10):
    """The reference path: one sorted Schur form per channel, gees asking about each
    eigenvalue in turn (the rule of channel_of plus the rounding test, one at a time)."""
    from scipy import linalg

    from posinterp.analysis.channels import channel_of
    from posinterp.analysis.spectral import real_within_rounding

    scale = float(np.abs(np.linalg.eigvals(B)).max())

    def select(re, im):
        c = channel_of(re, im, scale, eps, null_tol)
        if c == "complex" and bool(real_within_rounding(
                torch.from_numpy(B), torch.tensor([complex(re, im)]))[0]):
            c = "positive_real" if re > 0 else "negative_real"
        return c == channel

    T, Z, k = linalg.schur(B, output="real", sort=select)
    if k in (0, len(B)):
        return np.zeros_like(B) if k == 0 else np.eye(len(B))
    Y = linalg.solve_sylvester(T[:k, :k], -T[k:, k:], -T[:k, k:])
    P = np.zeros_like(B)
    P[:k, :k], P[:k, k:] = np.eye(k), -Y
    return Z @ P @ Z.T


@pytest.mark.parametrize("case", ["random", "low rank", "defective", "rotation"])
def test_channel_projectors_equal_the_sorted_schur_path(case):
    """One Schur form reordered per channel (dtrsen) gives the projectors that a sorted
    Schur form per channel gives, with the same channel for every eigenvalue."""
    rng = np.random.default_rng(3)
    d = 12
    if case == "random":
        B = rng.standard_normal((40, d)).T @ rng.standard_normal((40, d))
    elif case == "low rank":  # a null channel too
        B = rng.standard_normal((d, 5)) @ rng.standard_normal((5, d))
    else:
        J = np.diag(rng.uniform(0.5, 2.0, d) * rng.choice([-1, 1], d))
        if case == "defective":  # a real double eigenvalue rounding may split
            J[:2, :2] = [[1.5, 1.0], [0.0, 1.5]]
        else:
            J[:2, :2] = [[0.3, -0.8], [0.8, 0.3]]
        S = rng.standard_normal((d, d))
        B = S @ J @ np.linalg.inv(S)
    P = channel_projectors(torch.from_numpy(B))
    for c, Pc in P.items():
        np.testing.assert_allclose(Pc.numpy(), _projector_by_sorted_schur(B, c), atol=1e-9)
    assert np.allclose(sum(P.values()).numpy(), np.eye(d), atol=1e-9)


def test_channel_projectors_refuse_a_non_finite_form():
    B = torch.eye(4, dtype=torch.float64)
    B[1, 2] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        channel_projectors(B)
