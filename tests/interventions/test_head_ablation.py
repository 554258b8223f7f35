"""Batched per-head ablations (issue 26): the exact suffix path equals one naive full forward
pass per ablation on both TransformerLens lines; attribution patching is the first-order
term of the same loss change."""

import numpy as np
import pytest
import torch

import posinterp as pi
from posinterp.analysis._checks import next_token_loss
from posinterp.analysis.frequencies import parse_band_label
from posinterp.dashboard.inspect import _band_kinds
from posinterp.devices import move_model
from posinterp.interventions import head_ablation
from posinterp.interventions.head_ablation import (
    HEAD_ABLATIONS,
    attribution_estimates,
    head_ablation_losses,
)
from posinterp.interventions.qk import QKIntervention, intervene
from posinterp.models.backend import z_hook
from tests.helpers import random_tokens, save_tiny_checkpoint, tiny_hf_configs, tiny_model


def _padded_mask(batch, pos):
    mask = torch.ones(batch, pos, dtype=torch.long)
    mask[0, :3] = 0  # left padding in sequence 0
    mask[1, -2:] = 0  # right padding in sequence 1
    return mask


def _intervention(kind, layer, head):
    """The QKIntervention an ablation kind names (``remove_band_<band>`` included)."""
    if kind.startswith("remove_band_"):
        band = parse_band_label(kind.removeprefix("remove_band_"))
        return QKIntervention("remove_band", layer, heads=(head,), band=band)
    return QKIntervention(kind, layer, heads=(head,))


def _naive_loss(model, tokens, mask, layer, head, kind):
    """One whole forward pass with the ablation, the way posinterp ran it before."""
    def zero(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    with torch.no_grad():
        if kind == "zero_head":
            with model.hooks(fwd_hooks=[(z_hook(model, layer), zero)]):
                logits = model(tokens, attention_mask=mask)
        else:
            with intervene(model, _intervention(kind, layer, head)):
                logits = model(tokens, attention_mask=mask)
    return float(next_token_loss(logits, tokens, mask))


def _all_ablations(model):
    """Every kind inspect runs: zero_head, the channels and, on RoPE, the fastest and the
    slowest frequency band."""
    return [(layer, head, kind) for layer in range(model.cfg.n_layers)
            for head in range(model.cfg.n_heads)
            for kind in (*HEAD_ABLATIONS, *_band_kinds(model, layer))]


def _check_exact(model, tokens, mask, max_tokens=head_ablation.MAX_TOKENS, route="suffix"):
    abl = _all_ablations(model)
    clean, losses, got_route = head_ablation_losses(model, tokens, mask, abl, max_tokens=max_tokens)
    assert got_route == route
    with torch.no_grad():
        ref_clean = float(next_token_loss(model(tokens, attention_mask=mask), tokens, mask))
    assert abs(clean - ref_clean) <= 1e-5
    naive = np.array([_naive_loss(model, tokens, mask, *a) for a in abl])
    np.testing.assert_allclose(losses, naive, rtol=0, atol=1e-5)
    assert np.ptp(naive) > 1e-4  # the ablations do change the loss: the check has teeth


@pytest.mark.parametrize("pe", ["rotary", "alibi", "absolute"])
def test_batched_suffix_ablations_equal_naive_full_passes(pe):
    model = tiny_model(pe)
    tokens = random_tokens(model, 4, 12)
    _check_exact(model, tokens, _padded_mask(4, 12))


def test_batched_ablations_split_into_several_reruns_give_the_same_numbers():
    model = tiny_model("rotary")
    tokens = random_tokens(model, 3, 10)
    _check_exact(model, tokens, None, max_tokens=2 * 3 * 10)  # two ablations per rerun


def test_full_pass_fallback_where_the_replay_check_fails(monkeypatch):
    monkeypatch.setattr(head_ablation, "suffix_replay_matches", lambda model, inputs: False)
    model = tiny_model("rotary")
    tokens = random_tokens(model, 3, 10)
    _check_exact(model, tokens, _padded_mask(3, 10), route="full")


def test_batched_ablations_on_a_loaded_hf_llama_with_grouped_query_heads(tmp_path):
    from posinterp.models import load_model

    folder = tmp_path / "llama-gqa"
    save_tiny_checkpoint("LlamaForCausalLM", tiny_hf_configs()["llama-gqa"], folder)
    model, _ = load_model(str(folder), device="cpu")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 90, (3, 10), generator=gen)
    _check_exact(model, tokens, _padded_mask(3, 10))


@pytest.mark.parametrize("name", ["bloom-12-heads", "gpt2", "opt", "gptneo-local", "neox",
                                  "mistral-sliding-16", "qwen2",
                                  "gptj-rotary-dim-4"])
def test_batched_ablations_on_loaded_hf_models_with_their_own_block_inputs(tmp_path, name):
    """Each causal architecture's blocks take their own inputs (BLOOM's ``alibi`` is
    [batch * n_heads, 1, key], which TL 4 passes on and the reruns once left untiled: a
    crash); the suffix reruns tile them as the batch is tiled, or fall back to full
    passes, and equal one full pass per ablation."""
    from posinterp.models import load_model
    from tests.helpers import parity_cases

    arch, make, _ = parity_cases()[name]
    save_tiny_checkpoint(arch, make(), tmp_path / name)
    model, _ = load_model(str(tmp_path / name), device="cpu")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 90, (3, 10), generator=gen)
    abl = _all_ablations(model)
    _, _, route = head_ablation_losses(model, tokens, _padded_mask(3, 10), abl)
    _check_exact(model, tokens, _padded_mask(3, 10), route=route)
    assert route == "suffix" or name not in ("bloom-12-heads", "gpt2")


def test_bad_ablations_name_the_parameter():
    model = tiny_model("rotary")
    tokens = random_tokens(model, 2, 6)
    with pytest.raises(ValueError, match="kind must be one of"):
        head_ablation_losses(model, tokens, None, [(0, 0, "zero")])
    with pytest.raises(ValueError, match="layer must be in"):
        attribution_estimates(model, tokens, None, [(9, 0, "zero_head")])
    with pytest.raises(ValueError, match="head must be in"):
        head_ablation_losses(model, tokens, None, [(0, 99, "zero_head")])


def _scaled_loss(model, tokens, mask, layer, head, kind, eps):
    """Loss with the ablation applied a fraction eps of the way: a + eps (a' - a)."""
    from posinterp.interventions.qk import _query_projector
    from posinterp.models.backend import query_hooks

    if kind == "zero_head":
        name = z_hook(model, layer)

        def edit(x, hook):
            x = x.clone()
            x[:, :, head] = x[:, :, head] * (1 - eps)
            return x
    else:
        name = query_hooks(model, layer)[0]
        P = _query_projector(model, _intervention(kind, layer, head))[head]

        def edit(x, hook):
            x = x.clone()
            a = x[:, :, head].double()
            x[:, :, head] = (a + eps * (a @ P - a)).to(x.dtype)
            return x
    with torch.no_grad(), model.hooks(fwd_hooks=[(name, edit)]):
        return float(next_token_loss(model(tokens, attention_mask=mask), tokens, mask))


@pytest.mark.parametrize("pe", ["rotary", "absolute"])
def test_attribution_is_the_derivative_of_the_ablation_path(pe):
    # The estimate is linear in the edit, so it must equal d/de L(a + e (a' - a)) at e = 0:
    # a central difference in float64 checks every kind against an independent computation.
    model = move_model(tiny_model(pe), dtype=torch.float64)
    tokens = random_tokens(model, 3, 10)
    mask = _padded_mask(3, 10)
    abl = _all_ablations(model)
    clean, est = attribution_estimates(model, tokens, mask, abl)
    eps = 1e-5
    fd = np.array([(_scaled_loss(model, tokens, mask, *a, eps) - _scaled_loss(model, tokens, mask, *a, -eps))
                   / (2 * eps) for a in abl])
    np.testing.assert_allclose(est, fd, rtol=1e-5, atol=1e-9)
    assert np.abs(est).max() > 1e-4


def test_attribution_ranks_the_exact_loss_changes_on_a_tiny_model():
    from scipy import stats

    model = tiny_model("rotary")
    tokens = random_tokens(model, 4, 12)
    abl = _all_ablations(model)
    clean, exact, _ = head_ablation_losses(model, tokens, None, abl)
    _, est = attribution_estimates(model, tokens, None, abl)
    rho = stats.spearmanr(est, exact - clean).statistic
    assert rho > 0.5, rho


def test_cli_ablate_approx_labels_the_estimates_on_the_page_and_in_the_table(tmp_path):
    import json

    import pandas as pd

    from posinterp.cli import main

    folder = tmp_path / "llama-gqa"
    save_tiny_checkpoint("LlamaForCausalLM", tiny_hf_configs()["llama-gqa"], folder)
    out = tmp_path / "out"
    assert main(["inspect", str(folder), "--tokens", "8", "--batch", "2", "--ablate-approx", "3",
                 "--out", str(out), "--no-progress"]) == 0
    table = pd.read_csv(out / "heads.csv")
    model, _ = pi.load_model(folder)
    assert (table.metric == "loss_change_attribution").sum() == len(_all_ablations(model))
    assert (table.metric == "loss_change").sum() == 3
    run = json.loads((out / "run.json").read_text())
    assert run["ablate"] == "attribution" and run["exact_top_k"] == 3
    page = (out / "inspect.html").read_text()
    assert "approximate (attribution patching)" in page and "3 largest by size were rerun" in page
    assert main(["inspect", str(folder), "--ablate", "--ablate-approx", "3",
                 "--out", str(tmp_path / "o2"), "--no-progress"]) == 2


def test_projectors_are_those_the_qk_interventions_apply():
    from posinterp.interventions.qk import _query_projector

    model = tiny_model("rotary")
    abl = [a for a in _all_ablations(model) if a[2] != "zero_head"]
    assert any(k.startswith("remove_band_") for _, _, k in abl)
    got = head_ablation._projectors(model, abl)
    for layer, head, kind in abl:
        ref = _query_projector(model, _intervention(kind, layer, head))[head]
        assert torch.equal(got[(layer, head, kind)], ref)
