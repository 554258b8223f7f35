"""Hooks are used for what they were verified to carry, never for their names (issue 21
item 5), and score interventions change only the content term (issue 22 item 1).

References are closed forms computed here from the cached q and k of a clean run:
symmetrized scores are (c_ij + c_ji)/2 + (everything else the scores held), and where a
model has no pre-softmax hook, the pattern is softmax of that.
"""

from __future__ import annotations

import pytest
import torch

import posinterp as pi
from posinterp.interventions import QKIntervention, ablation_effect, intervene, intervention_hooks
from posinterp.models import backend
from tests.helpers import parity_cases, random_tokens, save_tiny_checkpoint, tiny_hf_configs, tiny_model

HF_FOLDERS = {"gpt2": ("GPT2LMHeadModel", "gpt2-absolute"),
              "bloom": ("BloomForCausalLM", "bloom-12-heads"),
              "llama": ("LlamaForCausalLM", "llama-gqa")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hook-meaning")
    out = {}
    configs = tiny_hf_configs()
    for key, (arch, name) in HF_FOLDERS.items():
        save_tiny_checkpoint(arch, configs[name], root / key)
        out[key] = root / key
    cases = parity_cases()
    for key in ("opt", "gptneo-local"):
        arch, make, _ = cases[key]
        save_tiny_checkpoint(arch, make(), root / key)
        out[key] = root / key
    return out


def _model(kind, folders):
    if kind.startswith("toy-"):
        return tiny_model(kind.removeprefix("toy-"))
    return pi.load_model(folders[kind])[0]


def _content(model, cache, layer=0):
    q_name, k_name = backend.content_qk_hooks(model, layer)
    q, k = cache[q_name].double(), cache[k_name].double()
    if k.shape[2] != q.shape[2]:
        k = torch.repeat_interleave(k, q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bihd,bjhd->bhij", q, k) / backend.attn_scale(model, layer)


def _user_edit(scores, hook):
    """A user's own edit before the intervention: +3 on key 2 of head 1, knockouts of
    (5, 1) as -1e30 and (6, 3) as finfo.min in every head."""
    scores = scores.clone()
    scores[:, 1, :, 2] += 3.0
    scores[:, :, 5, 1] = -1e30
    scores[:, :, 6, 3] = torch.finfo(scores.dtype).min
    return scores


@pytest.mark.parametrize("kind", ["toy-rotary", "toy-alibi", "gpt2", "bloom", "llama"])
@pytest.mark.parametrize("iv_kind", ["symmetric", "antisymmetric"])
def test_symmetrization_keeps_every_upstream_edit(kind, iv_kind, folders):
    model = _model(kind, folders)
    n = 9
    toks = random_tokens(model, 2, n, seed=3)
    name = backend.scores_hook(model, 0)
    _, clean = model.run_with_cache(toks)
    c = _content(model, clean)
    with model.hooks(fwd_hooks=[(name, _user_edit)]):  # the user's hook comes first
        _, edited = model.run_with_cache(toks, names_filter=name)
        seen = {}
        hooks = intervention_hooks(model, QKIntervention(iv_kind, 0)) + [
            (name, lambda x, hook: seen.setdefault("s", x.detach()))]
        model.run_with_hooks(toks, fwd_hooks=hooks)
    sign = 1.0 if iv_kind == "symmetric" else -1.0
    other = edited[name].double() - c  # bias, mask and the user's edit
    want = 0.5 * (c + sign * c.mT) + other
    got = seen["s"].double()
    live = torch.ones(n, n, dtype=torch.bool).tril()
    live[5, 1] = live[6, 3] = False
    torch.testing.assert_close(got[..., live], want[..., live], rtol=1e-5, atol=1e-4)
    assert (got[..., 5, 1] <= -1e30).all() and (got[..., 6, 3] <= -1e30).all()
    # the +3 is still there: against the same intervention without the user's edit
    plain = {}
    model.run_with_hooks(toks, fwd_hooks=intervention_hooks(model, QKIntervention(iv_kind, 0)) + [
        (name, lambda x, hook: plain.setdefault("s", x.detach()))])
    diff = (got - plain["s"].double())[:, 1, 2:, 2]
    torch.testing.assert_close(diff, torch.full_like(diff, 3.0), rtol=0, atol=1e-4)


def test_reweighted_pattern_is_the_softmax_of_shifted_scores():
    from posinterp.interventions.qk import reweight_pattern

    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 6, 6, generator=g, dtype=torch.float64) * 4
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    s = s.masked_fill(~causal, float("-inf"))
    d = torch.randn(2, 3, 6, 6, generator=g, dtype=torch.float64)
    got = reweight_pattern(s.softmax(-1).float(), d)
    torch.testing.assert_close(got, (s + d).softmax(-1), rtol=1e-5, atol=1e-7)
    # an allowed key whose probability underflowed, which the delta would raise: refused
    s2 = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    s2[..., 1, 0] = -200.0
    s2[..., 0, 1] = float("-inf")
    d2 = torch.zeros_like(s2)
    d2[..., 1, 0] = 250.0
    with pytest.raises(ValueError, match="underflowed"):
        reweight_pattern(s2.softmax(-1).float(), d2)
    torch.testing.assert_close(reweight_pattern(s2.softmax(-1).double(), d2), (s2 + d2).softmax(-1))


def _neo_scale(kind, model):
    """HF's own divisor: OPT scales q by head_dim**-0.5; GPT-Neo never scales."""
    return 1.0 if kind == "gptneo-local" else model.cfg.d_head ** 0.5


@pytest.mark.parametrize("kind", ["opt", "gptneo-local"])
def test_symmetrization_acts_on_opt_and_gpt_neo(kind, folders):
    """TL 4.3 fires their hook_attn_scores after the softmax with the pattern; the
    intervention changed nothing there (issue 21 item 5). Now, on either line, the
    pattern is softmax((c + c^T)/2, causal) with c from HF's own scale, and the attention
    output is Σ_h p'_h v_h W_O,h + b_O."""
    model = _model(kind, folders)
    n = 10
    toks = random_tokens(model, 2, n, seed=4)
    _, clean = model.run_with_cache(toks)
    q = clean["blocks.0.attn.hook_q"].double()
    k = clean["blocks.0.attn.hook_k"].double()
    c = torch.einsum("bihd,bjhd->bhij", q, k) / _neo_scale(kind, model)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    want = (0.5 * (c + c.mT)).masked_fill(~causal, float("-inf")).softmax(-1)
    with intervene(model, QKIntervention("symmetric", 0)):
        logits, cache = model.run_with_cache(toks)
    p = cache["blocks.0.attn.hook_pattern"].double()
    torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-5)
    v = cache["blocks.0.attn.hook_v"].double()
    w = backend.attention_weights(model, 0)
    b_O = model.blocks[0].attn.b_O.detach().double()
    out = torch.einsum("bhij,bjhd,hdm->bim", want, v, w["W_O"]) + b_O
    torch.testing.assert_close(cache["blocks.0.hook_attn_out"].double(), out, rtol=1e-4, atol=1e-4)
    eff = ablation_effect(model, toks, QKIntervention("symmetric", 0))
    assert abs(float(eff[eff.metric == "loss"].value.iloc[0])) > 1e-4


@pytest.mark.parametrize("kind", ["opt", "gptneo-local"])
def test_inspect_score_kernel_is_never_a_pattern(kind, folders):
    """The "pre-softmax score" kernel comes from a verified hook, or is left out with a note."""
    model = _model(kind, folders)
    toks = random_tokens(model, 2, 8, seed=5)
    res = pi.inspect_heads(model, toks, n_null=20)
    kernel = res.table[res.table.metric == "kernel_score"]
    if backend.hook_meaning(model, 0).scores is None:
        assert kernel.empty and any("pre-softmax" in note for note in res.notes)
    else:
        # a pre-softmax score is not confined to [0, 1]
        assert kernel.value.abs().max() > 1.0 or (kernel.value < 0).any()


def test_verdict_is_cached_on_the_model_object(folders):
    model = _model("gpt2", folders).train()  # HF's dropout (TL 4) would make any edit "take effect"
    calls = []
    model.add_hook("blocks.0.attn.hook_pattern", lambda x, hook: calls.append(1))
    first = backend.hook_meaning(model, 0)
    assert model.training  # the caller's mode is restored
    assert first.scores is not None and first.query_qk is not None
    assert backend.hook_meaning(model, 0) is first
    assert not calls  # the probe hides the user's hooks and never fires them
    assert "posinterp_hook_meaning" in model.__dict__
    other = _model("gpt2", folders)
    assert "posinterp_hook_meaning" not in other.__dict__  # no module-level state
    model.reset_hooks()


def test_compiled_models_take_the_intervention():
    """Issue 22 item 5: hooks do not fire inside a compiled graph. model.compile() runs
    eagerly inside intervene; a torch.compile wrapper is refused by name there, and the
    analyses unwrap it."""
    model = tiny_model("rotary")
    toks = random_tokens(model, 2, 8, seed=6)
    iv = QKIntervention("symmetric", 0)
    clean = model(toks)
    with intervene(model, iv):
        want = model(toks)
    assert not torch.allclose(want, clean)
    want_eff = ablation_effect(model, toks, iv)
    model.compile()
    model(toks)  # the graph is built before any hook (then the old code's hooks never fired)
    assert backend.compiled_kind(model) == "model.compile()"
    with intervene(model, iv):
        got = model(toks)
    torch.testing.assert_close(got, want)
    eff = ablation_effect(model, toks, iv)
    torch.testing.assert_close(torch.tensor(eff.value.values), torch.tensor(want_eff.value.values))
    assert backend.compiled_kind(model) == "model.compile()"  # compiled again afterwards
    wrapper = torch.compile(tiny_model("rotary"))
    with pytest.raises(backend.CompiledModelError, match="_orig_mod"):
        with intervene(wrapper, iv):
            pass
    eff = ablation_effect(wrapper, toks, iv)
    torch.testing.assert_close(torch.tensor(eff.value.values), torch.tensor(want_eff.value.values))


@pytest.mark.skipif(backend.TL_MAJOR < 4, reason="a TransformerLens 4 native model")
@pytest.mark.parametrize("pe", ["standard", "rotary"])
def test_native_models_not_built_by_posinterp(pe):
    """TL 4 native models fire hook_attn_scores with the pattern and never fire
    hook_rot_q: symmetrization goes through the pattern; the content variant on RoPE,
    which needs the rotated q/k, is refused by name; the offset variant works."""
    from transformer_lens import TransformerBridgeConfig
    from transformer_lens.model_bridge.sources.native import boot

    model = boot(TransformerBridgeConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, n_ctx=8,
                                         d_vocab=11, positional_embedding_type=pe, seed=0))
    toks = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(0))
    _, clean = model.run_with_cache(toks)
    with pytest.raises(backend.MissingFeatureError, match="post-softmax pattern"):
        backend.scores_hook(model, 0)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    q, k = clean["blocks.0.attn.hook_q"].double(), clean["blocks.0.attn.hook_k"].double()
    scale = backend.attn_scale(model)
    if pe == "rotary":
        with pytest.raises(backend.MissingFeatureError, match="hook_rot_q"):
            intervention_hooks(model, QKIntervention("symmetric", 0))
        spec = backend.rotary_spec(model)
        pos = torch.arange(7)[None].expand(2, 7)
        qr, kr = backend.rope_rotate(q, spec, pos), backend.rope_rotate(k, spec, pos)
        o = torch.einsum("bihd,bjhd->bhij", qr, kr)
        # offset-symmetric: s[i, j] = q_j R(i - j) k_i, rotating q_j to i and k_i to j
        s = torch.zeros_like(o)
        for i in range(7):
            for j in range(7):
                qi = backend.rope_rotate(q[:, j:j + 1], spec, torch.full((2, 1), i))
                kj = backend.rope_rotate(k[:, i:i + 1], spec, torch.full((2, 1), j))
                s[:, :, i, j] = torch.einsum("bhd,bhd->bh", qi[:, 0], kj[:, 0])
        sym = 0.5 * (o + s) / scale
        iv = QKIntervention("symmetric", 0, rope_variant="offset")
    else:
        c = torch.einsum("bihd,bjhd->bhij", q, k)
        sym = 0.5 * (c + c.mT) / scale
        iv = QKIntervention("symmetric", 0)
    want = sym.masked_fill(~causal, float("-inf")).softmax(-1)
    with intervene(model, iv):
        _, cache = model.run_with_cache(toks)
    torch.testing.assert_close(cache["blocks.0.attn.hook_pattern"].double(), want, rtol=1e-4, atol=1e-5)


def test_content_symmetrization_on_gpt_neox_uses_the_calls_rotation(tmp_path):
    """TL 4's GPT-NeoX bridge never fires hook_rot_q (the content variant stopped with
    KeyError 'blocks.0.attn.hook_rot_q'); its hook_q/hook_k with the call's cos/sin are
    verified instead. Closed form: (c_ij + c_ji)/2 with c from q, k rotated here at the
    mask's positions (a left-padded row included)."""
    arch, make, _ = parity_cases()["neox"]
    save_tiny_checkpoint(arch, make(), tmp_path / "neox")
    model = pi.load_model(tmp_path / "neox", fold_ln=False, center_writing_weights=False,
                          center_unembed=False, fold_value_biases=False)[0]
    n = 10
    toks = random_tokens(model, 2, n, seed=7)
    mask = torch.ones_like(toks)
    mask[1, :3] = 0
    _, clean = model.run_with_cache(toks, attention_mask=mask)
    spec = backend.rotary_spec(model)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    q = backend.rope_rotate(clean["blocks.0.attn.hook_q"], spec, pos)
    k = backend.rope_rotate(clean["blocks.0.attn.hook_k"], spec, pos)
    c = torch.einsum("bihd,bjhd->bhij", q, k) / backend.attn_scale(model)
    seen = {}
    name = backend.scores_hook(model, 0)
    model.run_with_hooks(toks, attention_mask=mask, fwd_hooks=intervention_hooks(
        model, QKIntervention("symmetric", 0)) + [(name, lambda x, hook: seen.setdefault("s", x))])
    live = torch.ones(n, n, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :] & mask.bool()[:, :, None]
    live = live[:, None].expand_as(c)
    torch.testing.assert_close(seen["s"].double()[live], (0.5 * (c + c.mT))[live], rtol=1e-4, atol=1e-4)


def test_symmetrization_uses_gpt2_inverse_layer_scaling(tmp_path):
    """GPT-2's scale_attn_by_inverse_layer_idx divides layer l's scores by l + 1 as well;
    the content term used to be divided by sqrt(d_head) only. Closed form from HF's own
    scaling: c = q·k / (sqrt(d_head) (l + 1))."""
    arch, make, _ = parity_cases()["gpt2-inverse-layer-scale"]
    save_tiny_checkpoint(arch, make(), tmp_path / "gpt2-inv")
    model = pi.load_model(tmp_path / "gpt2-inv")[0]
    layer, n = 1, 9
    toks = random_tokens(model, 2, n, seed=8)
    _, clean = model.run_with_cache(toks)
    q = clean[f"blocks.{layer}.attn.hook_q"].double()
    k = clean[f"blocks.{layer}.attn.hook_k"].double()
    c = torch.einsum("bihd,bjhd->bhij", q, k) / (model.cfg.d_head ** 0.5 * (layer + 1))
    seen = {}
    name = backend.scores_hook(model, layer)
    model.run_with_hooks(toks, fwd_hooks=intervention_hooks(model, QKIntervention("symmetric", layer)) + [
        (name, lambda x, hook: seen.setdefault("s", x))])
    live = torch.ones(n, n, dtype=torch.bool).tril()
    torch.testing.assert_close(seen["s"].double()[..., live], (0.5 * (c + c.mT))[..., live],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["opt", "gptneo-local", "llama"])
def test_patterns_read_through_run_cached_are_hf_attentions(kind, folders):
    """Every analysis reads patterns through backend.run_cached, which verifies the hook's
    meaning first; on OPT and GPT-Neo (TL 4.3 fires their hook_pattern after the module
    returned) what it hands back is HF's own attention, and so is previous_token_scores'."""
    import transformers

    model = _model(kind, folders)
    toks = random_tokens(model, 2, 8, seed=3)
    cache = backend.run_cached(model, toks, None, lambda n: n.endswith("hook_pattern"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folders[kind], attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(toks, output_attentions=True).attentions
    for layer in range(model.cfg.n_layers):
        got = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert (got - want[layer]).abs().max() < 1e-5
    scores = pi.previous_token_scores(model, toks)
    prev = want[0][..., torch.arange(1, 8), torch.arange(0, 7)].mean(dim=(0, 2))
    row = scores[(scores.layer == 0)].sort_values("head").value.to_numpy()
    assert abs(row - prev.numpy()).max() < 1e-5


def test_an_unverified_pattern_hook_is_refused_by_name(monkeypatch):
    """A hook_pattern the probe could not tie to the layer's attention is never read."""
    model = tiny_model("rotary")
    verdicts = {layer: backend.hook_meaning(model, layer) for layer in range(model.cfg.n_layers)}
    blind = backend.HookMeaning(None, None, False, None, None, None, "a test's stand-in verdict")
    model.__dict__["posinterp_hook_meaning"] = {**verdicts, 1: blind}
    toks = random_tokens(model, 1, 6, seed=0)
    backend.run_cached(model, toks, None, "blocks.0.attn.hook_pattern")  # layer 0 verified
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.hook_pattern .*stand-in verdict"):
        backend.run_cached(model, toks, None, lambda n: n.endswith("hook_pattern"))
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.hook_pattern"):
        pi.previous_token_scores(model, toks)


def _sequential_edits(model, tokens, clean, edits):
    """The probe's edit checks one forward pass per edit, on the same sequence, with the
    same noise (the reference for the batched checks)."""
    from posinterp.models.backend import probe
    return [probe._changes_output(model, tokens[:1], clean[:1], [(n, probe._noise(s))])
            for n, s in edits]


@pytest.mark.parametrize("kind", ["toy-rotary", "toy-alibi", "gpt2", "bloom", "llama", "opt",
                                  "gptneo-local"])
def test_batched_edit_checks_give_the_one_edit_per_pass_verdicts(kind, folders, monkeypatch):
    """The probe checks its edits in batched passes (copy c of the probe batch carries edit c);
    every layer's verdict, messages included, equals checking them one pass per edit. OPT and
    GPT-Neo are the models where some edits are discarded (TL 4), so both outcomes occur."""
    from posinterp.models.backend import probe
    model = _model(kind, folders)
    with torch.no_grad():
        batched = probe._probe(model)
        monkeypatch.setattr(probe, "_edits_change_output", _sequential_edits)
        assert probe._probe(model) == batched


def test_batched_edit_checks_fall_back_where_batch_elements_interact(folders, monkeypatch):
    """A model whose batch elements interact (a hook adding the batch mean to the residual
    stream) breaks the batched check's premise; the unedited copies then differ from the
    clean run and every edit is checked in its own pass: same verdicts as the reference."""
    from posinterp.models.backend import probe
    model = _model("gpt2", folders)

    def couple(x, hook):
        return x + x.mean(0, keepdim=True)
    model.blocks[0].hook_resid_mid.register_forward_hook(lambda m, i, o: couple(o, None))
    passes = []
    seq = probe._changes_output
    monkeypatch.setattr(probe, "_changes_output", lambda *a: passes.append(1) or seq(*a))
    with torch.no_grad():
        batched = probe._probe(model)
        assert passes  # the fallback ran
        monkeypatch.setattr(probe, "_edits_change_output", _sequential_edits)
        assert probe._probe(model) == batched
