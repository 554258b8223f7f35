"""The ``posinterp`` command."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import pandas as pd

    from .experiments.demo import DemoConfig, run_demo

    cfg = DemoConfig(quick=args.quick, digits=args.digits, seed=args.seed,
                     max_steps=args.max_steps, threads=args.threads)
    out = args.out or ("posinterp-demo-quick" if args.quick else "posinterp-demo")
    res = run_demo(cfg, out, progress=not args.no_progress)
    with pd.option_context("display.width", 200, "display.max_columns", 20,
                           "display.float_format", "{:.3f}".format):
        print(res.table.to_string(index=False))
    status = "reached" if res.reached_target else "did not reach"
    print(f"\ntraining {status} the target in {res.steps} steps; "
          f"held-out exact match {res.accuracy:.3f}")
    print(f"report: {res.report_path.resolve()}")
    return 0


def _zoo_train(args: argparse.Namespace) -> int:
    import pandas as pd

    from .experiments.zoo import ZooConfig, train_zoo, zoo_home

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    cfg = ZooConfig(max_steps=args.max_steps, schemes=tuple(args.schemes))
    df = train_zoo(cfg, seeds=args.seeds, home=args.home, progress=not args.no_progress,
                   first_seed=args.first_seed)
    with pd.option_context("display.width", 200, "display.float_format", "{:.3f}".format):
        print(df.to_string(index=False))
    print(f"zoo: {args.home or zoo_home()}")
    return 0


def _zoo_list(args: argparse.Namespace) -> int:
    from .experiments.zoo import list_zoo, zoo_home

    df = list_zoo(args.home)
    print(df.to_string(index=False) if len(df) else "the zoo is empty")
    print(f"zoo: {args.home or zoo_home()}")
    return 0


def _spectrum(args: argparse.Namespace) -> int:
    import pandas as pd

    from .experiments.spectrum import run_spectrum

    res = run_spectrum(args.specs, args.out, K=args.top_k, dynamics=args.dynamics,
                       progress=not args.no_progress)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        if len(res.tests):
            print(res.tests.drop(columns="note").to_string(index=False))
            print(res.tests.note.iloc[0])
    print(f"report: {res.report_path.resolve()}")
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    import pandas as pd

    from .experiments.zuo2024 import ReproConfig, run_zuo2024

    cfg = ReproConfig.full() if args.full else ReproConfig()
    claims = run_zuo2024(cfg, args.out, progress=not args.no_progress)
    with pd.option_context("display.width", 250, "display.max_colwidth", 90):
        print(claims[["claim", "our_figure", "holds"]].to_string(index=False))
    print(f"report: {(Path(args.out) / 'report.html').resolve()}")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    import pandas as pd

    from .experiments.qk_constraints import ConstraintGrid, run_qk_constraints

    grid = ConstraintGrid.quick() if args.quick else ConstraintGrid()
    for name in ("seeds", "workers"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
            grid = dataclasses.replace(grid, **{name: value})
    summary = run_qk_constraints(grid, args.out, progress=not args.no_progress)
    with pd.option_context("display.width", 220, "display.max_columns", 20):
        print(summary.to_string(index=False))
    print(f"report: {(Path(args.out) / 'report.html').resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="posinterp", description=__doc__)
    p.add_argument("--version", action="version", version=f"posinterp {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a NoPE model on reversal and report its adjacency "
                       "pattern at init and after training (offline, CPU)")
    d.add_argument("--quick", action="store_true", help="6-digit strings, final accuracy on "
                   "5,000 held-out samples; ~2.5 min on one thread, ~80 s with --threads 2 "
                   "on an idle 2-core machine (docs/performance.md)")
    d.add_argument("--digits", type=int, default=None, help="string length (default 8, quick 6)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-steps", type=int, default=None)
    d.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady "
                   "when other jobs share the cores; --threads 2 is faster on an otherwise idle "
                   "2-core machine but several times slower next to a busy process; results "
                   "depend on the thread count)")
    d.add_argument("--out", default=None, help="output folder, resumable (default "
                   "posinterp-demo, or posinterp-demo-quick with --quick)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=_demo)

    z = sub.add_parser("zoo", help="small byte-level LMs identical except for positions")
    zsub = z.add_subparsers(dest="zoo_command", required=True)
    zt = zsub.add_parser("train", help="train (or resume) the zoo: one model per scheme and seed")
    zt.add_argument("--seeds", type=int, default=1, help="seeds per scheme (fingerprint "
                    "statistics need >= 3)")
    zt.add_argument("--first-seed", type=int, default=0, help="train seeds first-seed .. "
                    "first-seed + seeds - 1 (lets several processes share the zoo)")
    zt.add_argument("--schemes", nargs="+", default=["nope", "absolute", "rotary", "alibi"])
    zt.add_argument("--max-steps", type=int, default=2000, help="steps per model (~10 min on "
                    "2 cores at the default)")
    zt.add_argument("--home", default=None, help="zoo folder (default $POSINTERP_HOME/zoo)")
    zt.add_argument("--threads", type=int, default=None)
    zt.add_argument("--no-progress", action="store_true")
    zt.set_defaults(func=_zoo_train)
    zl = zsub.add_parser("list", help="show the zoo's models")
    zl.add_argument("--home", default=None)
    zl.set_defaults(func=_zoo_list)

    sp = sub.add_parser("spectrum", help="QK-circuit spectra, previous-token heads and "
                        "RoPE-vs-other fingerprint statistics for one or more models")
    sp.add_argument("specs", nargs="+", help="hub names, HF folders, .bin files, zoo:<pe>[:<seed>], "
                    "all-MiniLM-L6-v2")
    sp.add_argument("--out", default="posinterp-spectrum")
    sp.add_argument("--top-k", type=int, default=5, help="K: top-k previous-token heads")
    sp.add_argument("--dynamics", action="store_true", help="also analyse zoo snapshots")
    sp.add_argument("--no-progress", action="store_true")
    sp.set_defaults(func=_spectrum)

    rp = sub.add_parser("reproduce", help="rerun a paper's results with posinterp")
    rp.add_argument("paper", choices=["zuo2024"])
    mode = rp.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="CPU default (~10-20 min, 2 cores)")
    mode.add_argument("--full", action="store_true", help="the paper's protocol (GPU-sized)")
    rp.add_argument("--out", default="posinterp-zuo2024")
    rp.add_argument("--no-progress", action="store_true")
    rp.set_defaults(func=_reproduce)

    ex = sub.add_parser("experiment", help="learning-speed experiments")
    ex.add_argument("name", choices=["qk-constraints"])
    ex.add_argument("--quick", action="store_true", help="a smoke run of a few minutes")
    ex.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 5)")
    ex.add_argument("--workers", type=int, default=None,
                    help="processes sharing the cells, one torch thread each (default 2)")
    ex.add_argument("--out", default="posinterp-qk-constraints",
                    help="output folder (default posinterp-qk-constraints)")
    ex.add_argument("--no-progress", action="store_true")
    ex.set_defaults(func=_experiment)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``posinterp`` command; returns the exit status (2 on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"posinterp: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("posinterp: interrupted; finished work is saved, rerun the same command to "
              "resume", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
