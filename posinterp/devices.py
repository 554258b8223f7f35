"""Where models run: device and dtype choice, and moving models and batches (docs/scale.md).

One rule for the whole package: a forward pass (and training) runs on the model's
device; everything after it — float64 scores, eigen-decompositions, the numba adjacency
kernel — runs on CPU copies of the activations and weights an analysis asked for. So a
metric has one code path on every device, and results come back as CPU tensors and
DataFrames. Seeded initial weights are drawn on CPU and then moved, so a CUDA run starts
from the same model as a CPU run.

No global state: every builder, loader and run takes ``device``; None means
:func:`default_device`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["DEVICE_HELP", "DTYPES", "default_device", "model_device", "move_model",
           "resolve_device", "resolve_dtype", "to_device"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}
DEVICE_HELP = ("where models run: 'auto' (default: cuda if available, else cpu), 'cpu', "
               "'cuda' or 'cuda:N'")
_KINDS = ("cpu", "cuda")


def default_device() -> torch.device:
    """``cuda`` (the current CUDA device) when PyTorch sees a GPU, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None = None, name: str = "device") -> torch.device:
    """The ``torch.device`` that ``device`` names.

    Args:
        device: None or ``"auto"`` (:func:`default_device`), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``, or a ``torch.device`` of those kinds.
        name: the parameter's name in error messages (e.g. ``--device``).

    Raises:
        ValueError: naming ``name`` and the allowed values, for an unknown string, a kind
            other than cpu/cuda (mps and others are untested here), ``cuda`` when PyTorch
            sees no CUDA device, or ``cuda:N`` beyond the visible devices.
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return default_device()
    allowed = "'auto', 'cpu', 'cuda' or 'cuda:N'"
    try:
        dev = device if isinstance(device, torch.device) else torch.device(str(device).strip())
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} must be {allowed}; got {device!r}") from None
    if dev.type not in _KINDS:
        raise ValueError(f"{name} must be {allowed}; got {device!r} (device type "
                         f"{dev.type!r} is not supported by posinterp)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r} but PyTorch sees no CUDA device (torch "
                             f"{torch.__version__}, CUDA build {torch.version.cuda}); use "
                             f"{name}='cpu' or 'auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={device!r} but only {torch.cuda.device_count()} CUDA "
                             f"device(s) are visible (cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None = None, name: str = "dtype") -> torch.dtype:
    """The floating ``torch.dtype`` that ``dtype`` names (None: float32).

    Raises:
        ValueError: naming ``name`` and the allowed values (the keys of :data:`DTYPES` or
            a floating ``torch.dtype``).
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating dtype; got {dtype}")
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"{name} must be one of {sorted(DTYPES)} or a floating torch.dtype; "
                         f"got {dtype!r}")
    return DTYPES[key]


def model_device(model) -> torch.device:
    """The device of ``model``'s first parameter (or buffer); CPU for a model without either."""
    for tensors in (model.parameters(), model.buffers()):
        for t in tensors:
            return t.device
    return torch.device("cpu")


def move_model(model, device: str | torch.device | None = None, dtype=None):
    """Move ``model`` (TL 3.9 ``HookedTransformer``/``HookedEncoder``, TL 4
    ``TransformerBridge``, or any ``nn.Module``) to ``device`` and, if given, ``dtype``,
    keeping ``model.cfg.device``/``cfg.dtype`` true (TransformerLens moves inputs to
    ``cfg.device``), without TransformerLens's "Moving model to device" prints.

    Returns:
        the same model object, moved in place.

    Raises:
        ValueError: from :func:`resolve_device` / :func:`resolve_dtype`.
    """
    dev = resolve_device(device)
    dt = None if dtype is None else resolve_dtype(dtype)
    cfg = getattr(model, "cfg", None)
    for target in (dev, dt):
        if target is None:
            continue
        try:
            model.to(target, print_details=False)
        except TypeError:  # a plain nn.Module: no print_details
            model.to(target)
    if cfg is not None and hasattr(cfg, "device"):
        # TL 3.9 records dev.type only ("cuda"), which is cuda:0 for its input moves.
        cfg.device = str(dev)
    return model


def to_device(batch, device: torch.device):
    """``batch`` (a tensor, or a tuple/list/dict of them, nested) with every tensor on
    ``device``; other values unchanged. A no-op copy-free return where already there."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
