"""What moves when the product-Ginibre null is drawn the second way (issue 36).

Null version 1 drew each random head's W_Q, W_K at d_model x d_head; version 2 draws the
d_head x d_head forms directly (:func:`posinterp.analysis.spectral.random_small_forms`),
with the same law and another seeded draw. A head's measure does not depend on the null,
so its version-2 percentile can be re-derived from the committed measure alone: this is
what a rerun on current code would write. The fingerprint page prints the shift beside
the committed (version-1) numbers, for every head table and every families test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..analysis.fingerprint import unit_table, unit_test
from ..analysis.spectral import GINIBRE_NULL_VERSION, NULL_HEADS, ginibre_null, null_percentiles

__all__ = ["null_shift_section", "renulled"]

_MEASURE = "rotational_mass"


def renulled(heads: pd.DataFrame, shapes: dict[str, tuple[int, int]], unit: str,
             prefixes=("",), seed: int = 0) -> pd.DataFrame:
    """``heads`` with each ``<prefix>rotational_mass_null_percentile`` (and its SE)
    recomputed from ``<prefix>rotational_mass`` against the current null of each unit's
    ``(d_model, d_head)`` in ``shapes`` (keyed by the ``unit`` column's values)."""
    out = heads.copy()
    for key, (d_model, d_head) in shapes.items():
        rows = out[unit] == key
        null = ginibre_null(d_model, d_head, n_heads=NULL_HEADS, seed=seed)
        for prefix in prefixes:
            meas = pd.DataFrame({"metric": _MEASURE, "value": out.loc[rows, prefix + _MEASURE]})
            for m in ("phase", "antisymmetric_energy"):  # null_percentiles scores all three
                meas = pd.concat([meas, pd.DataFrame({"metric": m, "value": [0.0]})])
            pct = null_percentiles(meas, null)
            for suffix in ("_null_percentile", "_null_percentile_se"):
                v = pct[pct.metric == _MEASURE + suffix].value.to_numpy()
                out.loc[rows, prefix + _MEASURE + suffix] = v
    return out


def _families_rows(fam: Path) -> list[dict]:
    run = json.loads((fam / "run.json").read_text())
    heads = pd.read_csv(fam / "heads.csv")
    tests = pd.read_csv(fam / "tests.csv")
    shapes = {}
    for u in heads.unit.unique():
        cfg = run["families"][u.split("/")[0]]["config"]
        shapes[u] = (cfg["d_model"], cfg["d_model"] // cfg["n_heads"])
    new = renulled(heads, shapes, "unit", prefixes=("", "stored_"))
    rows = []
    for a in run["analyses"]:
        name, column, k, nope = a[0], a[2], a[3], a[4]
        t = unit_test(unit_table(new, column, k=k, nope=nope))
        old = tests[tests.analysis == name].iloc[0]
        rows.append({"analysis": name, "p_v1": float(old.p_permutation),
                     "p_v2": t["p_permutation"], "mean_rope_v1": float(old.mean_rope),
                     "mean_rope_v2": t["mean_rope"], "mean_other_v1": float(old.mean_other),
                     "mean_other_v2": t["mean_other"]})
    col = _MEASURE + "_null_percentile"
    shift = (new[col] - heads[col]).abs()
    se = heads[col + "_se"]
    return [{"max_shift": float(shift.max()), "median_shift_in_se": float((shift / se).median()),
             "tests": rows}]


def _fmt_p(v: float) -> str:
    return "—" if not np.isfinite(v) else f"{v:.3g}"


def null_shift_section(out: Path) -> list[str]:
    """The page's section on the null's version: empty when every data set was written
    with the current null, else the shift of each head table and families test when its
    percentiles are re-derived from its committed measures against the current null."""
    run = json.loads((out / "run.json").read_text())
    sets = [("the three pretrained models (heads.csv)", out, run)]
    for sub in ("families", "families-design2"):
        if (out / sub / "run.json").is_file():
            sets.append((f"`{sub}/`", out / sub, json.loads((out / sub / "run.json").read_text())))
    old = [(name, folder) for name, folder, r in sets
           if r.get("null_version", 1) != GINIBRE_NULL_VERSION]
    if not old:
        return []
    p = ["## The null's second draw\n",
         f"These runs drew their {NULL_HEADS:,}-head product-Ginibre null as version 1: each "
         "random head's W_Q and W_K at d_model × d_head. posinterp now draws version "
         f"{GINIBRE_NULL_VERSION}: the d_head × d_head forms directly (a Bartlett factor and a "
         "Wishart term; the same law, tested by KS against the first draw, and a tenth of the "
         "cost at 7B shapes; issue 36). A head's measure does not depend on the null, so the "
         "percentiles a rerun would write are re-derived here from the committed measures. "
         "The numbers above are the committed version-1 ones.\n"]
    lines = ["| data | largest shift of a head's percentile | median shift / its SE | "
             "test | p (v1 → v2) | mean RoPE (v1 → v2) | mean other (v1 → v2) |",
             "|---|---|---|---|---|---|---|"]
    for name, folder in old:
        if folder == out:
            heads = pd.read_csv(out / "heads.csv")
            shapes = {m: (info["n_heads"] * info["d_head"], info["d_head"])
                      for m, info in run["models"].items()}
            new = renulled(heads, shapes, "model")
            col = _MEASURE + "_null_percentile"
            shift = (new[col] - heads[col]).abs()
            lines.append(f"| {name} | {shift.max():.2f} | "
                         f"{(shift / heads[col + '_se']).median():.2f} | — | — | — | — |")
            continue
        for r in _families_rows(folder):
            for i, t in enumerate(r["tests"]):
                head = (f"| {name} | {r['max_shift']:.2f} | {r['median_shift_in_se']:.2f} "
                        if i == 0 else "| | | ")
                lines.append(head + f"| {t['analysis']} | {_fmt_p(t['p_v1'])} → "
                             f"{_fmt_p(t['p_v2'])} | {t['mean_rope_v1']:.1f} → "
                             f"{t['mean_rope_v2']:.1f} | {t['mean_other_v1']:.1f} → "
                             f"{t['mean_other_v2']:.1f} |")
    p.append("\n".join(lines) + "\n")
    p.append("Shifts are in percentile points. The onset dynamics' trajectories keep their "
             "measures to 5 digits only, so their percentiles are not re-derived here; their "
             "onsets read a band of the null, which moves by the same Monte Carlo amount.\n")
    return p
