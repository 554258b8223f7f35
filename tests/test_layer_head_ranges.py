"""Issue 11 case 13, hunted beyond QKIntervention: every public function that takes layer
or head indices raises a ValueError naming the parameter and its range, before it reads
a weight or changes the model; a negative index never counts from the end."""

import pytest
import torch

from posinterp.analysis import probe_positions
from posinterp.analysis.spectral import qk_spectrum, qk_weights, spectral_measures
from posinterp.interventions import per_head_interventions
from posinterp.interventions.constraints import constrain_qk
from tests.helpers import random_tokens, tiny_model


@pytest.mark.parametrize("layer", [-1, 2, 1.0, True])
def test_qk_weights(layer):
    model = tiny_model("nope")  # 2 layers
    with pytest.raises(ValueError, match=r"layer must be integers in \[0, 1\]"):
        qk_weights(model, layer)


@pytest.mark.parametrize("fn", [qk_spectrum, spectral_measures])
def test_spectra(fn):
    model = tiny_model("nope")
    with pytest.raises(ValueError, match=r"layers must be integers in \[0, 1\]"):
        fn(model, layers=[0, -1])
    with pytest.raises(ValueError, match=r"heads must be integers in \[0, 3\]"):
        fn(model, heads=[True])
    with pytest.raises(ValueError, match="heads must not repeat"):
        fn(model, heads=[1, 1])


def test_constrain_qk_checks_every_layer_before_changing_any():
    model = tiny_model("nope")
    before = model.blocks[0].attn.W_K.detach().clone()
    with pytest.raises(ValueError, match=r"layers must be integers in \[0, 1\]"):
        constrain_qk(model, "symmetric", layers=[0, 2])
    from torch.nn.utils import parametrize

    from posinterp.models.backend import qk_slots

    assert not any(parametrize.is_parametrized(s.module) for s in qk_slots(model, 0).values() if s)
    assert torch.equal(model.blocks[0].attn.W_K, before)
    with pytest.raises(ValueError, match="must not repeat"):
        constrain_qk(model, "symmetric", layers=[0, 0])


def test_per_head_interventions():
    model = tiny_model("nope")
    with pytest.raises(ValueError, match=r"layers must be integers in \[0, 1\]"):
        per_head_interventions(model, ["symmetric"], layers=[2])


@pytest.mark.parametrize("layers", [[-2], [2]])
def test_probe_positions_layers(layers):
    model = tiny_model("nope")
    toks = random_tokens(model, 6, 8)
    with pytest.raises(ValueError, match=r"layers must be integers in \[-1, 1\]"):
        probe_positions(model, toks, layers=layers, features=("mask_only",), seeds=(0,))


def test_fresh_user_inputs_name_the_parameter():
    """Found by a fresh-user trial: these raised IndexError, a torch RuntimeError, a pandas
    KeyError, or were accepted silently."""
    from posinterp.analysis.heads import random_tokens
    from posinterp.interventions import QKIntervention, ablation_effect, intervention_hooks

    model = tiny_model("nope")
    with pytest.raises(ValueError, match="pos must be a positive integer"):
        random_tokens(model, 2, 0, bos=False)
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        random_tokens(model, -1, 4, bos=False)
    with pytest.raises(ValueError, match="interventions must hold at least one"):
        ablation_effect(model, random_tokens(model, 2, 6, bos=False), [])
    with pytest.raises(ValueError, match=f"k must be <= d_head = {model.cfg.d_head}"):
        intervention_hooks(model, QKIntervention("keep_top_k", 0, k=model.cfg.d_head + 1))
