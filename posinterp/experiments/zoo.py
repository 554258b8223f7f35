"""The zoo: small byte-level LMs identical except for their positional scheme.

Pretrained models differ in data, size and tokenizer as well as in positions; the
clean comparison trains them ourselves. Each zoo model is a toy ``HookedTransformer``
(:func:`posinterp.build_model`) with one ``pe`` in {nope, absolute, rotary, alibi}, the
same initialization of every shared weight, the same data (the standard-library
corpus), the same batch order (from the seed) and the same step budget.

Layout under ``$POSINTERP_HOME/zoo`` (default ``~/.cache/posinterp/zoo``)::

    rotary-seed0/
        checkpoints/step_0002000/...     resumable training state (latest 2 kept)
        checkpoints/snapshots/step_*.safetensors   ~10 log-spaced weight snapshots
        card.json                        written last: the model is complete
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from .._validate import require_at_least
from ..analysis.heads import previous_token_scores, random_tokens
from ..devices import model_device
from ..executors import Cell, Executor, LocalExecutor, gpus_for, run_cells
from ..io import check_out_dir, versions
from ..models.toy import PE_SCHEMES, ToyModelConfig, build_model
from ..specs import parse_zoo_spec, zoo_home
from ..specs import zoo_model_dir as _model_dir
from ..tasks.corpus import ByteCorpus, stdlib_corpus
from ..training import (
    TrainConfig,
    _weights_problem,
    check_checkpoint,
    fit,
    latest_checkpoint,
    load_weights,
)

__all__ = ["FAMILIES", "FAMILY_SETS", "FamilySet", "ZooConfig", "ZooFamily", "check_zoo_model",
           "family_set", "list_zoo", "load_zoo_model", "train_zoo", "zoo_family", "zoo_home"]


@dataclass(frozen=True)
class ZooConfig:
    """Architecture and budget shared by every zoo model (only ``pe`` and seed vary).

    The default (4 layers, d_model 128, 2,000 steps of 32 x 128 bytes) takes about
    10 minutes per model on 2 CPU cores.

    Raises:
        ValueError: for an unknown scheme or non-positive sizes.
    """

    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_ctx: int = 128
    batch_size: int = 32
    max_steps: int = 2000
    lr: float = 1e-3
    warmup_steps: int = 100
    eval_every: int = 200
    n_val_windows: int = 64
    n_snapshots: int = 10
    schemes: tuple[str, ...] = field(default=tuple(PE_SCHEMES))
    weight_decay: float = 0.1
    data_part: tuple[int, int] | None = None
    # explicit snapshot steps (dense through a window, for the training dynamics); None:
    # ``n_snapshots`` log-spaced ones
    snapshot_grid: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "schemes", tuple(self.schemes))
        bad = [s for s in self.schemes if s not in PE_SCHEMES]
        if bad:
            raise ValueError(f"schemes must be among {sorted(PE_SCHEMES)}, got {bad}")
        require_at_least(self, ("n_layers", "d_model", "n_heads", "n_ctx", "batch_size",
                                "max_steps", "n_val_windows", "n_snapshots"))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads "
                             f"({self.n_heads})")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.data_part is not None:
            part = tuple(self.data_part)
            if not (len(part) == 2 and 0 <= part[0] < part[1]):
                raise ValueError(f"data_part must be (i, n) with 0 <= i < n or None, got {part!r}")
            object.__setattr__(self, "data_part", part)
        if self.snapshot_grid is not None:
            grid = tuple(int(s) for s in self.snapshot_grid)
            if not grid or list(grid) != sorted(set(grid)) or grid[0] < 0 \
                    or grid[-1] > self.max_steps:
                raise ValueError(f"snapshot_grid must be strictly increasing steps in [0, "
                                 f"max_steps={self.max_steps}] or None, got {self.snapshot_grid!r}")
            object.__setattr__(self, "snapshot_grid", grid)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def model_config(self, pe: str, seed: int) -> ToyModelConfig:
        return ToyModelConfig(pe=pe, n_layers=self.n_layers, d_model=self.d_model,
                              n_heads=self.n_heads, n_ctx=self.n_ctx, tokenizer="byte", seed=seed)

    def train_config(self, seed: int) -> TrainConfig:
        return TrainConfig(max_steps=self.max_steps, batch_size=self.batch_size, lr=self.lr,
                           weight_decay=self.weight_decay, warmup_steps=self.warmup_steps,
                           eval_every=self.eval_every, target_accuracy=None,
                           checkpoint_every=250, seed=seed)

    def to_dict(self) -> dict:
        """The config as recorded in checkpoints and cards. Fields added later are left out
        at their defaults, so a model trained before they existed still resumes."""
        d = asdict(self)
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        if d.get("data_part") is not None:
            d["data_part"] = list(d["data_part"])
        if d.get("snapshot_grid") is not None:
            d["snapshot_grid"] = list(d["snapshot_grid"])
        return d

    def snapshot_steps(self) -> list[int]:
        """``snapshot_grid`` when set, else 0 (init) plus ``n_snapshots`` log-spaced steps
        up to ``max_steps``."""
        if self.snapshot_grid is not None:
            return list(self.snapshot_grid)
        steps = np.unique(np.geomspace(1, self.max_steps, self.n_snapshots).round().astype(int))
        return [0, *steps.tolist()]

    def corpus(self) -> ByteCorpus:
        """The training text: the standard-library corpus, or its part ``data_part``."""
        return stdlib_corpus(part=self.data_part)


_LATER_FIELDS = {"weight_decay": 0.1, "data_part": None, "snapshot_grid": None}


@dataclass(frozen=True)
class ZooFamily:
    """One family of the fingerprint zoo: an architecture, data and optimizer (``config``)
    trained under each positional scheme from one seed.

    A family x scheme is one independent unit of the fingerprint test
    (:func:`posinterp.analysis.fingerprint.unit_table`): families differ in depth, width,
    heads, data or optimizer, so their models share code but not design choices, and
    each family has its own seed, so no two families share an initialization.

    Raises:
        ValueError: for a name that is not a plain folder name or a negative seed.
    """

    name: str
    config: ZooConfig
    seed: int
    differs_in: str

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ValueError(f"family name must be letters, digits, '-' or '_', got {self.name!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def home(self, root: str | Path) -> Path:
        """The family's zoo folder under ``root`` (``<root>/<name>``)."""
        return Path(root) / self.name


def _family(name: str, seed: int, differs_in: str, **changes) -> ZooFamily:
    return ZooFamily(name, replace(FAMILY_BASE, **changes), seed, differs_in)


# Fixed before any family was trained (docs/reproductions/fingerprints.md, "Design"):
# small enough for ~2-4 min per model on one CPU thread, large enough that byte-level
# previous-token heads form (checked on `base` rotary with n_ctx 64 first: after 600
# steps its best head scores 0.49 on held-out text, 0.26 on random bytes, which it never
# saw). n_ctx 32 halves the cost on a machine shared by ~15 processes.
FAMILY_BASE = ZooConfig(n_layers=2, d_model=64, n_heads=4, n_ctx=32, batch_size=16,
                        max_steps=800, lr=1e-3, warmup_steps=50, eval_every=200,
                        n_val_windows=32, n_snapshots=6)
FAMILIES: dict[str, ZooFamily] = {f.name: f for f in [
    _family("base", 100, "reference: 2 layers, d_model 64, 4 heads, all data, AdamW lr 1e-3"),
    _family("heads8", 101, "heads: 8 heads of d_head 8", n_heads=8),
    _family("deep", 102, "depth: 3 layers", n_layers=3),
    _family("wide", 103, "width: d_model 96 (d_head 24)", d_model=96),
    _family("halfdata-lr", 104, "data and optimizer: half the library (part 1 of 2), "
            "lr 3e-3, no weight decay, batch 24", data_part=(1, 2), lr=3e-3, weight_decay=0.0,
            batch_size=24),
]}




@dataclass(frozen=True)
class FamilySet:
    """One design of the fingerprint zoo: its families, the folder its models and tables
    go to (``<root>/<folder>``, ``<out>/<folder>``) and why it exists.

    A set is fixed before its models are trained; a later set is a new design with its
    own folder, so an earlier design's models, tables and page section stay as they were.
    """

    name: str
    families: dict[str, ZooFamily]
    folder: str
    why: str


# Design 2 (fixed 2026-12-01 18:10 UTC, before any of its models trained): design 1's
# families with only the step budget tripled, built as replace(config, max_steps=...), so
# the configs recorded in its cards are exactly those of /work/runs-fplong/train_long.py.
DESIGN2_STEPS = 2400
FAMILY_SETS: dict[str, FamilySet] = {
    "design1": FamilySet("design1", FAMILIES, "families", "the design fixed before any "
                         "family was trained (800 steps per model)"),
    "design2": FamilySet(
        "design2",
        {n: replace(f, config=replace(f.config, max_steps=DESIGN2_STEPS))
         for n, f in FAMILIES.items()},
        "families-design2",
        "fixed after design 1's outcome and before any of its models trained: in design 1, "
        "7 of the 10 absolute and ALiBi units had no previous-token head (best score below "
        "the threshold 0.3), leaving fewer units than designed; design 2 changes only the "
        f"training length (max_steps 800 -> {DESIGN2_STEPS}, 3x), every other choice "
        "(families, seeds, data, threshold, ranking text, k, measure, test) as in design 1"),
}


def family_set(name: str = "design1") -> FamilySet:
    """The design called ``name`` (:data:`FAMILY_SETS`: ``design1``, ``design2``).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in FAMILY_SETS:
        raise ValueError(f"family_set must be one of {sorted(FAMILY_SETS)}, got {name!r}")
    return FAMILY_SETS[name]


def zoo_family(name: str, family_set_name: str = "design1") -> ZooFamily:
    """The family called ``name`` in the design ``family_set_name`` (:func:`family_set`;
    default design 1, :data:`FAMILIES`).

    Raises:
        ValueError: for an unknown family or design, listing the known ones.
    """
    families = family_set(family_set_name).families
    if name not in families:
        raise ValueError(f"family must be one of {sorted(families)}, got {name!r}")
    return families[name]


def _val_starts(corpus: ByteCorpus, cfg: ZooConfig) -> torch.Tensor:
    gen = torch.Generator().manual_seed(12345)
    return torch.randint(len(corpus.val) - cfg.n_ctx, (cfg.n_val_windows,), generator=gen)


@torch.no_grad()
def _val_loss(model, corpus: ByteCorpus, cfg: ZooConfig) -> dict[str, float]:
    model.eval()
    toks = corpus.windows("val", _val_starts(corpus, cfg), cfg.n_ctx).to(model_device(model))
    return {"val_loss": model(toks, return_type="loss").item()}


def _strongest_previous_token_heads(model, corpus: ByteCorpus, cfg: ZooConfig) -> dict:
    """Top head by the previous-token score on random bytes and on validation text."""
    out = {}
    inputs = {"random_tokens": random_tokens(model, 16, cfg.n_ctx, seed=0, bos=False),
              "natural_text": corpus.windows("val", _val_starts(corpus, cfg)[:16], cfg.n_ctx)}
    for name, toks in inputs.items():
        df = previous_token_scores(model, toks)
        top = df.loc[df.value.idxmax()]
        out[name] = {"layer": int(top.layer), "head": int(top["head"]), "score": float(top.value)}
    out["bos"] = "no BOS: windows of a byte stream; every query i >= 1 counts"
    return out


def train_zoo(config: ZooConfig = ZooConfig(), seeds: int = 1, home: str | Path | None = None,
              progress: bool = True, corpus: ByteCorpus | None = None,
              first_seed: int = 0, executor: Executor | None = None,
              threads: int = 1, device=None, only: tuple[str, ...] | None = None
              ) -> pd.DataFrame:
    """Train (or resume, or skip when done) every (scheme, seed) of the zoo on ``device``
    (:func:`posinterp.devices.resolve_device`; None: CUDA when available, else CPU).

    Each model is an independent cell (:mod:`posinterp.executors`): its folder is
    addressed by ``pe`` and seed, a finished one (with ``card.json``) is skipped, an
    unfinished one resumes from its last checkpoint. Seeds ``first_seed .. first_seed +
    seeds - 1`` are trained, so several processes can share the work (one seed range
    each). ``executor`` runs the models (default: one after another in this process);
    A model counts as done only when its card, its final checkpoint and its snapshots
    pass :func:`check_zoo_model`; a damaged one trains again from its last undamaged
    checkpoint (:func:`posinterp.training.fit`), to the same weights.
    Each trains with ``threads`` torch threads (and asks a scheduler for that many CPUs),
    so its weights depend on ``threads``, not on the executor. ``card.json`` is written
    by the driver once the model is trained; a model that fails is reported (with the
    others trained) by :class:`posinterp.executors.CellsFailed`.

    Args:
        corpus: the training text; default ``config.corpus()`` (the standard-library
            corpus or its ``data_part``), read by each cell itself (so it is not shipped
            to every worker).
        only: train only these of ``config.schemes`` (None: all). The models' recorded
            config stays ``config``, so a later run with another ``only`` resumes them.

    Returns:
        One row per model: ``pe, seed, val_loss, steps`` and the strongest
        previous-token head on random bytes and on natural text.

    Raises:
        ValueError: for ``seeds < 1``, ``first_seed < 0``, ``threads < 1``, ``only`` outside
            ``config.schemes`` or a folder trained with another config.
        posinterp.executors.CellsFailed: after the other models finished, if some failed.
    """
    if seeds < 1 or first_seed < 0:
        raise ValueError(f"need seeds >= 1 and first_seed >= 0, got {seeds}, {first_seed}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if only is not None and (not only or set(only) - set(config.schemes)):
        raise ValueError(f"only must name some of the config's schemes {config.schemes}, "
                         f"got {only!r}")
    home = check_out_dir(Path(home) if home is not None else zoo_home(), "home")
    in_process = executor is None or isinstance(executor, LocalExecutor)
    keys = [(pe, seed) for seed in range(first_seed, first_seed + seeds) for pe in config.schemes
            if only is None or pe in only]
    cells = [Cell(f"{_model_dir(Path(), pe, seed).name}/card", _train_model,
                  dict(config=config, pe=pe, seed=seed, home=home, corpus=corpus,
                       progress=progress and in_process, device=device),
                  num_cpus=threads, num_gpus=gpus_for(device)) for pe, seed in keys]
    # Locked per model (by its training), not per home: processes share a zoo by seed range.
    cards = run_cells(cells, home, executor, progress=progress and not in_process, desc="zoo",
                      seconds_file=None, verify=lambda cell, card: check_zoo_model(
                          _model_dir(home, card["pe"], card["seed"]), card), lock=False)
    rows = []
    for (pe, seed), card in zip(keys, cards.values(), strict=True):
        rows.append({"pe": pe, "seed": seed, "val_loss": card["val_loss"], "steps": card["steps"],
                     **{f"{k}_top": f"L{v['layer']}H{v['head']} {v['score']:.3f}"
                        for k, v in sorted(card["previous_token_heads"].items()) if k != "bos"}})
    return pd.DataFrame(rows)


def _train_model(config: ZooConfig, pe: str, seed: int, home: Path, corpus: ByteCorpus | None,
                 progress: bool, device=None) -> dict:
    """Train (or resume) one zoo model; return its card (the driver writes card.json)."""
    corpus = corpus or config.corpus()
    folder = _model_dir(home, pe, seed)
    model_cfg, train_cfg = config.model_config(pe, seed), config.train_config(seed)
    model = build_model(model_cfg, device=device)
    n_train = len(corpus.train) - config.n_ctx

    def next_batch(gen):
        starts = torch.randint(n_train, (config.batch_size,), generator=gen)
        return corpus.windows("train", starts, config.n_ctx)

    configs = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "zoo": config.to_dict(),
               "corpus": corpus.fingerprint}
    history, steps = fit(
        model, next_batch, lambda m, toks: m(toks, return_type="loss"),
        lambda m: _val_loss(m, corpus, config), train_cfg, configs,
        checkpoint_dir=folder / "checkpoints", progress=progress,
        snapshot_steps=config.snapshot_steps(), desc=f"zoo {pe} seed {seed}")
    return {
        "pe": pe, "seed": seed, "steps": steps, "val_loss": _val_loss(model, corpus, config)["val_loss"],
        "val_loss_unit": "nats per byte", "model": model_cfg.to_dict(), "train": train_cfg.to_dict(),
        "zoo": config.to_dict(), "snapshot_steps": config.snapshot_steps(),
        "corpus": {"fingerprint": corpus.fingerprint, **corpus.info},
        "previous_token_heads": _strongest_previous_token_heads(model, corpus, config),
        "history": history[history.metric == "val_loss"][["step", "value"]].values.tolist(),
        "versions": versions(),
    }


def check_zoo_model(folder: Path, card: dict) -> Path:
    """Check that a finished zoo model's weights are whole; return its final checkpoint.

    The final checkpoint must pass :func:`posinterp.training.check_checkpoint` (hashes,
    readable, finite weights) at the card's step, and every snapshot up to it must read
    back with finite weights.

    Raises:
        ValueError: naming the folder or file that is missing or damaged.
    """
    folder = Path(folder)
    last = latest_checkpoint(folder / "checkpoints")
    if last is None:
        raise ValueError(f"{folder} has a card but no checkpoint")
    configs, _, _ = check_checkpoint(last)
    if configs.get("step") != card["steps"]:
        raise ValueError(f"{last} is at step {configs.get('step')}, the card says {card['steps']}")
    for step in card.get("snapshot_steps", []):
        path = folder / "checkpoints" / "snapshots" / f"step_{step:07d}.safetensors"
        if step <= card["steps"]:
            problem = "missing" if not path.exists() else _weights_problem(path)
            if problem:
                raise ValueError(f"snapshot {path} is damaged ({problem})")
    return last


def list_zoo(home: str | Path | None = None) -> pd.DataFrame:
    """What the zoo holds: one row per model folder, finished or not."""
    home = Path(home) if home is not None else zoo_home()
    rows = []
    for folder in sorted(home.glob("*-seed*")) if home.is_dir() else []:
        card = folder / "card.json"
        try:
            c = json.loads(card.read_text()) if card.exists() else None
        except ValueError:  # `zoo train` sets it aside and trains the model again
            rows.append({"name": folder.name, "pe": folder.name.rsplit("-seed", 1)[0],
                         "seed": int(folder.name.rsplit("-seed", 1)[1]), "status": "damaged",
                         "steps": 0, "val_loss": float("nan")})
            continue
        if c is not None:
            rows.append({"name": folder.name, "pe": c["pe"], "seed": c["seed"], "status": "done",
                         "steps": c["steps"], "val_loss": c["val_loss"]})
        else:
            last = latest_checkpoint(folder / "checkpoints")
            step = int(last.name.split("_")[1]) if last else 0
            pe, seed = folder.name.rsplit("-seed", 1)
            rows.append({"name": folder.name, "pe": pe, "seed": int(seed), "status": "partial",
                         "steps": step, "val_loss": float("nan")})
    return pd.DataFrame(rows, columns=["name", "pe", "seed", "status", "steps", "val_loss"])


def load_zoo_model(spec: str, home: str | Path | None = None, device=None):
    """Load ``zoo:<pe>[:<seed>][@<step>]`` (default seed 0, final weights) onto ``device``
    (:func:`posinterp.devices.resolve_device`; None: CUDA when available, else CPU).

    Returns:
        ``(model, card)``.

    Raises:
        ValueError: for a malformed spec or unknown scheme, or damaged weights
            (:func:`check_zoo_model`; named, with how to repair them).
        FileNotFoundError: if that model (or snapshot) has not been trained.
    """
    from safetensors.torch import load_file

    zoo = parse_zoo_spec(spec)
    home = Path(home) if home is not None else zoo_home()
    folder = _model_dir(home, zoo.pe, zoo.seed)
    card_path = folder / "card.json"
    if not card_path.exists():
        raise FileNotFoundError(f"{folder} holds no finished zoo model (no card.json); "
                                "run `posinterp zoo train` first")
    card = json.loads(card_path.read_text())
    model = build_model(ToyModelConfig.from_dict(card["model"]), device=device)
    repair = "rerun `posinterp zoo train` with the same options to train it again"
    if zoo.step is not None:
        weights = folder / "checkpoints" / "snapshots" / f"step_{zoo.step:07d}.safetensors"
        if not weights.exists():
            raise FileNotFoundError(f"no snapshot {weights}; snapshots: {card['snapshot_steps']}")
        problem = _weights_problem(weights)
        if problem:
            raise ValueError(f"snapshot {weights} is damaged ({problem}); {repair}")
    else:
        try:
            weights = check_zoo_model(folder, card) / "model.safetensors"
        except ValueError as err:
            raise ValueError(f"{err}; {repair}") from None
    # TL 3.9 weights convert on TL 4; other mismatches are refused by name (load_weights)
    load_weights(model, load_file(weights), card.get("versions"), f"zoo model {folder}")
    model.eval()
    return model, {**card, "weights": str(weights)}
