"""How posinterp runs a model for a measurement: eagerly (compiled models, whose graphs
skip hooks: :func:`compiled_kind`, :func:`eager`, :func:`unwrap`), in eval mode
(:func:`eval_mode`) and, for probes, in float32 (:func:`_in_float32`)."""

from __future__ import annotations

import contextlib

import torch

from .errors import MissingFeatureError


def compiled_kind(model) -> str | None:
    """``"torch.compile"`` for a ``torch.compile(model)`` wrapper, ``"model.compile()"`` for
    a module compiled in place, None for an eager model.

    TransformerLens hooks added after compilation do not fire inside the compiled graph
    (issue 22 item 5), so hook-based features ask this first (:func:`eager`).
    """
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        return "torch.compile"
    if getattr(model, "_compiled_call_impl", None) is not None:
        return "model.compile()"
    return None


class CompiledModelError(MissingFeatureError):
    """A hook-based feature was asked of a compiled model whose hooks would not fire."""


def check_not_wrapped(model, feature: str) -> None:
    """Refuse a ``torch.compile(model)`` wrapper for ``feature`` (hooks would not fire in
    its calls).

    Raises:
        CompiledModelError: naming the wrapper and the way out (pass ``model._orig_mod``).
    """
    if compiled_kind(model) == "torch.compile":
        raise CompiledModelError(
            f"{feature} needs TransformerLens hooks, which do not fire inside the graph of a "
            "torch.compile(model) wrapper; pass the uncompiled model (model._orig_mod)")


class eager:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Run a model compiled in place with ``model.compile()`` eagerly inside the block, so
    hooks fire; restored afterwards. A ``torch.compile(model)`` wrapper is unwrapped by
    :func:`unwrap` instead; an eager model is left alone.

    Uses ``nn.Module._compiled_call_impl`` (torch >= 2.2), the attribute ``Module.compile``
    sets; ``__call__`` falls back to the eager forward while it is None.
    """

    def __init__(self, model):
        self.model = unwrap(model)
        self.saved = None

    def __enter__(self):
        self.saved = getattr(self.model, "_compiled_call_impl", None)
        if self.saved is not None:
            self.model._compiled_call_impl = None
        return self.model

    def __exit__(self, *exc):
        if self.saved is not None:
            self.model._compiled_call_impl = self.saved
        return False


def unwrap(model):
    """The module a ``torch.compile(model)`` wrapper compiles (the model itself otherwise)."""
    return model._orig_mod if compiled_kind(model) == "torch.compile" else model


@contextlib.contextmanager
def _in_float32(model):
    """Run the block with every half-precision parameter and buffer of ``model`` in float32,
    then give each back its own dtype. A hook's meaning does not depend on the dtype, and
    float32 lets the probe's tolerances tell meanings apart in a bf16/fp16 model too (half
    precision rounds the pattern by ~1e-2). Half -> float32 -> half is exact, so the
    model's weights come back bit for bit. Yields whether anything was in half precision
    (tables computed from half-precision values, such as RoPE's cos/sin, keep that rounding).

    The configs say float32 for the block too: TL 3.9's norms cast their output to
    ``cfg.dtype`` (``LayerNormPre``/``RMSNormPre`` of a folded bf16 load would hand bf16
    activations to float32 weights: "mat1 and mat2 must have the same dtype"), and TL 3.9
    builds other tensors in ``cfg.dtype``, which must match the weights."""
    saved, configs = [], {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for t in store.values():
                # half precision only: a float64 model already resolves meanings
                if t is not None and t.dtype in (torch.float16, torch.bfloat16):
                    saved.append((t, t.data))
                    t.data = t.data.float()
        cfg = module.__dict__.get("cfg")
        if getattr(cfg, "dtype", None) in (torch.float16, torch.bfloat16):
            configs[id(cfg)] = (cfg, cfg.dtype)
    try:
        if saved:
            for cfg, _ in configs.values():
                cfg.dtype = torch.float32
        yield bool(saved)
    finally:
        for t, data in saved:
            t.data = data
        if saved:
            for cfg, dtype in configs.values():
                cfg.dtype = dtype


@contextlib.contextmanager
def eval_mode(model):
    """Run the block with every module of ``model`` in eval mode, then restore each
    module's own mode exactly (a model left in ``train()`` after a user's fine-tuning
    loop, or one with a single submodule in train mode, comes back as it was).

    Analyses are measurements: with dropout active (HF models bridged by TL 4, a user's
    module attached to a hook) the numbers would change from call to call. Every
    forward pass posinterp runs for an analysis goes through here (:func:`run_cached`
    and the inspector's scores pass). Yields ``model``.
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield model
    finally:
        for m, training in modes:
            m.training = training
