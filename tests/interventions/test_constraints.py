import pytest
import torch

from posinterp.analysis.spectral import antisymmetric_energy, eigenvalues
from posinterp.interventions import CONSTRAINTS, constrain_qk
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


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("pe", ["absolute", "rotary"])
def test_constraint_holds_after_optimizer_steps_and_gradients_flow(kind, pe):
    model = tiny_model(pe)
    constrain_qk(model, kind)
    grads = _train_steps(model)
    assert all(g > 0 for g in grads)
    attn = model.blocks[0].attn
    X = attn.parametrizations.W_K[0].x()
    assert attn.parametrizations.W_K.original.grad is None  # the original W_K is unused
    assert attn.parametrizations.W_K[0].A.grad.abs().sum() > 0
    assert attn.W_Q.grad.abs().sum() > 0  # gradients reach W_Q through the tie
    W_Q, W_K = model.W_Q.detach().double(), model.W_K.detach().double()  # [layer, head, ...]
    Xs = torch.stack([b.attn.parametrizations.W_K[0].x().detach().double() for b in model.blocks])
    torch.testing.assert_close(W_K, W_Q @ Xs, rtol=1e-5, atol=1e-6)
    a = antisymmetric_energy(W_Q, W_K)
    lam = eigenvalues(W_Q, W_K)
    top = lam.abs().amax(-1, keepdim=True)
    real = lam.imag.abs() <= 1e-6 * top
    if kind == "symmetric":
        assert (a < 1e-10).all() and real.all()
    elif kind == "antisymmetric":
        assert ((a - 1).abs() < 1e-10).all()
    elif kind == "no_positive_real":
        assert (lam.real < 1e-9 * top).all()
    elif kind == "no_negative_real":
        assert (lam.real > -1e-9 * top).all()
    # Keys really are k = q X (biases tied too), so the forward pass obeys the constraint.
    _, cache = model.run_with_cache(random_tokens(model, 1, 6, seed=1))
    q, k = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_k"]
    torch.testing.assert_close(k, torch.einsum("bphd,hde->bphe", q, X.detach()),
                               rtol=1e-4, atol=1e-5)


def test_bad_constraints():
    model = tiny_model("nope")
    with pytest.raises(ValueError, match="constraint must be one of"):
        constrain_qk(model, "orthogonal")
    with pytest.raises(ValueError, match="layers must be in"):
        constrain_qk(model, "symmetric", layers=[5])
