"""Refactor equivalence: hash the outputs of a fixed set of calls, to compare two commits.

A restructuring (moving modules, one home per concept) must change no number. Run this
script on the commit before and on the commit after, under each TransformerLens line,
and compare the two JSON files: every entry must be equal, byte for byte.

    OMP_NUM_THREADS=1 python benchmarks/refactor_equivalence.py --out before.json
    ... (restructure) ...
    OMP_NUM_THREADS=1 python benchmarks/refactor_equivalence.py --out after.json
    python benchmarks/refactor_equivalence.py --compare before.json after.json

The calls (issue 35): ``inspect_heads`` on a RoPE and an ALiBi toy and on stories260K
(exported inspection.json, heads table, page HTML), ``qk_spectrum`` of SmolLM2-135M, one
qk-constraints training cell (40 steps), and the three reproduction pages rendered from
their committed data. Only the public API and the experiments' own entry points are
called, so the script runs unchanged on both sides of a move.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT.parent / "shared" / "models"


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _first(*names: str):
    """The first of ``names`` (``module.attribute``) that imports: the page writer's home
    is one of the things a restructuring moves."""
    import importlib

    for name in names:
        module, attr = name.rsplit(".", 1)
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {names} imports")


def _inspection_hashes(name: str, model, tokens, tmp: Path) -> dict[str, str]:
    import posinterp as pi

    save_page = _first("posinterp.dashboard.save_inspect_page", "posinterp.viz.save_inspect_page")
    insp = pi.inspect_heads(model, tokens, ablate=True, seed=0, model_name=name)
    path = pi.export_inspection(insp, tmp / f"{name}.json")
    page = save_page(insp, tmp / f"{name}.html", title=name)
    return {f"inspect/{name}/inspection.json": _sha(path.read_bytes()),
            f"inspect/{name}/heads.csv": _sha(insp.table.to_csv(index=False)),
            f"inspect/{name}/page.html": _sha(Path(page).read_bytes())}


def pi_errors() -> tuple[type[Exception], ...]:
    """The refusals a load may give on one TL line (TL 3.9 refuses SmolLM2 on some CPUs)."""
    from posinterp.models.pretrained import UnsupportedConfigError

    return (UnsupportedConfigError,)


def compute() -> dict[str, str]:
    import torch

    import posinterp as pi
    from posinterp.experiments import qk_constraints, spectrum, zuo2024

    torch.set_num_threads(1)
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for pe in ("rotary", "alibi"):
            model = pi.build_model(pi.ToyModelConfig(pe=pe, n_layers=2, n_heads=4, d_model=64,
                                                     n_ctx=32, d_vocab=32, tokenizer=None, seed=0))
            tokens = pi.random_tokens(model, batch=4, pos=24, seed=0, bos=False)
            out.update(_inspection_hashes(f"toy-{pe}", model, tokens, tmp))
        stories, _ = pi.load_model(MODELS / "stories260K.bin")
        out.update(_inspection_hashes("stories260K", stories,
                                      pi.random_tokens(stories, batch=4, pos=32, seed=0, bos=False), tmp))
        try:
            smol, _ = pi.load_model(MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf")
            out["qk_spectrum/SmolLM2"] = _sha(pi.qk_spectrum(smol).to_csv(index=False))
        except pi_errors() as err:  # a refusal is an output too: the same on both sides
            out["qk_spectrum/SmolLM2"] = f"refused: {type(err).__name__}: {err}"
        grid = qk_constraints.ConstraintGrid(max_steps=40, seeds=1, workers=1)
        for constraint in ("ban_positive_real", "rank_matched_positive_real"):
            row = qk_constraints._train_cell(grid, "rotary", constraint, 0)
            out[f"qk_constraints/rotary-{constraint}-seed0"] = _sha(json.dumps(row, sort_keys=True))
        pages = ROOT / "docs" / "reproductions"
        for page, data, render in (("qk-constraints", "qk-constraints", qk_constraints.render_markdown),
                                   ("fingerprints", "fingerprints", spectrum.render_markdown),
                                   ("zuo2024", "zuo2024", zuo2024.render_markdown)):
            out[f"page/{page}.md"] = _sha(render(pages / "data" / data))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="write the hashes here (JSON)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.loads(f.read_text()) for f in args.compare)
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        print(f"{len(a.keys() & b.keys()) - len(set(diff) & a.keys() & b.keys())} equal, "
              f"{len(diff)} differ" + "".join(f"\n  differs: {k}" for k in diff))
        return 1 if diff else 0
    from importlib.metadata import version

    hashes = compute()
    result = {"transformer_lens": version("transformer-lens"), **hashes}
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
