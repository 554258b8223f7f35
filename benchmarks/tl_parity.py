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
score per residual hook, QK eigenvalues (offsets 0 and -1 for RoPE), spectral
measures, previous-token scores, ablation effects (loss, previous-token score,
adjacency) of a channel removal, a top-k projection and symmetrization, and
symmetrization / antisymmetrization of every layer. ``compare`` prints the largest
absolute difference per quantity and model (docs/tl4.md holds the table).
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


def _models(ck: Path):
    import posinterp as pi

    for pe in ("nope", "absolute", "rotary", "alibi"):
        yield f"toy-{pe}", pi.build_model(pi.preset("tiny", pe=pe))
    for key, path in _checkpoints(ck).items():
        yield key, pi.load_model(path)[0]


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


def dump(path: Path, ck: Path) -> None:
    import transformer_lens  # noqa: F401

    from posinterp.models.backend import TL_VERSION

    torch.set_num_threads(1)
    result = {"transformer_lens": TL_VERSION, "models": {}}
    for name, model in _models(ck):
        result["models"][name] = _numbers(model)
        print(f"{name}: done", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def compare(a: Path, b: Path) -> int:
    A, B = json.loads(a.read_text()), json.loads(b.read_text())
    print(f"| quantity | model | max abs diff (TL {A['transformer_lens']} vs {B['transformer_lens']}) |")
    print("|---|---|---|")
    worst = 0.0
    for model, qa in A["models"].items():
        qb = B["models"].get(model)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("--checkpoints", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "dump":
        dump(args.out, args.checkpoints)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
