"""posinterp: how transformers represent token position (a TransformerLens plugin).

Every command runs offline, on a CPU or (--device) a GPU, except for hub model names,
which need the network or a local Hugging Face cache; see docs/cli.md and docs/scale.md.
"""

# Imports stay inside the command functions: ``posinterp --help`` must not load torch.
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

__all__ = ["build_parser", "main"]

SCHEMES = ("nope", "absolute", "rotary", "alibi")
# posinterp.experiments.zoo.FAMILIES, named here so --help needs no torch (tested equal)
FAMILY_NAMES = ("base", "heads8", "deep", "wide", "halfdata-lr")
# posinterp.experiments.zoo.FAMILY_SETS: the designs, each its own folder (tested equal)
FAMILY_SETS = {"design1": "families", "design2": "families-design2"}


def _query_block(text: str):
    """``--query-block``: a positive integer, ``auto`` or ``none``."""
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, 'auto' or 'none', got {text!r}")
    return value


def _index_items(text: str) -> list[int]:
    """One ``--layers``/``--heads`` item: ``5`` or an inclusive range ``17-20``; the range
    check against the model is :func:`posinterp.experiments.inspect.run_inspect`'s."""
    a, sep, b = text.partition("-")
    try:
        lo = int(a)
        hi = int(b) if sep else lo
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an index (5) or an inclusive range (17-20) of "
                                         f"non-negative integers, got {text!r}") from None
    if hi < lo:
        raise argparse.ArgumentTypeError(f"a range must run upwards (17-20), got {text!r}")
    return list(range(lo, hi + 1))


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


def _out_folder(text: str, writable: bool = True) -> str:
    """argparse type for --out: refuse a path that is (or is inside) a file, or that cannot
    be written, at parse time (before any model loads or cell runs)."""
    from .io import check_out_dir

    try:
        check_out_dir(text, create=False, writable=writable)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).replace("out_dir ", "", 1)) from None
    return text


def _home_folder(text: str) -> str:
    """argparse type for --home: as --out, but it may be read-only (a shared zoo is read)."""
    return _out_folder(text, writable=False)


def _executor(args: argparse.Namespace, default: str = "local", workers: int | None = None):
    """The executor of --executor/--workers/--address (posinterp.executors.make_executor).

    ``workers`` is the process count when --executor process is chosen without --workers.
    """
    from .executors import make_executor

    name = args.executor or default
    count = args.workers if args.workers is not None else (workers if name == "process" else None)
    if name == "local" and args.executor is None and count == 1:
        count = None  # --workers 1 chose the in-process executor (qk-constraints): one worker
    return make_executor(name, workers=count, address=args.address)


def _executor_options(p, workers_help: str, default: str = "local") -> None:
    p.add_argument("--executor", choices=["local", "process", "ray"], default=None,
                   help=f"where the cells run (default {default}): in this process, a pool of "
                   "--workers processes, or Ray tasks (pip install 'ray>=2.9'); every "
                   "cell runs with its own seed and thread count, so the results are the same "
                   "under each (docs/scale.md)")
    p.add_argument("--workers", type=_int_at_least(1), default=None, help=workers_help)
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="--executor ray: the cluster (e.g. 10.0.0.5:6379 or ray://host:10001); "
                   "default $RAY_ADDRESS, else a Ray instance running here, else a new local one")


def _device(text: str) -> str:
    """argparse type for --device: checked at parse time (imports torch only when given)."""
    from .devices import resolve_device

    try:
        resolve_device(text, "--device")
    except ValueError as err:
        # A Ray driver may have no GPU while its workers do: availability is checked
        # where the cells run (the run functions check it for local executors).
        if "sees no CUDA device" not in str(err):
            raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _add_device(p) -> None:
    p.add_argument("--device", type=_device, default=None, metavar="DEVICE",
                   help="where models run: auto (default: cuda if PyTorch sees a GPU, else "
                   "cpu), cpu, cuda or cuda:N; see docs/scale.md")


def _table(df, **options) -> str:
    import pandas as pd

    from .viz.report import integer_columns

    # option_context takes (name, value) pairs positionally, never keywords.
    pairs = [x for kv in options.items() for x in kv]
    with pd.option_context("display.width", 220, "display.max_columns", 20,
                           "display.float_format", "{:.3f}".format, *pairs):
        return integer_columns(df).to_string(index=False)


def _demo(args: argparse.Namespace) -> int:
    from .experiments.demo import DemoConfig, run_demo

    cfg = DemoConfig(quick=args.quick, digits=args.digits, seed=args.seed,
                     max_steps=args.max_steps, threads=args.threads)
    out = args.out or ("posinterp-demo-quick" if args.quick else "posinterp-demo")
    res = run_demo(cfg, out, progress=not args.no_progress, device=args.device)
    print(_table(res.table))
    import json

    run = json.loads((Path(out) / "run.json").read_text())
    status = "reached" if res.reached_target else "did not reach"
    # Two different held-out samples: say which number is which.
    print(f"\ntraining {status} the target ({cfg.target_accuracy:.0%} exact match on the "
          f"stopping rule's {run['train']['n_eval']:,} held-out samples) in {res.steps} steps; "
          f"exact match on {run['n_test']:,} held-out samples: {res.accuracy:.3f}")
    # The figures are this CPU's: float32 rounding differs across CPUs (README).
    print(f"took {run['seconds']:.0f} s on {run['cpu']}, {cfg.threads} thread(s)")
    print(f"report: {res.report_path.resolve()}")
    return 0


def _zoo_train(args: argparse.Namespace) -> int:
    from .experiments.zoo import ZooConfig, train_zoo, zoo_home

    if args.family or args.family_set:
        return _zoo_train_families(args)
    cfg = ZooConfig(max_steps=args.max_steps or 2000, schemes=tuple(args.schemes or SCHEMES))
    with _executor(args) as executor:
        df = train_zoo(cfg, seeds=args.seeds, home=args.home, progress=not args.no_progress,
                       first_seed=args.first_seed, executor=executor, threads=args.threads,
                       device=args.device)
    print(_table(df))
    print(f"zoo: {args.home or zoo_home()}")
    return 0


def _zoo_train_families(args: argparse.Namespace) -> int:
    """``zoo train [--family-set SET] --family NAME ...``: each family's config and seed in
    that design, under ``<home>/<NAME>`` (home default ``$POSINTERP_HOME/zoo/<set folder>``)."""
    from .experiments.zoo import family_set, train_zoo, zoo_family, zoo_home

    if args.max_steps is not None or args.seeds != 1 or args.first_seed != 0:
        raise SystemExit("posinterp: error: --family fixes the steps and the seed; drop "
                         "--max-steps, --seeds and --first-seed")
    fset = family_set(args.family_set or "design1")
    # every name checked first
    families = [zoo_family(name, fset.name) for name in (args.family or fset.families)]
    root = Path(args.home) if args.home else zoo_home() / fset.folder
    with _executor(args) as executor:
        for fam in families:
            df = train_zoo(fam.config, home=fam.home(root), progress=not args.no_progress,
                           first_seed=fam.seed, executor=executor, threads=args.threads,
                           device=args.device, only=tuple(args.schemes) if args.schemes else None)
            print(f"family {fam.name} ({fam.differs_in}):")
            print(_table(df))
    print(f"families: {root}")
    return 0


def _zoo_fingerprint(args: argparse.Namespace) -> int:
    """``zoo fingerprint``: the unit-level fingerprint test over the trained families of
    one design (``--family-set``), written to ``<out>/<the set's folder>``."""
    from .experiments.fingerprint_families import run_families
    from .experiments.zoo import family_set, zoo_home

    fset = family_set(args.family_set)
    if args.verify is not None:
        from .experiments.fingerprint_families import verify_units

        data = args.verify_data or f"docs/reproductions/data/fingerprints/{fset.folder}"
        table = verify_units(data, args.verify, progress=not args.no_progress)
        print(_table(table[~table.within] if not table.within.all() else
                     table.groupby("cell", sort=False).within.agg(["size", "all"])
                     .rename(columns={"size": "fields", "all": "within"}).reset_index()))
        print(table.attrs["summary"])
        return 0 if table.within.all() else 1
    if args.out is None:
        raise SystemExit("posinterp zoo fingerprint: error: --out is required (except with --verify)")
    families = tuple(args.family) if args.family else None
    root = Path(args.home) if args.home else zoo_home() / fset.folder
    resume = ("posinterp zoo train"
              + (f" --family-set {fset.name}" if fset.name != "design1" else "")
              + " --family " + " ".join(families or FAMILY_NAMES)
              + (f" --home {args.home}" if args.home else "") + " --threads 1")
    with _executor(args) as executor:
        tests = run_families(Path(args.out) / fset.folder, root, families,
                             progress=not args.no_progress,
                             command=" ".join(["posinterp", *args.argv]),
                             resume_command=resume, executor=executor,
                             family_set_name=fset.name)
    cols = ["analysis", "n_rope", "n_other", "mean_rope", "mean_other", "p_permutation",
            "min_possible_p", "separated"]
    print(_table(tests[cols]))
    if args.markdown:
        from .experiments.spectrum import render_markdown

        Path(args.markdown).write_text(render_markdown(args.out))
        print(f"page: {args.markdown}")
    print(f"tables: {(Path(args.out) / fset.folder).resolve()}")
    return 0


def _zoo_dynamics(args: argparse.Namespace) -> int:
    """``zoo dynamics``: onset times of behaviour and signature over dense snapshots."""
    from dataclasses import replace

    from .experiments.dynamics import DESIGN, run_dynamics
    from .experiments.zoo import zoo_home

    design = replace(DESIGN, families=tuple(args.family or DESIGN.families),
                     n_seeds=args.seeds or DESIGN.n_seeds)
    root = Path(args.home) if args.home else zoo_home() / "dynamics"
    with _executor(args) as executor:
        summary = run_dynamics(Path(args.out) / "dynamics", root, design,
                               progress=not args.no_progress,
                               command=" ".join(["posinterp", *args.argv]), executor=executor,
                               device=args.device)
    prim = summary[summary.rule == "primary"]
    print(_table(prim[["statistic", "estimate", "ci_low", "ci_high", "n_heads", "n_runs"]]))
    if args.markdown:
        from .experiments.spectrum import render_markdown

        Path(args.markdown).write_text(render_markdown(args.out))
        print(f"page: {args.markdown}")
    print(f"tables: {(Path(args.out) / 'dynamics').resolve()}")
    return 0


def _zoo_list(args: argparse.Namespace) -> int:
    from .experiments.zoo import list_zoo, zoo_home

    df = list_zoo(args.home)
    print(_table(df) if len(df) else "the zoo is empty")
    print(f"zoo: {args.home or zoo_home()}")
    return 0


def _spectrum(args: argparse.Namespace) -> int:
    import json

    from .experiments.spectrum import run_spectrum

    if args.min_prev_score is not None and not 0 <= args.min_prev_score <= 1:
        raise ValueError(f"--min-prev-score must be in [0, 1], got {args.min_prev_score}")
    extra = {} if args.min_prev_score is None else {"min_prev_score": args.min_prev_score}
    if args.weights_only:
        from .experiments.spectrum import run_weights_only

        if args.dynamics or args.markdown or args.min_prev_score is not None:
            raise ValueError("--weights-only reads no activations: it cannot be combined with "
                             "--dynamics, --markdown or --min-prev-score")
        with _executor(args) as executor:
            heads = run_weights_only(args.specs, args.out, progress=not args.no_progress,
                                     command=" ".join(["posinterp", *args.argv]),
                                     revisions=args.revisions, executor=executor)
        out = Path(args.out).resolve()
        if len(heads):
            cols = [c for c in ("model", "revision", "layer", "head", "rotational_mass",
                                "rotational_mass_null_percentile") if c in heads]
            print("heads with the largest rotational mass (offset 0):")
            print(_table(heads.sort_values("rotational_mass", ascending=False)[cols].head(10)))
        if args.revisions is None:
            print(f"tables: {out} (heads.csv, spectrum.csv, run.json)")
            return 0
        run = json.loads((out / "run.json").read_text())
        bad = [f"{m}@{r}: {e['status']}" for m, revs in run["revisions"].items()
               for r, e in revs.items() if e["status"] != "ok"]
        for line in bad:
            print(line)
        print(f"tables: {out} (series.parquet, series.html, heads.csv, run.json)")
        # a missing or damaged revision is an incomplete series: say so in the exit status
        return 1 if any(": damaged" in line or ": missing" in line for line in bad) else 0
    if args.revisions is not None:
        raise ValueError("--revisions needs --weights-only (a series is read from the weights "
                         "alone)")
    with _executor(args) as executor:
        res = run_spectrum(args.specs, args.out, K=args.top_k, dynamics=args.dynamics,
                           progress=not args.no_progress, units=args.units,
                           markdown=args.markdown, command=" ".join(["posinterp", *args.argv]),
                           executor=executor, device=args.device, **extra)
    if len(res.tests):
        from .viz.report import fingerprint_summary

        print(_table(fingerprint_summary(res.tests)))
        print(res.tests.note.iloc[0])
    else:
        print(res.tests.attrs.get("note", "no test"))
    print(f"report: {res.report_path.resolve()}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .experiments.compare import run_compare

    res = run_compare(args.spec, args.compare, args.out, text=args.text, n_tokens=args.tokens,
                      batch=args.batch, ablate=args.ablate, seed=args.seed,
                      max_pattern_tokens=args.max_pattern_tokens, progress=not args.no_progress,
                      device=args.device, input_kind=args.input)
    cmp = res.comparison
    print("heads that changed most (B - A):")
    print(_table(cmp.heads[["layer", "head", "change", "kernel_attention_change", "spectrum_change"]
                           + [c for c in ("delta_previous_token_score",) if c in cmp.heads]].head(5)))
    print(f"\nformed or dissolved: {len(cmp.formed)} crossing(s)")
    if len(cmp.formed):
        print(_table(cmp.formed))
    if cmp.notes:  # what was not compared and why, as on the page
        print("\nnotes:")
        for note in cmp.notes:
            print(f"- {note}")
    print(f"\ntook {res.seconds:.1f} s; page: {res.report_path.resolve()}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.compare is not None:
        if args.layers is not None or args.heads is not None:
            raise ValueError("--layers/--heads are not supported with --compare (a comparison "
                             "pairs every head); drop them or inspect each model on its own")
        return _compare(args)
    from .experiments.inspect import run_inspect

    if args.ablate and args.ablate_approx is not None:
        raise ValueError("--ablate (exact) and --ablate-approx K (approximate) are alternatives; "
                         "give one of them")
    layers, heads = (None if v is None else [i for item in v for i in item]
                     for v in (args.layers, args.heads))
    approx = args.ablate_approx is not None
    res = run_inspect(args.spec, args.out, text=args.text, n_tokens=args.tokens,
                      batch=args.batch, ablate="attribution" if approx else args.ablate,
                      exact_top_k=args.ablate_approx if approx else 20, seed=args.seed,
                      max_pattern_tokens=args.max_pattern_tokens, progress=not args.no_progress,
                      device=args.device, input_kind=args.input, layers=layers, heads=heads,
                      query_block=args.query_block)
    from .dashboard.schema import head_wide

    wide = head_wide(res.table)
    top = wide.sort_values("previous_token_score", ascending=False).head(5)
    print("top previous-token heads:")
    print(_table(top[[c for c in wide.columns if c in (
        "layer", "head", "previous_token_score", "self_score", "first_token_score")
        or c.startswith("rotational_mass")]]))
    if "induction_score" in wide:
        ind = [c for c in ("induction_score", "induction_score_input") if c in wide]
        print("\ntop induction heads (repeated random tokens):")
        print(_table(wide.sort_values("induction_score", ascending=False).head(5)[["layer", "head", *ind]]))
    print(f"\ntook {res.seconds:.1f} s; page: {res.report_path.resolve()}")
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    from .experiments.zuo2024 import ReproConfig, run_zuo2024

    if args.verify is not None:
        from .experiments.zuo2024 import verify_trainings

        data = args.verify_data or "docs/reproductions/data/zuo2024"
        table = verify_trainings(data, args.verify, device=args.device,
                                 progress=not args.no_progress)
        print(_table(table))
        print(table.attrs["summary"])
        return 0 if table.within.all() else 1
    cfg = ReproConfig.full() if args.full else ReproConfig()
    command = ("posinterp reproduce zuo2024 " + ("--full" if args.full else "--quick")
               + f" --out {args.out}" + (f" --markdown {args.markdown}" if args.markdown else ""))
    with _executor(args) as executor:
        claims = run_zuo2024(cfg, args.out, progress=not args.no_progress,
                             markdown=args.markdown, command=command, executor=executor,
                             device=args.device, compute=not args.no_compute)
    print(_table(claims[["claim", "point", "figure", "holds"]], **{"display.max_colwidth": 90}))
    print(f"report: {(Path(args.out) / 'report.html').resolve()}")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from .experiments.qk_constraints import (
        ConstraintGrid,
        display_summary,
        restore_run,
        run_qk_constraints,
        run_sensitivity,
        write_page,
    )

    if args.verify is not None:
        from .experiments.qk_constraints import verify_cells

        if args.restore_from is None:
            raise SystemExit("posinterp experiment: --verify K needs --restore-from DATA "
                             "(the committed outputs whose cells are re-run)")
        table = verify_cells(args.restore_from, args.verify, device=args.device,
                             progress=not args.no_progress)
        print(_table(table))
        print(table.attrs["summary"])
        return 0 if table.within.all() else 1
    grid = ConstraintGrid.quick() if args.quick else ConstraintGrid()
    if args.pes is not None:
        grid = dataclasses.replace(grid, pes=tuple(args.pes))
    if args.constraints is not None:
        grid = dataclasses.replace(grid, constraints=tuple(args.constraints))
    for name in ("seeds", "workers"):
        value = getattr(args, name)
        if value is not None:
            grid = dataclasses.replace(grid, **{name: value})
    import json

    command = " ".join(["posinterp", *args.argv])
    # without --executor, --workers (default 2) processes share the cells, as before
    default = "local" if grid.workers == 1 else "process"
    if args.restore_from is not None:
        restored = restore_run(args.restore_from, args.out)
        print(f"restored {len(restored)} finished cells from {args.restore_from} into {args.out}")
    with _executor(args, default, grid.workers) as executor:
        summary = run_qk_constraints(grid, args.out, progress=not args.no_progress,
                                     markdown=None if args.sensitivity else args.markdown,
                                     command=command, executor=executor, device=args.device,
                                     only_finished=args.tables_only)
        if args.sensitivity:
            run_sensitivity(args.out, base=grid, progress=not args.no_progress, command=command,
                            executor=executor, device=args.device,
                            only_finished=args.tables_only)
    if args.sensitivity and args.markdown:
        write_page(args.out, args.markdown)
    # capped medians and the ratios they bound print as bounds, as on the page
    print(_table(display_summary(summary)))
    run = json.loads((Path(args.out) / "run.json").read_text())
    print(f"task ceiling (plain induction on the scored tokens): {run['induction_ceiling']:.3f}; "
          f"target {grid.target}")
    print(f"report: {(Path(args.out) / 'report.html').resolve()}")
    return 0


def _parser(sub, name: str, summary: str, description: str, func, resumable: str):
    p = sub.add_parser(name, help=summary, description=f"{summary}. {description}")
    p.set_defaults(func=func, resumable=resumable)
    return p


def _no_progress(p) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars or log lines")
    _add_device(p)  # every command that runs a model has both


def build_parser() -> argparse.ArgumentParser:
    """The ``posinterp`` argument parser (cheap: imports nothing heavy)."""
    from .io import POSINTERP_VERSION  # standard library only: keeps the parser cheap

    pos1, pos0 = _int_at_least(1), _int_at_least(0)
    p = argparse.ArgumentParser(prog="posinterp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"posinterp {POSINTERP_VERSION}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = _parser(sub, "demo", "train a NoPE model on reversal and report its adjacency pattern "
                "at init and after training (offline; CPU or --device)",
                "Writes report.html, adjacency.csv and history.csv; resumes from the last "
                "checkpoint when rerun with the same options.", _demo, "checkpoints")
    d.add_argument("--quick", action="store_true",
                   help="6-digit strings, at most 600 steps, final accuracy on 5,000 held-out "
                   "samples; ~90 s on one thread, ~65 s with --threads 2 on an idle 2-core "
                   "machine (docs/performance.md)")
    d.add_argument("--digits", type=int, default=None, choices=range(5, 17), metavar="{5..16}",
                   help="length of the strings to reverse (default 8, or 6 with --quick)")
    d.add_argument("--seed", type=pos0, default=0, help="seed of model, data and batches (default 0)")
    d.add_argument("--max-steps", type=pos1, default=None,
                   help="training step cap (default 3000, or 600 with --quick)")
    d.add_argument("--threads", type=pos1, default=1, help="torch threads (default 1: steady "
                   "when other jobs share the cores; --threads 2 is faster on an otherwise idle "
                   "2-core machine but several times slower next to a busy process; results "
                   "depend on the thread count)")
    d.add_argument("--out", type=_out_folder, default=None, help="output folder, resumable "
                   "(default posinterp-demo, or posinterp-demo-quick with --quick)")
    _no_progress(d)

    i = _parser(sub, "inspect", "a head-by-head positional dashboard of any model (offline HTML)",
                "For every head: positional kernel, previous-token/self/first-token scores, "
                "QK eigenvalues against random heads and, with --ablate, the loss change when "
                "the head or one of its spectral channels is removed. Writes inspect.html, inspection.json, "
                "heads.csv (tidy) and run.json.", _inspect, "")
    i.add_argument("spec", help="a model: toy/zoo spec (zoo:rotary), HF checkpoint folder, "
                   "GGUF file (its tokenizer included), llama2.c .bin file or hub name (from "
                   "the Hugging Face cache; the network only to fill it)")
    src = i.add_mutually_exclusive_group()
    src.add_argument("--text", default=None, metavar="FILE",
                     help="UTF-8 text, one sequence per paragraph (blank-line separated), "
                     "tokenized by the model's tokenizer with its own attention mask")
    src.add_argument("--tokens", type=_int_at_least(3), default=64, metavar="N",
                     help="random-token sequences of N tokens (default 64; used without --text)")
    i.add_argument("--input", choices=["random", "sampled"], default="random",
                   help="without --text: uniform random token ids (default), or the model's "
                   "own seeded samples from its BOS (natural text for a model without a "
                   "tokenizer, e.g. stories260K); --tokens and --batch set their size")
    i.add_argument("--batch", type=pos1, default=8,
                   help="number of random-token or sampled sequences (default 8)")
    i.add_argument("--ablate", action="store_true",
                   help="also measure the loss change when each head or spectral channel is removed "
                   "(exact: one batched rerun of the layers from the ablated one on)")
    i.add_argument("--ablate-approx", type=pos0, default=None, metavar="K",
                   help="instead of --ablate: first-order estimates of every loss change "
                   "(attribution patching: one forward and one backward pass; labelled approximate "
                   "on the page and in heads.csv as loss_change_attribution) and exact reruns of "
                   "the K largest")
    i.add_argument("--seed", type=pos0, default=0, help="seed of random tokens and the null (default 0)")
    i.add_argument("--max-pattern-tokens", type=pos1, default=96,
                   help="pattern views of a longer input are pooled into blocks to at most "
                   "this many cells a side, the scale stated (default 96)")
    i.add_argument("--layers", type=_index_items, nargs="+", default=None, metavar="L",
                   help="inspect only these layers: indices and inclusive ranges, e.g. "
                   "--layers 0 17-20 (default: all; checked against the model's n_layers)")
    i.add_argument("--heads", type=_index_items, nargs="+", default=None, metavar="H",
                   help="inspect only these heads in every inspected layer, e.g. --heads 4-6 "
                   "(default: all; checked against the model's n_heads)")
    i.add_argument("--query-block", type=_query_block, default="auto", metavar="N",
                   help="run the forward pass N positions at a time through the model's KV "
                   "cache, so no layer's tokens x tokens attention is made (memory per head: "
                   "N x tokens); 'auto' (default): 512 past 2,048 tokens where the model's "
                   "pass in blocks is verified; 'none': never")
    i.add_argument("--out", type=_out_folder, default="posinterp-inspect",
                   help="output folder (default posinterp-inspect)")
    i.add_argument("--compare", default=None, metavar="SPEC_B",
                   help="compare SPEC with SPEC_B (same n_layers x n_heads and vocabulary, e.g. "
                   "two checkpoints) on the same input: per head the change of every score, "
                   "kernel and spectrum, and which heads formed; writes compare.html")
    _no_progress(i)

    z = sub.add_parser("zoo", help="small byte-level LMs identical except for positions",
                       description="Small byte-level LMs identical except for positions.")
    zsub = z.add_subparsers(dest="zoo_command", required=True, metavar="ZOO_COMMAND")
    zt = _parser(zsub, "train", "train (or resume) the zoo: one model per scheme and seed",
                 "Each (scheme, seed) is skipped when finished and resumed when not.",
                 _zoo_train, "finished models")
    zt.add_argument("--seeds", type=pos1, default=1,
                    help="seeds per scheme (default 1; fingerprint statistics need >= 3)")
    zt.add_argument("--first-seed", type=pos0, default=0, help="train seeds first-seed .. "
                    "first-seed + seeds - 1, so several processes can share the zoo (default 0)")
    zt.add_argument("--schemes", nargs="+", default=None, choices=SCHEMES,
                    help="positional schemes (default: all four)")
    zt.add_argument("--max-steps", type=pos1, default=None,
                    help="steps per model (default 2000, ~10 min on 2 cores)")
    zt.add_argument("--family", nargs="+", default=None, choices=sorted(FAMILY_NAMES),
                    metavar="NAME", help="train these fingerprint-zoo families (each its own "
                    "architecture, data, optimizer and seed; one model per scheme) under "
                    "HOME/NAME, HOME defaulting to $POSINTERP_HOME/zoo/families; names: "
                    + ", ".join(FAMILY_NAMES))
    zt.add_argument("--family-set", default=None, choices=sorted(FAMILY_SETS), metavar="SET",
                    help="the design the families come from: design1 (800 steps per model, "
                    "the default) or design2 (the same families, 2400 steps); HOME defaults "
                    "to $POSINTERP_HOME/zoo/families or .../families-design2; with no "
                    "--family, every family of the set")
    zt.add_argument("--home", type=_home_folder, default=None,
                    help="zoo folder (default $POSINTERP_HOME/zoo, else ~/.cache/posinterp/zoo)")
    zt.add_argument("--threads", type=pos1, default=1, help="torch threads per model, also the "
                    "CPUs each model asks a scheduler for (default 1; the weights depend on it)")
    _executor_options(zt, "--executor process: models trained at once (default: one per core)")
    _no_progress(zt)
    zf = _parser(zsub, "fingerprint", "the RoPE-vs-other fingerprint test over the trained "
                 "families (one unit per family x scheme)",
                 "Writes OUT/families/{heads,units,tests}.csv and run.json (design2: "
                 "OUT/families-design2/...); models not trained "
                 "yet are listed as pending. Each model's table is kept and reused while its "
                 "card is unchanged.", _zoo_fingerprint, "finished models' tables")
    zf.add_argument("--family", nargs="+", default=None, choices=sorted(FAMILY_NAMES),
                    metavar="NAME", help="families to include (default all: "
                    + ", ".join(FAMILY_NAMES) + ")")
    zf.add_argument("--family-set", default="design1", choices=sorted(FAMILY_SETS),
                    metavar="SET", help="the design: design1 (800 steps per model, the "
                    "default; tables to OUT/families) or design2 (the same families, 2400 "
                    "steps; tables to OUT/families-design2)")
    zf.add_argument("--home", type=_home_folder, default=None,
                    help="the families' folder (as for zoo train --family; default "
                    "$POSINTERP_HOME/zoo/families, design2 .../families-design2)")
    zf.add_argument("--out", type=_out_folder, default=None,
                    help="a `posinterp spectrum` output folder; the tables go to OUT/families "
                    "(design2: OUT/families-design2); required except with --verify")
    zf.add_argument("--verify", type=pos1, default=None, metavar="K",
                    help="instead: re-train K seeded-random units of the committed design "
                    "here and compare each head's scores and the unit's loss with the page's "
                    "precision (exit 1 if one differs)")
    zf.add_argument("--verify-data", default=None, metavar="DATA",
                    help="the outputs --verify reads (default "
                    "docs/reproductions/data/fingerprints/<the set's folder>)")
    zf.add_argument("--markdown", default=None, metavar="PAGE",
                    help="also write the fingerprint page, from OUT (the real models), "
                    "OUT/families and OUT/families-design2")
    _executor_options(zf, "--executor process: models analysed at once")
    _no_progress(zf)
    zd = _parser(zsub, "dynamics", "onset times of the previous-token behaviour and of the "
                 "rotational signature over dense training snapshots (rotary families x seeds)",
                 "The design (threshold, null band, persistence rule, snapshot grid, bootstrap) "
                 "is written to OUT/dynamics/run.json before training; models train (or resume) "
                 "under HOME/<family>, each run's trajectories are kept under HOME/cells.",
                 _zoo_dynamics, "finished models and trajectories")
    zd.add_argument("--family", nargs="+", default=None, choices=sorted(FAMILY_NAMES),
                    metavar="NAME", help="families (default base wide heads8; names: "
                    + ", ".join(FAMILY_NAMES) + ")")
    zd.add_argument("--seeds", type=pos1, default=None,
                    help="runs per family, seeds 10 * F + i for a family of seed F (default 4)")
    zd.add_argument("--home", type=_home_folder, default=None,
                    help="models and cells (default $POSINTERP_HOME/zoo/dynamics)")
    zd.add_argument("--out", type=_out_folder, required=True,
                    help="a `posinterp spectrum` output folder; the tables go to OUT/dynamics")
    zd.add_argument("--markdown", default=None, metavar="PAGE",
                    help="also write the fingerprint page from OUT")
    _executor_options(zd, "--executor process: runs trained and analysed at once")
    _no_progress(zd)
    zl = _parser(zsub, "list", "show the zoo's models", "One row per model folder.", _zoo_list, "")
    zl.add_argument("--home", default=None,
                    help="zoo folder (default $POSINTERP_HOME/zoo, else ~/.cache/posinterp/zoo)")

    sp = _parser(sub, "spectrum", "QK-circuit spectra, previous-token heads and RoPE-vs-other "
                 "fingerprint statistics for one or more models",
                 "Writes heads.csv, spectrum.csv, fingerprint CSVs and report.html; each "
                 "model's tables are kept in --out/cells and reused while its files are "
                 "unchanged.", _spectrum, "finished models' tables")
    sp.add_argument("specs", nargs="+", metavar="SPEC", help="hub names, HF folders, .bin files, "
                    "zoo:<pe>[:<seed>], all-MiniLM-L6-v2")
    sp.add_argument("--out", type=_out_folder, default="posinterp-spectrum",
                    help="output folder (default posinterp-spectrum)")
    sp.add_argument("--top-k", type=pos1, default=5,
                    help="K: compare the top 1..K previous-token heads (default 5)")
    sp.add_argument("--dynamics", action="store_true", help="also analyse zoo snapshots")
    sp.add_argument("--units", choices=["family", "model"], default="family",
                    help="independent units of the test: 'family' (default) pools zoo seeds "
                    "of one scheme into one unit; 'model' counts each seed")
    sp.add_argument("--min-prev-score", type=float, default=None,
                    help="a model whose best previous-token score is below this has no "
                    "previous-token head and is left out of the test (default 0.3)")
    sp.add_argument("--markdown", default=None, metavar="PATH",
                    help="also write the reproduction page (tables from this run's outputs)")
    sp.add_argument("--weights-only", action="store_true",
                    help="read only the q/k projections and attention-norm gains (local HF "
                    "folders with safetensors, .gguf files): no forward pass, no full model in "
                    "memory; spectra and null percentiles, no previous-token ranking")
    sp.add_argument("--revisions", default=None, metavar="REVS",
                    help="with --weights-only and hub model names: a checkpoint series, "
                    "'step0,step1000,...' or 'all' (every branch in the Hugging Face cache); "
                    "revisions with identical q/k bytes are refused by name; writes "
                    "series.parquet and series.html")
    _executor_options(sp, "--executor process: models analysed at once (default: one per core)")
    _no_progress(sp)

    rp = _parser(sub, "reproduce", "rerun a paper's results with posinterp",
                 "zuo2024: Zuo, Guerzhoy & Guerzhoy 2024 (arXiv 2501.00073), claim by claim.",
                 _reproduce, "finished cells")
    rp.add_argument("paper", choices=["zuo2024"], help="which paper (choices: zuo2024)")
    rp.add_argument("--verify", type=pos1, default=None, metavar="K",
                    help="re-train K seeded-random trainings of committed outputs here and "
                         "report how many reproduce within the page's precision (exit 1 if "
                         "one does not); writes nothing")
    rp.add_argument("--verify-data", default=None, metavar="DATA",
                    help="the outputs --verify reads (default docs/reproductions/data/zuo2024)")
    mode = rp.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="the CPU protocol, the default (wall time on 2 shared cores: "
                      "docs/reproductions/zuo2024.md)")
    mode.add_argument("--full", action="store_true", help="the paper's protocol (GPU-sized)")
    rp.add_argument("--out", type=_out_folder, default="posinterp-zuo2024",
                    help="output folder (default posinterp-zuo2024)")
    rp.add_argument("--markdown", default=None, metavar="PATH",
                    help="also write the reproduction page (every figure from this run's CSVs)")
    rp.add_argument("--no-compute", "--tables-only", dest="no_compute", action="store_true",
                    help="(either name) run nothing: summarize the finished cells and list the unfinished "
                    "trainings (deeper models, other tasks) as pending (the init, grid, "
                    "reversal and probe cells must be finished)")
    _executor_options(rp, "--executor process: cells run at once (default: one per core)")
    _no_progress(rp)

    ex = _parser(sub, "experiment", "learning-speed experiments",
                 "qk-constraints: steps to learn induction under each QK constraint vs its control.",
                 _experiment, "finished cells")
    ex.add_argument("name", choices=["qk-constraints"], help="which experiment (choices: qk-constraints)")
    ex.add_argument("--quick", action="store_true", help="a smoke run of a few minutes")
    ex.add_argument("--verify", type=pos1, default=None, metavar="K",
                    help="with --restore-from DATA: re-run K seeded-random cells of DATA's grid "
                         "here and report how many reproduce within the page's precision "
                         "(exit 1 if one does not); writes nothing")
    ex.add_argument("--seeds", type=pos1, default=None, help="seeds per cell (default 5)")
    ex.add_argument("--pes", nargs="+", default=None, choices=["nope", "absolute", "rotary", "alibi"],
                    help="positional schemes (default: absolute rotary)")
    ex.add_argument("--constraints", nargs="+", default=None, metavar="NAME",
                    help="constraints (default: none; the channel bans ban_positive_real, "
                         "ban_negative_real, ban_complex, each with its controls rank_matched_<c> "
                         "(a fixed random subspace of the ban's rank at init) and rank_tracked_<c> "
                         "(one resized to the ban's rank as it changes; needs its ban); tied, "
                         "symmetric); also antisymmetric, left_half_plane, "
                         "right_half_plane, and on RoPE (--pes rotary) frequency-band bans "
                         "ban_band_p0, ban_band_p0-1, ... (rotary pairs, pair 0 the fastest)")
    _executor_options(ex, "processes sharing the cells, one torch thread each (default 2)",
                      default="process with 2 workers")
    ex.add_argument("--out", type=_out_folder, default="posinterp-qk-constraints",
                    help="output folder (default posinterp-qk-constraints)")
    ex.add_argument("--markdown", default=None, metavar="PATH",
                    help="also write the reproduction page (tables from this run's outputs)")
    ex.add_argument("--sensitivity", action="store_true",
                    help="after the grid, run (or resume) the sensitivity grids of the "
                         "symmetrization claim (absolute PE; other init scales, learning rates, "
                         "depth, width) into OUT/sensitivity/")
    ex.add_argument("--tables-only", "--no-compute", dest="tables_only", action="store_true",
                    help="(either name, as reproduce's --no-compute) run no cell: write the "
                         "tables and page from the finished cells, listing the others as "
                         "pending (the same command without this flag resumes them)")
    ex.add_argument("--restore-from", default=None, metavar="DATA",
                    help="first turn committed run outputs (e.g. "
                         "docs/reproductions/data/qk-constraints) into finished cells in OUT, "
                         "so only the cells they lack are run")
    _no_progress(ex)
    return p


def _interrupted(err: KeyboardInterrupt, args: argparse.Namespace) -> str:
    """A truthful line about what an interrupted command kept."""
    saved = getattr(err, "saved", False)
    kept = getattr(args, "resumable", "")
    if saved is not False:  # raised by posinterp.train with the last complete checkpoint
        step = getattr(err, "step", "?")
        # in a grid, the training that was interrupted is one cell; the finished ones stay
        grid = f"; {kept} are kept" if kept and kept != "checkpoints" else ""
        if saved is None and grid:
            return (f"posinterp: interrupted at step {step} of a running cell, which had no "
                    f"checkpoint yet and will start again{grid}; rerun the same command to resume")
        if saved is None:
            return (f"posinterp: interrupted at step {step}; no checkpoint had been written yet, "
                    "so nothing was saved")
        return (f"posinterp: interrupted at step {step}; the last checkpoint ({saved}) is saved"
                f"{grid}; rerun the same command to resume from it")
    if kept:
        return f"posinterp: interrupted; {kept} are kept, rerun the same command to resume"
    return "posinterp: interrupted; no partial output was written"


def _input_errors(args: argparse.Namespace) -> list[str]:
    """Every spec, path and range the command was given that cannot work, one message
    each, found before torch is imported or any cell starts (posinterp.specs)."""
    from .specs import context_length, read_text_file, spec_errors

    errors = []
    if args.command == "inspect":
        specs = [args.spec] + ([args.compare] if args.compare is not None else [])
        errors += spec_errors(specs)
        if args.text is not None:
            try:
                read_text_file(args.text, "--text")
            except (ValueError, FileNotFoundError) as err:
                errors.append(str(err))
        else:  # --tokens is used only without --text
            for spec in specs:
                n_ctx = context_length(spec)
                if n_ctx is not None and args.tokens > n_ctx:
                    errors.append(f"--tokens must be <= the model's n_ctx = {n_ctx} ({spec}), "
                                  f"got {args.tokens}")
    elif args.command == "spectrum":
        errors += spec_errors(args.specs)
        if args.min_prev_score is not None and not 0 <= args.min_prev_score <= 1:
            errors.append(f"--min-prev-score must be in [0, 1], got {args.min_prev_score}")
    return errors


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``posinterp`` command; returns the exit status (2 on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line, recorded with results
    errors = _input_errors(args)
    if errors:
        for line in errors:
            print(f"posinterp: error: {line}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (MemoryError, RuntimeError) as err:
        from ._memory import is_out_of_memory

        if not is_out_of_memory(err):
            raise
        print(_out_of_memory(err, args), file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"posinterp: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk or a read-only folder: the path and the cause
        from .io import describe_os_error

        print(f"posinterp: error: {describe_os_error(err)}", file=sys.stderr)
        return 2
    except ImportError as err:
        # an optional package posinterp asked for, with the command that installs it
        if "needs" not in str(err) or "pip install" not in str(err):
            raise
        print(f"posinterp: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from .executors import CellsFailed

        if not isinstance(err, CellsFailed):
            raise
        print(f"posinterp: error: {err}", file=sys.stderr)
        # every failure a bad-input error (a bad spec, say): the status of bad input
        bad_input = {"ValueError", "FileNotFoundError", "NotImplementedError"}
        return 2 if set(err.errors.values()) <= bad_input else 1
    except KeyboardInterrupt as err:
        print(_interrupted(err, args), file=sys.stderr)
        return 130


def _out_of_memory(err: BaseException, args) -> str:
    """One line for an allocation failure: the command's own sentence where it has one
    (:class:`posinterp._memory.InputTooLargeError`), else what ran out and the way out."""
    from ._memory import InputTooLargeError

    if isinstance(err, InputTooLargeError):
        return f"posinterp: error: {err}"
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return (f"posinterp: error: out of memory in `posinterp {args.command}` ({first}); use a "
            "smaller input (fewer tokens, a smaller batch, fewer layers) or a machine with more "
            "memory; results already finished are kept, nothing was half-written")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
