"""GGUF checkpoints (llama.cpp's format) through transformers' own GGUF reader.

``load_model("model.gguf")`` comes here. We never parse GGUF tensors ourselves:

1. the header is read with the ``gguf`` package's ``GGUFReader`` (architecture, file type,
   tensor types), so a truncated file or an architecture posinterp does not support is
   refused by name before anything slow happens;
2. ``transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=NAME)``
   dequantizes the weights to float32 and undoes llama.cpp's q/k row permutation; the
   model it returns is marked quantized and refuses ``save_pretrained``, so its state
   dict is copied into a model built from its config, which is saved, with the file's
   tokenizer, as an ordinary HF folder in a user cache (:func:`gguf_cache_home`), written
   atomically and reused on the next load of a file with the same sha256;
3. that folder is loaded like any local HF checkpoint (same refusals, same check against
   HF's own model), and :class:`~posinterp.models.ModelInfo` records the GGUF file, its
   quantization type and that the weights are dequantized.

Dequantized weights are an approximation of the released float weights (a Q4_1 file
keeps 4 bits per weight): say so wherever a number comes from them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

from .common import _offline, _quiet_handled

__all__ = ["GGUF_INSTALL_HINT", "gguf_cache_home", "gguf_folder", "load_gguf", "read_gguf_header"]

# posinterp is installed from its repository, not the package index: the extra works in a
# clone only, the package itself anywhere
GGUF_INSTALL_HINT = 'pip install "gguf>=0.10" (in a clone of posinterp: pip install ".[gguf]")'
_SIDECAR = "posinterp-gguf.json"  # what the cache folder was made from
_FORMAT = 1  # bump when the cached folder's layout changes


def gguf_cache_home() -> Path:
    """Where converted GGUF files are kept: ``$POSINTERP_HOME/gguf``, else
    ``$XDG_CACHE_HOME/posinterp/gguf``, else ``~/.cache/posinterp/gguf``."""
    from ...specs import cache_home

    return cache_home() / "gguf"


def _require_gguf(path) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(f"reading the GGUF file {path} needs the gguf package: "
                          f"{GGUF_INSTALL_HINT}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def read_gguf_header(path: str | os.PathLike) -> dict:
    """The facts posinterp records about a GGUF file, read with ``gguf.GGUFReader``.

    Returns:
        ``{"architecture", "name", "file_type", "tensor_types", "n_tensors", "bytes"}``:
        llama.cpp's architecture name (e.g. ``llama``), ``general.name``, the file type
        (e.g. ``MOSTLY_Q4_1``), and how many tensors have each storage type
        (e.g. ``{"Q4_1": 210, "F32": 61, "Q8_0": 1}``).

    Raises:
        ImportError: without the ``gguf`` package (naming the extra to install).
        FileNotFoundError: if ``path`` does not exist.
        ValueError: a file that is not GGUF, or is truncated or corrupt (naming the file,
            and the tensor whose data runs past its end when that is what is wrong).
    """
    return _open(path)[1]


def _open(path) -> tuple:
    """``(GGUFReader, header)``: :func:`read_gguf_header`, keeping the reader's memory map."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    _require_gguf(path)
    import gguf

    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # numpy reshape/index errors on a short file
        raise ValueError(f"{path} ({size:,} bytes) is truncated or corrupt: the GGUF reader "
                         f"failed with {type(err).__name__}: {err}") from None
    for t in reader.tensors:  # the reader does not always notice a short last tensor
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(f"{path} is truncated: tensor {t.name} ends at byte {end:,} but the "
                             f"file has {size:,} bytes")

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch, file_type = field("general.architecture"), field("general.file_type")
    if arch is None:
        raise ValueError(f"{path} has no general.architecture entry; cannot tell the model family")
    try:
        file_type = gguf.LlamaFileType(file_type).name if file_type is not None else None
    except ValueError:
        file_type = str(file_type)
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    return reader, {"architecture": str(arch), "name": field("general.name"), "file_type": file_type,
                    "tensor_types": dict(sorted(types.items())), "n_tensors": len(reader.tensors),
                    "bytes": size}


def _hf_architecture(path: Path, header: dict) -> str:
    """The HF class transformers builds for this file; refused unless posinterp knows it.

    Raises:
        ValueError: naming the GGUF architecture when transformers cannot read it, or
            the HF class when posinterp has no positional scheme for it.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ..info import ARCHITECTURE_SCHEMES

    arch = header["architecture"]
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (transformers "
                         f"{transformers.__version__} reads {sorted(GGUF_SUPPORTED_ARCHITECTURES)})")
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if cls not in ARCHITECTURE_SCHEMES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} (HF {cls or config.model_type}) is not "
                         f"supported by posinterp; supported: {sorted(ARCHITECTURE_SCHEMES)}")
    return cls


def _convert(path: Path, target: Path) -> None:
    """Dequantize ``path`` with transformers and save it as an HF folder in ``target``."""
    import torch
    import transformers

    from .hf_files import refuse_incomplete

    hf, loading = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, output_loading_info=True)
    # A tensor the file lacks is made up by HF; the saved folder would then look complete.
    refuse_incomplete(path, loading, type(hf).__name__)
    # The GGUF model is marked quantized and refuses save_pretrained: copy its weights
    # into a plain model of the same config (strict: every key must match).
    plain = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)
    plain.load_state_dict(hf.state_dict(), strict=True)
    del hf
    plain.save_pretrained(str(target))
    del plain
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(target))


def _cached(folder: Path, sha: str) -> dict | None:
    try:
        meta = json.loads((folder / _SIDECAR).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("sha256") != sha or meta.get("format") != _FORMAT:
        return None
    if not (folder / "config.json").is_file() or not list(folder.glob("model*.safetensors")):
        return None
    return meta


def gguf_folder(path: str | os.PathLike, cache: str | os.PathLike | None = None
                ) -> tuple[Path, dict]:
    """The HF checkpoint folder of a GGUF file: converted once, then reused.

    The folder is ``<cache>/<first 16 hex digits of the file's sha256>/`` and holds
    ``config.json``, ``model.safetensors`` (float32, dequantized), the tokenizer and
    ``posinterp-gguf.json`` (the file's sha256 and header facts). It is built in a
    sibling temporary folder and renamed into place, so an interrupted conversion leaves
    nothing a later load would trust; it is reused when its recorded sha256 matches.

    Args:
        path: a ``.gguf`` file.
        cache: the cache folder (default :func:`gguf_cache_home`).

    Returns:
        ``(folder, meta)``: the folder and its recorded facts (``sha256``, ``source``,
        ``architecture``, ``hf_architecture``, ``file_type``, ``tensor_types``, ...).

    Raises:
        ImportError: without the ``gguf`` package (naming how to install it).
        FileNotFoundError: a missing file.
        ValueError: a truncated or corrupt file, or an unsupported architecture (named).
        IncompleteCheckpointError: (a ``ValueError``) the file lacks a tensor the
            architecture needs, or holds one of the wrong shape (named); nothing is cached.
    """
    from ...io import atomic_dir, atomic_write_json

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no such GGUF file: {path}")
    _require_gguf(path)
    sha = _sha256(path)
    folder = Path(cache) if cache is not None else gguf_cache_home()
    folder = folder / sha[:16]
    meta = _cached(folder, sha)
    if meta is not None:
        return folder, meta
    header = read_gguf_header(path)
    with _offline(), _quiet_handled():
        cls = _hf_architecture(path, header)
        # A minute of silence needs a word (logging's last-resort handler shows warnings).
        logging.getLogger(__name__).warning(
            "posinterp: dequantizing %s (%s) into %s; done once, about a minute per 100M "
            "parameters", path.name, header["file_type"], folder)
        import transformers

        meta = {"format": _FORMAT, "sha256": sha, "source": str(path.resolve()),
                "hf_architecture": cls, **header, "dequantized_to": "float32",
                "transformers": transformers.__version__}
        if folder.exists():  # stale or half-written by an older version: rebuild
            import shutil

            shutil.rmtree(folder)
        try:
            with atomic_dir(folder) as tmp:
                _convert(path, tmp)
                atomic_write_json(tmp / _SIDECAR, meta)
        except (FileExistsError, OSError):
            # Another process finished the same conversion first: use its folder.
            done = _cached(folder, sha)
            if done is None:
                raise
            return folder, done
    return folder, meta


def load_gguf(path: Path, processing: dict, dtype, cache: str | os.PathLike | None = None):
    """``load_model`` for a ``.gguf`` file: :func:`gguf_folder`, then the HF-folder loader.

    Returns:
        ``(model, info)`` with ``info.source == "gguf"`` and ``info.weights`` holding the
        file, its sha256, ``file_type`` (e.g. ``MOSTLY_Q4_1``), ``tensor_types``,
        ``dequantized: True`` and the cache folder.

    Raises:
        ImportError: without the ``gguf`` package (as :func:`gguf_folder`).
        FileNotFoundError: a missing file.
        ValueError: as :func:`gguf_folder`, and as the HF-folder loader (its refusals and
            its check against HF's own model on the dequantized weights).
    """
    from .hf_folder import _load_local_hf

    folder, meta = gguf_folder(path, cache)
    with _quiet_handled():
        model, info = _load_local_hf(folder, processing, dtype)
    weights = {"path": str(Path(path).resolve()), "sha256": meta["sha256"], "format": "gguf",
               "file_type": meta["file_type"], "tensor_types": meta["tensor_types"],
               "dequantized": True, "dequantized_to": meta["dequantized_to"],
               "folder": str(folder)}
    return model, dataclasses.replace(info, spec=str(path), source="gguf", weights=weights)


def load(spec: str, processing: dict, dtype, revision=None):
    """:func:`posinterp.load_model`'s entry for a ``.gguf`` file: :func:`load_gguf`."""
    return load_gguf(Path(spec).expanduser(), processing, dtype)
