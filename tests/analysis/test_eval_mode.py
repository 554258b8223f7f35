"""Analyses on a model left in train() measure the model, not its dropout (issue 22, item 2).

A user's module with dropout is attached to a hook (as an SAE or adapter with dropout
would be), so the same model carries active dropout on both TransformerLens lines. Every
analysis entry point that runs a forward pass must give the same numbers on two calls,
and leave every module in the mode the caller had set.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from posinterp.analysis import (
    ProbeConfig,
    adjacency_by_layer,
    previous_token_scores,
    probe_positions,
    similarity_by_layer,
    variance_by_layer,
)
from posinterp.dashboard import inspect_heads
from posinterp.interventions import QKIntervention, ablation_effect
from tests.helpers import random_tokens, tiny_model


def _model_in_train_mode():
    model = tiny_model("nope")
    model.user_dropout = torch.nn.Dropout(0.5)  # a submodule: model.train() turns it on
    model.add_hook("blocks.0.hook_resid_post", lambda x, hook: model.user_dropout(x),
                   is_permanent=True)
    model.train()
    model.blocks[1].eval()  # a mixed mode the caller chose: restored exactly too
    return model


def _modes(model):
    return [m.training for m in model.modules()]


def _tables(out):
    if isinstance(out, dict):
        return [v for v in out.values()]
    if hasattr(out, "table"):
        return [out.table]
    return [out]


def _equal(a, b):
    for x, y in zip(_tables(a), _tables(b), strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, equal_nan=True, rtol=0, atol=0)
        else:
            pd.testing.assert_frame_equal(x, y)


ENTRY_POINTS = {
    "adjacency_by_layer": lambda m, t: adjacency_by_layer(m, t),
    "similarity_by_layer": lambda m, t: similarity_by_layer(m, t),
    "variance_by_layer": lambda m, t: variance_by_layer(m, t),
    "previous_token_scores": lambda m, t: previous_token_scores(m, t),
    "probe_positions": lambda m, t: probe_positions(
        m, t, layers=[0], features=("cosine",), seeds=(0,),
        config=ProbeConfig(hidden=8, max_epochs=3)),
    "inspect_heads": lambda m, t: inspect_heads(m, t, ablate=True, n_null=20),
    "ablation_effect": lambda m, t: ablation_effect(m, t, QKIntervention("symmetric", 1)),
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_train_mode_gives_the_eval_numbers_and_is_restored(name):
    model = _model_in_train_mode()
    tokens = random_tokens(model, 9, 12)
    before = _modes(model)
    first = ENTRY_POINTS[name](model, tokens)
    assert _modes(model) == before  # the caller's modes, module by module
    second = ENTRY_POINTS[name](model, tokens)
    _equal(first, second)
    model.eval()  # the same numbers as the model in eval mode
    _equal(first, ENTRY_POINTS[name](model, tokens))


def test_eval_mode_restores_after_an_error():
    from posinterp.models.backend import eval_mode

    model = _model_in_train_mode()
    before = _modes(model)
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not any(_modes(model))
        raise RuntimeError("inside")
    assert _modes(model) == before
