"""The fingerprint test over independent units: zoo families x positional schemes.

A unit is one trained model, ``<family>/<pe>`` of one design
(:func:`posinterp.experiments.zoo.family_set`: ``design1``, the families of
:data:`~posinterp.experiments.zoo.FAMILIES`; ``design2``, the same with 3x the steps;
families differ in depth, width, heads, data or optimizer, and in seed). Its value is the
mean null percentile of rotational mass over its top-k previous-token heads that reach
the threshold (:func:`posinterp.analysis.fingerprint.unit_table`); RoPE units are tested
against absolute and ALiBi units (NoPE apart) with an exact permutation test whose floor
is printed beside it (:func:`posinterp.analysis.fingerprint.unit_test`).

Everything the test depends on is fixed in :data:`DESIGN` and :data:`ANALYSES` before a
family is trained, and written to ``run.json`` with the design's name and why it exists.

Layout of ``out_dir``::

    cells/<family>/<pe>.csv     one model's head table (reused while its card is unchanged)
    heads.csv  units.csv  tests.csv  run.json
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pandas as pd
import torch

from ..analysis.fingerprint import MIN_PREV_SCORE, PRIMARY_K, head_table, unit_table, unit_test
from ..analysis.spectral import GINIBRE_NULL_VERSION
from ..executors import Cell, Executor, run_cells
from ..io import atomic_path, atomic_write_json, check_out_dir, locks_output, versions
from ..tasks.corpus import stdlib_corpus
from ._verify import compare_rerun, report, verify_table
from .zoo import family_set, load_zoo_model, train_zoo, zoo_family, zoo_home

__all__ = ["ANALYSES", "DESIGN", "ranking_tokens", "run_families", "verify_units"]

N_RANK_WINDOWS = 16
RANK_SEED = 0
SCHEMES = ("rotary", "absolute", "alibi", "nope")

DESIGN = {
    "unit": "one model: a zoo family x a positional scheme (one seed per family; families "
            "differ in depth, width, heads, data or optimizer, and in seed)",
    "ranking": f"previous-token score on {N_RANK_WINDOWS} windows of n_ctx bytes of held-out "
               "standard-library text (the validation files of the whole corpus, window "
               f"starts drawn with seed {RANK_SEED}), the same text for every unit",
    "threshold": MIN_PREV_SCORE,
    "primary_k": PRIMARY_K,
    "aggregation": f"mean over the unit's top-{PRIMARY_K} previous-token heads that reach the "
                   "threshold; a unit with none is left out (listed)",
    "measure": "null percentile (0-100) of the head's rotational mass R in a product-Ginibre "
               "null of its shape (2,500 null heads), R of M = W_Q W_K^T at offset 0, with "
               "the effective (norm-gain folded) weights",
    "test": "RoPE units > absolute and ALiBi units: exact one-sided permutation test of the "
            "difference of means (every relabelling enumerated); NoPE units reported apart",
}

# (name, what changes from the primary row, head column, k, NoPE's side)
ANALYSES = (
    ("primary", "as designed", "rotational_mass_null_percentile", PRIMARY_K, "exclude"),
    ("stored weights", "raw stored W_Q, W_K instead of the effective ones",
     "stored_rotational_mass_null_percentile", PRIMARY_K, "exclude"),
    ("k = 1", "top-1 previous-token head", "rotational_mass_null_percentile", 1, "exclude"),
    ("k = 3", "top-3 previous-token heads", "rotational_mass_null_percentile", 3, "exclude"),
    ("R, not its percentile", "the rotational mass itself", "rotational_mass", PRIMARY_K,
     "exclude"),
    ("NoPE as other", "NoPE units join the other side", "rotational_mass_null_percentile",
     PRIMARY_K, "other"),
)


def ranking_tokens(n_ctx: int, n: int = N_RANK_WINDOWS, seed: int = RANK_SEED,
                   corpus=None) -> torch.Tensor:
    """The text heads are ranked on: ``[n, n_ctx]`` byte ids from the validation split of
    the whole standard-library corpus (:func:`posinterp.tasks.corpus.stdlib_corpus`),
    window starts drawn with ``seed``.

    Raises:
        ValueError: for ``n`` or ``n_ctx`` below 1.
    """
    if n < 1 or n_ctx < 1:
        raise ValueError(f"n and n_ctx must be >= 1, got {n}, {n_ctx}")
    corpus = corpus or stdlib_corpus()
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(corpus.val) - n_ctx, (n,), generator=gen)
    return corpus.windows("val", starts, n_ctx)


def _unit_heads(family: str, pe: str, root: str, corpus=None,
                family_set_name: str = "design1") -> pd.DataFrame:
    """One model's cell: its head table, ranked on :func:`ranking_tokens`, with the
    effective and stored weights' measures."""
    fam = zoo_family(family, family_set_name)
    model, card = load_zoo_model(f"zoo:{pe}:{fam.seed}", home=fam.home(root), device="cpu")
    toks = ranking_tokens(model.cfg.n_ctx, corpus=corpus)
    table = head_table(model, tokens=toks, seed=RANK_SEED, weights=("effective", "stored"))
    return table.assign(family=family, pe=pe, unit=f"{family}/{pe}", seed=fam.seed,
                        steps=card["steps"], val_loss=card["val_loss"])


def _card(root: Path, family: str, pe: str, family_set_name: str = "design1") -> Path:
    fam = zoo_family(family, family_set_name)
    return fam.home(root) / f"{pe}-seed{fam.seed}" / "card.json"


@locks_output()
def run_families(out_dir: str | Path, root: str | Path | None = None,
                 families: tuple[str, ...] | None = None, *, progress: bool = True,
                 command: str | None = None, resume_command: str | None = None,
                 executor: Executor | None = None, corpus=None,
                 family_set_name: str = "design1") -> pd.DataFrame:
    """Tabulate every finished family model, test RoPE vs other per :data:`ANALYSES`.

    Models not trained yet (no ``card.json`` under ``root``) are listed as pending in
    ``run.json``, with ``resume_command``; the test uses the units that are done. Each
    model's head table is a cell keyed by its card's hash, so a rerun reuses it until the
    model is retrained.

    Args:
        root: the families' zoo folder (``posinterp zoo train --family ... --home``);
            default ``$POSINTERP_HOME/zoo/<the set's folder>`` (``families``,
            ``families-design2``).
        families: names in the design (default all).
        corpus: the corpus whose validation split heads are ranked on (default the
            standard library, :func:`ranking_tokens`).
        family_set_name: the design (:func:`~posinterp.experiments.zoo.family_set`);
            its name and why it exists are recorded in ``run.json``.

    Returns:
        The tests table (one row per analysis).

    Raises:
        posinterp.io.FolderInUse: (a ValueError) another run holds ``out_dir``; refused
            before any work, writing nothing.
        ValueError: for an unknown family or design name.
    """
    t0 = time.time()
    fset = family_set(family_set_name)
    names = tuple(families or fset.families)
    for name in names:
        zoo_family(name, fset.name)
    root = Path(root) if root is not None else zoo_home() / fset.folder
    out = check_out_dir(out_dir, "out_dir")
    done, pending = [], []
    for fam in names:
        for pe in SCHEMES:
            (done if _card(root, fam, pe, fset.name).exists() else pending).append((fam, pe))
    cells = [Cell(f"{fam}/{pe}", _unit_heads, dict(family=fam, pe=pe, root=str(root), corpus=corpus,
                                                   family_set_name=fset.name),
                  key={"card_sha256": hashlib.sha256(
                      _card(root, fam, pe, fset.name).read_bytes()).hexdigest(), "design": DESIGN})
             for fam, pe in done]
    results = run_cells(cells, out / "cells", executor, fmt="csv", progress=progress,
                        desc="families")
    heads = (pd.concat(results.values(), ignore_index=True) if results
             else pd.DataFrame(columns=["unit", "pe", "previous_token_score"]))
    units, tests = [], []
    for name, changes, column, k, nope in ANALYSES:
        u = unit_table(heads, column, k=k, nope=nope) if len(heads) else pd.DataFrame(
            columns=["unit", "pe", "group", "best_prev_score", "n_heads_used", "heads_used",
                     "value"])
        units.append(u.assign(analysis=name))
        tests.append({"analysis": name, "changes": changes, "column": column, "k": k,
                      "nope": nope, **unit_test(u)})
    units_df, tests_df = pd.concat(units, ignore_index=True), pd.DataFrame(tests)
    for df, fname in ((heads, "heads.csv"), (units_df, "units.csv"), (tests_df, "tests.csv")):
        with atomic_path(out / fname) as tmp:
            df.to_csv(tmp, index=False)
    cards = {}
    for fam, pe in done:
        c = json.loads(_card(root, fam, pe, fset.name).read_text())
        cards[f"{fam}/{pe}"] = {"steps": c["steps"], "val_loss": c["val_loss"],
                                "corpus": c["corpus"]["fingerprint"][:12]}
    atomic_write_json(out / "run.json", {
        "design": DESIGN, "analyses": [list(a) for a in ANALYSES],
        "family_set": fset.name, "family_set_why": fset.why,
        "families": {n: {"seed": fset.families[n].seed, "differs_in": fset.families[n].differs_in,
                         "config": fset.families[n].config.to_dict()} for n in names},
        "done": [f"{f}/{p}" for f, p in done], "pending": [f"{f}/{p}" for f, p in pending],
        "models": cards, "command": command, "resume_command": resume_command,
        "versions": versions(), "null_version": GINIBRE_NULL_VERSION,
        "seconds": round(time.time() - t0, 1)})
    return tests_df


#: What --verify compares per head, at the precision the page prints each (half its last
#: digit: scores and R to 3 decimals, null percentiles to 1), and per unit: steps exactly,
#: the validation loss to 3 decimals.
VERIFY_HEAD_FIELDS = {"previous_token_score": 5e-4, "rotational_mass": 5e-4,
                      "rotational_mass_null_percentile": 0.05}
VERIFY_UNIT_FIELDS = {"steps": 0.0, "val_loss": 5e-4}


def verify_units(data_dir, k: int, seed: int = 0, work_dir=None, progress: bool = True,
                 corpus=None) -> pd.DataFrame:
    """Re-train ``k`` units (family x scheme) drawn (seeded) from a committed design's
    outputs (``heads.csv``, ``run.json``: ``docs/reproductions/data/fingerprints/families``)
    here with the current code, tabulate each as the run did, and compare it with its
    committed rows at the precision the page prints (:data:`VERIFY_HEAD_FIELDS` for every
    head, :data:`VERIFY_UNIT_FIELDS` for the unit). A design committed against an earlier
    null draw (``run.json``'s ``null_version``, 1 where absent) has its percentiles
    re-derived from its committed R against the current null first, as the page's
    null-shift section prints them.

    ``work_dir``: where the re-trained models go (default a temporary folder, removed);
    ``corpus``: the training and ranking text, as :func:`run_families` took it (default
    the families' own).

    Returns:
        Tidy rows ``cell, field, committed, rerun, tolerance, within`` (``cell``: the unit,
        or ``unit L<layer>H<head>``); ``.attrs["summary"]``: "m of k units reproduce".

    Raises:
        FileNotFoundError: without ``heads.csv`` or ``run.json`` in ``data_dir``.
        ValueError: for ``k`` outside [1, the design's trained units].

    Source: issue 37 item 1 (a trained cell must reproduce within the page's precision).
    """
    import shutil
    import tempfile

    import numpy as np

    data = Path(data_dir)
    heads = pd.read_csv(data / "heads.csv")
    run = json.loads((data / "run.json").read_text())
    fset = run.get("family_set", "design1")
    done = sorted(run["done"])
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(done):
        raise ValueError(f"k must be in [1, {len(done)}] (the design's trained units), got {k!r}")
    picked = [done[i] for i in np.random.default_rng(seed).choice(len(done), size=k, replace=False)]
    root = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="posinterp-verify-"))
    rows: list[dict] = []
    try:
        for unit in picked:
            family, pe = unit.split("/")
            fam = zoo_family(family, fset)
            t0 = time.time()
            train_zoo(fam.config, seeds=1, home=fam.home(root), first_seed=fam.seed,
                      only=(pe,), progress=False, corpus=corpus)
            new = _unit_heads(family, pe, str(root), corpus=corpus, family_set_name=fset)
            old = heads[heads.unit == unit]
            if run.get("null_version", 1) != GINIBRE_NULL_VERSION:
                # committed against an earlier null draw: its percentiles re-derived from
                # the committed R against today's null, as the page's null-shift section
                # prints them (R itself is compared as committed)
                from ._null_shift import renulled

                cfg = run["families"][family]["config"]
                old = renulled(old, {unit: (cfg["d_model"], cfg["d_model"] // cfg["n_heads"])},
                               "unit")
            card = run["models"][unit]
            unit_rows = compare_rerun(unit, card, {"steps": int(new.steps.iloc[0]),
                                                   "val_loss": float(new.val_loss.iloc[0])},
                                      VERIFY_UNIT_FIELDS)
            merged = old.merge(new, on=["layer", "head"], suffixes=("_old", ""))
            for r in merged.to_dict("records"):
                unit_rows += compare_rerun(
                    f"{unit} L{r['layer']}H{r['head']}",
                    {f: r[f"{f}_old"] for f in VERIFY_HEAD_FIELDS},
                    {f: r[f] for f in VERIFY_HEAD_FIELDS}, VERIFY_HEAD_FIELDS)
            # a unit reproduces when the unit and all its heads do: one cell per unit
            rows += [{**r, "cell": unit, "field": r["field"] if r["cell"] == unit
                      else f"{r['cell'].split()[1]} {r['field']}"} for r in unit_rows]
            if progress:
                print(report(unit, rows, time.time() - t0), flush=True)
    finally:
        if work_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return verify_table(rows, "units")
