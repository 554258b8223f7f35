"""A site another plugin took over is still scored (issue 22, item 6).

SAELens attaches an SAE by putting the SAE module where the HookPoint was
(``HookedSAETransformer.add_sae``: ``set_deep_attr`` then ``setup()``, so on TL 3.9 the
name leaves ``hook_dict``; TL 4's ``SAETransformerBridge`` sets the SAE at the resolved
hook path and registers it and its inner hooks in ``_hook_registry``). The emulation
below does the same to a tiny model, without SAELens. The SAE's output is what the rest
of the model reads at that site; posinterp must score it, not drop the row.
"""

from __future__ import annotations

import torch
from transformer_lens.hook_points import HookPoint

from posinterp.analysis import (
    adjacency_by_layer,
    adjacency_score,
    cosine_self_similarity,
    site_hooks,
    variance_by_layer,
)
from posinterp.analysis.variance import position_variance
from posinterp.models.backend import is_bridge
from tests.helpers import random_tokens, tiny_model

SITE = "blocks.0.hook_resid_post"


class ToySAE(torch.nn.Module):
    """encode -> ReLU -> decode, with SAELens's inner hook names."""

    def __init__(self, d_model: int):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.W_enc = torch.nn.Parameter(torch.randn(d_model, 2 * d_model, generator=gen) / d_model ** 0.5)
        self.W_dec = torch.nn.Parameter(torch.randn(2 * d_model, d_model, generator=gen) / d_model ** 0.5)
        self.hook_sae_input, self.hook_sae_acts_post = HookPoint(), HookPoint()
        self.hook_sae_output = HookPoint()

    def forward(self, x):
        acts = self.hook_sae_acts_post(torch.relu(self.hook_sae_input(x) @ self.W_enc))
        return self.hook_sae_output(acts @ self.W_dec)


def _set_deep_attr(obj, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    setattr(obj, last, value)


def attach_sae(model, name: str) -> str:
    """Attach a ToySAE at ``name`` as SAELens does; return the SAE output hook's name."""
    sae = ToySAE(model.cfg.d_model)
    if not is_bridge(model):  # HookedSAETransformer.add_sae
        _set_deep_attr(model, name, sae)
        model.setup()
        return f"{name}.hook_sae_output"
    aliases = {**model.hook_aliases, **model._collect_hook_aliases_from_registry()}
    actual = aliases.get(name, name)  # SAETransformerBridge.add_sae
    _set_deep_attr(model, actual, sae)
    model._hook_registry[actual] = sae
    for inner, hook in sae.named_modules():
        if isinstance(hook, HookPoint) and inner:
            hook.name = f"{actual}.{inner}"
            model._hook_registry[hook.name] = hook
    return f"{actual}.hook_sae_output"


def _sae_output(model, tokens, out_hook):
    """The SAE's output, read through its own inner hook (not posinterp's path)."""
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == out_hook)
    return cache[out_hook]


def test_adjacency_scores_the_site_an_sae_took_over():
    model = tiny_model("nope")
    tokens = random_tokens(model, 4, 10)
    before = adjacency_by_layer(model, tokens)
    out_hook = attach_sae(model, SITE)
    after = adjacency_by_layer(model, tokens)
    assert len(after) == len(before) == 1 + 4 * model.cfg.n_layers
    assert list(after.hook) == list(before.hook)
    want = adjacency_score(cosine_self_similarity(_sae_output(model, tokens, out_hook))).score
    assert after.set_index("hook").value[SITE] == want
    assert SITE in dict(site_hooks(model))


def test_variance_reads_the_sae_output_too():
    model = tiny_model("nope")
    tokens = random_tokens(model, 3, 8)
    out_hook = attach_sae(model, SITE)
    df = variance_by_layer(model, tokens)
    got = df[df.hook == SITE].sort_values("position").value.to_numpy()
    want = position_variance(_sae_output(model, tokens, out_hook)).mean(0).numpy()
    assert got.shape == want.shape and (abs(got - want) <= 1e-12 * abs(want).max()).all()
