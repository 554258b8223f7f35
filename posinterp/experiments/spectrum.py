"""``posinterp spectrum``: QK spectra, previous-token heads and PE fingerprints across models."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..analysis.fingerprint import fingerprint_table, fingerprint_test, head_dynamics, head_table
from ..analysis.spectral import qk_spectrum
from ..io import atomic_path, atomic_write_json, versions
from ..models import load_model
from ..viz import Report, dynamics_plot, eigenvalue_planes, fingerprint_plot

__all__ = ["SpectrumResult", "run_spectrum"]


@dataclass(frozen=True)
class SpectrumResult:
    heads: pd.DataFrame
    fingerprint: pd.DataFrame
    tests: pd.DataFrame
    report_path: Path


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def run_spectrum(specs: list[str], out_dir: str | Path, K: int = 5,
                 measure: str = "rotational_mass", dynamics: bool = False, seed: int = 0,
                 progress: bool = True) -> SpectrumResult:
    """Load each model, tabulate its heads, test RoPE vs other, write CSVs and a report.

    Writes ``heads.csv``, ``spectrum.csv``, ``fingerprint.csv``, ``fingerprint_test.csv``,
    ``run.json`` and ``report.html`` (and ``dynamics.csv`` for zoo specs with
    ``dynamics``) to ``out_dir``.

    Raises:
        ValueError, FileNotFoundError: from :func:`posinterp.load_model` for bad specs.
    """
    log = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    heads, spectra, schemes, infos, dyn = {}, [], {}, {}, []
    for spec in specs:
        log(f"[posinterp] {spec}")
        model, info = load_model(spec)
        heads[spec] = head_table(model, seed=seed)
        spectra.append(qk_spectrum(model).assign(model=spec))
        schemes[spec] = (info.pe, info.causal)
        infos[spec] = info.to_dict()
        if dynamics and spec.startswith("zoo:"):
            from ..experiments.zoo import load_zoo_model

            _, card = load_zoo_model(spec)
            body = spec.split("@")[0]
            snaps = ((s, load_zoo_model(f"{body}@{s}")[0]) for s in card["snapshot_steps"])
            dyn.append(head_dynamics(snaps, seed=seed).assign(model=spec))
    head_df = pd.concat([h.assign(model=m) for m, h in heads.items()], ignore_index=True)
    table = fingerprint_table(heads, schemes, K=K, measure=measure)
    tests = fingerprint_test(table)
    _write_csv(head_df, out / "heads.csv")
    _write_csv(pd.concat(spectra, ignore_index=True), out / "spectrum.csv")
    _write_csv(table, out / "fingerprint.csv")
    _write_csv(tests, out / "fingerprint_test.csv")
    dyn_df = pd.concat(dyn, ignore_index=True) if dyn else None
    if dyn_df is not None:
        _write_csv(dyn_df, out / "dynamics.csv")
    atomic_write_json(out / "run.json", {"specs": specs, "K": K, "measure": measure,
                                         "models": infos, "versions": versions(),
                                         "seconds": round(time.time() - t0, 1)})
    rep = _report(specs, heads, spectra, table, tests, dyn_df, infos, measure)
    return SpectrumResult(head_df, table, tests, rep.save(out / "report.html"))


def _report(specs, heads, spectra, table, tests, dyn_df, infos, measure) -> Report:
    rep = Report("posinterp spectrum: QK circuits and previous-token heads")
    rep.paragraph(
        "For each head, M = W_Q W_K^T; its nonzero eigenvalues are those of B = W_K^T W_Q. "
        "Rotational mass = share of |λ| on complex eigenvalues. Rotary heads are analysed "
        "at offset Δ = 0 (the raw W_Q W_K^T); offset -1 is in spectrum.csv. Heads are ranked "
        "by previous-token score on random tokens. Null percentiles compare each head with "
        "random (product-Ginibre) heads of the same shape.", note=True)
    if len(tests):
        rep.heading(f"Fingerprint: mean {measure} of the top-k previous-token heads")
        rep.paragraph(tests.note.iloc[0], note=True)
        rep.table(tests.drop(columns="note"))
        rep.figure(fingerprint_plot(table), "fingerprint across models")
    for spec, spec_df in zip(specs, spectra, strict=True):
        info = infos[spec]
        rep.heading(f"{spec} ({info['pe']}, {'causal' if info['causal'] else 'bidirectional'})")
        top = heads[spec].sort_values("previous_token_score", ascending=False).head(5)
        rep.table(top[["layer", "head", "previous_token_score", "rotational_mass", "phase",
                       "antisymmetric_energy", "rotational_mass_null_percentile", "rotational_mass_null_percentile_se"]])
        first = spec_df[spec_df.offset.isna() | (spec_df.offset == 0)]
        rep.figure(eigenvalue_planes(first, heads[spec], title=spec), f"{spec} eigenvalues")
    if dyn_df is not None:
        rep.heading("Training dynamics (zoo snapshots)")
        for spec, g in dyn_df.groupby("model", sort=False):
            rep.figure(dynamics_plot(g, title=spec), f"{spec} dynamics")
    return rep
