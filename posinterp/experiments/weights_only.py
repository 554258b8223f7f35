"""``posinterp spectrum --weights-only``: QK spectra from the q/k weights alone.

One cell per checkpoint (a local folder, a GGUF file, or one revision of a hub model in
the Hugging Face cache), run through :mod:`posinterp.executors`, so ``--workers`` and
``--executor ray`` split the models and a rerun resumes: each cell reads its q/k one
layer at a time (:func:`posinterp.models.qk_only.read_qk_weights`), solves every head
once and keeps only per-head results.

**Checkpoint series** (``--revisions``): every revision of a hub model is resolved in the
cache (:func:`posinterp.models.hub.snapshot_folder`) and its q/k bytes hashed first;
a revision whose q/k equal an earlier one's is refused by name (EleutherAI/pythia issue
205: many early ``stepN`` branches serve the final weights), a damaged or missing one is
reported, and the rest run. The result is one tidy table, ``series.parquet``:
``model, revision, step, layer, head, offset, metric, value``. Source: issue 36.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

import pandas as pd

from ..analysis.fingerprint import _null
from ..analysis.spectral import (
    DEFAULT_EPS,
    GINIBRE_NULL_VERSION,
    NULL_HEADS,
    _at_offset,
    _measures_frame,
    _spectra,
    _spectrum_columns,
    null_percentiles,
)
from ..executors import Cell, Executor, run_cells
from ..io import atomic_path, atomic_write_json, check_out_dir, locks_output, versions

__all__ = ["SERIES_COLUMNS", "qk_digest", "run_weights_only", "series_revisions"]

#: the columns of ``series.parquet``, in order
SERIES_COLUMNS = ("model", "revision", "step", "layer", "head", "offset", "metric", "value")
_STEP = re.compile(r"^step(\d+)$")
_VERSION = 1  # of a cell's computation, in its key


def qk_digest(qk) -> str:
    """SHA-256 over what a weights-only spectrum reads of a checkpoint: each layer's
    stored W_Q, W_K (``[n_heads, d_model, d_head]`` float64, K expanded), attention-norm
    gain and q/k-norm gains, in layer order. Two checkpoints with equal digests give
    equal spectra; storage (shards, dtype of the file) does not enter beyond the values.

    Raises:
        ValueError: a tensor that cannot be read (a damaged file), from the reader.
    """
    h = hashlib.sha256()
    h.update(json.dumps([qk.architecture, qk.n_layers, qk.n_heads, qk.d_model, qk.d_head]).encode())
    for layer in range(qk.n_layers):
        parts = [qk.W_Q[layer], qk.W_K[layer], qk.gain[layer]]
        if qk.qk_norm:
            norm = qk.qk_norm[layer]
            parts += [norm.q_gain, norm.k_gain]
        for t in parts:
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _step(revision: str | None):
    m = _STEP.match(revision or "")
    return int(m.group(1)) if m else None


def _tables(spec: str, folder: str, seed: int) -> dict:
    """A cell: one checkpoint's spectrum (every eigenvalue and offset) and its per-head
    measures, ``|λ|`` max and null percentiles (offset 0 for RoPE heads)."""
    from ..models.sources.qk_only import read_qk_weights

    qk = read_qk_weights(folder)
    keys, lam, anti = _spectra(qk, None, None, None, "effective")
    # compact: one row per eigenvalue is the one output that grows with depth; ``hook``
    # (a string per row) is rebuilt from ``layer`` as the file is written
    spectrum = pd.DataFrame(_spectrum_columns(keys, lam)).astype(
        {"layer": "int32", "head": "int32", "rank": "int32"})
    offset = 0 if qk.pe == "rotary" else None
    keys0, lam0, anti0 = _at_offset(keys, lam, anti, offset)
    meas = _measures_frame(keys0, lam0, anti0, None, DEFAULT_EPS)
    null = _null(qk.d_model, qk.d_head, NULL_HEADS, 0.02, None, seed)
    long = pd.concat([meas, null_percentiles(meas, null)], ignore_index=True)
    abs_max = meas[meas.metric == "rotational_mass"].assign(
        metric="abs_max", value=lam0.abs().amax(-1).numpy())
    long = pd.concat([long, abs_max], ignore_index=True)
    source = {"architecture": qk.architecture, "pe": qk.pe, "n_layers": qk.n_layers,
              "n_heads": qk.n_heads, "n_kv_heads": qk.n_kv_heads, "d_model": qk.d_model,
              "d_head": qk.d_head, **qk.source}
    return {"spectrum": spectrum, "measures": long[["layer", "head", "offset", "metric", "value"]],
            "source": source}


def series_revisions(name: str, revisions: str) -> list[str]:
    """The revisions of ``--revisions``: a comma-separated list as given, or ``all``: every
    branch of hub model ``name`` (the hub's list when it can be reached, else the cache's
    refs), ordered by training step (``stepN``), then by name.

    Raises:
        ValueError: an empty list, or ``all`` for a model with no revision in the cache
            and no reachable hub.
    """
    if revisions.strip() != "all":
        out = [r.strip() for r in revisions.split(",") if r.strip()]
        if not out:
            raise ValueError(f"--revisions must list revisions (step0,step1000,...) or be "
                             f"'all', got {revisions!r}")
        return list(dict.fromkeys(out))
    import huggingface_hub

    from ..models.hub import hub_cache_dir

    refs: list[str] = []
    try:  # the hub's own branch list where it answers
        from ..models.sources.hub import _offline_mode

        if not _offline_mode():
            refs = [b.name for b in huggingface_hub.list_repo_refs(name).branches]
    except Exception:  # unreachable, offline, unknown: the cache says what is there
        refs = []
    if not refs:
        try:
            info = huggingface_hub.scan_cache_dir(hub_cache_dir())
        except huggingface_hub.CacheNotFound:
            info = None
        for repo in (info.repos if info else ()):
            if repo.repo_id == name and repo.repo_type == "model":
                refs = sorted({r for rev in repo.revisions for r in rev.refs})
    if not refs:
        raise ValueError(f"--revisions all: the Hugging Face cache ({hub_cache_dir()}) holds no "
                         f"revision of {name} and the hub cannot be asked; list them "
                         "(--revisions step0,step1000,...)")
    return sorted(refs, key=lambda r: (_step(r) is None, _step(r) or 0, r))


def _cell_name(spec: str, revision: str | None) -> str:
    text = spec if revision is None else f"{spec}@{revision}"
    safe = re.sub(r"[^A-Za-z0-9._+=-]+", "_", text).strip("_")[:80] or "model"
    return f"{safe}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _file_key(path: Path) -> list:
    """What a local checkpoint's cell depends on: each file's name, size and mtime."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _resolve(specs, revisions, log) -> tuple[list[dict], dict]:
    """One entry per checkpoint to run, and the report of every revision (its commit,
    q/k digest and status: ``ok``, ``duplicate of <revision>``, ``missing: <why>`` (not in
    the Hugging Face cache) or ``damaged: <why>`` (there, but its q/k cannot be read))."""
    from ..models.sources.hub import snapshot_folder
    from ..models.sources.qk_only import read_qk_weights

    todo, report = [], {}
    for spec in specs:
        if revisions is None:
            path = Path(spec).expanduser()
            todo.append({"model": spec, "revision": None, "folder": str(path),
                         "key": {"files": _file_key(path) if path.exists() else None}})
            continue
        report[spec] = {}
        seen: dict[str, str] = {}
        for rev in series_revisions(spec, revisions):
            entry = report[spec][rev] = {"step": _step(rev)}
            try:
                folder = snapshot_folder(spec, rev)
            except (FileNotFoundError, ValueError, OSError) as err:  # not in the cache
                entry["status"] = f"missing: {err}"
                continue
            try:
                entry["commit"] = folder.name
                log(f"[posinterp] {spec}@{rev}: hashing its q/k")
                digest = qk_digest(read_qk_weights(folder))
            except (FileNotFoundError, ValueError, OSError) as err:
                entry["status"] = f"damaged: {err}"
                continue
            entry["qk_sha256"] = digest
            if digest in seen:
                entry["status"] = f"duplicate of {seen[digest]}"
                continue
            seen[digest] = rev
            entry["status"] = "ok"
            todo.append({"model": spec, "revision": rev, "folder": str(folder),
                         "key": {"commit": folder.name, "qk_sha256": digest}})
    return todo, report


@locks_output()
def run_weights_only(specs: list[str], out_dir: str | Path, *, seed: int = 0, progress: bool = True,
                     command: str | None = None, revisions: str | None = None,
                     executor: Executor | None = None) -> pd.DataFrame:
    """QK spectra from the q/k weights alone: no forward pass, no full model in memory.

    Each spec (a local HF folder with safetensors, or a ``.gguf`` file; with
    ``revisions``, a hub model name) is read with
    :func:`posinterp.models.qk_only.read_qk_weights` one layer at a time, so a study
    over many large checkpoints costs their q/k bytes. The numbers equal those of the
    fully loaded model (tests/models/test_qk_only.py). Previous-token scores need a
    forward pass, so there is no head ranking and no fingerprint test here.

    Writes ``heads.csv`` (per head: rotational measures at offset 0 for RoPE heads,
    ``abs_max`` = max |λ|, and product-Ginibre null percentiles with their SE; columns
    ``model`` and, for a series, ``revision``, ``step``), ``run.json`` (what was read,
    each revision's commit, q/k digest and status) and, for plain runs, ``spectrum.csv``
    (every eigenvalue, offsets 0 and -1 for rotary heads); for a series,
    ``series.parquet`` (:data:`SERIES_COLUMNS`, tidy) and ``series.html`` (per-head
    trajectories against training step and a model-vs-model table). Each checkpoint is
    a cell under ``out_dir/cells``: a rerun resumes, and local, process and Ray
    executors give the same bytes.

    Args:
        revisions: ``"step0,step1000,..."`` or ``"all"`` (:func:`series_revisions`).

    Returns:
        The heads table.

    Raises:
        posinterp.io.FolderInUse: (a ValueError) another run holds ``out_dir``; refused
            before any work, writing nothing.
        FileNotFoundError, ValueError: from ``read_qk_weights`` (missing path, an
            unsupported architecture, a truncated file), before anything is written;
            with ``revisions``, a spec that is a local path. A damaged revision of a
            series is reported in ``run.json`` instead, and the rest run.
        posinterp.executors.CellsFailed: a checkpoint failed after the others finished.
    """
    from ..models.sources.qk_only import read_qk_weights

    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if progress else (lambda *a: None)
    out = check_out_dir(out_dir, "out_dir", create=False)
    t0 = time.time()
    if revisions is not None:
        local = [s for s in specs if Path(s).expanduser().exists()]
        if local:
            raise ValueError(f"--revisions reads revisions of hub models in the Hugging Face "
                             f"cache; {local[0]} is a local path (a folder has one revision)")
    else:
        for spec in specs:  # refused by name before any work: path, architecture, headers
            read_qk_weights(spec)
    todo, report = _resolve(specs, revisions, log)
    cells = [Cell(_cell_name(t["model"], t["revision"]), _tables,
                  {"spec": t["model"], "folder": t["folder"], "seed": seed},
                  key={**t["key"], "seed": seed, "null_version": GINIBRE_NULL_VERSION,
                       "version": _VERSION})
             for t in todo]
    out.mkdir(parents=True, exist_ok=True)
    results = run_cells(cells, out / "cells", executor, fmt="pickle", progress=progress,
                        desc="checkpoints") if cells else {}
    heads, spectra, tidy, sources = [], [], [], {}
    for t, cell in zip(todo, cells, strict=True):
        res = results[cell.name]
        ident = {"model": t["model"]}
        if revisions is not None:
            ident |= {"revision": t["revision"], "step": _step(t["revision"])}
        m = res["measures"]
        wide = m.pivot_table(index=["layer", "head"], columns="metric", values="value").reset_index()
        wide.columns.name = None
        offset = m.offset.iloc[0] if len(m) else pd.NA
        heads.append(wide.assign(offset=pd.array([offset] * len(wide), dtype="Int64"), **ident))
        if revisions is None:
            spectra.append((t["model"], res["spectrum"]))
            sources[t["model"]] = res["source"]
        else:
            tidy.append(m.assign(**ident))
            sources.setdefault(t["model"], res["source"])
    head_df = pd.concat(heads, ignore_index=True) if heads else pd.DataFrame()
    _write_csv(head_df, out / "heads.csv")
    if revisions is None:
        _write_spectrum(spectra, out / "spectrum.csv")
    else:
        series = _series_frame(tidy)
        with atomic_path(out / "series.parquet") as tmp:
            series.to_parquet(tmp, index=False)
        from ..viz.series import series_page

        with atomic_path(out / "series.html") as tmp:
            Path(tmp).write_text(series_page(_series_data(series, report)))
    atomic_write_json(out / "run.json", {
        "specs": specs, "weights_only": True, "seed": seed, "null_version": GINIBRE_NULL_VERSION,
        "revisions": report if revisions is not None else None, "command": command,
        "models": sources, "versions": versions(), "seconds": round(time.time() - t0, 1)})
    for spec, revs in report.items():
        for rev, entry in revs.items():
            if entry["status"] != "ok":
                log(f"[posinterp] {spec}@{rev}: {entry['status']}")
    return head_df


def _series_frame(tidy: list[pd.DataFrame]) -> pd.DataFrame:
    if not tidy:
        return pd.DataFrame({c: [] for c in SERIES_COLUMNS})
    df = pd.concat(tidy, ignore_index=True)
    df["step"] = pd.array(df["step"], dtype="Int64")
    df["offset"] = pd.array(df["offset"], dtype="Int64")
    return df[list(SERIES_COLUMNS)]


def _series_data(series: pd.DataFrame, report: dict) -> dict:
    """Plain data for :func:`posinterp.viz.series.series_page` (no pandas objects)."""
    metrics = ("rotational_mass", "rotational_mass_null_percentile", "abs_max")
    models = {}
    for model, g in series.groupby("model", sort=False):
        g = g[g.metric.isin(metrics)]
        revs = list(dict.fromkeys(g.revision))
        steps = {r: (None if pd.isna(s) else int(s))
                 for r, s in g.drop_duplicates("revision")[["revision", "step"]].itertuples(index=False)}
        heads = {}
        for (layer, head, metric), h in g.groupby(["layer", "head", "metric"], sort=True):
            by_rev = dict(zip(h.revision, h.value, strict=True))
            heads.setdefault(f"L{int(layer)}H{int(head)}", {})[metric] = [
                float(by_rev[r]) if r in by_rev else None for r in revs]
        models[model] = {"revisions": revs, "steps": [steps[r] for r in revs], "heads": heads}
    return {"models": models, "report": report}


_CHUNK = 1 << 18  # rows of spectrum.csv formatted at a time


def _write_spectrum(spectra: list[tuple[str, pd.DataFrame]], path: Path) -> None:
    """spectrum.csv (``hook, layer, head, offset, rank, real, imag, abs, model``) written in
    chunks, so no full-size copy of the table (strings per row) is held."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        header = True
        for model, df in spectra:
            for start in range(0, len(df), _CHUNK):
                part = df.iloc[start:start + _CHUNK]
                part = part.assign(hook="blocks." + part.layer.astype(str) + ".attn", model=model)
                part = part[["hook", "layer", "head", "offset", "rank", "real", "imag", "abs",
                             "model"]]
                part.to_csv(f, index=False, header=header)
                header = False
        if header:  # no model: the header alone
            f.write("hook,layer,head,offset,rank,real,imag,abs,model\n")


def _write_csv(df: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)
