import dataclasses

import pytest
import torch

from posinterp.models import preset
from posinterp.tasks import TaskConfig
from posinterp.training import (
    TrainConfig,
    answer_loss,
    exact_match,
    latest_checkpoint,
    load_checkpoint,
    train,
)
from tests.helpers import tiny_task


def rehash(folder):
    """Rewrite a checkpoint's manifest for its current files (a consistent checkpoint)."""
    import hashlib
    import json

    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["sha256"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
                          for n in manifest["sha256"]}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _cfg(**kw):
    base = dict(max_steps=12, batch_size=8, eval_every=4, n_eval=32, checkpoint_every=5,
                warmup_steps=3, target_accuracy=None, seed=7)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("pe", ["nope", "rotary"])
def test_resume_reproduces_uninterrupted_parameters(tmp_path, pe):
    mc = preset("tiny", pe=pe)
    data = tiny_task("reversal", n=100, max_digits=6)
    full = train(mc, data, _cfg(), progress=False)
    # Interrupt the same run during step 7: the last checkpoint is step 5.
    from posinterp.models import build_model

    victim = build_model(mc)
    calls = []

    def crash(act, hook):
        if victim.training:
            calls.append(1)
            if len(calls) == 7:
                raise KeyboardInterrupt

    victim.add_perma_hook("hook_embed", crash)
    with pytest.raises(KeyboardInterrupt):
        train(mc, data, _cfg(), checkpoint_dir=tmp_path, progress=False, model=victim)
    assert latest_checkpoint(tmp_path).name == "step_0000005"
    resumed = train(mc, data, _cfg(), checkpoint_dir=tmp_path, progress=False)
    assert resumed.steps == 12
    for (name, a), (_, b) in zip(full.model.state_dict().items(),
                                 resumed.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.history.equals(full.history)


def test_resume_refuses_a_different_config(tmp_path):
    mc = preset("tiny")
    data = tiny_task("reversal", n=50, max_digits=6)
    train(mc, data, _cfg(max_steps=5), checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="different model config"):
        train(preset("tiny", seed=1), data, _cfg(max_steps=5), checkpoint_dir=tmp_path,
              progress=False)


def test_checkpoint_round_trip(tmp_path):
    mc = preset("tiny", pe="alibi")
    data = tiny_task("addition", n=50)
    res = train(mc, data, _cfg(max_steps=5), checkpoint_dir=tmp_path, progress=False)
    model, configs = load_checkpoint(latest_checkpoint(tmp_path))
    assert configs["model"]["pe"] == "alibi" and configs["step"] == 5
    toks = data.test.tokens[:4]
    torch.testing.assert_close(model(toks), res.model(toks))


def test_loss_ignores_everything_but_answer_tokens():
    data = tiny_task("reversal", n=20, max_digits=6)
    s = data.train
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*s.tokens.shape, 27, generator=gen)
    base = answer_loss(logits, s.tokens, s.answer_mask)
    # Perturbing predictions at positions that do not predict an answer token is free.
    not_target = ~s.answer_mask[:, 1:].bool()
    noisy = logits.clone()
    noisy[:, :-1][not_target] += 5 * torch.randn(int(not_target.sum()), 27, generator=gen)
    assert answer_loss(noisy, s.tokens, s.answer_mask) == base
    # Perfect answer logits give exact match 1 and near-zero loss.
    perfect = torch.full_like(logits, -20.0)
    perfect[:, :-1].scatter_(-1, s.tokens[:, 1:, None], 20.0)
    assert exact_match(perfect, s.tokens, s.answer_mask).eq(1).all()
    assert answer_loss(perfect, s.tokens, s.answer_mask) < 1e-6
    # One wrong answer token breaks exact match for that sample only.
    r, t = 0, int(s.answer_mask[0].nonzero()[0]) - 1
    perfect[r, t] = perfect[r, t].flip(-1)
    em = exact_match(perfect, s.tokens, s.answer_mask)
    assert em[0] == 0 and em[1:].eq(1).all()


def test_train_config_errors():
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0)
    with pytest.raises(ValueError, match="target_accuracy"):
        TrainConfig(target_accuracy=1.5)
    with pytest.raises(ValueError, match="n_ctx"):
        train(preset("tiny", n_ctx=10), tiny_task("reversal", n=20), _cfg(), progress=False)


def test_two_threads_give_the_same_parameters_twice():
    # the embedding backward sums in a thread-dependent order unless fit makes it
    # deterministic; training amplifies the difference (seen in the demo)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        mc = preset("small", pe="nope")
        data = tiny_task("reversal", n=256, max_digits=6)
        cfg = _cfg(max_steps=4, batch_size=64, checkpoint_every=100, eval_every=100)
        a, b = (train(mc, data, cfg, progress=False, threads=None).model for _ in range(2))
    finally:
        torch.set_num_threads(before)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is restored


def test_training_is_not_resumed_across_transformerlens_majors(tmp_path):
    """A checkpoint records the TransformerLens that wrote it; resuming it under the other
    major version (other parameter names and shapes, so other optimizer state) is refused
    with both versions named; loading TL 4 weights under TL 3.9 (no converter back) too."""
    import json

    from posinterp.models.backend import TL_MAJOR

    mc = preset("tiny")
    data = tiny_task("reversal", n=50, max_digits=6)
    train(mc, data, _cfg(max_steps=5), checkpoint_dir=tmp_path, progress=False)
    last = latest_checkpoint(tmp_path)
    config = json.loads((last / "config.json").read_text())
    other = "3.9.0" if TL_MAJOR >= 4 else "4.3.0"
    config["versions"]["transformer-lens"] = other
    (last / "config.json").write_text(json.dumps(config))
    rehash(last)  # as the other version would have written it: not damage
    with pytest.raises(ValueError, match=f"TransformerLens {other}.*cannot be resumed"):
        train(mc, data, _cfg(max_steps=6), checkpoint_dir=tmp_path, progress=False)
    # Loading: TL 4 weights under TL 3.9 are refused by name; on TL 4 these weights are
    # labelled 3.9 but are a bridge's, which the conversion names too.
    match = ("not in that layout" if TL_MAJOR >= 4
             else f"TransformerLens {other}.*no conversion.*transformer-lens=={other}")
    with pytest.raises(ValueError, match=match):
        load_checkpoint(last)


def _tl3_checkpoint(folder, config, weights_seed: int):
    """A checkpoint as TL 3.9's train() writes it, built without TL 3.9: HookedTransformer
    names and per-head shapes (toy_state_dict), its buffers (causal mask, IGNORE, RoPE
    sin/cos tables), a config.json recording transformer-lens 3.9.0."""
    import json

    from safetensors.torch import save_file

    from posinterp.models.native import _tl39_rotary_tables
    from posinterp.models.toy import toy_state_dict

    sd = toy_state_dict(dataclasses.replace(config, seed=weights_seed))
    for layer in range(config.n_layers):
        p = f"blocks.{layer}.attn"
        sd[f"{p}.mask"] = torch.ones(config.n_ctx, config.n_ctx).tril().bool()
        sd[f"{p}.IGNORE"] = torch.tensor(-torch.inf)
        if config.pe == "rotary":
            cos, sin = _tl39_rotary_tables(config.d_head, config.n_ctx, config.rotary_base)
            sd[f"{p}.rotary_sin"], sd[f"{p}.rotary_cos"] = sin, cos
    if config.pe == "rotary":
        del sd["pos_embed.W_pos"]
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {"model": config.to_dict(), "step": 5, "versions": {"transformer-lens": "3.9.0"}}))
    torch.save({"step": 5}, folder / "trainer_state.pt")  # every train() checkpoint has one
    return folder


@pytest.mark.parametrize("pe", ["nope", "absolute", "rotary", "alibi"])
def test_a_tl39_checkpoint_loads_as_the_model_it_holds(tmp_path, pe):
    """TL 3.9 weights load on either line (on TL 4 through TL's convert_tl_checkpoint) and
    give the model built from those weights: the same logits as build_model of the seed
    that drew them (toy_state_dict is the same function on both lines)."""
    from posinterp.models.toy import build_model

    config = preset("tiny", pe=pe)
    folder = _tl3_checkpoint(tmp_path / "step_0000005", config, weights_seed=3)
    model, configs = load_checkpoint(folder)
    want = build_model(dataclasses.replace(config, seed=3))
    assert not torch.equal(build_model(config).embed.W_E, want.embed.W_E)  # the seed matters
    toks = torch.randint(0, config.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(toks), want(toks))


def test_training_reaches_tl39s_weights_bitwise():
    """The same seed trains the same model on both lines: posinterp.train's weights after
    10 AdamW steps equal those TL 3.9 reached (tests/data/tl39_training.safetensors, written
    under TL 3.9 by ``python benchmarks/tl_parity.py train-fixture``), and a qk-constraints
    cell's runs.csv row equals TL 3.9's, bit for bit (to 1e-12 in float64 summaries) on the
    torch build and CPU type that wrote the fixture. Another build or CPU rounds its float32
    kernels differently (an AVX-512 Xeon vs this EPYC: 10% of weights off by <= 6e-8 after
    these 10 steps), so there the bound is 1e-6: about 16 float32 ulps of weights of size ~1
    per step, far below the 1e-3 changes a wrong gradient makes in 10 steps at lr 1e-3.
    On TL 4 the fixture is converted with TL's convert_tl_checkpoint.
    Before the fix, TL 4's gradients differed in the last bit (TL 3.9 calls ln1 once per
    q/k/v input) and the clip coefficient with the parameters' order and layout."""
    import importlib.util
    from pathlib import Path

    from safetensors import safe_open

    from posinterp.models.backend import is_bridge

    # benchmarks/ is not a package: the script that writes the fixture is loaded by path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "tl_parity.py"
    spec = importlib.util.spec_from_file_location("tl_parity_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    FIXTURE, fixture_setup, cpu_signature = bench.FIXTURE, bench.fixture_setup, bench.cpu_signature
    from posinterp.training import train

    with safe_open(FIXTURE, "pt") as f:
        meta = f.metadata()
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no items)
    assert meta["transformer_lens"].startswith("3.9")
    same_kernels = meta["torch"] == torch.__version__ and meta.get("cpu") == cpu_signature()
    atol = 0.0 if same_kernels else 1e-6
    for pe in ("absolute", "rotary"):
        mc, data, cfg = fixture_setup(pe)
        model = train(mc, data, cfg, progress=False).model
        want = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith(pe + "/")}
        if is_bridge(model):
            from posinterp.models.backend import convert_tl3_weights

            want = convert_tl3_weights(model, want)
        got = model.state_dict()
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=atol, msg=f"{pe} {name}")
    # a qk-constraints cell (constrain_qk's ban, no attention mask): TL 3.9's runs.csv row.
    # Its 30 steps (three times the 10 above) compound another CPU's rounding further: on
    # a generic Intel Xeon ||M||_F = 0.2472 differed by 1.3e-6 (5e-6 relative), so off the
    # fixture's CPU the bound is 1e-4 relative, far below what one AdamW step at lr 3e-3
    # moves each weight (about 3e-3).
    import json

    want_row, got_row = json.loads(meta["qk_cell"]), bench.fixture_qk_cell()
    assert set(got_row) == set(want_row)
    for key, value in want_row.items():
        bound = 1e-12 if same_kernels else max(1e-6, 1e-4 * abs(value))
        assert abs(got_row[key] - value) <= bound, key


def test_clip_coefficient_ignores_parameter_order_and_layout():
    """clip_grad_norm's total norm is the same number for the same gradients in any order
    and layout (TL 3.9 W_Q [head, d_model, d_head] vs TL 4 q.weight [head*d_head, d_model]),
    and it clips as torch's clip_grad_norm_ does."""
    from posinterp.training import clip_grad_norm

    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 32, 8), (32,), (4, 8, 32), (27, 32), (128, 32)]

    def params(grads):
        out = []
        for g in grads:
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
            out.append(p)
        return out

    grads = [torch.randn(s, generator=gen) * 0.3 for s in shapes]
    a = params(grads)
    # the same numbers in TL 4's layout (per-head -> flat rows) and in another order
    relaid = [g.permute(0, 2, 1).reshape(-1, g.shape[1]).contiguous() if g.ndim == 3 else g
              for g in grads][::-1]
    b = params(relaid)
    na, nb = clip_grad_norm(a, 1.0), clip_grad_norm(b, 1.0)
    assert na == nb and na > 1  # clipping happened
    for pa, pb in zip(a, reversed(b), strict=True):
        want = pa.grad.permute(0, 2, 1).reshape(-1, pa.grad.shape[1]) if pa.grad.ndim == 3 else pa.grad
        assert torch.equal(want, pb.grad)
    c = params(grads)
    torch.nn.utils.clip_grad_norm_(c, 1.0)
    for pa, pc in zip(a, c, strict=True):
        torch.testing.assert_close(pa.grad, pc.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_training_inside_no_grad_and_inference_mode(context):
    """A notebook's no_grad/inference_mode block does not stop training: the same weights."""
    mc = preset("tiny")
    data = tiny_task("reversal", n=50, max_digits=6)
    outside = train(mc, data, _cfg(max_steps=3), progress=False)
    with getattr(torch, context)():
        inside = train(mc, data, _cfg(max_steps=3), progress=False)
    for (name, a), (_, b) in zip(outside.model.state_dict().items(),
                                 inside.model.state_dict().items(), strict=True):
        assert torch.equal(a, b.clone()), name


def _threads_seen(monkeypatch) -> list[int]:
    import posinterp.training as training

    seen = []
    real = training.answer_loss

    def spy(*a, **kw):
        seen.append(torch.get_num_threads())
        return real(*a, **kw)
    monkeypatch.setattr(training, "answer_loss", spy)
    return seen


def test_train_uses_one_thread_unless_asked_and_restores_the_count(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's setting
    try:
        seen = _threads_seen(monkeypatch)
        data = tiny_task("reversal", n=20)
        train(preset("tiny"), data, _cfg(max_steps=2), progress=False)
        assert set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        train(preset("tiny"), data, _cfg(max_steps=2), progress=False, threads=2)
        assert set(seen) == {2}
        seen.clear()
        torch.set_num_threads(1)
        train(preset("tiny"), data, _cfg(max_steps=2), progress=False, threads=None)  # left alone
        assert set(seen) == {1}
    finally:
        torch.set_num_threads(before)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="threads"):
            train(preset("tiny"), data, _cfg(max_steps=2), progress=False, threads=bad)


def _last_bar(err: str) -> str:
    return err.replace("\r", "\n").strip().splitlines()[-1]


def test_progress_bar_shows_the_cap_as_a_cap_and_closes_at_the_stopping_step(capsys, monkeypatch):
    import posinterp.training as training

    data = tiny_task("reversal", n=20)
    # the target is reached at the first evaluation (step 2) of a 40-step cap
    monkeypatch.setattr(training, "evaluate", lambda *a, **k: {"test_accuracy": 1.0})
    res = train(preset("tiny"), data, _cfg(max_steps=40, eval_every=2, target_accuracy=0.9),
                progress=True)
    assert res.reached_target and res.steps == 2
    line = _last_bar(capsys.readouterr().err)
    assert f"target reached at step {res.steps} (cap 40)" in line
    assert "%" not in line and "40/40" not in line and "<" not in line  # no share, no ETA
    # without a target the run goes to the cap, and tqdm's own bar says so
    train(preset("tiny"), data, _cfg(max_steps=3), progress=True)
    assert "3/3" in _last_bar(capsys.readouterr().err)


def test_each_evaluation_prints_its_metrics_elapsed_time_and_seconds_per_step(capsys, tmp_path):
    """Issue 39 item 2: the step a target is reached differs across CPUs (float32 kernels
    round differently), so a log must show the pace and the accuracy at every evaluation,
    with or without the bar. Checked against the run's own history and the closed form
    s/step = elapsed / steps of this process (a resumed run counts only its own)."""
    import re

    data = tiny_task("reversal", n=20)
    line = re.compile(r"\[posinterp\] step (\d+) \(cap (\d+)\): loss ([\d.]+), test_accuracy "
                      r"([\d.]+), test_loss [\d.]+; ([\d.]+) s elapsed( since resuming at step (\d+))?, "
                      r"([\d.]+) s/step")

    def lines(out):
        return [line.fullmatch(x) for x in out.splitlines() if x.startswith("[posinterp] step")]

    res = train(preset("tiny"), data, _cfg(max_steps=6, eval_every=2, checkpoint_every=2),
                checkpoint_dir=tmp_path, progress=True)
    got = lines(capsys.readouterr().out)
    assert all(got) and [int(m[1]) for m in got] == [2, 4, 6]
    acc = res.history[res.history.metric == "test_accuracy"].value.tolist()
    assert [float(m[4]) for m in got] == pytest.approx(acc, abs=5e-4)
    for m in got:
        assert int(m[2]) == 6 and m[6] is None
        assert float(m[8]) == pytest.approx(float(m[5]) / int(m[1]), abs=0.06)
    # resumed from step 4 (the last checkpoint's step 6 is removed): it times its own 2 steps
    import shutil
    shutil.rmtree(tmp_path / "step_0000006")
    train(preset("tiny"), data, _cfg(max_steps=6, eval_every=2, checkpoint_every=2),
          checkpoint_dir=tmp_path, progress=True)
    (m,) = lines(capsys.readouterr().out)
    assert m[1] == "6" and m[7] == "4"
    assert float(m[8]) == pytest.approx(float(m[5]) / 2, abs=0.06)
    train(preset("tiny"), data, _cfg(max_steps=4, eval_every=2), progress=False)
    assert "[posinterp] step" not in capsys.readouterr().out


def test_a_checkpoint_from_before_task_layouts_compares_as_the_default_layout():
    """Checkpoints written before TaskConfig had ``format`` hold no such field: they were
    made in the default layout and resume as such, not refused as another config."""
    from posinterp.training import _comparable

    new = {"task": TaskConfig("indexing").to_dict()}
    old = {"task": {k: v for k, v in new["task"].items() if k != "format"}}
    assert _comparable(old) == _comparable(new)
    other = {"task": TaskConfig("indexing", format="query_first").to_dict()}
    assert _comparable(old) != _comparable(other)


def test_n_confirm_stops_only_where_the_target_holds_on_the_confirmation_samples(monkeypatch):
    """The 1,000-sample estimate can pass 0.9 where the whole test set does not: with
    n_confirm a run goes on past such an evaluation and stops at the first one confirmed;
    the steps before it are the unconfirmed run's, bitwise, and a config without
    n_confirm keeps the dict (and so the cell keys) it had before the field existed."""
    import posinterp.training as training

    data = tiny_task("reversal", n=40)
    full = iter([0.85, 0.89, 0.93, 0.99])
    calls = []

    def fake(model, split, n=None, batch_size=500):
        calls.append(n)
        acc = 0.95 if n == 8 else next(full)
        return {"test_accuracy": acc, "test_loss": 0.1}

    monkeypatch.setattr(training, "evaluate", fake)
    base = _cfg(max_steps=40, eval_every=2, n_eval=8, target_accuracy=0.9)
    plain = train(preset("tiny"), data, base, progress=False)
    confirmed = train(preset("tiny"), data, dataclasses.replace(base, n_confirm=40),
                      progress=False)
    assert plain.steps == 2 and plain.reached_target
    assert confirmed.steps == 6 and confirmed.reached_target  # 0.85, 0.89, then 0.93
    h = confirmed.history
    conf = h[h.metric == "confirm_accuracy"]
    assert conf.step.tolist() == [2, 4, 6] and conf.value.tolist() == [0.85, 0.89, 0.93]
    assert calls.count(40) == 3
    def loss(r):
        return r.history[(r.history.metric == "train_loss") & (r.history.step <= 2)]

    assert loss(plain).value.tolist() == loss(confirmed).value.tolist()
    assert "n_confirm" not in TrainConfig().to_dict()
    assert dataclasses.replace(base, n_confirm=40).to_dict()["n_confirm"] == 40
    with pytest.raises(ValueError, match="n_confirm"):
        TrainConfig(n_confirm=0)


def test_n_confirm_that_never_holds_runs_to_the_cap(monkeypatch):
    """An estimate above the target that the confirmation never matches does not stop the
    run, and the result says the target was not reached."""
    import posinterp.training as training

    monkeypatch.setattr(training, "evaluate", lambda m, s, n=None, batch_size=500: {
        "test_accuracy": 0.95 if n == 8 else 0.5, "test_loss": 0.1})
    res = train(preset("tiny"), tiny_task("reversal", n=40),
                _cfg(max_steps=6, eval_every=2, n_eval=8, target_accuracy=0.9, n_confirm=40),
                progress=False)
    assert res.steps == 6 and not res.reached_target
