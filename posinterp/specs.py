"""Model specs checked before anything heavy is imported (no torch, no transformers).

The command line checks every spec it was given here first, so a typo in the last of
five specs, a zoo model that was never trained or a missing ``.bin`` file is one line
on stderr at once, not a traceback after the good models have run or after a minute of
imports. :func:`posinterp.load_model` stays the authority on what a spec loads; this
module only refuses what it would certainly refuse.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LLAMA2C_HEADER_BYTES", "LOCAL_SUFFIXES", "ZOO_SCHEMES", "check_spec", "looks_local",
           "spec_errors", "zoo_home", "zoo_model_dir"]

ZOO_SCHEMES = ("nope", "absolute", "rotary", "alibi")  # = posinterp.models.PE_SCHEMES (tested)
LLAMA2C_HEADER_BYTES = 7 * 4  # llama2.c's Config: seven int32 (dim, hidden_dim, ... seq_len)
_MINILM = ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")


def zoo_home() -> Path:
    """``$POSINTERP_HOME/zoo``, default ``~/.cache/posinterp/zoo``."""
    return Path(os.environ.get("POSINTERP_HOME", Path.home() / ".cache" / "posinterp")) / "zoo"


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


def check_spec(spec: str, home: str | os.PathLike | None = None) -> None:
    """Refuse a spec that :func:`posinterp.load_model` would certainly refuse, cheaply.

    Checks: a zoo spec's form and that the model (and snapshot) was trained; a local
    path exists; a llama2.c ``.bin`` file is at least its header long. Hub names are
    left to the loader (they need the network or a local HF cache).

    Raises:
        ValueError: an empty spec, a malformed zoo spec, a ``.bin`` file shorter than
            the llama2.c header.
        FileNotFoundError: a local path that does not exist, a zoo model not trained.
    """
    text = str(spec).strip()
    if not text:
        raise ValueError("spec must be a hub name, a checkpoint folder, a .bin file or zoo:<pe>; "
                         "got an empty string")
    if text.startswith("zoo:"):
        _check_zoo(text, home)
        return
    if text in _MINILM:
        return
    path = Path(text).expanduser()
    if path.suffix == ".bin" and path.is_file():
        size = path.stat().st_size
        if size < LLAMA2C_HEADER_BYTES:
            raise ValueError(f"{spec}: {size} bytes, shorter than a llama2.c header "
                             f"({LLAMA2C_HEADER_BYTES} bytes): a truncated or wrong file")
        return
    if path.exists():
        return
    if looks_local(text):
        raise FileNotFoundError(f"no such folder or file: {spec}")


def _check_zoo(spec: str, home) -> None:
    body, _, step = spec.removeprefix("zoo:").partition("@")
    pe, _, seed = body.partition(":")
    if pe not in ZOO_SCHEMES or (seed and not seed.isdigit()) or (step and not step.isdigit()):
        raise ValueError(f"zoo spec must look like 'zoo:<pe>[:<seed>][@<step>]' with pe in "
                         f"{sorted(ZOO_SCHEMES)}, got {spec!r}")
    folder = zoo_model_dir(Path(home) if home is not None else zoo_home(), pe, int(seed or 0))
    if not (folder / "card.json").exists():
        raise FileNotFoundError(f"{spec}: {folder} holds no finished zoo model (no card.json); "
                                "run `posinterp zoo train` first")
    if step and not (folder / "checkpoints" / "snapshots" / f"step_{int(step):07d}.safetensors").exists():
        raise FileNotFoundError(f"{spec}: no snapshot at step {int(step)} in {folder}")


def spec_errors(specs, home: str | os.PathLike | None = None) -> list[str]:
    """One message per spec that :func:`check_spec` refuses (empty when all pass)."""
    errors = []
    for spec in specs:
        try:
            check_spec(spec, home)
        except (ValueError, FileNotFoundError) as err:
            errors.append(str(err))
    return errors
