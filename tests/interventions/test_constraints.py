import numpy as np
import pytest
import torch
from torch.nn.utils import parametrize

from posinterp.analysis.spectral import (
    antisymmetric_energy,
    channel_masses,
    eigenvalues,
    qk_weights,
)
from posinterp.interventions import (
    BANS,
    CONSTRAINTS,
    TIED_CONSTRAINTS,
    constrain_qk,
    match_qk_norm,
    qk_norms,
)
from posinterp.models.backend import attention_weights, is_bridge, qk_slots
from tests.helpers import random_tokens, tiny_model


def _train_steps(model, n=3):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    toks = random_tokens(model, 4, 12, seed=0)
    grads = []
    for _ in range(n):
        opt.zero_grad()
        model(toks, return_type="loss").backward()
        grads.append(sum(p.grad.abs().sum().item() for p in params if p.grad is not None))
        opt.step()
    return grads


def _param(slot):
    """The leaf parameter behind a backend.QKSlot (its original when parametrized)."""
    if parametrize.is_parametrized(slot.module, slot.name):
        return slot.module.parametrizations[slot.name].original
    return getattr(slot.module, slot.name)


def _stacked(model, name):
    """``name`` (W_Q, W_K, b_Q, ...) of every layer, TL 3.9's per-head layout, float64."""
    return torch.stack([attention_weights(model, layer)[name] for layer in range(model.cfg.n_layers)])


def _effective(model):
    W = [qk_weights(model, layer) for layer in range(model.cfg.n_layers)]
    return torch.stack([q for q, _ in W]), torch.stack([k for _, k in W])


@pytest.mark.parametrize("kind", TIED_CONSTRAINTS)
@pytest.mark.parametrize("pe", ["absolute", "rotary"])
def test_tied_constraint_holds_after_optimizer_steps_and_gradients_flow(kind, pe):
    model = tiny_model(pe)
    constrain_qk(model, kind, generator=torch.Generator().manual_seed(0))
    grads = _train_steps(model)
    assert all(g > 0 for g in grads)
    slots = [qk_slots(model, layer) for layer in range(model.cfg.n_layers)]
    k = slots[0]["W_K"]
    X = k.module.parametrizations[k.name][0].x()
    assert _param(k).grad is None  # the original W_K is unused
    assert k.module.parametrizations[k.name][0].A.grad.abs().sum() > 0
    assert _param(slots[0]["W_Q"]).grad.abs().sum() > 0  # gradients reach W_Q through the tie
    W_Q, W_K = _stacked(model, "W_Q"), _stacked(model, "W_K")  # [layer, head, ...]
    Xs = torch.stack([s["W_K"].module.parametrizations[s["W_K"].name][0].x().detach().double()
                      for s in slots])
    torch.testing.assert_close(W_K, W_Q @ Xs, rtol=1e-5, atol=1e-6)
    # the constraint holds on the effective form (trained LN gains folded, centred)
    W_Q, W_K = _effective(model)
    a = antisymmetric_energy(W_Q, W_K)
    lam = eigenvalues(W_Q, W_K)
    top = lam.abs().amax(-1, keepdim=True)
    real = lam.imag.abs() <= 1e-6 * top
    if kind == "symmetric":
        assert (a < 1e-10).all() and real.all()
    elif kind == "antisymmetric":
        assert ((a - 1).abs() < 1e-10).all()
    elif kind == "left_half_plane":
        assert (lam.real < 1e-9 * top).all()
    elif kind == "right_half_plane":
        assert (lam.real > -1e-9 * top).all()
    # Keys really are k = q X (biases tied too), so the forward pass obeys the constraint.
    _, cache = model.run_with_cache(random_tokens(model, 1, 6, seed=1))
    q, k = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_k"]
    torch.testing.assert_close(k, torch.einsum("bphd,hde->bphe", q, X.detach()),
                               rtol=1e-4, atol=1e-5)


def test_half_plane_bans_a_complex_pair_that_has_no_positive_real_part():
    """B with eigenvalues 0.5 ± 1i has no positive-real eigenvalue, yet left_half_plane
    cannot represent it (issue 14): the name says what it constrains."""
    model = tiny_model("nope")
    constrain_qk(model, "left_half_plane", generator=torch.Generator().manual_seed(0))
    lam = eigenvalues(*_effective(model))
    assert (lam.real < 0).all()  # no eigenvalue with Re > 0, complex or not


@pytest.mark.parametrize("kind", BANS)
@pytest.mark.parametrize("pe", ["absolute", "rotary"])
def test_single_channel_ban_removes_exactly_that_channel_after_optimizer_steps(kind, pe):
    model = tiny_model(pe)
    before = eigenvalues(*_effective(model))
    constrain_qk(model, kind)
    slots = qk_slots(model, 0)
    # at once: B' = B (I - Π_c) keeps every other eigenvalue exactly, channel c goes to 0
    channel = kind.removeprefix("ban_")
    after = eigenvalues(*_effective(model))
    keep = {c: m for c, m in channel_masses(before).items()}
    assert (keep[channel] > 0).any()  # the ban has something to remove
    for lam0, lam1 in zip(before.reshape(-1, before.shape[-1]), after.reshape(-1, after.shape[-1]),
                          strict=True):
        top = lam0.abs().max()
        cplx = lam0.imag.abs() > 1e-8 * top
        in_c = {"complex": cplx, "positive_real": ~cplx & (lam0.real > 0),
                "negative_real": ~cplx & (lam0.real < 0)}[channel]
        want = np.sort_complex(lam0[~in_c].numpy())
        got = lam1.numpy()
        # the banned weights are float32: removed eigenvalues fall to ~1e-7 of the top
        got = np.sort_complex(got[np.abs(got) > 1e-5 * float(top)])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(top))
    grads = _train_steps(model)
    assert all(g > 0 for g in grads)
    assert _param(slots["W_Q"]).grad.abs().sum() > 0
    assert _param(slots["W_K"]).grad.abs().sum() > 0
    # after AdamW steps (weights, LN gains and W_K all moved): still banned, others alive
    masses = channel_masses(eigenvalues(*_effective(model)))
    assert masses[channel].max() < 1e-5  # float32 weights: zero up to rounding
    others = [c for c in masses if c != channel]
    left = sum(masses[c] for c in others)
    # the other channels carry all the mass; a head whose whole spectrum was in channel
    # c has none left (M' = 0), which is what banning c means for it
    assert (((left - 1).abs() < 1e-5) | (left == 0)).all() and (left > 0).float().mean() > 0.5
    # the forward pass uses the banned weights: q = (x W_Q° + b_Q°)(I - Π_c)
    _, cache = model.run_with_cache(random_tokens(model, 1, 6, seed=1))
    x = cache["blocks.0.ln1.hook_normalized"]
    gain = model.blocks[0].ln1.w
    w = {n: t.float() for n, t in attention_weights(model, 0).items()}  # the banned W_Q, b_Q
    q_want = torch.einsum("bpd,hde->bphe", x * gain + model.blocks[0].ln1.b, w["W_Q"]) + w["b_Q"]
    torch.testing.assert_close(cache["blocks.0.attn.hook_q"], q_want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_every_family_starts_from_the_matched_norm(kind):
    target = qk_norms(tiny_model("absolute"))  # the untied model's, same seed
    model = tiny_model("absolute")
    constrain_qk(model, kind, generator=torch.Generator().manual_seed(0))
    reached = match_qk_norm(model, 0.5 * target)
    torch.testing.assert_close(reached, 0.5 * target, rtol=1e-5, atol=0)
    torch.testing.assert_close(qk_norms(model), 0.5 * target, rtol=1e-5, atol=0)
    if kind in BANS:  # still banned after rescaling
        assert channel_masses(eigenvalues(*_effective(model)))[kind[4:]].max() < 1e-5


def test_bad_constraints():
    model = tiny_model("nope")
    with pytest.raises(ValueError, match="constraint must be one of"):
        constrain_qk(model, "orthogonal")
    with pytest.raises(ValueError, match="renamed 'left_half_plane'.*ban_positive_real"):
        constrain_qk(model, "no_positive_real")
    with pytest.raises(ValueError, match="layers must be in"):
        constrain_qk(model, "symmetric", layers=[5])
    with pytest.raises(ValueError, match="target must be"):
        match_qk_norm(model, torch.ones(3))


def _tl_layout(model, layer: int, name: str, stored: torch.Tensor) -> torch.Tensor:
    """``stored`` (a parameter or its gradient as the model stores it) in TL 3.9's per-head
    layout, through TransformerLens's own ``convert_tl_checkpoint`` (TL 4), not posinterp's
    reshapes: the conversion is a permutation, so pushing indices through it inverts it."""
    if not is_bridge(model):
        return stored
    from transformer_lens.conversion_utils import convert_tl_checkpoint

    H, dh, D = model.cfg.n_heads, model.cfg.d_head, model.cfg.d_model
    shape = (H, D, dh) if name.startswith("W_") else (H, dh)
    idx = torch.arange(stored.numel(), dtype=torch.float64).reshape(shape)
    (where,) = convert_tl_checkpoint({f"blocks.{layer}.attn.{name}": idx}, model.cfg).values()
    out = torch.empty(stored.numel(), dtype=stored.dtype)
    out[where.reshape(-1).long()] = stored.detach().reshape(-1)
    return out.reshape(shape)


def _from_tl(model, layer: int, name: str, value: torch.Tensor) -> torch.Tensor:
    """A TL 3.9-layout tensor in the model's stored layout (TL's ``convert_tl_checkpoint``)."""
    if not is_bridge(model):
        return value
    from transformer_lens.conversion_utils import convert_tl_checkpoint

    (out,) = convert_tl_checkpoint({f"blocks.{layer}.attn.{name}": value}, model.cfg).values()
    return out


@pytest.mark.parametrize("kind", ["tied", "symmetric", "ban_complex", "ban_positive_real",
                                  "rank_matched_complex"])
@pytest.mark.parametrize("pe", ["absolute", "rotary"])
def test_gradients_are_the_chain_rule_of_the_unconstrained_model(kind, pe):
    """The constrained model is the unconstrained one evaluated at the effective weights,
    and its gradients are the chain rule through W_K = W_Q X (tied) or W_Q = W_Q° P (bans),
    computed in TL 3.9's per-head layout. On TL 4 the stored gradients are read back through
    TransformerLens's own layout conversion, so this is the TL 3.9 computation checked
    against the TL 4 model."""
    torch.manual_seed(0)
    model = tiny_model(pe)
    constrain_qk(model, kind, generator=torch.Generator().manual_seed(0))
    plain = tiny_model(pe)
    L = model.cfg.n_layers
    eff = [{n: t.float() for n, t in attention_weights(model, layer).items()} for layer in range(L)]
    for layer in range(L):
        with torch.no_grad():
            for name in ("W_Q", "b_Q", "W_K", "b_K"):
                _param(qk_slots(plain, layer)[name]).copy_(_from_tl(plain, layer, name, eff[layer][name]))
    toks = random_tokens(model, 3, 10, seed=2)
    loss, plain_loss = model(toks, return_type="loss"), plain(toks, return_type="loss")
    assert abs(loss.item() - plain_loss.item()) < 1e-6
    loss.backward()
    plain_loss.backward()
    for layer in range(L):
        s, ps = qk_slots(model, layer), qk_slots(plain, layer)
        G = {n: _tl_layout(plain, layer, n, _param(ps[n]).grad).double() for n in ps}
        got_q = _tl_layout(model, layer, "W_Q", _param(s["W_Q"]).grad).double()
        got_bq = _tl_layout(model, layer, "b_Q", _param(s["b_Q"]).grad).double()
        if kind in TIED_CONSTRAINTS:
            tk = s["W_K"].module.parametrizations[s["W_K"].name][0]
            X = tk.x().detach().double()
            W_Q, b_Q = eff[layer]["W_Q"].double(), eff[layer]["b_Q"].double()
            dX = W_Q.mT @ G["W_K"] + b_Q[:, :, None] * G["b_K"][:, None, :]
            dA = dX if kind == "tied" else 0.5 * (dX + dX.mT)
            want_q = G["W_Q"] + G["W_K"] @ X.mT
            want_bq = G["b_Q"] + torch.einsum("he,hde->hd", G["b_K"], X)
            torch.testing.assert_close(tk.A.grad.double(), dA, rtol=1e-4, atol=1e-7)
        else:
            P = s["W_Q"].module.parametrizations[s["W_Q"].name][0].projector().double()
            want_q, want_bq = G["W_Q"] @ P.mT, torch.einsum("he,hde->hd", G["b_Q"], P)
            got_k = _tl_layout(model, layer, "W_K", _param(s["W_K"]).grad).double()
            torch.testing.assert_close(got_k, G["W_K"], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(got_q, want_q, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(got_bq, want_bq, rtol=1e-4, atol=1e-7)


def test_band_ban_keeps_the_banned_pairs_at_zero_through_training():
    """ban_band: the banned rotary pairs' query dims stay exactly 0 through AdamW steps
    (so their terms of every score are 0, issue 28), the rest trains, and removing the
    same band at inference then changes nothing."""
    from posinterp.interventions import QKIntervention, intervene
    from posinterp.interventions.qk import band_dims
    from posinterp.models import backend, build_model, preset

    model = build_model(preset("tiny", pe="rotary", seed=5))
    band = (0, 2)
    constrain_qk(model, "ban_band", band=band)
    dims = band_dims(model, 0, band)
    before = backend.attention_weights(model, 1)["W_Q"].clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    toks = torch.randint(0, model.cfg.d_vocab, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(5):
        opt.zero_grad()
        model(toks).pow(2).mean().backward()
        opt.step()
    for layer in range(model.cfg.n_layers):
        w = backend.attention_weights(model, layer)
        assert w["W_Q"][..., dims].abs().max() <= 1e-6 and w["b_Q"][..., dims].abs().max() <= 1e-6
    after = backend.attention_weights(model, 1)["W_Q"]
    assert (after - before).abs().max() > 1e-4  # the other dims trained
    with torch.no_grad():
        plain = model(toks)
        with intervene(model, [QKIntervention("remove_band", layer, band=band)
                               for layer in range(model.cfg.n_layers)]):
            cut = model(toks)
    torch.testing.assert_close(cut, plain)


def test_band_ban_is_checked_like_the_inference_band():
    from posinterp.models import build_model, preset

    with pytest.raises(ValueError, match="needs a RoPE model"):
        constrain_qk(build_model(preset("tiny", pe="absolute")), "ban_band", band=(0,))
    rotary = build_model(preset("tiny", pe="rotary"))
    with pytest.raises(ValueError, match="needs band"):
        constrain_qk(rotary, "ban_band")
    with pytest.raises(ValueError, match="band applies only"):
        constrain_qk(rotary, "symmetric", band=(0,))


_HF_ARCH = {"gpt2-absolute": "GPT2LMHeadModel", "llama-gqa": "LlamaForCausalLM"}


@pytest.mark.parametrize("name, kind", [("gpt2-absolute", "tied"), ("gpt2-absolute", "symmetric"),
                                        ("gpt2-absolute", "ban_complex"),
                                        ("llama-gqa", "ban_positive_real")])
def test_constraints_on_loaded_hf_checkpoints(tmp_path, name, kind, no_network):
    """HF GPT-2 (fused c_attn, biases) and Llama (grouped-query keys) folders as
    ``load_model`` gives them, weight processing included (TL 3.9: a HookedTransformer;
    TL 4: a bridge whose attention runs HF's modules, constrained through the q/k
    ``nn.Linear`` its ``attn.q``/``attn.k`` wrap). The constrained model is the
    unconstrained one at the effective weights, its gradients are the chain rule through
    W_K = W_Q X or W_Q = W_Q° P, and a ban keeps the banned channel at 0 through AdamW steps."""
    from posinterp.models import load_model
    from tests.helpers import save_tiny_checkpoint, tiny_hf_configs

    save_tiny_checkpoint(_HF_ARCH[name], tiny_hf_configs()[name], tmp_path / name)
    model, _ = load_model(tmp_path / name)
    plain, _ = load_model(tmp_path / name)
    constrain_qk(model, kind, generator=torch.Generator().manual_seed(0))
    L = model.cfg.n_layers
    names = ("W_Q", "b_Q", "W_K", "b_K")
    for layer in range(L):
        # the slot's per-head view is TransformerLens's own reading of the weight
        s = qk_slots(plain, layer)
        read = attention_weights(plain, layer)  # attn.W_Q / attn.W_K, keys expanded
        for n in ("W_Q", "W_K"):
            mine = s[n].to_tl(_param(s[n])).detach().double()
            mine = mine.repeat_interleave(model.cfg.n_heads // s[n].n, dim=0)
            torch.testing.assert_close(mine, read[n], rtol=0, atol=0)
        eff = {n: t.float() for n, t in attention_weights(model, layer).items()}
        with torch.no_grad():
            for n in names:
                if s[n] is not None:
                    stored = eff[n] if s[n].n == model.cfg.n_heads else eff[n][::model.cfg.n_heads // s[n].n]
                    _param(s[n]).copy_(s[n].from_tl(stored))
    toks = torch.randint(0, model.cfg.d_vocab, (3, 10), generator=torch.Generator().manual_seed(2))
    loss, plain_loss = model(toks, return_type="loss"), plain(toks, return_type="loss")
    assert abs(loss.item() - plain_loss.item()) < 1e-6
    loss.backward()
    plain_loss.backward()
    for layer in range(L):
        s, ps = qk_slots(model, layer), qk_slots(plain, layer)
        G = {n: ps[n].to_tl(_param(ps[n]).grad).double() for n in names if ps[n] is not None}
        got_q = s["W_Q"].to_tl(_param(s["W_Q"]).grad).double()
        if kind in TIED_CONSTRAINTS:
            tk = s["W_K"].module.parametrizations[s["W_K"].name][0]
            X = tk.x().detach().double()
            W_Q = attention_weights(model, layer)["W_Q"].float().double()
            b_Q = attention_weights(model, layer)["b_Q"].float().double()
            dX = W_Q.mT @ G["W_K"] + b_Q[:, :, None] * G["b_K"][:, None, :]
            dA = dX if kind == "tied" else 0.5 * (dX + dX.mT)
            torch.testing.assert_close(tk.A.grad.double(), dA, rtol=1e-4, atol=1e-7)
            torch.testing.assert_close(got_q, G["W_Q"] + G["W_K"] @ X.mT, rtol=1e-4, atol=1e-7)
            got_bq = s["b_Q"].to_tl(_param(s["b_Q"]).grad).double()
            torch.testing.assert_close(got_bq, G["b_Q"] + torch.einsum("he,hde->hd", G["b_K"], X),
                                       rtol=1e-4, atol=1e-7)
        else:
            P = s["W_Q"].module.parametrizations[s["W_Q"].name][0].projector().double()
            torch.testing.assert_close(got_q, G["W_Q"] @ P.mT, rtol=1e-4, atol=1e-7)
            got_k = s["W_K"].to_tl(_param(s["W_K"]).grad).double()
            torch.testing.assert_close(got_k, G["W_K"], rtol=1e-4, atol=1e-7)
    grads = _train_steps(model)
    assert all(g > 0 for g in grads)
    lam = eigenvalues(*_effective(model))
    if kind in BANS:
        assert channel_masses(lam)[kind.removeprefix("ban_")].max() < 1e-5
    elif kind == "symmetric":
        assert (antisymmetric_energy(*_effective(model)) < 1e-10).all()


def _channel_counts(model, channel):
    """Eigenvalues of each head's effective B in ``channel``, counted from numpy's
    eigenvalues (a complex pair counts 2): an implementation independent of the projectors."""
    out = []
    for layer in range(model.cfg.n_layers):
        W_Q, W_K = qk_weights(model, layer)
        row = []
        for h in range(model.cfg.n_heads):
            lam = np.linalg.eigvals((W_K[h].mT @ W_Q[h]).numpy())
            top = np.abs(lam).max()
            cplx = np.abs(lam.imag) > 1e-8 * top
            live = np.abs(lam) > 1e-10 * top
            in_c = {"complex": cplx, "positive_real": ~cplx & (lam.real > 0),
                    "negative_real": ~cplx & (lam.real < 0)}[channel] & live
            row.append(int(in_c.sum()))
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("channel", ["positive_real", "negative_real", "complex"])
@pytest.mark.parametrize("pe", ["absolute", "rotary"])
def test_rank_matched_control_removes_a_random_subspace_of_the_bans_rank(channel, pe):
    """rank_matched_<c>: per head, a fixed random subspace U of the rank ban_<c> removes at
    init (its Π_c's rank, also counted from numpy's eigenvalues) carries no query energy
    through AdamW steps with weight decay; the other directions train."""
    from posinterp.interventions import banned_ranks, removed_ranks

    model = tiny_model(pe)
    want = _channel_counts(model, channel)
    assert torch.equal(banned_ranks(model, channel), want) and want.sum() > 0
    banned = tiny_model(pe)
    constrain_qk(banned, f"ban_{channel}")
    constrain_qk(model, f"rank_matched_{channel}", generator=torch.Generator().manual_seed(3))
    assert torch.equal(removed_ranks(model), want)
    assert torch.equal(removed_ranks(banned), want)  # the ban's Π_c at init, same rank
    removed = []
    for layer in range(model.cfg.n_layers):
        q = qk_slots(model, layer)["W_Q"]
        P = q.module.parametrizations[q.name][0].removed.double()  # Π_U per head
        # an orthogonal projector of that rank (stored in float32): symmetric,
        # idempotent, trace = rank
        torch.testing.assert_close(P, P.mT, rtol=0, atol=1e-7)
        torch.testing.assert_close(P @ P, P, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.diagonal(P, 0, -2, -1).sum(-1),
                                   want[layer].double(), rtol=0, atol=1e-5)
        removed.append(P)
    before = _stacked(model, "W_Q").clone()
    grads = _train_steps(model, n=5)
    assert all(g > 0 for g in grads)
    W_Q, b_Q = _stacked(model, "W_Q"), _stacked(model, "b_Q")
    for layer, P in enumerate(removed):
        energy = (W_Q[layer] @ P).pow(2).sum((-1, -2)) / W_Q[layer].pow(2).sum((-1, -2))
        assert energy.max() < 1e-12  # float32 weights: zero up to rounding
        assert torch.einsum("hd,hde->he", b_Q[layer], P).abs().max() < 1e-6
    assert (W_Q - before).abs().max() > 1e-4  # the kept directions trained
    # the rank q keeps is d_head - r (where r < d_head), as for the ban at init
    sv = torch.linalg.svdvals(W_Q)
    kept = (sv > 1e-5 * sv[..., :1]).sum(-1)
    assert torch.equal(kept, model.cfg.d_head - want)
    # the control's subspace is not the channel's (a random one): seeds give other draws
    other = tiny_model(pe)
    constrain_qk(other, f"rank_matched_{channel}", generator=torch.Generator().manual_seed(4))
    q0 = qk_slots(other, 0)["W_Q"]
    assert (q0.module.parametrizations[q0.name][0].removed.double() - removed[0]).abs().max() > 1e-3


def test_random_subspace_ranks_are_checked():
    from posinterp.interventions import removed_ranks

    model = tiny_model("absolute")
    d = model.cfg.d_head
    with pytest.raises(ValueError, match="needs rank"):
        constrain_qk(model, "ban_random_subspace")
    with pytest.raises(ValueError, match="rank must be"):
        constrain_qk(model, "ban_random_subspace", rank=d + 1)
    with pytest.raises(ValueError, match="rank must be"):
        constrain_qk(model, "ban_random_subspace", rank=[[1, 2]])
    with pytest.raises(ValueError, match="rank applies only"):
        constrain_qk(model, "symmetric", rank=2)
    with pytest.raises(ValueError, match="reads its ranks"):
        constrain_qk(model, "rank_matched_complex", rank=2)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())  # untouched
    constrain_qk(model, "ban_random_subspace", rank=3, generator=torch.Generator().manual_seed(0))
    assert (removed_ranks(model) == 3).all()


def test_a_head_whose_whole_d_head_is_removed_is_not_scaled_into_noise():
    """A ban that removes a head's whole d_head leaves M = rounding residue; rescaling that
    to the target norm (about 1e15 x) made a full-norm head of float32 noise (issue 37).
    The emptied head keeps M ~ 0 while every other head reaches its target."""
    model = tiny_model("absolute")
    target = qk_norms(model)
    ranks = torch.ones(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.int64)
    ranks[0, 1] = model.cfg.d_head  # the whole head removed
    constrain_qk(model, "ban_random_subspace", rank=ranks,
                 generator=torch.Generator().manual_seed(0))
    before = qk_norms(model)
    assert before[0, 1] < 1e-6 * target[0, 1]  # residue only
    reached = match_qk_norm(model, target)
    assert reached[0, 1] <= max(before[0, 1], 1e-6 * target[0, 1])
    others = torch.ones_like(target, dtype=torch.bool)
    others[0, 1] = False
    torch.testing.assert_close(reached[others], target[others], rtol=1e-5, atol=0)
    from posinterp.interventions.constraints import emptied_heads

    assert torch.equal(emptied_heads(model), ~others)  # reported as M = 0, the others not
