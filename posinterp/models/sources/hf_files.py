"""Which weight files of an HF checkpoint folder transformers reads, whether they hold
every weight its architecture needs, and a digest of the tensors they hold.

transformers fills a weight the files lack with random values and says so only in its
log (which TL 3.9 silences) and in ``output_loading_info``; every HF load in posinterp
reads that report here, so an interrupted download or copy is refused by name instead of
giving random numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

__all__ = ["IncompleteCheckpointError", "checkpoint_files", "explicit_weights", "refuse_incomplete",
           "safetensors_files", "weights_sha256"]


# (single file, index of shards) in the order transformers looks for them
# (``_get_resolved_checkpoint_files`` in transformers/modeling_utils.py, transformers 5).
_WEIGHT_LAYOUTS = (("model.safetensors", "model.safetensors.index.json"),
                   ("pytorch_model.bin", "pytorch_model.bin.index.json"))
# transformers reads a folder holding files of this name as a torch.distributed checkpoint,
# ahead of every other weight file (transformers/distributed/checkpoint.py).
_DISTRIBUTED = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")


def explicit_weights(folder: str | os.PathLike) -> str | None:
    """The weight file ``config.json`` names in ``transformers_weights``, if any.

    transformers reads that file (one ``.safetensors`` file or a ``.safetensors.index.json``)
    ahead of the standard names. None without such a key (or without a readable config).

    Raises:
        ValueError: a name that is not a safetensors file or index, or that points outside
            ``folder`` (transformers refuses both too).
    """
    folder = Path(folder)
    try:
        name = json.loads((folder / "config.json").read_text()).get("transformers_weights")
    except (OSError, ValueError, AttributeError):
        return None
    if name is None:
        return None
    if not isinstance(name, str) or not name.endswith((".safetensors", ".safetensors.index.json")):
        raise ValueError(f"{folder / 'config.json'}: transformers_weights must name a "
                         f"*.safetensors file or a *.safetensors.index.json, got {name!r}")
    if Path(os.path.commonpath([folder.resolve(), (folder / name).resolve()])) != folder.resolve():
        raise ValueError(f"{folder / 'config.json'}: transformers_weights must name a file inside "
                         f"{folder}, got {name!r}")
    return name


def weight_layouts(folder: str | os.PathLike) -> tuple[tuple[str | None, str | None], ...]:
    """``(single file, index of shards)`` pairs transformers tries in ``folder``, in order:
    the ``transformers_weights`` file of ``config.json`` alone when it names one, else
    :data:`_WEIGHT_LAYOUTS` (either name may be None).

    Raises:
        ValueError: as :func:`explicit_weights`.
    """
    explicit = explicit_weights(folder)
    if explicit is None:
        return _WEIGHT_LAYOUTS
    return ((None, explicit) if explicit.endswith(".json") else (explicit, None),)


def checkpoint_files(folder: str | os.PathLike) -> list[str]:
    """The weight files transformers reads from an HF checkpoint folder, names relative to it.

    transformers' own order (5.x, ``from_pretrained`` on a local folder), first match wins:
    the file ``config.json`` names in ``transformers_weights``; ``model.safetensors``;
    ``model.safetensors.index.json``; ``pytorch_model.bin``; ``pytorch_model.bin.index.json``.
    So a folder holding ``model.safetensors`` beside a leftover sharded index is read from
    ``model.safetensors``. An index is followed by every shard it names
    (``model-0000k-of-0000n.safetensors``, ``pytorch_model-0000k-of-0000n.bin``). Every
    posinterp reader of an HF folder takes its files from here.

    Raises:
        FileNotFoundError: no weights, the file ``transformers_weights`` names is missing,
            or a shard the index names is missing (named).
        ValueError: an index that is not valid JSON with a ``weight_map``; a bad
            ``transformers_weights``; or a torch.distributed checkpoint
            (``shard-*-model-*-of-*.safetensors``, which transformers reads ahead of every
            other file), which posinterp does not read.
    """
    folder = Path(folder)
    if folder.is_dir() and any(_DISTRIBUTED.match(p.name) for p in folder.iterdir()):
        raise ValueError(
            f"{folder} holds a torch.distributed checkpoint (shard-*-model-*-of-*.safetensors), "
            "which transformers reads ahead of any other weights and posinterp does not read; "
            "save it with save_pretrained as model.safetensors (or shards with their index)")
    explicit = explicit_weights(folder)
    if explicit is not None and not (folder / explicit).is_file():
        raise FileNotFoundError(f"{folder}: config.json names transformers_weights="
                                f"{explicit!r}, which is missing; fetch it again")
    for single, index in weight_layouts(folder):
        if single and (folder / single).is_file():
            return [single]
        if index and (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{folder / index} is not a valid shard index "
                                 f"({type(err).__name__}: {err})") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise FileNotFoundError(
                    f"{folder} lacks {len(missing)} of the {len(shards)} shards its {index} "
                    f"names: {missing[:4]} (an interrupted download or copy?); fetch them again")
            return [index, *shards]
    raise FileNotFoundError(
        f"{folder} has no weights: expected model.safetensors or pytorch_model.bin, or shards "
        "with their index (model.safetensors.index.json, pytorch_model.bin.index.json)")


def safetensors_files(folder: str | os.PathLike) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files transformers reads from ``folder``, for readers that open
    tensors themselves (weights-only reads): :func:`checkpoint_files` and, for shards, the
    index's ``weight_map`` (tensor name -> shard file; None for one file).

    Raises:
        FileNotFoundError: as :func:`checkpoint_files`, or a folder transformers would read
            from ``.bin`` files (named), which only a full load reads.
        ValueError: as :func:`checkpoint_files`.
    """
    files = checkpoint_files(folder)
    if not files[0].endswith((".safetensors", ".safetensors.index.json")):
        raise FileNotFoundError(
            f"{folder}: transformers reads {files[0]} here; weights-only reading needs "
            "safetensors files (model.safetensors or model.safetensors.index.json); load the "
            "whole model instead")
    if len(files) == 1:
        return files, None
    return files, json.loads((Path(folder) / files[0]).read_text())["weight_map"]


class IncompleteCheckpointError(ValueError):
    """A checkpoint whose files lack weights its architecture needs (named in the message)."""


def refuse_incomplete(folder: str | os.PathLike, loading_info: dict, architecture: str,
                      may_lack: tuple[str, ...] = ()) -> None:
    """Refuse a load whose weights transformers had to make up.

    Args:
        folder: the checkpoint folder, or a single-file checkpoint such as a GGUF file
            (named in the message).
        loading_info: transformers' ``output_loading_info`` dict (``missing_keys``,
            ``mismatched_keys``).
        architecture: the HF class loaded (named in the message).
        may_lack: name prefixes of weights posinterp does not use or replaces knowingly
            (e.g. BERT's ``cls.`` masked-LM head, which posinterp seeds and records);
            missing keys under them are allowed. Mismatched shapes never are.

    Raises:
        IncompleteCheckpointError: a weight the architecture needs is missing from the
            files (transformers' ``missing_keys``) or has another shape
            (``mismatched_keys``); the first six are named.
    """
    missing = sorted(k for k in loading_info.get("missing_keys") or ()
                     if not k.startswith(tuple(may_lack)))
    mismatched = sorted(str(k) for k in loading_info.get("mismatched_keys") or ())
    if not (missing or mismatched):
        return
    what = (f"lack {len(missing)} weight(s) that {architecture} needs: {missing[:6]}"
            f"{' ...' if len(missing) > 6 else ''}" if missing
            else f"hold weights of the wrong shape: {mismatched[:6]}")
    where = (f"the weight file {folder}" if Path(folder).is_file()
             else f"the weight files in {folder} ({len(checkpoint_files(folder))} read)")
    raise IncompleteCheckpointError(
        f"{where} {what}; HF "
        "would fill them with random values. The checkpoint is incomplete (an interrupted "
        "download or copy?): fetch it again")


def _tensors(folder: Path):
    """(name, tensor) pairs of every weight file of ``folder``, as transformers would read."""
    import torch

    for name in checkpoint_files(folder):
        path = folder / name
        if name.endswith(".json"):
            continue
        if name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()


def weights_sha256(folder: str | os.PathLike) -> str:
    """SHA-256 over the tensors of a checkpoint folder: names, dtypes, shapes and values.

    Independent of how the weights are stored (safetensors or ``.bin``, one file or shards,
    file metadata), so two folders with identical weights get the same digest.

    Raises:
        FileNotFoundError: ``folder`` holds no weight files (or an index names a missing shard).
    """
    import torch

    digest = hashlib.sha256()
    for key, tensor in sorted(_tensors(Path(folder)), key=lambda kv: kv[0]):
        t = tensor.detach().contiguous().cpu()
        head = json.dumps([key, str(t.dtype), list(t.shape)]).encode()
        digest.update(len(head).to_bytes(8, "little") + head)
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
