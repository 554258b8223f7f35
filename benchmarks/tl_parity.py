"""Cross-version parity: the same weights give the same numbers on TransformerLens 3.9 and 4.x.

Run once per version on the same checkpoint folder, then compare::

    python benchmarks/tl_parity.py dump /tmp/pi-parity/tl3.json --checkpoints /tmp/pi-parity/ck
    /path/to/tl4-venv/bin/python benchmarks/tl_parity.py dump /tmp/pi-parity/tl4.json \\
        --checkpoints /tmp/pi-parity/ck
    python benchmarks/tl_parity.py compare /tmp/pi-parity/tl3.json /tmp/pi-parity/tl4.json

Models: a toy model of each scheme (weights from ``toy_state_dict``, the same under
either version) and tiny local HF checkpoints of GPT-2, Llama with grouped-query
attention, BLOOM (12 heads, so ALiBi slopes interleave), OPT and GPT-Neo (local
attention layers), written once by whichever run comes first. Quantities: adjacency
score per residual hook, QK eigenvalues
(offsets 0 and -1 for RoPE), spectral measures, previous-token scores, and ablation
effects (loss, previous-token score, adjacency) of a channel removal, a top-k
projection and symmetrization, and symmetrization / antisymmetrization of every layer
(loss, previous-token score, adjacency). Also llama2.c's stories260K (when
``../shared/models/stories260K.bin`` or ``--stories`` exists) with the same quantities,
and qk-constraints cells (``_train_cell`` of a small grid: absolute and rotary x none,
symmetric, ban_complex, seed 0, 60 steps), each cell's ``runs.csv`` row. ``--only``
restricts a dump to models whose name contains one of the given strings. ``compare``
prints the largest absolute difference per quantity and model (docs/tl4.md holds the
table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HF = {"gpt2": "GPT2LMHeadModel", "llama-gqa": "LlamaForCausalLM", "bloom-12-heads": "BloomForCausalLM"}
# OPT and GPT-Neo: TL 4.3 fires their hook_attn_scores after the softmax, so symmetrization
# goes through the attention output there and through the scores on 3.9 (docs/tl4.md).
PARITY_CASES = ("opt", "gptneo-local")


def _checkpoints(folder: Path) -> dict[str, Path]:
    from tests.helpers import parity_cases, save_tiny_checkpoint, tiny_hf_configs

    configs = tiny_hf_configs()
    names = {"gpt2": "gpt2-absolute", "llama-gqa": "llama-gqa", "bloom-12-heads": "bloom-12-heads"}
    cases = parity_cases()
    todo = {key: (arch, lambda key=key: configs[names[key]]) for key, arch in HF.items()}
    todo |= {key: cases[key][:2] for key in PARITY_CASES}
    out = {}
    for key, (arch, make) in todo.items():
        path = folder / key
        if not (path / "config.json").is_file():
            save_tiny_checkpoint(arch, make(), path)
        out[key] = path
    return out


STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.bin"
QK_PES, QK_CONSTRAINTS = ("absolute", "rotary"), ("none", "symmetric", "ban_complex")


def _models(ck: Path, stories: Path):
    import posinterp as pi

    for pe in ("nope", "absolute", "rotary", "alibi"):
        yield f"toy-{pe}", lambda pe=pe: pi.build_model(pi.preset("tiny", pe=pe))
    for key, path in _checkpoints(ck).items():
        yield key, lambda path=path: pi.load_model(path)[0]
    if stories.is_file():
        yield "stories260K", lambda: pi.load_model(stories)[0]


def _qk_cells():
    """``runs.csv`` rows of qk-constraints cells (numeric columns, in the file's order)."""
    from posinterp.experiments.qk_constraints import ConstraintGrid, _train_cell

    grid = ConstraintGrid(pes=QK_PES, constraints=QK_CONSTRAINTS, seeds=1, max_steps=60,
                          eval_every=10, workers=1)
    for pe in QK_PES:
        for constraint in QK_CONSTRAINTS:
            def row(pe=pe, constraint=constraint):
                r = _train_cell(grid, pe, constraint, 0, device="cpu")
                return {"runs.csv row": [float(v) for v in r.values()
                                         if isinstance(v, (int, float))]}
            yield f"qk-{pe}-{constraint}", row


def _numbers(model) -> dict[str, list[float]]:
    import posinterp as pi
    from posinterp.interventions import QKIntervention, ablation_effect

    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(4, model.cfg.d_vocab, (3, 24), generator=gen)
    mask = torch.ones_like(toks)
    mask[1, :4] = 0  # left padding: positions come from the mask on both versions
    out: dict[str, list[float]] = {}
    adj = pi.adjacency_by_layer(model, toks, attention_mask=mask)
    out["adjacency"] = adj.value.tolist()
    spec = pi.qk_spectrum(model)
    # Eigenvalues per head as a sorted multiset (order among equal moduli is arbitrary).
    keys = ["layer", "head", "offset"]
    vals = []
    for _, g in spec.fillna({"offset": 0}).groupby(keys, sort=True):
        vals += sorted(zip(g.real.round(12), g.imag.round(12), strict=True))
    out["eigenvalues"] = [x for pair in vals for x in pair]
    meas = pi.spectral_measures(model).sort_values(["metric", "offset", "layer", "head"])
    out["spectral_measures"] = meas.value.tolist()
    out["previous_token"] = pi.previous_token_scores(model, toks, attention_mask=mask).value.tolist()
    ivs = [QKIntervention("remove_complex", 0, heads=(0,)), QKIntervention("keep_top_k", 0, k=2),
           QKIntervention("symmetric", 0)]
    eff = ablation_effect(model, toks, ivs, attention_mask=mask)
    out["ablation_effect"] = eff.value.tolist()
    sym = [QKIntervention(kind, layer) for kind in ("symmetric", "antisymmetric")
           for layer in range(model.cfg.n_layers)]
    out["symmetrization"] = ablation_effect(model, toks, sym, attention_mask=mask).value.tolist()
    return out


def dump(path: Path, ck: Path, stories: Path = STORIES, only: list[str] | None = None) -> None:
    import transformer_lens  # noqa: F401

    from posinterp.models.backend import TL_VERSION

    torch.set_num_threads(1)
    result = {"transformer_lens": TL_VERSION, "models": {}}
    jobs = [(n, lambda m=m: _numbers(m())) for n, m in _models(ck, stories)] + list(_qk_cells())
    for name, job in jobs:
        if only and not any(o in name for o in only):
            continue
        result["models"][name] = job()
        print(f"{name}: done", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def compare(a: Path, b: Path) -> int:
    A, B = json.loads(a.read_text()), json.loads(b.read_text())
    print(f"| quantity | model | max abs diff (TL {A['transformer_lens']} vs {B['transformer_lens']}) |")
    print("|---|---|---|")
    worst = 0.0
    for model, qa in A["models"].items():
        qb = B["models"].get(model, {})
        for q, va in qa.items():
            vb = None if qb is None else qb.get(q)
            if vb is None or len(va) != len(vb):
                print(f"| {q} | {model} | MISSING or shape differs |")
                worst = float("inf")
                continue
            d = max((abs(x - y) for x, y in zip(va, vb, strict=True)), default=0.0)
            worst = max(worst, d)
            print(f"| {q} | {model} | {d:.2e} |")
    print(f"\nworst: {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


TRAIN_STEPS = (1, 10, 100)


def _train_setup(pe: str):
    import posinterp as pi
    from posinterp.tasks import TaskConfig, make_task_data

    mc = pi.preset("tiny", pe=pe)
    data = make_task_data(TaskConfig("reversal", n_train=256, n_test=64, seed=0, max_digits=6))
    return mc, data


def train_dump(out: Path) -> None:
    """Gradients of the first training batch and weights after TRAIN_STEPS AdamW steps of
    ``posinterp.train`` (tiny preset, reversal task, seed 0), as safetensors in this
    line's own layout; ``train-compare`` (run under TL 4) converts TL 3.9's."""
    from safetensors.torch import save_file

    from posinterp.models.backend import TL_VERSION
    from posinterp.training import TrainConfig, answer_loss, train

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"transformer_lens": TL_VERSION}
    for pe in ("absolute", "rotary"):
        mc, data = _train_setup(pe)
        import posinterp as pi

        model = pi.build_model(mc)
        model.train()
        gen = torch.Generator().manual_seed(0)  # TrainConfig.seed: the trainer's first batch
        split = data.train
        idx = torch.randint(len(split), (32,), generator=gen)
        attn = split.attention_mask[idx]
        width = int(attn.sum(-1).max())
        toks, attn, ans = split.tokens[idx, :width], attn[:, :width], split.answer_mask[idx, :width]
        loss = answer_loss(model(toks, attention_mask=attn), toks, ans)
        loss.backward()
        meta[f"{pe}-loss0"] = loss.item()
        save_file({k: p.grad.contiguous() for k, p in _named_state_params(model)},
                  out / f"{pe}-grad0.safetensors")
        for n in TRAIN_STEPS:
            cfg = TrainConfig(max_steps=n, batch_size=32, eval_every=max(TRAIN_STEPS), seed=0,
                              checkpoint_seconds=None)
            res = train(mc, data, cfg, progress=False)
            sd = {k: v.contiguous() for k, v in res.model.state_dict().items()}
            save_file(sd, out / f"{pe}-step{n}.safetensors")
            losses = res.history[res.history.metric == "train_loss"].value.tolist()
            meta[f"{pe}-step{n}-losses"] = losses
        print(f"{pe}: done", flush=True)
    (out / "meta.json").write_text(json.dumps(meta))


def _named_state_params(model):
    """(state_dict key, parameter) pairs with a gradient (state_dict names, not the
    bridge's internal parameter names)."""
    by_id = {id(p): p for p in model.parameters()}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in by_id and v.grad is not None:
            yield k, v


def train_compare(tl3: Path, tl4: Path) -> None:
    """Largest absolute difference per tensor between the two ``train-dump`` folders,
    TL 3.9's converted to TL 4's layout with TL's convert_tl_checkpoint (run under TL 4)."""
    from safetensors.torch import load_file

    import posinterp as pi
    from posinterp.models.backend import convert_tl3_weights

    A, B = json.loads((tl3 / "meta.json").read_text()), json.loads((tl4 / "meta.json").read_text())
    for pe in ("absolute", "rotary"):
        model = pi.build_model(_train_setup(pe)[0])
        print(f"{pe}: loss0 {A[pe + '-loss0']!r} vs {B[pe + '-loss0']!r}")
        for tag in ["grad0", *(f"step{n}" for n in TRAIN_STEPS)]:
            a = load_file(tl3 / f"{pe}-{tag}.safetensors")
            a = convert_tl3_weights(model, a)
            b = load_file(tl4 / f"{pe}-{tag}.safetensors")
            diffs = {k: (a[k] - b[k]).abs().max().item() for k in b if k in a}
            worst = max(diffs, key=diffs.get)
            scale = max(v.abs().max().item() for v in b.values())
            print(f"  {tag}: max |diff| {diffs[worst]:.3e} at {worst} (max |value| {scale:.3e});"
                  f" only one side: {sorted(set(a) ^ set(b))}")
            if tag.startswith("step"):
                la, lb = A[f"{pe}-{tag}-losses"], B[f"{pe}-{tag}-losses"]
                first = next((i for i, (x, y) in enumerate(zip(la, lb, strict=True)) if x != y),
                             None)
                print(f"    train losses: first differing step {first}; last {la[-1]!r} vs {lb[-1]!r}")


FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "tl39_training.safetensors"
FIXTURE_STEPS = 10


def fixture_setup(pe: str):
    """The model, task and settings of the TL 3.9 training fixture (tests/test_train.py)."""
    import posinterp as pi
    from posinterp.tasks import TaskConfig, make_task_data
    from posinterp.training import TrainConfig

    mc = pi.preset("tiny", pe=pe, d_model=16, n_heads=2)
    data = make_task_data(TaskConfig("reversal", n_train=128, n_test=32, seed=0, max_digits=6))
    cfg = TrainConfig(max_steps=FIXTURE_STEPS, batch_size=16, eval_every=FIXTURE_STEPS, seed=0,
                      checkpoint_seconds=None)
    return mc, data, cfg


def fixture_qk_cell() -> dict:
    """The ``runs.csv`` row of one qk-constraints cell (absolute, ban_complex, seed 0, 30
    steps, no attention mask), numeric columns only."""
    from posinterp.experiments.qk_constraints import ConstraintGrid, _train_cell

    grid = ConstraintGrid(pes=("absolute",), constraints=("ban_complex",), seeds=1,
                          max_steps=30, eval_every=10, workers=1)
    row = _train_cell(grid, "absolute", "ban_complex", 0, device="cpu")
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}


def cpu_signature() -> str:
    """The CPU's model name and its vector ISA flags: float kernels round differently on
    different x86 CPUs with one torch build (DESIGN.md §6, "Bitwise results are per CPU")."""
    import platform

    name, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = sorted(x for x in value.split() if x.startswith(("avx", "fma", "amx")))
                    break
    except OSError:
        pass
    return f"{name} [{' '.join(flags)}]"


def train_fixture(out: Path) -> None:
    """Write the weights ``posinterp.train`` reaches after FIXTURE_STEPS steps (absolute and
    rotary, fixture_setup) and a qk-constraints cell's runs.csv row (fixture_qk_cell) under
    *this* line, in its own layout; run under TL 3.9 to make
    ``tests/data/tl39_training.safetensors``, which tests/test_train.py checks TL 4's
    training against (TL 3.9 weights converted with convert_tl_checkpoint)."""
    import platform

    from safetensors.torch import save_file

    from posinterp.models.backend import TL_VERSION
    from posinterp.training import train

    torch.set_num_threads(1)
    tensors = {}
    for pe in ("absolute", "rotary"):
        mc, data, cfg = fixture_setup(pe)
        model = train(mc, data, cfg, progress=False).model
        tensors.update({f"{pe}/{k}": v.contiguous() for k, v in model.state_dict().items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out, metadata={"transformer_lens": TL_VERSION, "torch": torch.__version__,
                                      "machine": platform.machine(), "cpu": cpu_signature(),
                                      "qk_cell": json.dumps(fixture_qk_cell()),
                                      "command": "python benchmarks/tl_parity.py train-fixture "
                                                 "(under TransformerLens 3.9)"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--checkpoints", type=Path, required=True)
    d.add_argument("--stories", type=Path, default=STORIES)
    d.add_argument("--only", nargs="*", help="models whose name contains one of these")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    t = sub.add_parser("train-dump")
    t.add_argument("out", type=Path)
    tc = sub.add_parser("train-compare")
    tc.add_argument("tl3", type=Path)
    tc.add_argument("tl4", type=Path)
    f = sub.add_parser("train-fixture")
    f.add_argument("out", type=Path, nargs="?", default=FIXTURE)
    args = ap.parse_args()
    if args.cmd == "train-fixture":
        train_fixture(args.out)
        return 0
    if args.cmd == "train-dump":
        train_dump(args.out)
        return 0
    if args.cmd == "train-compare":
        train_compare(args.tl3, args.tl4)
        return 0
    if args.cmd == "dump":
        dump(args.out, args.checkpoints, args.stories, args.only)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
