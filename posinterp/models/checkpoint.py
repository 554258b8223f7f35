"""Whether an HF checkpoint folder holds every weight its architecture needs.

transformers fills a weight the files lack with random values and says so only in its
log (which TL 3.9 silences) and in ``output_loading_info``; every HF load in posinterp
reads that report here, so an interrupted download or copy is refused by name instead of
giving random numbers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["IncompleteCheckpointError", "checkpoint_files", "refuse_incomplete"]


# (single file, index of shards) in the order transformers looks for them.
_WEIGHT_LAYOUTS = (("model.safetensors", "model.safetensors.index.json"),
                   ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def checkpoint_files(folder: str | os.PathLike) -> list[str]:
    """The weight files transformers reads from an HF checkpoint folder, names relative to it.

    One file (``model.safetensors``, else ``pytorch_model.bin``), or an index
    (``model.safetensors.index.json``, else ``pytorch_model.bin.index.json``) followed by
    every shard it names (``model-0000k-of-0000n.safetensors``,
    ``pytorch_model-0000k-of-0000n.bin``), in transformers' order of preference.

    Raises:
        FileNotFoundError: no weights, or a shard the index names is missing (named).
        ValueError: an index that is not valid JSON with a ``weight_map``.
    """
    folder = Path(folder)
    for single, index in _WEIGHT_LAYOUTS:
        if (folder / single).is_file():
            return [single]
        if (folder / index).is_file():
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
