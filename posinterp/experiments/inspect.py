"""``posinterp inspect``: load a model, build the input, inspect every head, write the page.

Writes ``inspect.html`` (offline), ``inspection.json`` (the whole inspection, versioned:
:mod:`posinterp.dashboard.export`), ``heads.csv`` (the tidy table of
:func:`posinterp.dashboard.inspect.inspect_heads`) and ``run.json`` (model facts,
input, versions) to the output folder (docs/inspect.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..io import atomic_path, atomic_write_json, check_out_dir, locks_output, versions

__all__ = ["InspectResult", "run_inspect", "text_batch"]


@dataclass(frozen=True)
class InspectResult:
    table: pd.DataFrame
    report_path: Path
    seconds: float


def text_batch(model, text: str, max_len: int | None = None):
    """Tokenize ``text`` with the model's own tokenizer: one sequence per paragraph.

    Paragraphs are separated by blank lines. Each is tokenized by
    :func:`posinterp.tokenize_texts` (the checkpoint's own tokenizer and its defaults:
    special tokens, e.g. a BOS, only where it adds them; TransformerLens's BOS-forcing
    copy is not used), cut to ``max_len`` (default ``n_ctx``) tokens, right-padded with
    mask 0. Paragraphs of fewer than 3 tokens are skipped. A note says which special
    tokens the tokenizer added.

    Returns:
        ``(tokens [batch, pos], attention_mask [batch, pos], notes)``; the kept
        paragraphs' rows are exactly ``tokenize_texts(model, kept, max_len=max_len)``.

    Raises:
        ValueError: if the model has no tokenizer or no paragraph has >= 3 tokens.
    """
    from ..models.text import _encode_texts, _own_tokenizer, _pad_batch

    if _own_tokenizer(getattr(model, "tokenizer", None)) is None:
        raise ValueError("this model has no tokenizer, so --text cannot be used; "
                         "use --tokens N (random token ids) instead")
    paragraphs = _paragraphs(text)
    if not paragraphs:
        raise ValueError("the text has no paragraph of 3 or more tokens (paragraphs are "
                         "separated by blank lines)")
    all_ids, all_masks, cut, tok = _encode_texts(model, paragraphs, max_len)
    max_len = max_len or model.cfg.n_ctx
    ids, masks, notes, added = [], [], [], set()
    for p, i, m in zip(paragraphs, all_ids, all_masks, strict=True):
        added.add(_added_special(tok, p, list(tok(p)["input_ids"])))
        if sum(m) < 3:
            continue
        ids.append(i)
        masks.append(m)
    short = len(paragraphs) - len(ids)
    if not ids:
        raise ValueError("the text has no paragraph of 3 or more tokens (paragraphs are "
                         "separated by blank lines)")
    notes.append("Special tokens added by the tokenizer (its defaults): "
                 + "; ".join(sorted(added)) + ".")
    if cut:
        notes.append(f"{len(cut)} paragraph(s) longer than {max_len} tokens were cut to {max_len}.")
    if short:
        notes.append(f"{short} paragraph(s) with fewer than 3 tokens were skipped.")
    tokens, mask = _pad_batch(tok, ids, masks, "right")
    return tokens, mask, notes


def _paragraphs(text: str) -> list[str]:
    """The paragraphs of ``text`` (separated by blank lines, stripped, empty ones dropped):
    the sequences of ``posinterp inspect --text``."""
    return [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def _added_special(tok, text: str, ids: list[int]) -> str:
    """Which special tokens encoding ``text`` added, and where: e.g. "'<s>' at the start"."""
    plain = list(tok(text, add_special_tokens=False)["input_ids"])
    if ids == plain:
        return "none"
    start = ids[: len(ids) - len(plain)] if ids[len(ids) - len(plain):] == plain else None
    end = ids[len(plain):] if ids[: len(plain)] == plain else None
    parts = []
    if start:
        parts.append(f"{tok.convert_ids_to_tokens(start)} at the start")
    if end:
        parts.append(f"{tok.convert_ids_to_tokens(end)} at the end")
    if not parts:  # added inside the sequence (both ends): list them
        extra = [t for t in ids if t in set(tok.all_special_ids) and t not in plain]
        parts.append(f"{tok.convert_ids_to_tokens(extra)}")
    return " and ".join(parts)


def _bos_id(model) -> int:
    """The BOS id sampling starts from (the tokenizer's, or the one a loader recorded:
    llama2.c's 1, as run.c uses)."""
    from ..models.backend import bos_token_id

    bos = bos_token_id(model)
    if bos is None:
        raise ValueError("--input sampled needs a BOS token id, and this model has no "
                         "tokenizer with a bos_token_id; use --input random or --text")
    return bos


def check_input_args(n_tokens: int, batch: int, max_pattern_tokens: int, input_kind: str,
                     text, specs=()) -> str | None:
    """The input options of ``posinterp inspect`` (and ``--compare``), checked before any
    model loads.

    ``specs``: the model specs; without ``text``, ``--tokens`` is checked against each
    one's ``n_ctx`` where its files say it (:func:`posinterp.specs.context_length`; the
    loaded model is checked again).

    Returns:
        the text of the ``text`` file (None without one).

    Raises:
        ValueError: ``--tokens`` < 3 or above a model's ``n_ctx``, ``--batch`` or
            ``--max-pattern-tokens`` < 1, an ``--input`` other than random/sampled,
            ``--input sampled`` with ``--text``, or a ``--text`` file that is not UTF-8
            or holds no text (naming the file).
        FileNotFoundError: a ``--text`` file that does not exist.
    """
    from ..specs import context_length, read_text_file

    for name, v in (("--tokens", n_tokens), ("--batch", batch), ("--max-pattern-tokens",
                                                                  max_pattern_tokens)):
        if v < (3 if name == "--tokens" else 1):
            raise ValueError(f"{name} must be >= {3 if name == '--tokens' else 1}, got {v}")
    if input_kind not in ("random", "sampled"):
        raise ValueError(f"--input must be 'random' or 'sampled', got {input_kind!r}")
    if text is not None and input_kind != "random":
        raise ValueError("--input sampled and --text are alternatives; give one of them")
    if text is not None:
        return read_text_file(text, "--text")
    for spec in specs:
        n_ctx = context_length(spec)
        if n_ctx is not None and n_tokens > n_ctx:
            raise ValueError(f"--tokens must be <= the model's n_ctx = {n_ctx} ({spec}), "
                             f"got {n_tokens}")
    return None


@locks_output()
def run_inspect(spec: str, out_dir: str | Path, *, text: str | Path | None = None,
                n_tokens: int = 64, batch: int = 8, ablate: bool | str = False,
                exact_top_k: int = 20, seed: int = 0,
                max_pattern_tokens: int = 96, progress: bool = True,
                device=None, input_kind: str = "random", layers=None, heads=None,
                query_block: int | str | None = "auto") -> InspectResult:
    """Inspect every head of the model ``spec`` and write the page to ``out_dir``.

    Args:
        spec: anything :func:`posinterp.load_model` takes.
        out_dir: output folder (created; must not be a file).
        text: a UTF-8 text file; one sequence per paragraph (see :func:`text_batch`).
            Without it, ``batch`` sequences of ``n_tokens`` uniform random token ids
            (seeded by ``seed``; a BOS first when the tokenizer has one).
        n_tokens: random-token length, at most the model's ``n_ctx``.
        batch: number of random-token sequences (intervals are over sequences).
        ablate: also measure loss changes when heads or spectral channels are removed:
            ``True``/``"exact"``, or ``"attribution"`` (first-order estimates, with exact
            reruns of the ``exact_top_k`` largest; :func:`posinterp.inspect_heads`);
            with ``progress``, a tqdm bar on stderr counts their forward passes.
        exact_top_k: see ``ablate``.
        progress: log lines on stdout and the ablations' bar on stderr.
        seed: seed of the random tokens and the random-head null.
        input_kind: without ``text``: ``"random"`` (uniform ids) or ``"sampled"``, the
            model's own seeded samples from its BOS (:func:`posinterp.analysis.sampled_tokens`;
            natural text for a model without a tokenizer, e.g. llama2.c's stories260K).
        device: where the model runs (:func:`posinterp.devices.resolve_device`; None:
            CUDA when available, else CPU); the scores are computed on CPU.
        layers: inspect only these layers (a list of indices; None: all), checked against
            the model as soon as it is loaded, before the input is built (errors name
            ``--layers``).
        heads: in each selected layer, only these heads (a list of indices; None: all),
            checked as ``layers`` is (errors name ``--heads``).
        query_block: see :func:`posinterp.inspect_heads` (``--query-block``).

    Raises:
        posinterp.io.FolderInUse: (a ValueError) another run holds ``out_dir``; refused
            before any work, writing nothing.
        ValueError: a bad argument (named), an output path that is a file or cannot be
            written, a text file that cannot be used, or tokens longer than ``n_ctx``
            (each checked before the model loads, except a text whose paragraphs all have
            fewer than 3 tokens, and an ``n_ctx`` that only the loaded model says).
        FileNotFoundError: from :func:`posinterp.load_model`, or a missing text file.
    """
    content = check_input_args(n_tokens, batch, max_pattern_tokens, input_kind, text, [spec])
    from ..devices import resolve_device

    device = resolve_device(device, "--device")
    # created once the model and input are good; unwritable: refused now, not after the work
    out = check_out_dir(out_dir, create=False, writable=True)
    from ..analysis.heads import _has_bos, random_tokens, sampled_tokens
    from ..dashboard.inspect import inspect_heads
    from ..dashboard.inspect_html import save_inspect_page
    from ..models import load_model

    log = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    t0 = time.time()
    log(f"[posinterp] loading {spec}")
    model, info = load_model(spec, device=device)
    if not info.causal:
        raise ValueError(f"{spec} is a bidirectional encoder; inspect needs a causal model")
    from .._validate import check_indices

    if layers is not None:
        layers = check_indices("--layers", layers, model.cfg.n_layers)
    if heads is not None:
        heads = check_indices("--heads", heads, model.cfg.n_heads)
    if text is not None:
        tokens, mask, notes = text_batch(model, content)
        source = f"text {Path(text).name}: {tokens.shape[0]} paragraph(s), up to {tokens.shape[1]} tokens"
    else:
        if n_tokens > model.cfg.n_ctx:
            raise ValueError(f"--tokens must be <= the model's n_ctx = {model.cfg.n_ctx}, got {n_tokens}")
        mask, notes = None, []
        if input_kind == "sampled":
            bos = _bos_id(model)
            log(f"[posinterp] sampling {batch} x {n_tokens} tokens from the model (seed {seed})")
            tokens = sampled_tokens(model, batch, n_tokens, bos, seed=seed)
            source = (f"{batch} samples of {n_tokens} tokens from the model itself (from BOS id "
                      f"{bos}, temperature 1, seed {seed})")
        else:
            tokens = random_tokens(model, batch, n_tokens, seed=seed, bos=_has_bos(model))
            source = (f"{batch} random-token sequences of {n_tokens} tokens (seed {seed}"
                      f"{', BOS first' if _has_bos(model) else ''})")
    n_l = model.cfg.n_layers if layers is None else len(layers)
    n_h = model.cfg.n_heads if heads is None else len(heads)
    log(f"[posinterp] inspecting {n_l} layers x {n_h} heads on {source}"
        + ((" with approximate ablations" if ablate == "attribution" else " with ablations")
           if ablate else ""))
    try:
        res = inspect_heads(model, tokens, mask, ablate=ablate, exact_top_k=exact_top_k,
                            seed=seed, model_name=str(spec), max_pattern_tokens=max_pattern_tokens,
                            progress=progress, layers=layers, heads=heads,
                            query_block=query_block)
    except (MemoryError, RuntimeError) as err:
        from .._memory import InputTooLargeError, attention_bytes, gib, is_out_of_memory

        if not is_out_of_memory(err):
            raise
        # reduced at hook time: one layer's eager attention (scores, masked scores,
        # softmax, pattern) is the working set, unless it ran in query blocks
        need = attention_bytes(1, model.cfg.n_heads, *tokens.shape, tensors=4)
        raise InputTooLargeError(
            f"out of memory inspecting {tokens.shape[0]} x {tokens.shape[1]} tokens of {spec}: "
            f"one layer's attention ({model.cfg.n_heads} heads, scores and pattern with their "
            f"softmax copies) needs about {gib(need)} (heads x batch x tokens^2 x 4 bytes, four "
            f"times); use fewer tokens (a shorter --text, --tokens, --batch), fewer layers "
            f"(--layers) or the pass in blocks of query rows (--query-block 256, where the "
            f"model has a KV cache); nothing was written") from None
    res.notes[:0] = notes
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "heads.csv") as tmp:
        res.table.to_csv(tmp, index=False)
    from ..dashboard.export import export_inspection

    export_inspection(res, out / "inspection.json")  # versioned, loads back (docs/inspect.md)
    seconds = round(time.time() - t0, 1)
    facts = (f"{spec}: {info.pe} positions, {model.cfg.n_layers} layers x {model.cfg.n_heads} heads, "
             f"d_model {model.cfg.d_model}, d_head {model.cfg.d_head}"
             + (f", {info.n_kv_heads} KV heads" if info.n_kv_heads != info.n_heads else "")
             + f". Input: {source}. Weight processing: "
             + (", ".join(k for k, v in info.processing.items() if v) or "none") + ".")
    atomic_write_json(out / "run.json", {"spec": str(spec), "model": info.to_dict(), "input": source,
                                         "ablate": res.meta["ablate"],
                                         "exact_top_k": res.meta["exact_top_k"], "seed": seed,
                                         "notes": res.notes,
                                         "versions": versions(), "seconds": seconds})
    path = save_inspect_page(res, out / "inspect.html", f"posinterp inspect: {spec}", facts)
    return InspectResult(res.table, path, seconds)
