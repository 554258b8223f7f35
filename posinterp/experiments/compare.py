"""``posinterp inspect A --compare B``: load two models, inspect both on one input, compare.

Writes to the output folder (docs/inspect.md, "Comparing two models"): ``compare.html``
(offline), ``changes.csv`` (long form, heads largest change first), ``formed.csv``,
``kernels.csv``, the two inspections as versioned JSON (``inspection-a.json``,
``inspection-b.json``: :mod:`posinterp.dashboard.export`) and ``run.json``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..io import atomic_path, atomic_write_json, check_out_dir, locks_output, versions
from .inspect import check_input_args

__all__ = ["CompareResult", "run_compare"]


@dataclass(frozen=True)
class CompareResult:
    """What :func:`run_compare` wrote: the comparison, the page's path, wall seconds."""

    comparison: object  # posinterp.dashboard.compare.Comparison
    report_path: Path
    seconds: float


def _write_csv(df, path: Path) -> None:
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


@locks_output()
def run_compare(spec_a: str, spec_b: str, out_dir: str | Path, *, text: str | Path | None = None,
                n_tokens: int = 64, batch: int = 8, ablate: bool = False, seed: int = 0,
                max_pattern_tokens: int = 96, progress: bool = True, device=None,
                input_kind: str = "random") -> CompareResult:
    """Inspect models ``spec_a`` and ``spec_b`` on the same input and write the comparison.

    Args:
        spec_a: anything :func:`posinterp.load_model` takes (e.g. a checkpoint folder,
            ``zoo:rotary@200``).
        spec_b: the same for B (e.g. a later checkpoint of the run, ``zoo:rotary``).
        out_dir: folder for the page and the tables.
        text: a UTF-8 text file, as :func:`posinterp.experiments.inspect.run_inspect`.
            Whatever the input, it is built once (from A's tokenizer; B's must have the
            same vocabulary) and given to both models.
        n_tokens: random-token length, as ``run_inspect``.
        batch: number of random-token sequences, as ``run_inspect``.
        ablate: also measure loss changes when heads are removed, as ``run_inspect``.
        seed: seed of the random tokens and the random-head null.
        max_pattern_tokens: pattern views of a longer sequence are pooled into blocks
            (:func:`posinterp.inspect_heads`).
        progress: log lines on stdout and the ablations' bar on stderr.
        device: where the models run, as ``run_inspect``.
        input_kind: ``"random"`` or ``"sampled"`` (the samples are A's own).

    Returns:
        :class:`CompareResult`; the page is ``out_dir/compare.html``.

    Raises:
        posinterp.io.FolderInUse: (a ValueError) another run holds ``out_dir``; refused
            before any work, writing nothing.
        ValueError: a bad argument (named); models that cannot be compared (different
            n_layers x n_heads, d_vocab or tokenizer vocabulary: see
            :func:`posinterp.dashboard.compare.compare_inspections`), checked before
            either model runs.
        FileNotFoundError: from :func:`posinterp.load_model`, or a missing text file.
    """
    content = check_input_args(n_tokens, batch, max_pattern_tokens, input_kind, text,
                               [spec_a, spec_b])
    from ..devices import resolve_device

    device = resolve_device(device, "--device")
    out = check_out_dir(out_dir, create=False, writable=True)
    from ..analysis.heads import _has_bos, random_tokens, sampled_tokens
    from ..dashboard.compare import compare_models
    from ..dashboard.compare_html import save_compare_page
    from ..dashboard.export import export_inspection
    from ..models import load_model
    from .inspect import _bos_id, text_batch

    log = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    t0 = time.time()
    models = []
    for spec in (spec_a, spec_b):
        log(f"[posinterp] loading {spec}")
        model, info = load_model(spec, device=device)
        if not info.causal:
            raise ValueError(f"{spec} is a bidirectional encoder; inspect needs a causal model")
        models.append((model, info))
    (ma, ia), (mb, _) = models
    n_ctx = min(ma.cfg.n_ctx, mb.cfg.n_ctx)
    if text is not None:
        tokens, mask, notes = text_batch(ma, content, max_len=n_ctx)
        source = f"text {Path(text).name}: {tokens.shape[0]} paragraph(s), up to {tokens.shape[1]} tokens"
    else:
        if n_tokens > n_ctx:
            raise ValueError(f"--tokens must be <= both models' n_ctx ({n_ctx}), got {n_tokens}")
        mask, notes = None, []
        if input_kind == "sampled":
            bos = _bos_id(ma)
            log(f"[posinterp] sampling {batch} x {n_tokens} tokens from A (seed {seed})")
            tokens = sampled_tokens(ma, batch, n_tokens, bos, seed=seed)
            source = (f"{batch} samples of {n_tokens} tokens from A ({spec_a}) itself (from BOS id "
                      f"{bos}, temperature 1, seed {seed})")
        else:
            tokens = random_tokens(ma, batch, n_tokens, seed=seed, bos=_has_bos(ma))
            source = (f"{batch} random-token sequences of {n_tokens} tokens (seed {seed}"
                      f"{', BOS first' if _has_bos(ma) else ''})")
    log(f"[posinterp] inspecting both ({ma.cfg.n_layers} layers x {ma.cfg.n_heads} heads) on {source}"
        + (" with ablations" if ablate else ""))
    cmp = compare_models(ma, mb, tokens, mask, names=(str(spec_a), str(spec_b)), ablate=ablate,
                         seed=seed, max_pattern_tokens=max_pattern_tokens)
    cmp.notes[:0] = notes
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(cmp.table, out / "changes.csv")  # long form; cmp.heads is its wide view
    _write_csv(cmp.formed, out / "formed.csv")
    _write_csv(cmp.kernels, out / "kernels.csv")
    export_inspection(cmp.a, out / "inspection-a.json")
    export_inspection(cmp.b, out / "inspection-b.json")
    seconds = round(time.time() - t0, 1)
    facts = (f"A = {spec_a}, B = {spec_b}: {ia.pe} positions, {ma.cfg.n_layers} layers x "
             f"{ma.cfg.n_heads} heads. Input (the same for both): {source}.")
    atomic_write_json(out / "run.json", {"spec_a": str(spec_a), "spec_b": str(spec_b),
                                         "models": [i.to_dict() for _, i in models], "input": source,
                                         "ablate": ablate, "seed": seed, "notes": cmp.notes,
                                         "versions": versions(), "seconds": seconds})
    path = save_compare_page(cmp, out / "compare.html", f"posinterp compare: {spec_a} vs {spec_b}", facts)
    return CompareResult(cmp, path, seconds)
