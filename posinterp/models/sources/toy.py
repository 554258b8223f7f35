"""posinterp's own models: toy-model checkpoint folders written by :func:`posinterp.train`
(or a folder holding their ``checkpoints/step_*``) and trained zoo models
``zoo:<pe>[:<seed>][@<step>]``; weights as trained, unprocessed, built in float32.
"""

from __future__ import annotations

from pathlib import Path

from ..info import ModelInfo
from ..positions import alibi_slopes


def load_toy(spec: str, processing: dict, dtype=None, revision=None):
    """:func:`posinterp.load_model`'s entry for a toy checkpoint folder (see :func:`_is_toy_checkpoint`)."""
    return _load_toy(Path(spec).expanduser())


def load_zoo(spec: str, processing: dict, dtype=None, revision=None):
    """:func:`posinterp.load_model`'s entry for a zoo spec (:func:`posinterp.specs.parse_zoo_spec`)."""
    return _load_zoo(spec)


def _load_zoo(spec: str):
    from ..zoo_store import load_zoo_model

    model, card = load_zoo_model(spec, device="cpu")  # load_model moves it
    return model, ModelInfo.from_model(
        model, spec=spec, source="zoo", pe=card["pe"], architecture="posinterp-toy",
        alibi_slopes=alibi_slopes(model.cfg.n_heads).tolist() if card["pe"] == "alibi" else None,
        processing={"fold_ln": False, "center_writing_weights": False, "center_unembed": False,
                    "fold_value_biases": False},
        weights={"path": card["weights"], "corpus": card["corpus"]["fingerprint"]})



def _is_toy_checkpoint(path: Path) -> bool:
    """A folder written by :func:`posinterp.train` (or holding ``checkpoints/step_*`` of one)."""
    from ..checkpoints import latest_checkpoint

    if (path / "trainer_state.pt").is_file() and (path / "model.safetensors").is_file():
        return True
    return (path / "checkpoints").is_dir() and latest_checkpoint(path / "checkpoints") is not None


def _load_toy(path: Path):
    from ..checkpoints import latest_checkpoint, load_checkpoint

    folder = path if (path / "trainer_state.pt").is_file() else latest_checkpoint(path / "checkpoints")
    model, configs = load_checkpoint(folder, device="cpu")  # load_model moves it
    pe = configs["model"]["pe"]
    return model, ModelInfo.from_model(
        model, spec=str(path), source="toy", pe=pe, architecture="posinterp-toy",
        alibi_slopes=alibi_slopes(model.cfg.n_heads).tolist() if pe == "alibi" else None,
        processing={"fold_ln": False, "center_writing_weights": False, "center_unembed": False,
                    "fold_value_biases": False},
        weights={"path": str(folder.resolve()), "step": configs.get("step")})

