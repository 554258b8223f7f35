"""Training toy models on the synthetic tasks: answer-only loss, exact match, resumable.

A run is fully determined by (model config, task config, train config): weights come
from the model seed, batches from a generator seeded by ``TrainConfig.seed`` whose
state is checkpointed, so a resumed run continues to exactly the parameters of an
uninterrupted one.

Checkpoints are written every ``checkpoint_every`` steps in the format of
:mod:`posinterp.models.checkpoints` (folders with a manifest, written atomically; one
check, :func:`check_checkpoint`, on every read): a damaged one is never resumed from, but
moved aside (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from ._progress import tqdm
from ._validate import require_at_least
from .devices import model_device, move_model, to_device
from .io import clean_temporaries, dumps_json, folder_lock, set_aside, versions
from .models.checkpoints import (  # noqa: F401 - the checkpoint format, re-exported
    CHECKPOINT_FILES,
    MANIFEST,
    CheckpointDamaged,
    _cpu_state,
    _save_weights,
    _snapshot_whole,
    _step_of,
    _weights_problem,
    check_checkpoint,
    check_tl_major,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    write_checkpoint,
)
from .models.toy import ToyModelConfig, build_model
from .tasks.synthetic import TaskConfig, TaskData, TaskSplit

__all__ = [
    "CheckpointDamaged", "TrainConfig", "TrainResult", "answer_loss", "check_checkpoint",
    "clip_grad_norm", "exact_match", "fit", "latest_checkpoint", "TrainingInterrupted",
    "load_checkpoint", "load_weights", "train",
]

# Settings that change when checkpoints are written, never what is computed: a resumed run
# may use other values than the run that wrote the checkpoint.
_CADENCE_FIELDS = ("checkpoint_every", "checkpoint_seconds", "keep_checkpoints")


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, saying truthfully what is on disk.

    Attributes:
        step: the last completed optimizer step.
        saved: the last complete checkpoint folder, or None if none was written.
    """

    def __init__(self, step: int, saved: Path | None):
        super().__init__(f"interrupted at step {step}; last checkpoint: {saved}")
        self.step, self.saved = step, saved


#: The history's metric for an evaluation's confirmation on ``TrainConfig.n_confirm`` samples.
CONFIRM_METRIC = "confirm_accuracy"


@dataclass(frozen=True)
class TrainConfig:
    """Optimization settings (AdamW, linear warmup then cosine decay to ``min_lr_ratio``).

    Training stops at ``max_steps`` or at the first evaluation whose exact-match
    accuracy reaches ``target_accuracy`` (None: never early). The evaluation reads the
    first ``n_eval`` test samples; with ``n_confirm``, an evaluation that reaches the
    target is confirmed on the first ``n_confirm`` test samples (all of them when the split
    is smaller) and training stops only if that accuracy reaches the target too, so a model
    that stopped is at the target on the samples it is scored on, not only on the
    1,000-sample estimate (which at 0.9 has a standard error of ~0.01). A checkpoint is written
    every ``checkpoint_every`` steps and also whenever ``checkpoint_seconds`` of wall
    time have passed since the last one (None: steps only), so an interrupted run
    loses at most that much work even when steps are slow.

    Raises:
        ValueError: for non-positive sizes/steps/learning rate, a target outside (0, 1]
            or ``n_confirm`` below 1.
    """

    max_steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    n_eval: int = 1000
    target_accuracy: float | None = 0.9
    n_confirm: int | None = None
    checkpoint_every: int = 250
    checkpoint_seconds: float | None = 120.0
    keep_checkpoints: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        require_at_least(self, ("max_steps", "batch_size", "eval_every", "n_eval",
                                "checkpoint_every", "keep_checkpoints"))
        if self.checkpoint_seconds is not None and not self.checkpoint_seconds >= 0:
            raise ValueError(f"checkpoint_seconds must be >= 0 or None, got {self.checkpoint_seconds}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy must be in (0, 1] or None, got {self.target_accuracy}")
        if self.n_confirm is not None and not self.n_confirm >= 1:
            raise ValueError(f"n_confirm must be >= 1 or None, got {self.n_confirm}")

    def to_dict(self) -> dict:
        """The settings; ``n_confirm`` only when set, so checkpoints and cell keys written
        before it existed (when no run confirmed) still compare equal."""
        d = asdict(self)
        if d["n_confirm"] is None:
            del d["n_confirm"]
        return d


@dataclass(frozen=True)
class TrainResult:
    """Outcome of :func:`train`.

    Attributes:
        model: the trained model.
        history: tidy DataFrame ``step, metric, value`` (``train_loss`` every step,
            ``test_accuracy`` and ``test_loss`` at every evaluation, and
            ``confirm_accuracy`` where an evaluation reached the target and ``n_confirm``
            is set).
        steps: optimizer steps taken in total.
        reached_target: whether an evaluation reached ``target_accuracy`` (and, with
            ``n_confirm``, its confirmation did too).
    """

    model: object
    history: pd.DataFrame
    steps: int
    reached_target: bool

    @property
    def final_accuracy(self) -> float:
        acc = self.history[self.history.metric == "test_accuracy"]
        return float(acc.value.iloc[-1]) if len(acc) else float("nan")


def answer_loss(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    answer_mask: Int[Tensor, "batch pos"],
) -> Float[Tensor, ""]:
    """Mean cross-entropy (nats per answer token) over answer tokens and EOS only.

    Position t predicts token t+1, so the loss uses ``logits[:, :-1]`` against
    ``tokens[:, 1:]`` where ``answer_mask[:, 1:]`` is 1. This assumes the token before
    each answer token is real, as in a :class:`~posinterp.tasks.TaskSplit` (right-padded,
    answers after the prompt); for other padding see
    :func:`posinterp.interventions.ablation_effect`, which pairs real tokens.

    Raises:
        ValueError: if the batch has no answer token.
    """
    target_mask = answer_mask[:, 1:].bool()
    if not target_mask.any():
        raise ValueError("answer_mask selects no answer token")
    return F.cross_entropy(logits[:, :-1][target_mask], tokens[:, 1:][target_mask])


def exact_match(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    answer_mask: Int[Tensor, "batch pos"],
) -> Float[Tensor, "batch"]:
    """1.0 where every answer token and the EOS is the argmax prediction, else 0.0.

    With teacher forcing this equals greedy decoding's exact match: greedy decoding
    reproduces the answer iff each step's argmax is the next answer token.
    """
    target_mask = answer_mask[:, 1:].bool()
    correct = (logits[:, :-1].argmax(-1) == tokens[:, 1:]) | ~target_mask
    return correct.all(-1).float()


@torch.no_grad()
def evaluate(model, split: TaskSplit, n: int | None = None, batch_size: int = 500) -> dict:
    """Exact-match accuracy and answer loss on the first ``n`` samples of ``split``
    (computed on the model's device; Python floats back)."""
    device = model_device(model)
    n = len(split) if n is None else min(n, len(split))
    was_training = model.training
    model.eval()
    hits, loss_sum, n_tok = 0.0, 0.0, 0
    for start in range(0, n, batch_size):
        sl = slice(start, min(n, start + batch_size))
        toks, attn, ans = to_device((split.tokens[sl], split.attention_mask[sl],
                                     split.answer_mask[sl]), device)
        logits = model(toks, attention_mask=attn)
        hits += exact_match(logits, toks, ans).sum().item()
        k = int(ans[:, 1:].sum())
        loss_sum += answer_loss(logits, toks, ans).item() * k
        n_tok += k
    model.train(was_training)
    return {"test_accuracy": hits / n, "test_loss": loss_sum / n_tok}


def _lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def _configs_dict(model_cfg: ToyModelConfig, task_cfg: TaskConfig, train_cfg: TrainConfig) -> dict:
    return {"model": model_cfg.to_dict(), "task": task_cfg.to_dict(), "train": train_cfg.to_dict()}


def _require_finite(model, step: int) -> None:
    for key, tensor in model.named_parameters():
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"training diverged: weight {key} holds non-finite values (inf/nan) "
                             f"after step {step}; the earlier checkpoints are kept. Lower lr or "
                             "grad_clip and train again in another folder")


def _save(ckpt_dir: Path, step: int, model, optimizer, scheduler, gen, history, configs,
          keep: int, last: Path | None = None) -> Path:
    """Write checkpoint ``step`` (files, then its manifest, in a folder renamed into place).

    Raises:
        OSError: naming the folder and the cause (e.g. a full disk); nothing half-written
            is left and the earlier checkpoints are kept.
        ValueError: if a weight is non-finite (training diverged).
    """
    from safetensors.torch import save as save_safetensors

    target = ckpt_dir / f"step_{step:07d}"
    if target.exists():
        try:
            check_checkpoint(target)
            return target
        except CheckpointDamaged as err:
            aside = set_aside(target)
            warnings.warn(f"{err}; moved it to {aside} and writing step {step} again",
                          stacklevel=3)
    _require_finite(model, step)
    weights = _cpu_state(model)
    state = io.BytesIO()
    torch.save({"step": step, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": gen.get_state(),
                "history": history}, state)
    # The device is provenance, not config: a checkpoint resumes on any device.
    blobs = {"model.safetensors": save_safetensors(weights),
             "config.json": dumps_json({**configs, "step": step, "device": str(model_device(model)),
                                        "versions": versions()}, indent=2).encode(),
             "trainer_state.pt": state.getvalue()}
    return write_checkpoint(ckpt_dir, step, blobs, keep, last)


def _with_grad(fn):
    """Run ``fn`` with gradients on, whatever the caller's context: notebooks wrap code in
    ``torch.no_grad()`` or ``torch.inference_mode()``, where training cannot work (and
    weights built under inference mode could never be updated)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return fn(*args, **kwargs)
    return wrapper


@_with_grad
def train(
    model_config: ToyModelConfig,
    data: TaskData,
    config: TrainConfig = TrainConfig(),
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    progress: bool = True,
    model=None,
    device=None,
    mixed_precision: str | None = None,
    threads: int | None = 1,
) -> TrainResult:
    """Train a toy model on a synthetic task with answer-only cross-entropy and AdamW.

    Source: the training protocol of Zuo et al. 2024 (arXiv 2501.00073), as read in
    docs/concepts.md: loss on answer tokens (and EOS) only, exact-match accuracy on the
    held-out test split.

    Args:
        model_config: the architecture; the model is built from it (weights from its seed).
        data: task data from :func:`posinterp.tasks.make_task_data`.
        config: optimization settings.
        checkpoint_dir: where to write ``step_*`` checkpoints; None disables them.
        resume: continue from the latest complete checkpoint in ``checkpoint_dir``.
        progress: show a tqdm bar, and at each evaluation a line with the metrics, the
            elapsed wall time and the seconds per step (:func:`fit`).
        model: an already-built model for ``model_config`` (e.g. to keep a handle on
            it); default: built here.
        device: where to train (:func:`posinterp.devices.resolve_device`; None: CUDA when
            available, else CPU, or where ``model`` already is). The initial weights and
            the batches' order do not depend on it; batches are drawn on CPU and moved.
        mixed_precision: None (float32) or ``"bf16"``: bfloat16 autocast of the forward
            pass, CUDA only (see :func:`fit`).
        threads: torch's CPU thread count while training (default 1, as ``posinterp
            demo`` and ``zoo train``; torch's own count is restored afterwards). One
            thread degrades gracefully when other jobs share the cores; with every core,
            torch's threads wait on each other whenever one is descheduled
            (docs/performance.md). None leaves torch's setting alone (for callers that
            set it themselves). The numbers depend on it (summation order).

    Returns:
        :class:`TrainResult`.

    Raises:
        ValueError: if the task's sequences exceed ``n_ctx``, a checkpoint to resume
            was written for different configs, or a bad ``device``/``mixed_precision``/
            ``threads``.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be an integer >= 1 or None, got {threads!r}")
    with _torch_threads(threads):
        return _train(model_config, data, config, checkpoint_dir, resume, progress, model,
                      device, mixed_precision)


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """Run the block with ``torch.set_num_threads(threads)``, restoring the count after
    (None: leave it alone)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(model_config, data, config, checkpoint_dir, resume, progress, model, device,
           mixed_precision) -> TrainResult:
    if data.max_len > model_config.n_ctx:
        raise ValueError(
            f"task sequences have up to {data.max_len} tokens but n_ctx is {model_config.n_ctx}")
    configs = _configs_dict(model_config, data.config, config)
    if model is None:
        model = build_model(model_config, device=device)
    elif device is not None:
        move_model(model, device)
    train_split = data.train

    def next_batch(gen: torch.Generator):
        idx = torch.randint(len(train_split), (config.batch_size,), generator=gen)
        attn = train_split.attention_mask[idx]
        width = int(attn.sum(-1).max())  # drop all-padding columns
        return (train_split.tokens[idx, :width], attn[:, :width],
                train_split.answer_mask[idx, :width])

    def loss_fn(model, batch):
        toks, attn, ans = batch
        return answer_loss(model(toks, attention_mask=attn), toks, ans)

    def evaluate_fn(m):
        metrics = evaluate(m, data.test, config.n_eval)
        if (config.n_confirm is not None and config.target_accuracy is not None
                and metrics["test_accuracy"] >= config.target_accuracy):
            metrics[CONFIRM_METRIC] = evaluate(m, data.test, config.n_confirm)["test_accuracy"]
        return metrics

    history, step = fit(
        model, next_batch, loss_fn, evaluate_fn, config,
        configs, checkpoint_dir=checkpoint_dir, resume=resume, progress=progress,
        mixed_precision=mixed_precision)
    return TrainResult(model=model, history=history, steps=step,
                       reached_target=_reached(history.itertuples(index=False), config))


def _reached(history, config: TrainConfig) -> bool:
    """Whether the last evaluation reached the target (and, with ``n_confirm``, was
    confirmed at the same step)."""
    if config.target_accuracy is None:
        return False
    last = {}
    for step, m, v in history:
        if m in ("test_accuracy", CONFIRM_METRIC):
            last[m] = (step, v)
    if "test_accuracy" not in last or last["test_accuracy"][1] < config.target_accuracy:
        return False
    if config.n_confirm is None:
        return True
    confirm = last.get(CONFIRM_METRIC)
    return (confirm is not None and confirm[0] == last["test_accuracy"][0]
            and confirm[1] >= config.target_accuracy)


@_with_grad
def fit(
    model,
    next_batch: Callable[[torch.Generator], object],
    loss_fn: Callable[[object, object], Tensor],
    evaluate_fn: Callable[[object], dict[str, float]],
    config: TrainConfig,
    configs: dict,
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    progress: bool = True,
    snapshot_steps: Sequence[int] = (),
    desc: str = "train",
    mixed_precision: str | None = None,
) -> tuple[pd.DataFrame, int]:
    """The training loop shared by task training and the zoo: AdamW, resumable, seeded.

    Runs on the model's device: each batch (drawn on CPU from the seeded generator, so
    the same batches on every device) is moved there before ``loss_fn``.

    Args:
        model: the model to train in place.
        next_batch: draws a batch from the seeded generator (its state is checkpointed,
            so a resumed run sees the same batches).
        loss_fn: ``(model, batch) -> scalar loss``.
        evaluate_fn: ``model -> {metric: value}``, run every ``config.eval_every`` steps.
        config: optimization settings; stops early at ``target_accuracy`` on the
            ``test_accuracy`` metric when set.
        configs: JSON-able dict recorded in every checkpoint and compared on resume.
        checkpoint_dir: where ``step_*`` folders go (None: no checkpoints).
        progress: a tqdm bar on stderr, and at each evaluation a line on stdout with the
            metrics, the wall time since training started in this process and the
            seconds per step (wall time, evaluations included).
        snapshot_steps: steps (0 = init) at which weights alone are also kept, under
            ``checkpoint_dir/snapshots/step_XXXXXXX.safetensors``, for training dynamics.
        mixed_precision: None: float32 throughout (the default, and the only choice on
            CPU). ``"bf16"``: the forward pass and loss under ``torch.autocast("cuda",
            torch.bfloat16)``; weights, gradients and AdamW state stay float32. Off by
            default because it changes the numbers (docs/scale.md); it is recorded in the
            checkpoints and a resume with another setting is refused.

    Returns:
        ``(history, steps)``: tidy ``step, metric, value`` DataFrame and steps taken.

    Runs with ``torch.use_deterministic_algorithms(True, warn_only=True)`` (restored
    afterwards): on CPU with several threads, the embedding backward otherwise sums in
    a thread-dependent order, and training amplifies the rounding into different runs.

    Raises:
        ValueError: if a checkpoint to resume was written with different ``configs`` or
            ``mixed_precision``; ``mixed_precision`` other than None/"bf16", or "bf16" on a
            model that is not on CUDA.
    """
    autocast = _autocast(mixed_precision, model_device(model))
    if mixed_precision is not None:
        configs = {**configs, "mixed_precision": mixed_precision}
    # One writer per checkpoint folder: a second run into it is refused (io.FolderInUse).
    lock = folder_lock(checkpoint_dir) if checkpoint_dir is not None else contextlib.nullcontext()
    with _deterministic_algorithms(), lock:
        return _fit(model, next_batch, loss_fn, evaluate_fn, config, configs, checkpoint_dir,
                    resume, progress, snapshot_steps, desc, autocast)


MIXED_PRECISION = (None, "bf16")


def _autocast(mixed_precision: str | None, device: torch.device):
    """A factory of the autocast context for one training step."""
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {mixed_precision!r}")
    if mixed_precision is None:
        return contextlib.nullcontext
    if device.type != "cuda":
        raise ValueError(f"mixed_precision='bf16' is for CUDA models; this model is on {device} "
                         "(use mixed_precision=None)")
    return lambda: torch.autocast("cuda", dtype=torch.bfloat16)


@contextlib.contextmanager
def _deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn, not fail, on CUDA
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _fit(
    model,
    next_batch: Callable[[torch.Generator], object],
    loss_fn: Callable[[object, object], Tensor],
    evaluate_fn: Callable[[object], dict[str, float]],
    config: TrainConfig,
    configs: dict,
    checkpoint_dir: str | Path | None = None,
    resume: bool = True,
    progress: bool = True,
    snapshot_steps: Sequence[int] = (),
    desc: str = "train",
    autocast=contextlib.nullcontext,
) -> tuple[pd.DataFrame, int]:
    device = model_device(model)

    def batch_on_device(gen: torch.Generator):
        return to_device(next_batch(gen), device)

    def loss_in_precision(m, batch):
        if autocast is contextlib.nullcontext:  # float32: exactly the plain call
            return loss_fn(m, batch)
        with autocast():
            return loss_fn(m, batch).float()

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    gen = torch.Generator().manual_seed(config.seed)
    history: list[tuple[int, str, float]] = []
    step = 0

    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt_dir is not None:
        # Writes killed mid-way (we hold the folder's lock, so none is running).
        clean_temporaries(ckpt_dir)
        clean_temporaries(ckpt_dir / "snapshots")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # A snapshot is written only when training passes its step: if one is damaged or
    # missing, resume from before it, so it is written again.
    before = min((s for s in snapshot_steps if ckpt_dir is not None
                  and not _snapshot_whole(ckpt_dir / "snapshots" / f"step_{s:07d}.safetensors")),
                 default=None)
    loaded = (_resume_state(ckpt_dir, configs, shapes, before)
              if (ckpt_dir is not None and resume) else None)
    last_saved = None
    if loaded is not None:
        last_saved, weights, state = loaded
        if progress:
            tqdm.write(f"[posinterp] resuming from {last_saved} (step {state['step']})")
        model.load_state_dict(weights, strict=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        gen.set_state(state["rng"])
        history = list(state["history"])
        step = state["step"]

    snapshots = set(snapshot_steps)

    def snapshot(at: int) -> None:
        if ckpt_dir is not None and at in snapshots:
            _save_weights(ckpt_dir / "snapshots" / f"step_{at:07d}.safetensors", model)

    if step == 0:
        snapshot(0)
    model.train()
    bar = tqdm(total=config.max_steps, initial=step, disable=not progress, desc=desc,
               dynamic_ncols=True, bar_format=_bar_format(config))
    try:
        step, last_saved = _loop(model, batch_on_device, loss_in_precision, evaluate_fn, config,
                                 configs, ckpt_dir, snapshot, params, optimizer, scheduler, gen,
                                 history, step, last_saved, bar)
        if step < config.max_steps:  # stopped early: close the bar where the run ended
            bar.total = step
            bar.bar_format = ("{desc}: " + f"target reached at step {step} (cap {config.max_steps})"
                              + " [{elapsed}{postfix}]")
            bar.refresh()
    finally:
        bar.close()
    model.eval()
    return pd.DataFrame(history, columns=["step", "metric", "value"]), step


def _bar_format(config: TrainConfig) -> str | None:
    """tqdm's layout: with a target accuracy the step count is a cap the run usually stops
    well before, so the bar shows the step and the cap, never a percentage or an ETA to
    the cap; without one, tqdm's own (the run goes to the cap)."""
    if config.target_accuracy is None:
        return None
    return ("{desc}: step {n_fmt} (cap {total_fmt}; stops at test_accuracy >= "
            f"{config.target_accuracy:g})" + " [{elapsed}, {rate_fmt}{postfix}]")


def _loop(model, next_batch, loss_fn, evaluate_fn, config, configs, ckpt_dir, snapshot, params,
          optimizer, scheduler, gen, history, step, last_saved, bar):
    """The optimizer loop; returns ``(step, last checkpoint)``. ``step`` counts completed steps."""
    last_time = time.monotonic()
    clock = (last_time, step)  # this session's start: a resumed run times its own steps
    try:
        while step < config.max_steps and not _reached(history, config):
            step, last_saved, last_time = _step(
                model, next_batch, loss_fn, evaluate_fn, config, configs, ckpt_dir, snapshot,
                params, optimizer, scheduler, gen, history, step, last_saved, last_time, bar,
                clock)
    except KeyboardInterrupt:
        raise TrainingInterrupted(step, last_saved) from None
    return step, last_saved


def _step(model, next_batch, loss_fn, evaluate_fn, config, configs, ckpt_dir, snapshot, params,
          optimizer, scheduler, gen, history, step, last_saved, last_time, bar, clock):
    """One optimizer step, its evaluation and its checkpoint."""
    loss = loss_fn(model, next_batch(gen))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    clip_grad_norm(params, config.grad_clip)
    optimizer.step()
    scheduler.step()
    step += 1
    history.append((step, "train_loss", loss.item()))
    if step % config.eval_every == 0 or step == config.max_steps:
        metrics = evaluate_fn(model)
        history.extend((step, k, v) for k, v in metrics.items())
        bar.set_postfix(loss=f"{loss.item():.3f}",
                        **{k: f"{v:.3f}" for k, v in metrics.items()})
        if not bar.disable:
            tqdm.write(_eval_line(step, config.max_steps, loss.item(), metrics, clock))
        model.train()
    snapshot(step)
    due = (config.checkpoint_seconds is not None
           and time.monotonic() - last_time >= config.checkpoint_seconds)
    if ckpt_dir is not None and (step % config.checkpoint_every == 0 or due
                                 or _reached(history, config) or step == config.max_steps):
        last_saved = _save(ckpt_dir, step, model, optimizer, scheduler, gen, history, configs,
                           config.keep_checkpoints, last_saved)
        last_time = time.monotonic()
    bar.update(1)
    return step, last_saved, last_time


def _eval_line(step: int, cap: int, loss: float, metrics: dict[str, float],
               clock: tuple[float, int]) -> str:
    """The line printed at each evaluation: metrics, wall time and seconds per step.

    A log without the bar (CI, a file) still shows the run's pace, and how far the
    step count and accuracy are from another machine's: training is deterministic per
    CPU, not across CPUs (float32 kernels round differently), so the step at which a
    target is reached can differ. ``clock`` is ``(monotonic time, step)`` when this
    process started training; a resumed run times only its own steps."""
    start, first = clock
    seconds = time.monotonic() - start
    since = f" since resuming at step {first}" if first else ""
    shown = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
    return (f"[posinterp] step {step} (cap {cap}): loss {loss:.3f}, {shown}; "
            f"{seconds:.1f} s elapsed{since}, {seconds / max(1, step - first):.3f} s/step")


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (L2, the same coefficient max_norm / (norm +
    1e-6), at most 1) with the total norm accumulated in float64.

    The float32 total norm depends on the order and memory layout of the parameters, and
    TransformerLens 3.9 and 4 store the same weights in different orders and layouts
    (``W_Q`` ``[head, d_model, d_head]`` vs ``q.weight`` ``[head * d_head, d_model]``): one
    ulp in the coefficient, amplified by training, gave a different model from the same
    seed (docs/tl4.md, "Training"). In float64 the rounding stays far below float32's.

    Returns:
        the total norm (float64; float32 on devices without float64).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    total = torch.stack([g.detach().to(dtype).pow(2).sum() for g in grads]).sum().sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def _comparable(configs: dict) -> dict:
    out = json.loads(json.dumps(configs))
    for key in _CADENCE_FIELDS:
        out.get("train", {}).pop(key, None)
    if isinstance(out.get("task"), dict):
        # a checkpoint from before tasks had formats holds no "format": it was the default
        try:
            out["task"] = json.loads(json.dumps(TaskConfig.from_dict(out["task"]).to_dict()))
        except (TypeError, ValueError):
            pass  # compared as written: it differs, and the refusal names both
    return out


def _resume_state(ckpt_dir: Path, configs: dict, shapes: dict[str, tuple],
                  before: int | None = None):
    """``(folder, weights, trainer state)`` of the newest undamaged checkpoint, or None.

    Every ``step_*`` folder, newest first, goes through :func:`check_checkpoint`; a damaged
    one (a missing, unreadable or changed file, non-finite weights, weights of another
    shape) is moved aside to ``broken-step_*`` (kept, never deleted) and the next older
    one is tried. One warning names each damaged folder, where it went, and the
    checkpoint the run resumes from (or that it starts again from step 0). With
    ``before``, only checkpoints of earlier steps are resumed from (the later ones stay:
    training writes the same ones again).

    Raises:
        ValueError: if a checkpoint was written with different configs or under another
            TransformerLens major version (not damage: the folder belongs to another run).
    """
    folders = sorted((p for p in ckpt_dir.glob("step_*") if p.is_dir()
                      and (before is None or _step_of(p) is None or _step_of(p) < before)),
                     reverse=True) if ckpt_dir.is_dir() else []
    damaged, found = [], None
    for folder in folders:
        try:
            saved, weights, state = check_checkpoint(folder, read_state=True)
            check_tl_major(saved.get("versions"), f"checkpoint {folder}", resume=True)
            _compare_configs(folder, saved, configs)
            got = {k: tuple(v.shape) for k, v in weights.items()}
            if got != shapes:
                diff = sorted(set(got.items()) ^ set(shapes.items()))[:3]
                raise CheckpointDamaged(folder, f"{folder / 'model.safetensors'} holds weights "
                                        f"of other names or shapes than its config's model "
                                        f"(e.g. {diff})")
        except CheckpointDamaged as err:
            # Moved aside (not deleted: it is the user's file), so the resumed run writes
            # this step again and later resumes never trip over it.
            damaged.append((err, set_aside(folder)))
            continue
        found = folder, weights, state
        break
    if damaged:
        then = (f"resuming from {found[0]} (step {found[2]['step']})" if found else
                f"no undamaged checkpoint is left in {ckpt_dir}: training starts again "
                "from step 0")
        for err, aside in damaged:
            warnings.warn(f"{err}; moved it to {aside}; {then}", stacklevel=4)
    return found


def _compare_configs(folder: Path, saved: dict, configs: dict) -> None:
    now, before = _comparable(configs), _comparable(saved)
    # mixed_precision is absent when off (so older checkpoints compare equal): check both ways.
    for key in [*now, *(["mixed_precision"] if "mixed_precision" in before.keys() - now.keys()
                        else [])]:
        if before.get(key) != now.get(key):
            raise ValueError(
                f"checkpoint {folder} was written with a different {key} config; "
                f"use another checkpoint_dir or resume=False.\n saved: {before.get(key)}\n"
                f" now:   {now.get(key)}")
