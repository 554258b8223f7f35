"""``load_model``'s weight-processing flags and what they do to the residual stream (issue 39,
item 9; docs/models.md, "Weight processing").

``pi.load_model(folder)`` applies TransformerLens's ``from_pretrained`` defaults, including
``center_writing_weights=True``: every vector written to the residual stream has its mean
over d_model removed, so cosines and adjacency differ from the same folder booted by the
user without processing (TL 4: ``TransformerBridge.boot_transformers``; TL 3.9:
``HookedTransformer.from_pretrained_no_processing``). Checked on a tiny LayerNorm GPT-2
(centring applies only to LayerNorm models):

* with ``center_writing_weights=False`` the residual stream equals the user's own model's
  (fold_ln, fold_value_biases and center_unembed leave it unchanged), and so does adjacency;
* with the default it equals the user's residual minus its mean over d_model (the closed
  form of centring), and ``ModelInfo.processing`` says centring was applied.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import posinterp as pi
from posinterp.models import backend
from tests.helpers import HF_VOCAB, save_tiny_checkpoint, tiny_hf_configs, write_hub_cache
from tests.test_inspect_text import _tokenizer

# Residual values are about 0.1 here; float32 rounding of the two computations (folded vs
# unfolded layer norms) stays below 1e-7 (measured: 2e-8).
RESID_TOL = 1e-6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("processing") / "gpt2-absolute"
    save_tiny_checkpoint("GPT2LMHeadModel", tiny_hf_configs()["gpt2-absolute"], path, sharpen=1.0)
    _tokenizer(False).save_pretrained(path)
    # TL 3.9's GPT-2 converter reads n_ctx, which transformers 5 no longer writes (DESIGN §6)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "n_ctx": cfg["n_positions"]}))
    return path


def _users_own(folder, tmp_path):
    """The model a TransformerLens user builds from the checkpoint, without posinterp and
    without weight processing."""
    if backend.TL_MAJOR >= 4:
        from transformer_lens.model_bridge import TransformerBridge

        return TransformerBridge.boot_transformers(str(folder), device="cpu").eval()
    from transformer_lens import HookedTransformer

    cache = tmp_path / "hf-cache"  # TL 3.9 takes hub names only: the folder as "gpt2"
    write_hub_cache(cache, "gpt2", folder)
    return HookedTransformer.from_pretrained_no_processing(
        "gpt2", cache_dir=str(cache), device="cpu",
        tokenizer=transformers.AutoTokenizer.from_pretrained(str(folder))).eval()


def _resid(model, tokens):
    hooks = [h for h, _ in pi.residual_hooks(model)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in hooks)
    return {h: cache[h] for h in hooks}


def _adjacency(model, tokens):
    df = pi.adjacency_by_layer(model, tokens)
    return df[df.metric == "adjacency_score"].set_index("hook").value


def test_centring_is_what_separates_load_model_from_the_users_own_boot(folder, tmp_path,
                                                                       no_network):
    tokens = torch.randint(0, HF_VOCAB, (4, 24), generator=torch.Generator().manual_seed(0))
    user = _users_own(folder, tmp_path)
    want = _resid(user, tokens)

    off, info_off = pi.load_model(folder, center_writing_weights=False, device="cpu")
    assert info_off.processing["center_writing_weights"] is False
    got = _resid(off, tokens)
    assert got.keys() == want.keys()
    for hook in want:
        torch.testing.assert_close(got[hook], want[hook], atol=RESID_TOL, rtol=0)
    # equal streams, equal scores (no two cosines here are within rounding of each other)
    adj_user, adj_off = _adjacency(user, tokens), _adjacency(off, tokens)
    assert (adj_off - adj_user).abs().max() <= 1e-9

    default, info = pi.load_model(folder, device="cpu")
    assert info.processing == {"fold_ln": True, "center_writing_weights": True,
                               "center_unembed": True, "fold_value_biases": True}
    centred = _resid(default, tokens)
    for hook in want:  # the closed form of centring: each vector minus its mean over d_model
        torch.testing.assert_close(centred[hook], want[hook] - want[hook].mean(-1, keepdim=True),
                                   atol=RESID_TOL, rtol=0)
    adj_default = _adjacency(default, tokens)
    for hook in want:  # the default's scores are those of the user's stream, centred
        x = want[hook] - want[hook].mean(-1, keepdim=True)
        score = pi.adjacency_score(pi.cosine_self_similarity(x)).score
        assert abs(float(score) - adj_default[hook]) <= 1e-9
    # and they are not the user's own: the difference the issue reported (0.015-0.018 there)
    assert (adj_default - adj_user).abs().max() > 1e-3


def test_every_flag_is_taken_by_its_transformerlens_name_and_recorded(folder):
    flags = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")
    _, info = pi.load_model(folder, device="cpu", fold_ln=False, center_writing_weights=False,
                            center_unembed=False, fold_value_biases=False)
    assert info.processing == dict.fromkeys(flags, False)
    _, info = pi.load_model(folder, device="cpu", fold_value_biases=False)
    assert info.processing == {**dict.fromkeys(flags, True), "fold_value_biases": False}
