"""stories260K (a real trained llama2.c model) against an independent numpy forward."""

from pathlib import Path

import numpy as np
import pytest
import torch

from posinterp.models import load_model
from tests.models import llama2c_reference as ref

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K.bin"
needs_stories = pytest.mark.skipif(
    not STORIES.is_file(), reason=f"{STORIES} not present (the shared test models are only on "
    "the developers' machines)")


@pytest.fixture(scope="module")
def stories():
    model, info = load_model(STORIES)
    cfg, weights = ref.read(STORIES)
    return model, info, cfg, weights


@needs_stories
def test_info(stories):
    model, info, _, _ = stories
    assert info.source == "llama2c" and info.pe == "rotary"
    assert (info.n_heads, info.n_kv_heads, info.d_head, info.rotary_dim) == (8, 4, 8, 8)
    assert info.rotary_adjacent_pairs is True and info.rotary_base == 10000
    assert info.processing["fold_ln"] is False and len(info.weights["sha256"]) == 64


@needs_stories
def test_logits_match_independent_reference(stories):
    model, _, cfg, weights = stories
    rng = np.random.default_rng(0)
    toks = [1, *rng.integers(3, 512, 23).tolist()]
    want = ref.forward_tokens(cfg, weights, toks)
    with torch.no_grad():
        got = model(torch.tensor([toks]))[0].double().numpy()
    assert np.abs(got - want).max() < 1e-4


@needs_stories
def test_greedy_continuation_from_bos_matches_reference(stories):
    model, _, cfg, weights = stories
    n_new = 64
    want = ref.greedy(cfg, weights, n_new)
    toks = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(n_new):
            toks = torch.cat([toks, model(toks)[:, -1].argmax(-1, keepdim=True)], 1)
    assert toks[0].tolist() == want


@needs_stories
def test_score_and_rotated_qk_hooks_match_the_reference(stories):
    """The hooks backend names carry run.c's pre-softmax scores and RoPE'd q/k (on TL 4
    posinterp's attention fires them; TL-native's would carry the pattern)."""
    from posinterp.models.backend import rotated_qk_hooks, scores_hook

    model, _, cfg, weights = stories
    toks = [1, *np.random.default_rng(1).integers(3, 512, 11).tolist()]
    rec: dict = {}
    ref.forward_tokens(cfg, weights, toks, record=rec)
    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([toks]))
    n, hs = len(toks), cfg["hs"]
    for layer in range(cfg["n_layers"]):
        scores = cache[scores_hook(model, layer)][0].double().numpy()  # [head, q, k]
        for pos in range(n):
            np.testing.assert_allclose(scores[:, pos, : pos + 1], rec["scores"][layer][pos], atol=1e-4)
            assert np.isneginf(scores[:, pos, pos + 1:]).all()
        q_name, k_name = rotated_qk_hooks(model, layer)
        q = cache[q_name][0].double().numpy().reshape(n, -1)  # [pos, head * d_head]
        k = cache[k_name][0].double().numpy().reshape(n, -1)
        np.testing.assert_allclose(q, np.stack(rec["q"][layer]), atol=1e-4)
        np.testing.assert_allclose(k, np.stack(rec["k"][layer]), atol=1e-4)
        assert k.shape[1] == cfg["n_kv"] * hs


@needs_stories
def test_editing_the_scores_hook_changes_the_output(stories):
    from posinterp.models.backend import scores_hook

    model = stories[0]
    toks = torch.tensor([[1, 40, 50, 60, 70]])

    def flatten(scores, hook):
        return torch.where(torch.isinf(scores), scores, torch.zeros_like(scores))

    with torch.no_grad():
        plain = model(toks)
        edited = model.run_with_hooks(toks, fwd_hooks=[(scores_hook(model, 0), flatten)])
    assert (plain - edited).abs().max() > 1e-3


@needs_stories
def test_processed_load_computes_the_same_distribution(stories):
    """fold_ln, center_writing_weights, center_unembed, fold_value_biases preserve
    log-probabilities (TL 3.9's processing; TL 4 runs TL's own ProcessWeights)."""
    raw = stories[0]
    folded, info = load_model(STORIES, fold_ln=True, center_writing_weights=True,
                              center_unembed=True, fold_value_biases=True)
    assert info.qk_convention["norm_gain"] == "folded by the loader"
    toks = torch.tensor([[1, *np.random.default_rng(2).integers(3, 512, 15).tolist()]])
    with torch.no_grad():
        a, b = raw(toks).log_softmax(-1), folded(toks).log_softmax(-1)
    assert (a - b).abs().max() < 1e-4


@needs_stories
def test_truncated_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "truncated.bin"
    bad.write_bytes(STORIES.read_bytes()[:100_000])
    with pytest.raises(ValueError, match=r"truncated\.bin: file has 100000 bytes but its header"):
        load_model(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["truncated.bin"]


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.bin")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a valid llama2.c"):
        load_model(junk)


def _tiny_llama2c(path, seed=0):
    """A random llama2.c (version 0) file: header, then every array run.c reads."""
    import struct

    from posinterp.models.sources.llama2c import Llama2cHeader, _sizes

    header = Llama2cHeader(dim=16, hidden_dim=32, n_layers=1, n_heads=2, n_kv_heads=2,
                           vocab_size=32, seq_len=16)
    n = sum(int(np.prod(shape)) for _, shape in _sizes(header))
    floats = np.random.default_rng(seed).normal(0, 0.1, n).astype("<f4")
    path.write_bytes(struct.pack("<7i", *vars(header).values()) + floats.tobytes())
    return path


def test_random_inputs_start_with_llama2cs_bos_like_sampled_ones(tmp_path):
    """run.c starts every sequence with token 1 and the .bin has no tokenizer: the loaded
    model says so, so "BOS first" inputs (random, repeated, sampled) agree."""
    import json

    from posinterp.analysis.heads import random_tokens, repeated_random_tokens
    from posinterp.experiments.inspect import run_inspect
    from posinterp.models.backend import bos_token_id
    from posinterp.models.sources.llama2c import BOS_ID

    path = _tiny_llama2c(tmp_path / "tiny.bin")
    model, info = load_model(path)
    assert getattr(model, "tokenizer", None) is None
    assert bos_token_id(model) == BOS_ID == 1
    assert (random_tokens(model, 3, 8)[:, 0] == BOS_ID).all()
    rep = repeated_random_tokens(model, 2, 5)
    assert rep.shape == (2, 11) and (rep[:, 0] == BOS_ID).all() and (rep[:, 1:] != BOS_ID).all()
    run_inspect(str(path), tmp_path / "out", n_tokens=8, batch=2, progress=False)
    assert "BOS first" in json.loads((tmp_path / "out" / "run.json").read_text())["input"]


def test_a_model_without_grouped_query_heads_matches_the_reference(tmp_path):
    """n_kv_heads == n_heads (stories260K has 4 of 8): TL 3.9 names such heads W_K/W_V."""
    path = _tiny_llama2c(tmp_path / "mha.bin", seed=1)
    model, info = load_model(path)
    assert info.n_kv_heads == info.n_heads == 2
    cfg, weights = ref.read(path)
    toks = [1, *np.random.default_rng(0).integers(2, 32, 12).tolist()]
    with torch.no_grad():
        got = model(torch.tensor([toks]))[0].double().numpy()
    assert np.abs(got - ref.forward_tokens(cfg, weights, toks)).max() < 1e-4
