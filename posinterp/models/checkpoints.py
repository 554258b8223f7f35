"""The checkpoint format of posinterp's toy models: folders, manifests, checks, snapshots.

A checkpoint is a folder ``step_0000500/`` holding ``model.safetensors``, ``config.json``,
``trainer_state.pt`` (optimizer, scheduler, RNG, history) and, written last,
``manifest.json`` (each file's SHA-256), built in a temporary folder and renamed, so a
crash never leaves a half checkpoint (:func:`write_checkpoint`). Every read of a
checkpoint (resume, :func:`load_checkpoint`, the zoo) goes through one check,
:func:`check_checkpoint`: a damaged one is never loaded or resumed from. Weight snapshots
(``snapshots/step_*.safetensors``) carry a ``.sha256`` sidecar written before them
(:func:`_save_weights`, :func:`_weights_problem`). docs/faults.md.

This is the models layer's: loaders read checkpoints without importing training.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import Tensor

from ..io import atomic_dir, atomic_path, set_aside
from .backend.weights import check_tl_major, load_weights  # noqa: F401 - re-exported
from .toy import ToyModelConfig, build_model

__all__ = ["CHECKPOINT_FILES", "CheckpointDamaged", "MANIFEST", "check_checkpoint",
           "check_tl_major", "latest_checkpoint", "load_checkpoint", "load_weights",
           "write_checkpoint"]

MANIFEST = "manifest.json"
CHECKPOINT_FILES = ("model.safetensors", "config.json", "trainer_state.pt")


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete checkpoint folder with the highest step, or None (by its files'
    presence; :func:`check_checkpoint` checks its content)."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        return None
    done = sorted(p for p in d.glob("step_*") if (p / "trainer_state.pt").exists())
    return done[-1] if done else None


class CheckpointDamaged(ValueError):
    """A checkpoint folder that fails :func:`check_checkpoint`.

    Attributes:
        folder: the checkpoint folder.
        problem: what is wrong, naming the file (missing, unreadable, changed since it
            was written, non-finite weights, or weights of another shape).
    """

    def __init__(self, folder: Path, problem: str):
        super().__init__(f"checkpoint {folder} is damaged: {problem}")
        self.folder, self.problem = Path(folder), problem


def check_checkpoint(path: str | Path, read_state: bool = False) -> tuple[dict, dict, dict | None]:
    """Read a checkpoint folder and check it whole; the one check every reader uses.

    Each file is read once: ``config.json`` must parse, ``model.safetensors`` must parse
    and hold only finite floating-point weights (TransformerLens's constant -inf mask
    buffers aside), and each file's SHA-256 must equal the
    one in ``manifest.json`` (written after the files, so a flipped bit anywhere is
    caught). Folders written before manifests existed are checked without hashes.

    Args:
        path: a ``step_*`` folder.
        read_state: also unpickle ``trainer_state.pt`` (resuming needs it).

    Returns:
        ``(configs, weights, trainer_state)``: the dict of ``config.json``, the weights
        (name -> CPU tensor) and the trainer state (None unless ``read_state``).

    Raises:
        CheckpointDamaged: (a ValueError) naming the folder, the file and the fault.
    """
    from safetensors.torch import load as load_safetensors

    folder = Path(path)

    def damaged(problem: str):
        return CheckpointDamaged(folder, problem)

    blobs = {}
    for name in (*CHECKPOINT_FILES, MANIFEST):
        try:
            blobs[name] = (folder / name).read_bytes()
        except FileNotFoundError:
            if name != MANIFEST:
                raise damaged(f"{folder / name} is missing") from None
        except OSError as err:
            raise damaged(f"{folder / name} is unreadable ({err.strerror or err})") from None
    try:
        configs = json.loads(blobs["config.json"])
        if not isinstance(configs, dict):
            raise ValueError("not a JSON object")
    except ValueError as err:
        raise damaged(f"{folder / 'config.json'} is unreadable ({type(err).__name__}: {err})"
                      ) from None
    try:
        weights = load_safetensors(blobs["model.safetensors"])
    except Exception as err:  # safetensors raises its own SafetensorError
        raise damaged(f"{folder / 'model.safetensors'} is unreadable ({type(err).__name__}: "
                      f"{err}); it is probably truncated") from None
    if MANIFEST in blobs:
        try:
            recorded = json.loads(blobs[MANIFEST])["sha256"]
        except (ValueError, KeyError, TypeError) as err:
            raise damaged(f"{folder / MANIFEST} is unreadable ({type(err).__name__}: {err})"
                          ) from None
        for name in CHECKPOINT_FILES:
            if hashlib.sha256(blobs[name]).hexdigest() != recorded.get(name):
                raise damaged(f"{folder / name} has changed since it was written (its SHA-256 "
                              f"differs from the one in {MANIFEST})")
    # Another TransformerLens major is not damage: load_weights converts TL 3.9 weights on
    # TL 4 and refuses the rest by name; resuming checks it too (check_tl_major).
    for key, tensor in weights.items():
        if _non_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            raise damaged(f"{folder / 'model.safetensors'}: weight {key} holds {bad} non-finite "
                          "value(s) (inf/nan)")
    state = None
    if read_state:
        try:
            # Optimizer moments saved from CUDA load here too; AdamW's load_state_dict
            # moves them to each parameter's device.
            state = torch.load(io.BytesIO(blobs["trainer_state.pt"]), weights_only=False,
                               map_location="cpu")
            step = state["step"]
        except Exception as err:
            raise damaged(f"{folder / 'trainer_state.pt'} is unreadable ({type(err).__name__}: "
                          f"{err})") from None
        if configs.get("step", step) != step:
            raise damaged(f"{folder / 'trainer_state.pt'} is at step {step} but "
                          f"{folder / 'config.json'} says step {configs.get('step')}")
    return configs, weights, state


def load_checkpoint(path: str | Path, device=None):
    """Load a checkpoint folder written by :func:`train`, on any device (the weights are
    read to CPU and copied into a model built on ``device``;
    :func:`posinterp.devices.resolve_device`, None: CUDA when available, else CPU).

    The folder is checked first (:func:`check_checkpoint`: hashes, readability, finite
    weights), so a damaged checkpoint is never loaded.

    Returns:
        ``(model, configs)`` where ``configs`` is the dict of ``config.json`` (model,
        task and train configs, versions).

    Raises:
        FileNotFoundError: if ``model.safetensors`` or ``config.json`` is missing.
        CheckpointDamaged: (a ValueError) if a file is unreadable (truncated, corrupt),
            differs from its manifest, or holds non-finite weights; the message names
            the file.
        ValueError: for weights of another model or TransformerLens major version, or a
            bad ``device``.
    """
    path = Path(path)
    for name in ("model.safetensors", "config.json"):
        if not (path / name).exists():
            raise FileNotFoundError(f"checkpoint {path} lacks {name}")
    configs, weights, _ = check_checkpoint(path)
    model = build_model(ToyModelConfig.from_dict(configs["model"]), device=device)
    # TL 3.9 weights convert on TL 4; other majors are refused by name (load_weights)
    load_weights(model, weights, configs.get("versions"), f"checkpoint {path}")
    return model, configs


def write_checkpoint(ckpt_dir: Path, step: int, blobs: dict[str, bytes], keep: int,
                     last: Path | None = None) -> Path:
    """Write checkpoint ``step``: ``blobs`` (file name -> bytes, :data:`CHECKPOINT_FILES`),
    each synced to disk, then their manifest, in a temporary folder renamed into place;
    then keep only the newest ``keep`` complete checkpoints of ``ckpt_dir``.

    Returns:
        the checkpoint folder ``ckpt_dir/step_{step:07d}``.

    Raises:
        OSError: naming the folder and the cause (e.g. a full disk), and whether ``last``
            (the previous checkpoint) is kept; nothing half-written is left.
    """
    target = ckpt_dir / f"step_{step:07d}"
    manifest = {"sha256": {n: hashlib.sha256(b).hexdigest() for n, b in blobs.items()},
                "bytes": {n: len(b) for n, b in blobs.items()}}
    try:
        with atomic_dir(target) as tmp:
            for name, data in blobs.items():
                _write_durably(tmp / name, data)
            # Last: a folder with a manifest has all its files.
            _write_durably(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
    except OSError as err:
        kept = f"the last checkpoint, {last.name}, is kept" if last else "no checkpoint was kept"
        raise OSError(err.errno, f"{err.strerror or err}; checkpoint step {step} was not "
                      f"written, {kept}", str(target)) from err
    complete = sorted(p for p in ckpt_dir.glob("step_*") if (p / "trainer_state.pt").exists())
    for old in complete[:-keep]:
        shutil.rmtree(old)
    return target


def _write_durably(file: Path, data: bytes) -> None:
    # fsync before the folder is renamed: after a power cut a renamed checkpoint could
    # otherwise hold zero-byte files.
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _non_finite(tensor: Tensor) -> bool:
    """Whether a saved tensor holds inf/nan that no weight should hold. TransformerLens
    keeps constant all -inf buffers (TL 3.9's ``attn.IGNORE`` mask value) in the state
    dict: those are left alone."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return False
    return not bool((tensor == float("-inf")).all())


def _step_of(folder: Path) -> int | None:
    tail = folder.name.removeprefix("step_")
    return int(tail) if tail.isdigit() else None


def _weights_problem(path: Path) -> str | None:
    """Why a weights file is damaged (unreadable, non-finite, or not the bytes its
    ``.sha256`` sidecar recorded when it was written), or None when it is whole. Files
    written before sidecars existed are checked without a hash."""
    from safetensors.torch import load as load_safetensors

    try:
        blob = path.read_bytes()
    except OSError as err:
        return f"unreadable ({err.strerror or err})"
    sidecar = _sidecar(path)
    if sidecar.exists():
        want = sidecar.read_text().strip()
        if hashlib.sha256(blob).hexdigest() != want:
            return f"its SHA-256 differs from the one recorded in {sidecar.name} when it was written"
    try:
        weights = load_safetensors(blob)
    except Exception as err:  # safetensors raises its own SafetensorError
        return f"unreadable ({type(err).__name__}: {err})"
    bad = [k for k, t in weights.items() if _non_finite(t)]
    return f"non-finite values in {bad[0]}" if bad else None


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _snapshot_whole(path: Path) -> bool:
    """Whether snapshot ``path`` exists and is whole; a damaged one is moved aside."""
    if not path.exists():
        return False
    problem = _weights_problem(path)
    if problem is None:
        return True
    aside = set_aside(path)
    warnings.warn(f"snapshot {path} is damaged ({problem}); moved it to {aside}; training "
                  "resumes from before its step to write it again", stacklevel=4)
    return False


def _save_weights(path: Path, model) -> None:
    """Write a weights snapshot (atomically, durably) unless a whole one is there."""
    from safetensors.torch import save as save_safetensors

    if path.exists() and _snapshot_whole(path):
        return
    blob = save_safetensors(_cpu_state(model))
    # the hash goes first: a sidecar without its snapshot is harmless (the snapshot is
    # rewritten, and so is the sidecar); a snapshot without its sidecar is checked unhashed
    with atomic_path(_sidecar(path)) as tmp:
        _write_durably(tmp, hashlib.sha256(blob).hexdigest().encode())
    with atomic_path(path) as tmp:
        _write_durably(tmp, blob)

def _cpu_state(model) -> dict[str, Tensor]:
    """The state dict as contiguous CPU tensors (NoPE's zero W_pos buffer included), the
    form safetensors writes and any device reads back."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
