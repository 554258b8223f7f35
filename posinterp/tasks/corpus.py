"""Real text every machine has: the running interpreter's standard-library sources, as bytes.

Used to train the zoo of small byte-level LMs. The split is by file (a file's path
decides it, so it never changes between runs); the fingerprint identifies the exact
corpus, which differs between Python versions.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

__all__ = ["ByteCorpus", "stdlib_corpus"]

_SKIP_DIRS = {"site-packages", "test", "tests", "__pycache__", "idle_test"}


@dataclass(frozen=True)
class ByteCorpus:
    """A byte stream split into train and validation (uint8 tensors).

    Attributes:
        train: ``[n_bytes]`` uint8, the training bytes.
        val: ``[n_bytes]`` uint8, the validation bytes.
        fingerprint: sha256 over (relative path, content sha256) of every file, in order.
        info: file and byte counts, root folder and Python version.
    """

    train: Tensor
    val: Tensor
    fingerprint: str
    info: dict

    def windows(self, split: str, starts: Int[Tensor, "batch"], n_ctx: int) -> Int[Tensor, "batch n_ctx"]:
        """Token windows ``[batch, n_ctx]`` (int64 byte values) starting at ``starts``."""
        data = {"train": self.train, "val": self.val}[split]
        idx = starts[:, None] + torch.arange(n_ctx)[None, :]
        return data[idx].long()


def stdlib_corpus(root: str | Path | None = None, val_every: int = 10,
                  part: tuple[int, int] | None = None) -> ByteCorpus:
    """Read every ``.py`` file under the standard library (tests and site-packages excluded).

    Args:
        root: folder to read; default ``sysconfig.get_paths()["stdlib"]``.
        val_every: about one file in ``val_every`` (chosen by a hash of its relative
            path) goes to validation.
        part: ``(i, n)``: keep only the files whose path hash is ``i`` mod ``n`` (disjoint
            parts of the library, so zoo families can differ in their data); None: all.
            The validation rule is the same, so part ``i``'s files are split as in the
            whole corpus.

    Raises:
        FileNotFoundError: if ``root`` (or that part of it) holds no ``.py`` file.
        ValueError: for ``part`` not a pair with ``0 <= i < n``.
    """
    if part is not None and not (len(part) == 2 and 0 <= part[0] < part[1]):
        raise ValueError(f"part must be (i, n) with 0 <= i < n, got {part!r}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    if part is not None:
        # byte 1 of the hash, independent of byte 0 that picks validation files
        files = [p for p in files if hashlib.sha256(p.relative_to(root).as_posix().encode())
                 .digest()[1] % part[1] == part[0]]
    if not files:
        raise FileNotFoundError(f"no .py files under {root}" + (f" in part {part}" if part else ""))
    train, val = bytearray(), bytearray()
    digest = hashlib.sha256()
    n_val = 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        content = path.read_bytes()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(content).digest())
        is_val = hashlib.sha256(rel.encode()).digest()[0] % val_every == 0
        target = val if is_val else train
        n_val += is_val
        target += content + b"\n"
    info = {"root": str(root), "python": platform.python_version(), "n_files": len(files),
            "n_val_files": n_val, "n_train_bytes": len(train), "n_val_bytes": len(val)}
    if part is not None:
        info["part"] = list(part)
    return ByteCorpus(_tensor(train), _tensor(val), digest.hexdigest(), info)


def _tensor(buf: bytearray) -> Tensor:
    return torch.from_numpy(np.frombuffer(bytes(buf), dtype=np.uint8).copy())
