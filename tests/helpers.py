"""Seeded factories for tests: tiny models and task data, built on demand (never at import)."""

from __future__ import annotations

import torch

from posinterp.models import build_model, preset
from posinterp.tasks import TaskConfig, make_task_data


def tiny_model(pe: str = "nope", **overrides):
    return build_model(preset("tiny", pe=pe, **overrides))


def tiny_task(task: str = "reversal", n: int = 200, seed: int = 0, **kw):
    return make_task_data(TaskConfig(task, n_train=n, n_test=n, seed=seed, **kw))


def random_tokens(model, batch: int, pos: int, seed: int = 0) -> torch.Tensor:
    """Random non-special token ids (ids >= 4 skip pad/bos/eos/unk)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, model.cfg.d_vocab, (batch, pos), generator=gen)
