"""The ``posinterp`` command."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import pandas as pd

    from .experiments.demo import DemoConfig, run_demo

    cfg = DemoConfig(quick=args.quick, digits=args.digits, seed=args.seed,
                     max_steps=args.max_steps, threads=args.threads)
    res = run_demo(cfg, args.out, progress=not args.no_progress)
    with pd.option_context("display.width", 200, "display.max_columns", 20,
                           "display.float_format", "{:.3f}".format):
        print(res.table.to_string(index=False))
    status = "reached" if res.reached_target else "did not reach"
    print(f"\ntraining {status} the target in {res.steps} steps; "
          f"held-out exact match {res.accuracy:.3f}")
    print(f"report: {res.report_path.resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="posinterp", description=__doc__)
    p.add_argument("--version", action="version", version=f"posinterp {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train a NoPE model on reversal and report its adjacency "
                       "pattern at init and after training (offline, CPU)")
    d.add_argument("--quick", action="store_true", help="6-digit strings, ~2 minutes")
    d.add_argument("--digits", type=int, default=None, help="string length (default 8, quick 6)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-steps", type=int, default=None)
    d.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    d.add_argument("--out", default="posinterp-demo", help="output folder (resumable)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"posinterp: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
