"""Regenerate the screenshots of docs/inspect.md (docs/img/inspect/) and the data behind them.

Run from the repository root (one torch thread; Debian's chromium for the screenshots)::

    OMP_NUM_THREADS=1 python benchmarks/inspect_figures.py [CASE ...] [--out docs/img/inspect]

Cases (default: all): ``stories260K`` (the shared llama2.c file, 8 random-token
sequences of 64 tokens, BOS first, ``--ablate``), ``toy-nope``, ``toy-absolute``, ``toy-rotary``,
``toy-alibi`` (``small`` preset trained 200 steps on 6-digit reversal, seed 0, then six
reversal strings with ``--text``, ``--ablate``) and ``bloom-12-heads`` (a BLOOM folder, 2
layers x 12 heads, d_model 48, seeded random weights with queries and keys scaled 20x,
posinterp's character tokenizer; same text, ``--ablate``).

For each case it runs ``posinterp inspect`` (:func:`posinterp.experiments.run_inspect`)
and writes, next to each other, ``CASE.png`` (headless Chromium, every host name
unresolvable, 1400 x 1500 pixels) and ``CASE.csv``: the page's per-head numbers
(``Inspection.head_view()``), so the picture and its numbers come from one run.
tests/test_inspect_figures.py recomputes a cheap case and checks it equals the committed
CSV: a figure the code no longer gives fails that test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "models" / "stories260K.bin"
TOYS = ("nope", "absolute", "rotary", "alibi")
CASES = ("stories260K", *(f"toy-{pe}" for pe in TOYS), "bloom-12-heads")
SEED = 0
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--host-resolver-rules=MAP * ~NOTFOUND", "--hide-scrollbars"]


def reversal_text() -> str:
    """Six held-out 6-digit reversal strings, one paragraph each (the toy and BLOOM input)."""
    from posinterp.tasks import TaskConfig, make_task_data

    test = make_task_data(TaskConfig("reversal", min_digits=6, max_digits=6, n_train=50,
                                     n_test=6, seed=SEED)).test
    return "\n\n".join(i + a for i, a in zip(test.inputs[:6], test.answers[:6], strict=True))


def bloom_folder(folder: Path) -> Path:
    """The BLOOM case: seeded random weights, q/k scaled 20x, posinterp's character tokenizer."""
    import transformers

    from posinterp.tasks.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(SEED)
    config = transformers.BloomConfig(n_layer=2, n_head=12, hidden_size=48, vocab_size=len(tok))
    model = transformers.BloomForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "query_key_value" in name:
                p.mul_(20.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def toy_folder(pe: str, folder: Path) -> Path:
    """The toy case: ``small`` preset, 200 AdamW steps on 6-digit reversal (5,000 training
    strings), seed 0."""
    import posinterp as pi
    from posinterp.tasks import TaskConfig, make_task_data
    from posinterp.training import TrainConfig

    data = make_task_data(TaskConfig("reversal", min_digits=6, max_digits=6, n_train=5000,
                                     n_test=200, seed=SEED))
    pi.train(pi.preset("small", pe=pe, seed=SEED), data,
             TrainConfig(max_steps=200, target_accuracy=None, eval_every=200, n_eval=200,
                         seed=SEED),
             checkpoint_dir=folder / "checkpoints", progress=False, threads=1)
    return folder


def inspect_case(case: str, work: Path, ablate: bool = True):
    """``(InspectResult, head view)`` of one case, run in ``work`` (the figures: ``ablate``).

    The model folder is named by the case and given relative to ``work`` (the working
    directory meanwhile), so the page's title reads ``posinterp inspect: CASE``.
    """
    old = Path.cwd()
    os.chdir(work)
    try:
        return _inspect_case(case, Path("."), ablate)
    finally:
        os.chdir(old)


def _inspect_case(case: str, work: Path, ablate: bool):
    from posinterp.dashboard.schema import head_wide
    from posinterp.experiments.inspect import run_inspect

    text = None
    if case == "stories260K":
        spec, kw = str(STORIES), dict(n_tokens=64, batch=8)
    else:
        text = work / "reversal.txt"
        text.write_text(reversal_text(), encoding="utf-8")
        spec = str(bloom_folder(work / case) if case == "bloom-12-heads"
                   else toy_folder(case.removeprefix("toy-"), work / case))
        kw = {}
    res = run_inspect(spec, work / f"{case}-out", text=text, ablate=ablate, seed=SEED,
                      progress=False, device="cpu", **kw)
    return res, head_wide(res.table)


def screenshot(page: Path, png: Path, profile: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=15000",
                    "--window-size=1400,1500", f"--screenshot={png}", page.as_uri()],
                   capture_output=True, text=True, timeout=300, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"any of {', '.join(CASES)} "
                    "(default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "inspect")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    for case in args.cases or CASES:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            res, wide = inspect_case(case, work)
            screenshot(work / res.report_path, args.out / f"{case}.png", work / "profile")
            wide.to_csv(args.out / f"{case}.csv", index=False, float_format="%.10g")
            print(f"{case}: {args.out / f'{case}.png'} and .csv ({res.seconds} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

