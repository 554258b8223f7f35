"""Hub names through the Hugging Face cache, loaded like local folders; distinct revisions.

A hub name (``"gpt2"``, ``"EleutherAI/pythia-70m"``) and an optional ``revision`` (a
branch such as Pythia's ``step1000``, a tag or a commit) are resolved with
``huggingface_hub.snapshot_download`` into a snapshot folder of the cache
(``HF_HUB_CACHE/models--ORG--NAME/snapshots/<commit>/``); :func:`posinterp.load_model` then
loads that folder exactly like a local checkpoint folder (same refusals, same HF check).
With ``HF_HUB_OFFLINE=1`` only the cache is read.

:func:`distinct_revisions` refuses a run over revisions two of which hold identical weights:
public Pythia repositories serve the final weights under some early ``stepN`` branches
(EleutherAI/pythia issue 205), and a training-dynamics curve over them would be wrong (digests:
:func:`posinterp.models.sources.hf_files.weights_sha256`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from .common import _quiet_handled
from .hf_files import weight_layouts, weights_sha256

__all__ = ["distinct_revisions", "hub_cache_dir", "load", "snapshot_folder"]

# Config, shard indexes and tokenizer first; then only the weight files transformers will
# read (checkpoint_files' order), never other formats or copies (TF, Flax, ONNX, GGUF,
# Mistral's consolidated.safetensors next to its shards).
_META_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken"]
_TRUE = ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    """The cache folder ``huggingface_hub`` uses, read from the environment at call time.

    ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``
    (huggingface_hub reads these once at import; a notebook that sets them later is honoured).
    """
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline_mode() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE or constants.HF_HUB_OFFLINE


def snapshot_folder(name: str, revision: str | None = None) -> Path:
    """The cache's snapshot folder of hub model ``name`` at ``revision``, fetched if needed.

    Args:
        name: a hub repository id (``"gpt2"``, ``"EleutherAI/pythia-70m"``).
        revision: a branch, tag or commit (default: ``main``).

    Returns:
        ``HF_HUB_CACHE/models--ORG--NAME/snapshots/<commit>/`` holding the config, tokenizer
        and the weight files transformers reads (one file, or an index and its shards;
        safetensors, else ``.bin``); nothing else is downloaded.

    Raises:
        FileNotFoundError: the name (or revision) is not in the cache and the hub cannot be
            reached or ``HF_HUB_OFFLINE`` is set (the message names the cache and the command
            that fills it), or the hub has no such repository or revision.
    """
    import huggingface_hub
    from huggingface_hub import errors

    cache, offline = hub_cache_dir(), _offline_mode()
    at = f"{name}@{revision}" if revision else name
    try:
        folder = Path(huggingface_hub.snapshot_download(
            name, revision=revision, cache_dir=cache, local_files_only=offline,
            allow_patterns=_META_PATTERNS if not offline else None))
        if not offline:
            folder = _fetch_weights(huggingface_hub.snapshot_download, name, revision, cache,
                                    folder)
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as err:
        raise FileNotFoundError(f"no such folder or file: {name}; nor does the Hugging Face hub "
                                f"serve a model of that name to this client ({type(err).__name__})"
                                ) from None
    except errors.RevisionNotFoundError:
        raise FileNotFoundError(f"{name} has no revision {revision!r} on the Hugging Face hub"
                                ) from None
    except errors.HFValidationError:
        raise FileNotFoundError(f"no such folder or file: {name}; nor is it a valid hub model name "
                                "(ORG/NAME)") from None
    except errors.IncompleteSnapshotError:
        raise FileNotFoundError(
            f"{at}: the Hugging Face cache ({cache}) holds an incomplete snapshot (an interrupted "
            f"download?) and the hub cannot complete it; run `hf download {name}` again") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as err:
        why = ("HF_HUB_OFFLINE is set" if offline
               else f"the hub cannot be reached ({type(err).__name__})")
        rev = f" --revision {revision}" if revision else ""
        raise FileNotFoundError(
            f"no such folder or file: {at}; it is not in the Hugging Face cache ({cache}) and "
            f"{why}. Fill the cache where the hub is reachable (`hf download {name}{rev}`, then "
            "copy the cache folder and point HF_HUB_CACHE at it), or pass a local checkpoint "
            "folder") from None
    return folder


def _fetch_weights(download, name: str, revision: str | None, cache: Path, folder: Path) -> Path:
    """Download the weight files transformers will read, in its order of preference
    (:func:`~posinterp.models.sources.hf_files.checkpoint_files`): the file the config names in
    ``transformers_weights``, else ``model.safetensors``, the shards of
    ``model.safetensors.index.json``, then the same for ``pytorch_model.bin`` (the indexes
    came with the config)."""

    for single, index in weight_layouts(folder):
        if single is not None:
            folder = Path(download(name, revision=revision, cache_dir=cache,
                                   allow_patterns=[single]))
            if (folder / single).is_file():
                return folder
        if index is not None and (folder / index).is_file():
            shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            return Path(download(name, revision=revision, cache_dir=cache, allow_patterns=shards))
    return folder  # no weights: load_model names what is missing


def distinct_revisions(name: str, revisions) -> dict[str, str]:
    """Weight digests of hub model ``name`` at each of ``revisions``; refuse duplicates.

    Args:
        name: a hub repository id (e.g. ``"EleutherAI/pythia-70m"``).
        revisions: branch/tag/commit names, e.g. ``["step1000", "step2000"]``.

    Returns:
        ``{revision: sha256}`` (:func:`weights_sha256`) in the given order.

    Raises:
        ValueError: two revisions hold identical weights (both named, with the digest):
            a dynamics curve over them would repeat one checkpoint under two steps.
        FileNotFoundError: as :func:`snapshot_folder`.
    """
    digests: dict[str, str] = {}
    seen: dict[str, str] = {}
    for revision in revisions:
        digest = weights_sha256(snapshot_folder(name, revision))
        if digest in seen:
            raise ValueError(
                f"{name}: revisions {seen[digest]!r} and {revision!r} hold identical weights "
                f"(sha256 {digest[:16]}...); the hub serves one checkpoint under both names, so "
                "a curve over these revisions would be wrong. Drop one of them")
        seen[digest] = revision
        digests[revision] = digest
    return digests


def load(name: str, processing: dict, dtype, revision: str | None = None):
    """:func:`posinterp.load_model`'s entry for a hub name: its snapshot folder in the cache
    (:func:`snapshot_folder` at ``revision``), loaded exactly like a local folder."""
    from ..backend.version import hub_repo_for
    from .hf_folder import _load_local_hf

    repo = hub_repo_for(name)  # TL's aliases ("pythia-70m") keep working
    folder = snapshot_folder(repo, revision)
    with _quiet_handled():
        model, info = _load_local_hf(folder, processing, dtype)
    return model, replace(info, spec=name, source="hub",
                          weights={"hub": repo, "revision": revision or "main",
                                   "commit": folder.name, **info.weights})
