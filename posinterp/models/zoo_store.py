"""Reading finished zoo models: ``zoo:<pe>[:<seed>][@<step>]`` -> a checked toy model.

The zoo (:mod:`posinterp.experiments.zoo`) trains them; this module is the models layer's
half: it checks a finished model's card, final checkpoint and snapshots
(:func:`check_zoo_model`) and loads one (:func:`load_zoo_model`), so loaders never
import the experiments that write them. Layout under ``$POSINTERP_HOME/zoo``::

    rotary-seed0/
        checkpoints/step_0002000/...     resumable training state (latest 2 kept)
        checkpoints/snapshots/step_*.safetensors   ~10 log-spaced weight snapshots
        card.json                        written last: the model is complete
"""

from __future__ import annotations

import json
from pathlib import Path

from ..specs import parse_zoo_spec, zoo_home
from ..specs import zoo_model_dir as _model_dir
from .checkpoints import _weights_problem, check_checkpoint, latest_checkpoint, load_weights
from .toy import ToyModelConfig, build_model

__all__ = ["check_zoo_model", "load_zoo_model"]


def check_zoo_model(folder: Path, card: dict) -> Path:
    """Check that a finished zoo model's weights are whole; return its final checkpoint.

    The final checkpoint must pass :func:`posinterp.models.checkpoints.check_checkpoint` (hashes,
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
