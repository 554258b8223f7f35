"""Devices: choice and validation, CPU results unchanged by the default, CUDA vs CPU.

The CUDA tests (``-k cuda``) run only where PyTorch sees a GPU; each compares a CUDA
model with the same model on CPU within a tolerance stated in the test.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pandas as pd
import pytest
import torch

from posinterp.analysis import adjacency_by_layer, similarity_by_layer
from posinterp.analysis.spectral import qk_spectrum
from posinterp.devices import (
    default_device,
    model_device,
    move_model,
    resolve_device,
    resolve_dtype,
    to_device,
)
from posinterp.models import build_model, preset
from posinterp.training import TrainConfig, fit, load_checkpoint, train
from tests.helpers import random_tokens, tiny_task

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="PyTorch sees no CUDA device")
no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks the error raised without CUDA")
SCHEMES = ("nope", "absolute", "rotary", "alibi")


def _tiny(pe="nope", **kw):
    return preset("tiny", pe=pe, **kw)


def _steps(n=4):
    return TrainConfig(max_steps=n, batch_size=8, eval_every=2, n_eval=16, warmup_steps=1,
                       target_accuracy=None, checkpoint_seconds=None)


# --- choice and validation -------------------------------------------------------------


def test_auto_and_none_pick_cuda_when_available_else_cpu():
    want = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto") == resolve_device(" AUTO ") == want
    assert default_device() == want


def test_cpu_names_and_devices_resolve_to_cpu():
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "", "cuda:x", "mps", "meta", "tpu", 3.5])
def test_bad_device_names_the_parameter_and_the_allowed_values(bad):
    with pytest.raises(ValueError, match=r"--device .*'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device(bad, "--device")


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_a_gpu_is_a_clear_error(name):
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device(name)


@no_cuda
def test_build_and_train_refuse_cuda_without_a_gpu():
    with pytest.raises(ValueError, match="device='cuda' but PyTorch sees no CUDA"):
        build_model(_tiny(), device="cuda")
    with pytest.raises(ValueError, match="sees no CUDA"):
        train(_tiny(), tiny_task(n=40), _steps(1), progress=False, device="cuda")


def test_dtypes_resolve_and_bad_ones_are_named():
    assert resolve_dtype(None) is torch.float32
    assert resolve_dtype("bf16") is resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("torch.float64") is torch.float64
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float8")
    with pytest.raises(ValueError, match="floating"):
        resolve_dtype(torch.int64)


def test_cli_validates_device_at_parse_time(capsys):
    from posinterp.cli import build_parser

    args = build_parser().parse_args(["demo", "--quick", "--device", "cpu"])
    assert args.device == "cpu"
    assert build_parser().parse_args(["demo"]).device is None  # auto
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["demo", "--device", "gpu"])
    assert exit_.value.code == 2
    assert "'auto', 'cpu', 'cuda' or 'cuda:N'" in capsys.readouterr().err


def test_every_command_that_runs_a_model_takes_device():
    from posinterp.cli import build_parser

    commands = [["demo"], ["inspect", "zoo:nope"], ["zoo", "train"], ["spectrum", "zoo:nope"],
                ["reproduce", "zuo2024"], ["experiment", "qk-constraints"]]
    for argv in commands:
        assert build_parser().parse_args([*argv, "--device", "cpu"]).device == "cpu", argv


def test_to_device_moves_every_tensor_and_keeps_the_structure():
    batch = {"a": (torch.ones(2), [torch.zeros(1), 3]), "b": "text"}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["b"] == "text" and moved["a"][1][1] == 3
    assert isinstance(moved["a"], tuple) and isinstance(moved["a"][1], list)
    assert torch.equal(moved["a"][0], batch["a"][0])


def test_move_model_keeps_cfg_device_true():
    model = build_model(_tiny(), device="cpu")
    assert model_device(model) == torch.device("cpu") and str(model.cfg.device) == "cpu"
    assert move_model(model, "cpu") is model


def test_dtype_reaches_the_weights():
    model = build_model(_tiny(), device="cpu", dtype="float64")
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_mixed_precision_is_cuda_only_and_validated():
    model = build_model(_tiny(), device="cpu")
    data = tiny_task(n=40)
    with pytest.raises(ValueError, match="mixed_precision='bf16' is for CUDA"):
        train(_tiny(), data, _steps(1), progress=False, model=model, mixed_precision="bf16")
    with pytest.raises(ValueError, match=r"mixed_precision must be one of \(None, 'bf16'\)"):
        fit(model, None, None, None, _steps(1), {}, mixed_precision="fp8")


def test_resume_refuses_another_mixed_precision_setting(tmp_path):
    """A checkpoint written under bf16 autocast must not be continued in float32 (nor the
    other way round): the run would mix two precisions under one config."""
    data = tiny_task(n=40)
    train(_tiny(), data, _steps(2), progress=False, device="cpu", checkpoint_dir=tmp_path)
    cfg_file = next(tmp_path.glob("step_*")) / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "mixed_precision": "bf16"}))
    from tests.test_train import rehash

    rehash(cfg_file.parent)  # as a bf16 run would have written it: not damage
    with pytest.raises(ValueError, match="different mixed_precision config"):
        train(_tiny(), data, _steps(2), progress=False, device="cpu", checkpoint_dir=tmp_path)


# --- the default device gives the CPU numbers on a machine without CUDA ---------------


@no_cuda
@pytest.mark.parametrize("pe", SCHEMES)
def test_default_device_is_bit_identical_to_cpu_on_this_machine(pe, tmp_path):
    """No GPU here, so the default must be exactly the explicit CPU run: same initial
    weights, same training losses and weights, same adjacency table."""
    data = tiny_task(n=60)
    runs = {}
    for name, device in (("default", None), ("cpu", "cpu")):
        res = train(_tiny(pe), data, _steps(4), progress=False, device=device,
                    checkpoint_dir=tmp_path / name)
        toks = data.test.tokens[:8]
        mask = data.test.attention_mask[:8]
        runs[name] = (res.history, res.model.state_dict(), adjacency_by_layer(res.model, toks, mask))
    (h0, w0, a0), (h1, w1, a1) = runs["default"], runs["cpu"]
    pd.testing.assert_frame_equal(h0, h1, check_exact=True)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    pd.testing.assert_frame_equal(a0, a1, check_exact=True)
    saved = json.loads(next((tmp_path / "cpu").glob("step_*/config.json")).read_text())
    assert saved["device"] == "cpu"


# --- CUDA against CPU (run with -k cuda on a GPU machine) ----------------------------

# float32 on both sides; CUDA reduces in another order (and PyTorch's default keeps TF32
# off for float32 matmuls), so logits agree to ~1e-6 relative: 1e-4 absolute on logits of
# size ~1 leaves a wide margin while a wrong device path (other weights, lost positions)
# changes them by O(1).
LOGIT_ATOL = 1e-4


@needs_cuda
@pytest.mark.parametrize("pe", SCHEMES)
def test_cuda_toy_model_starts_from_the_cpu_weights_and_computes_the_same(pe):
    cpu, gpu = build_model(_tiny(pe), device="cpu"), build_model(_tiny(pe), device="cuda")
    assert model_device(gpu).type == "cuda"
    sd_cpu, sd_gpu = cpu.state_dict(), gpu.state_dict()
    assert all(torch.equal(sd_cpu[k], sd_gpu[k].cpu()) for k in sd_cpu)  # bit-identical init
    toks = random_tokens(cpu, 4, 16)
    mask = torch.ones_like(toks)
    mask[1, 12:] = 0  # a padded row: positions from the mask must match too
    with torch.no_grad():
        want = cpu(toks, attention_mask=mask)
        got = gpu(toks.cuda(), attention_mask=mask.cuda()).cpu()
    assert (got - want).abs().max().item() <= LOGIT_ATOL


@needs_cuda
def test_cuda_analyses_return_cpu_results_matching_cpu():
    cpu, gpu = build_model(_tiny("rotary"), device="cpu"), build_model(_tiny("rotary"), device="cuda")
    toks = random_tokens(cpu, 8, 16)
    sims_cpu, sims_gpu = similarity_by_layer(cpu, toks), similarity_by_layer(gpu, toks)
    for hook, s in sims_cpu.items():
        assert sims_gpu[hook].device.type == "cpu"
        assert (sims_gpu[hook] - s).abs().max().item() <= 1e-5  # cosines in [-1, 1]
    a_cpu, a_gpu = adjacency_by_layer(cpu, toks), adjacency_by_layer(gpu, toks)
    # A rank score over pairs: float32 noise can swap near-tied similarities, each swap
    # moving a sequence's score by 1/(number of pairs); 0.02 allows a few such swaps.
    assert (a_gpu.value - a_cpu.value).abs().max() <= 0.02
    # Spectra read CPU float64 copies of the (identical) weights: the same numbers exactly.
    pd.testing.assert_frame_equal(qk_spectrum(gpu), qk_spectrum(cpu), check_exact=True)


@needs_cuda
def test_cuda_training_steps_match_cpu_and_checkpoints_load_anywhere(tmp_path):
    data = tiny_task(n=60)
    cpu = train(_tiny("rotary"), data, _steps(4), progress=False, device="cpu")
    every2 = dataclasses.replace(_steps(4), checkpoint_every=2)
    gpu = train(_tiny("rotary"), data, every2, progress=False, device="cuda",
                checkpoint_dir=tmp_path / "ck")
    loss_c = cpu.history[cpu.history.metric == "train_loss"].value.to_numpy()
    loss_g = gpu.history[gpu.history.metric == "train_loss"].value.to_numpy()
    # Same batches and initial weights: the first loss agrees to float32 noise; after a
    # few AdamW steps (lr 1e-3) the weights differ by rounding only.
    assert abs(loss_g[0] - loss_c[0]) <= 1e-4
    assert abs(loss_g - loss_c).max() <= 1e-3
    w_c, w_g = cpu.model.state_dict(), gpu.model.state_dict()
    floats = [k for k in w_c if w_c[k].is_floating_point()]  # not the boolean causal masks
    assert max((w_g[k].cpu() - w_c[k]).abs().max().item() for k in floats) <= 1e-4
    # The CUDA checkpoints load on CPU, and the run resumes there from step 2 (optimizer
    # state included) to the weights of the uninterrupted CPU run, to rounding.
    model, configs = load_checkpoint(tmp_path / "ck" / "step_0000004", device="cpu")
    assert configs["device"].startswith("cuda") and model_device(model).type == "cpu"
    shutil.rmtree(tmp_path / "ck" / "step_0000004")
    resumed = train(_tiny("rotary"), data, every2, progress=False, device="cpu",
                    checkpoint_dir=tmp_path / "ck")
    w_r = resumed.model.state_dict()
    assert resumed.steps == 4
    assert max((w_r[k] - w_c[k]).abs().max().item() for k in floats) <= 1e-4


@needs_cuda
def test_cuda_bf16_autocast_trains_close_to_float32():
    data = tiny_task(n=60)
    fp32 = train(_tiny(), data, _steps(3), progress=False, device="cuda")
    bf16 = train(_tiny(), data, _steps(3), progress=False, device="cuda", mixed_precision="bf16")
    l32 = fp32.history[fp32.history.metric == "train_loss"].value.to_numpy()
    l16 = bf16.history[bf16.history.metric == "train_loss"].value.to_numpy()
    # bf16 keeps 8 mantissa bits (relative 4e-3 per op); the loss (~3 nats at init) is
    # a mean over many tokens, so 5e-2 nats is loose for rounding and tight for a bug.
    assert abs(l16 - l32).max() <= 5e-2
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}  # master weights


@needs_cuda
def test_cuda_local_hf_checkpoint_through_load_model(tmp_path):
    from posinterp.models import load_model
    from tests.helpers import save_tiny_checkpoint, tiny_hf_configs

    folder = tmp_path / "gpt2-absolute"
    save_tiny_checkpoint("GPT2LMHeadModel", tiny_hf_configs()["gpt2-absolute"], folder)
    cpu, _ = load_model(folder, device="cpu")
    gpu, _ = load_model(folder, device="cuda")
    assert model_device(gpu).type == "cuda"
    toks = torch.randint(0, cpu.cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = cpu(toks).log_softmax(-1)
        got = gpu(toks.cuda()).log_softmax(-1).cpu()
    # sharpened attention (q/k x20) amplifies rounding; 1e-3 nats still flags any real fault
    assert (got - want).abs().max().item() <= 1e-3


@needs_cuda
def test_cuda_inputs_on_the_gpu_give_the_same_cpu_results():
    """Tokens and masks may arrive on the GPU: analyses bring them to the CPU for the
    metrics and to the model for the forward, so the result is the same table."""
    gpu = build_model(_tiny("alibi"), device="cuda")
    toks = random_tokens(gpu, 6, 16)
    mask = torch.ones_like(toks)
    mask[0, :5] = 0  # left padding
    want = adjacency_by_layer(gpu, toks, mask)
    pd.testing.assert_frame_equal(adjacency_by_layer(gpu, toks.cuda(), mask.cuda()), want,
                                  check_exact=True)


@needs_cuda
@pytest.mark.parametrize("kind, variant", [("remove_complex", "content"), ("symmetric", "content"),
                                           ("symmetric", "offset"), ("antisymmetric", "content")])
def test_cuda_qk_interventions_match_cpu(kind, variant):
    """Intervention hooks run on the model's device with float64 projectors/rotations
    built on CPU; the loss changes agree with the CPU run to float32 rounding."""
    from posinterp.interventions import QKIntervention, ablation_effect

    cpu, gpu = build_model(_tiny("rotary"), device="cpu"), build_model(_tiny("rotary"), device="cuda")
    toks = random_tokens(cpu, 6, 16)
    ivs = [QKIntervention(kind, 0, heads=(0,), rope_variant=variant)]
    a, b = ablation_effect(cpu, toks, ivs), ablation_effect(gpu, toks, ivs)
    loss_a = a[a.metric == "loss"].value.to_numpy()
    loss_b = b[b.metric == "loss"].value.to_numpy()
    assert abs(loss_a - loss_b).max() <= 1e-4  # nats; the change itself is O(1e-2..1)


@needs_cuda
def test_cuda_activations_in_the_pure_metrics_give_the_cpu_numbers():
    """A user's cache may live on the GPU: the pure metric functions take its tensors
    (and a CUDA mask, with a gap) and return exactly the CPU result, on the CPU."""
    from posinterp.analysis.heads import previous_token_score
    from posinterp.analysis.probing import position_features
    from posinterp.analysis.similarity import cosine_self_similarity
    from posinterp.analysis.variance import position_variance

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 12, 16, generator=gen)
    x[:, 5] = x[:, 2]  # a repeated vector: the exact-tie path
    pattern = torch.softmax(torch.randn(3, 2, 12, 12, generator=gen), -1)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 7] = 0  # a gap
    for fn, args in ((cosine_self_similarity, (x,)), (position_variance, (x,)),
                     (previous_token_score, (pattern,))):
        want = fn(*args, mask)
        got = fn(*(a.cuda() for a in args), mask.cuda())
        assert got.device.type == "cpu" and torch.equal(torch.nan_to_num(got, 7.0),
                                                        torch.nan_to_num(want, 7.0)), fn.__name__
    for a, b in zip(position_features(x, mask), position_features(x.cuda(), mask.cuda()),
                    strict=True):
        assert b.device.type == "cpu" and torch.equal(a, b)
