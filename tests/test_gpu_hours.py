"""benchmarks/gpu_hours.py's projection: its FLOP counter against torch's own count, and the
properties of the bracket (docs/scale.md, "GPU-hours per full reproduction").

benchmarks/ is not a package, so the script is loaded from its path."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from posinterp.models import ToyModelConfig, build_model
from posinterp.models.toy import toy_parameter_shapes

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_hours.py"


@pytest.fixture(scope="module")
def gh():
    spec = importlib.util.spec_from_file_location("gpu_hours_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _config(pe="rotary", attn_only=False, **kw):
    base = dict(pe=pe, n_layers=2, d_model=24, n_heads=3, d_head=6, d_mlp=40, n_ctx=16,
                tokenizer=None, d_vocab=37, attn_only=attn_only)
    return ToyModelConfig(**{**base, **kw})


def _torch_flops(cfg, batch, n, backward):
    model = build_model(cfg, device="cpu")
    tokens = torch.randint(cfg.d_vocab, (batch, n), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        if backward:
            logits.sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("pe", ["nope", "absolute", "rotary", "alibi"])
@pytest.mark.parametrize("attn_only", [False, True])
def test_flops_match_torch_flop_counter(gh, pe, attn_only):
    # torch counts every mm/bmm/addmm the forward (and autograd) actually runs: an
    # independent count of the same matrix products.
    cfg = _config(pe, attn_only)
    batch, n = 3, 11
    assert gh.flops_forward(cfg, batch, n) == _torch_flops(cfg, batch, n, backward=False)
    assert gh.flops_train_step(cfg, batch, n) == _torch_flops(cfg, batch, n, backward=True)


def test_linear_part_is_six_n_tokens(gh):
    # F(n) = a·n + b·n² per sequence; a must be 6 x the matmul parameters (the standard
    # 6·N·tokens), b the attention's n² term.
    # (parameter shapes in TransformerLens 3.9 names, whatever the installed backend)
    cfg = _config(d_model=32, n_heads=4, d_head=8, d_mlp=64)
    n_matmul = sum(math.prod(shape) for name, shape in toy_parameter_shapes(cfg).items()
                   if name.rsplit(".", 1)[-1] in ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "W_U"))
    assert n_matmul > 0
    f1, f2 = gh.flops_train_step(cfg, 1, 1), gh.flops_train_step(cfg, 1, 2)
    b = (f2 - 2 * f1) / 2
    assert f1 - b == 6 * n_matmul
    assert b > 0


def test_bracket_is_ordered_and_grows_with_flops(gh):
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        flops = float(10 ** (torch.rand(1, generator=gen) * 12 + 3))
        top = int(torch.randint(0, 5000, (1,), generator=gen))
        host = gh.Host(float(torch.rand(1, generator=gen)) * 0.1, top, top + 7)
        for precision in ("fp32", "bf16"):
            low, high = gh.bracket(flops, host, precision)
            assert 0 < low <= high
            low2, high2 = gh.bracket(flops * 10, host, precision)
            assert low2 >= low and high2 > high
    # bf16's rate is higher than fp32's: never slower
    host = gh.Host(1e-3, 10, 20)
    assert gh.bracket(1e13, host, "bf16")[1] < gh.bracket(1e13, host, "fp32")[1]


def test_hours_scale_linearly_with_units(gh):
    rows = gh.Rows(torch.device("cpu"), project="h200")
    per_step = gh.Projected(*gh.bracket(3e11, gh.Host(0.01, 100, 200), "fp32"), 3e11,
                            gh.Host(0.01, 100, 200))
    for units in (1_000, 3_000):
        rows.add("r", f"train x {units}", "fp32", per_step, "step", units, "")
    a, b = rows.rows
    assert b["hours_low"] == pytest.approx(3 * a["hours_low"])
    assert b["hours_high"] == pytest.approx(3 * a["hours_high"])
    assert a["hours_low"] == pytest.approx(per_step.low * 1_000 / 3600)
    scaled = per_step * 4
    assert (scaled.low, scaled.high) == pytest.approx((4 * per_step.low, 4 * per_step.high))


def test_kernel_counts_are_per_op_and_additive(gh):
    a = torch.randn(8, 8)

    def ops(k):
        def fn():
            x = a
            for _ in range(k):
                x = torch.nn.functional.gelu(x @ a).view(8, 8)  # view: no kernel
        return fn

    (t1, l1), (t3, l3) = gh.count_kernels(ops(1)), gh.count_kernels(ops(3))
    assert t1 >= 2 and l1 >= t1  # the matmul and gelu at least; a top op has >= 1 leaf
    assert (t3, l3) == (3 * t1, 3 * l1)
