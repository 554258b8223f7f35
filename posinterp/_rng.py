"""The caller's global random state, left as it was by every posinterp function.

posinterp draws its own numbers from private, seeded generators. Building or loading a
model still touches the global ones from inside other libraries: ``nn.Linear``, HF's
models and TransformerLens 3.9's ``HookedTransformer`` draw default initial values from
torch's global generator before the real weights replace them, and TransformerLens 3.9's
config reseeds torch, numpy and Python's ``random`` when handed a ``seed``. A user who
seeds 1, 2 and 3 for replicates and then builds a model would draw identical numbers
after it. :func:`preserved_rng` puts those states back.
"""

from __future__ import annotations

import contextlib

__all__ = ["preserved_rng"]

# The seed a CUDA generator starts from when nothing seeded it (c10's default_rng_seed_val).
_CUDA_DEFAULT_SEED = 67280421310721


@contextlib.contextmanager
def preserved_rng():
    """Restore the caller's global random states on exit (also on an exception).

    Restored: torch's CPU generator; numpy's legacy global state (``np.random.seed``);
    Python's ``random``; and with CUDA, each device's generator: saved on entry when CUDA
    is initialized, else what CUDA's lazy initialization will seed them from (torch
    queues a ``torch.manual_seed`` made before CUDA starts; a seed queued inside the
    block is dropped, and generators that CUDA started inside the block are reset to the
    state it would have given them without the block). Draws inside the block are
    unaffected: code that seeds and draws there gets the same numbers as without it.
    Usable as a decorator.
    """
    import random

    import numpy as np
    import torch

    cpu = torch.get_rng_state()
    cuda = tracker = queued = None
    if torch.cuda.is_available():
        if torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        else:
            tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)  # private: guarded
            queued = dict(vars(tracker)) if tracker is not None else None
    legacy = np.random.get_state()
    python = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        elif queued is not None:
            # the tracker's fields are reassigned, never mutated: a shallow copy restores them
            vars(tracker).update(queued)
            if torch.cuda.is_initialized():  # started inside: redo what its start would do
                for i in range(torch.cuda.device_count()):
                    torch.cuda.default_generators[i].manual_seed(_CUDA_DEFAULT_SEED)
                for call in tracker.get_calls():
                    if call:
                        call[0]()
        np.random.set_state(legacy)
        random.setstate(python)
