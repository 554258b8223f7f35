"""``load_model(spec)``: one loader for every kind of model spec, dispatched by a table.

``load_model(spec)`` returns ``(model, ModelInfo)``: a ``HookedTransformer`` under
TransformerLens 3.9, a ``TransformerBridge`` under 4.x. The spec is classified once with
the package's spec grammar (:func:`posinterp.specs.spec_kind`; a folder is then a toy
checkpoint or an HF folder), and :data:`SOURCES` maps the kind to the source that loads it
(:mod:`posinterp.models.sources`, one module per kind):

* a **local HF checkpoint folder** (``config.json`` + one weight file or shards with their
  index, safetensors or ``.bin``), loaded offline and checked against HF's own model
  (:mod:`.sources.hf_folder`);
* a **hub name** ("gpt2", "EleutherAI/pythia-70m", any repo of a listed architecture) and
  ``revision``, resolved into a snapshot folder of the Hugging Face cache and then loaded
  exactly like a local folder (:mod:`.sources.hub`);
* a **GGUF file** (:mod:`.sources.gguf`), a **llama2.c ``.bin`` file**
  (:mod:`.sources.llama2c`), all-MiniLM-L6-v2 (:mod:`.sources.encoder`), a toy checkpoint
  folder or a zoo model (:mod:`.sources.toy`).

ALiBi models get the ALiBi paper's slopes (= HF BLOOM's) and an exact per-call bias,
not TL 3.9's slopes, which differ for head counts that are not a power of two.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# MINILM_NAMES, UnsupportedConfigError, HALF_TOL_FACTOR and PROCESSING_TOL are re-exported
# for their old import path (tests, benchmarks); each lives where it is used: monkeypatch
# it there (PROCESSING_TOL: posinterp.models.sources.hf_folder), not here.
from ..specs import MINILM_NAMES, refusal, spec_kind, spec_text  # noqa: F401
from .hf_config import UnsupportedConfigError  # noqa: F401
from .sources import encoder, gguf, hf_folder, hub, llama2c, toy
from .sources.hf_files import IncompleteCheckpointError, checkpoint_files, weights_sha256
from .sources.hf_folder import HALF_TOL_FACTOR, PROCESSING_TOL  # noqa: F401
from .sources.hub import distinct_revisions, snapshot_folder

__all__ = ["IncompleteCheckpointError", "checkpoint_files", "distinct_revisions", "load_model",
           "snapshot_folder", "weights_sha256"]

PROCESSING_FLAGS = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases")


@dataclass(frozen=True)
class Source:
    """How :func:`load_model` reads one kind of spec.

    Attributes:
        load: ``load(spec, processing, dtype, revision) -> (model, info)``, on CPU
            (``processing``: the four TL flags; ``revision`` is None except for hub names).
        processed: the default of every processing flag (llama2.c: False, run.c runs the
            raw weights; sources that build unprocessed models ignore the flags).
    """

    load: Callable
    processed: bool = True


# spec kind (posinterp.specs.SPEC_KINDS, "folder" split into "toy" and "local-hf") -> source
SOURCES: dict[str, Source] = {
    "zoo": Source(toy.load_zoo),
    "toy": Source(toy.load_toy),
    "local-hf": Source(hf_folder.load),
    "hub": Source(hub.load),
    "gguf": Source(gguf.load),
    "llama2c": Source(llama2c.load, processed=False),
    "minilm": Source(encoder.load_minilm),
}


def source_kind(spec: str | os.PathLike) -> str:
    """The key of :data:`SOURCES` (or of a refusal) for ``spec``: :func:`posinterp.specs.spec_kind`,
    a folder split into "toy" (:func:`posinterp.train`'s) and "local-hf".

    Raises:
        ValueError: an empty spec.
    """
    kind = spec_kind(str(spec))
    if kind == "folder":
        kind = "toy" if toy._is_toy_checkpoint(Path(spec).expanduser()) else "local-hf"
    return kind


def load_model(spec: str | os.PathLike, *, fold_ln: bool | None = None,
               center_writing_weights: bool | None = None, center_unembed: bool | None = None,
               fold_value_biases: bool | None = None, dtype=None, device=None,
               revision: str | None = None):
    """Load a pretrained model as a TransformerLens model and describe its positions.

    Every model is read, converted and checked against HF on CPU (so the load-time checks
    give the same numbers everywhere), then moved to ``device`` (docs/scale.md).

    Args:
        spec: a hub name (any hub repository of an architecture in
            :data:`~posinterp.models.ARCHITECTURE_SCHEMES`, resolved through the Hugging Face
            cache and then loaded exactly like a local folder), a local HF checkpoint folder
            (one weight file or shards with their index, safetensors or ``.bin``), a llama2.c ``.bin`` file, a
            toy-model checkpoint folder written by :func:`posinterp.train` (or a folder
            holding ``checkpoints/step_*``, e.g. the demo's output; the latest is used), or a
            zoo model ``zoo:<pe>[:<seed>][@<step>]`` (weights as trained, unprocessed), or
            ``"all-MiniLM-L6-v2"`` (a bidirectional BERT encoder, served offline from the
            ``minilm`` extra; returned as a ``HookedEncoder`` with ``info.causal`` False).
        fold_ln: TransformerLens weight processing, like the three below (the names of
            TL's ``from_pretrained``). Defaults: TL's (all True) for HF models; all False
            for llama2.c files, whose raw weights are what run.c uses. They change
            M = W_Q W_K^T, so they are recorded in ``ModelInfo.processing`` (what TL
            actually did).
        center_writing_weights: see ``fold_ln``. It also changes the residual stream:
            every ``hook_resid_*`` loses its mean over d_model (LayerNorm models only), so
            cosines and adjacency differ from the same folder booted without processing
            (``TransformerBridge.boot_transformers``); pass False to match that
            (docs/models.md, "Weight processing").
        center_unembed: see ``fold_ln``.
        fold_value_biases: see ``fold_ln``.
        dtype: torch dtype of the weights (default float32), for every kind of spec.
        device: where the model lives (:func:`posinterp.devices.resolve_device`; None:
            CUDA when available, else CPU).
        revision: for a hub name, the branch, tag or commit to load (e.g. Pythia's
            ``"step1000"``; default ``main``). Refused for every other kind of spec.

    Returns:
        ``(model, info)``: a ``HookedTransformer`` (TL 3.9) or ``TransformerBridge`` (TL 4;
        ``HookedEncoder`` for BERT on TL 3.9) and a :class:`ModelInfo`. For HF checkpoints
        ``info.hf_check`` records the load-time comparison with HF's own model.

    Raises:
        FileNotFoundError: a local path that does not exist or lacks config/weights
            (``no such folder or file: ...``), or a shard its index names; a hub name that
            is neither in the Hugging Face cache nor reachable (said at once, naming the
            cache and how to fill it), or that the hub does not serve.
        IncompleteCheckpointError: (a ``ValueError``) weights the architecture needs that
            the checkpoint's files lack, named.
        UnsupportedConfigError: (a ``ValueError``) a config setting TL would drop, named;
            or log-probabilities that differ from HF's own model of the checkpoint even
            without weight processing (the message says whether precision can explain it).
            Where only TL's weight processing makes them differ, the model is loaded
            unprocessed instead, with a UserWarning, and ``info.processing`` says so.
        ValueError: a corrupt or truncated file (the message names it and what was
            expected), or an architecture without a known positional scheme (see
            :data:`posinterp.models.ARCHITECTURE_SCHEMES`); a bad ``device``, ``dtype``
            or ``revision`` (naming the allowed values).
    """
    import torch

    from .._rng import preserved_rng
    from ..devices import move_model, resolve_device, resolve_dtype

    device, dtype = resolve_device(device), resolve_dtype(dtype)  # fail before loading
    with preserved_rng():  # TL 3.9's and HF's constructors draw their unused initial values
        model, info = _load_on_cpu(spec, fold_ln, center_writing_weights, center_unembed,
                                   fold_value_biases, dtype, revision)
        # HF loads are already in dtype; others (toy, zoo, llama2.c, BERT) are built in float32.
        move_model(model, device, None if dtype == torch.float32 else dtype)
    return model, info


def _load_on_cpu(spec, fold_ln, center_writing_weights, center_unembed, fold_value_biases,
                 dtype, revision=None):
    """:func:`load_model` before the move to its device: the spec's kind looked up in
    :data:`SOURCES`."""
    spec = spec_text(spec)
    kind = source_kind(spec)
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise ValueError(f"revision must be a non-empty branch, tag or commit name, got {revision!r}")
    if revision is not None and kind != "hub":
        raise ValueError(f"revision={revision!r} applies to hub names only; {spec} is not one "
                         "(for zoo snapshots use zoo:<pe>[:<seed>]@<step>)")
    if refusal(kind, str(spec)):
        raise FileNotFoundError(refusal(kind, str(spec)))
    source = SOURCES[kind]
    chosen = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                  center_unembed=center_unembed, fold_value_biases=fold_value_biases)
    processing = {k: source.processed if chosen[k] is None else chosen[k]
                  for k in PROCESSING_FLAGS}
    return source.load(str(spec), processing, dtype, revision)
