"""A local Hugging Face checkpoint folder, loaded offline and checked against HF's own model.

The folder's ``config.json`` is read and refused by name where TL would drop a setting
(:mod:`posinterp.models.hf_config`); HF's own model of the folder is loaded with
``output_loading_info`` and a weight the architecture needs that the files lack is refused
by name (:func:`_hf_expected`); then the TL model is built (TL 3.9: TL's converters through
a neutrally named view of the folder, :func:`_tl3_builder`; TL 4: ``boot_transformers``,
:func:`_bridge_builder`) and its log-probs are checked against HF's in the same dtype
(:func:`_build_checked`, within :data:`PROCESSING_TOL` or :data:`HALF_TOL_FACTOR` x HF's own
rounding). The hub and GGUF sources end here too, on a snapshot or a converted folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..hf_config import hf_rotary_inv_freq, tl_overrides
from ..info import ModelInfo, scheme_for_architecture
from ..positions import alibi_slopes, install_alibi, install_rotary
from .common import _offline, _processing_done, _quiet_handled, _read_config, _refuse_mla
from .hf_files import checkpoint_files, refuse_incomplete


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

PROCESSING_TOL = 1e-4
# The loaded model may differ from HF in the same dtype by this many times HF's own rounding
# in that dtype (half: half vs float32; float32, past PROCESSING_TOL: float32 vs float64).
# Two computations in one dtype that each stray from the exact function by about that much
# differ by up to about twice it; TL's other order of operations adds about as much again
# (measured: at most 1.95x on tiny GPT-2 and Llama checkpoints in bf16 and fp16; 0.82x for
# SmolLM2-135M in float32 on TL 3.9, whose 30 layers round by 1.25e-4 nats, docs/models.md).
HALF_TOL_FACTOR = 4.0

@dataclass(frozen=True)
class _Expected:
    """HF's own log-probs on the load-time probe batch (float32 and in ``dtype``)."""

    folder: Path
    tokens: object
    log_probs32: object
    log_probs: object
    dtype: object
    tolerance: float
    hf_half_vs_float32: float | None

def _probe_tokens(d_vocab: int, n_ctx: int):
    """2 seeded random sequences of min(32, n_ctx) tokens: the load-time probe batch."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, d_vocab, (2, min(32, n_ctx)), generator=gen)

def _hf_expected(folder: Path, architecture: str, dtype, n_ctx: int) -> tuple[_Expected, list]:
    """Load HF's model of ``folder`` (float32, eager, offline), refuse missing weights, and
    run it on the probe batch in float32 and, for half precision, in ``dtype``.

    Returns:
        the expectation and the checkpoint's unexpected keys (weights the architecture
        does not use; recorded, not refused).

    Raises:
        IncompleteCheckpointError: weights the architecture needs that the files lack
            (transformers' ``missing_keys``) or of another shape (``mismatched_keys``).
        ValueError: the files cannot be read.
    """
    import torch
    import transformers

    with _offline():
        try:
            reference, loading = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, dtype=torch.float32,
                attn_implementation="eager", output_loading_info=True)
        except Exception as err:  # safetensors, torch and HF each raise their own types
            raise ValueError(f"could not read the weights in {folder}: "
                             f"{type(err).__name__}: {err}") from None
    # TL 3.9 sets the transformers logger to ERROR, hiding transformers' own report of
    # these; HF fills them with random values, so an HF-based check alone cannot see them.
    refuse_incomplete(folder, loading, architecture)
    reference.eval()
    tokens = _probe_tokens(reference.get_input_embeddings().num_embeddings, n_ctx)
    with torch.no_grad():
        want32 = want = reference(tokens).logits.double().log_softmax(-1)
        noise = None
        if dtype not in (torch.float32, torch.float64):
            want = reference.to(dtype)(tokens).logits.double().log_softmax(-1)
            noise = float((want - want32).abs().max())
    tol = PROCESSING_TOL if noise is None else max(PROCESSING_TOL, HALF_TOL_FACTOR * noise)
    del reference
    return (_Expected(folder, tokens, want32, want, dtype, tol, noise),
            sorted(loading.get("unexpected_keys") or ()))

def _hf_float32_rounding(expected: _Expected) -> float:
    """HF's own float32-vs-float64 difference on the probe batch (nats): how far float32
    rounding alone moves this model's log-probabilities. Loads HF's model of the folder in
    float64 (twice the float32 reference's memory), so it is only asked for when a float32
    model misses ``PROCESSING_TOL``."""
    import torch
    import transformers

    with _offline():
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(expected.folder), local_files_only=True, dtype=torch.float64,
            attn_implementation="eager").eval()
    with torch.no_grad():
        want64 = reference(expected.tokens).logits.log_softmax(-1)
    del reference
    return float((want64 - expected.log_probs32).abs().max())

def _hf_difference(model, tokens, want) -> float:
    """Max |log-prob difference| (nats) between ``model`` and HF's ``want`` on ``tokens``."""
    import torch

    with torch.no_grad():
        got = model(tokens).double().log_softmax(-1)
    return float((got - want).abs().max())

def _build_checked(build, processing: dict, expected: _Expected, architecture: str):
    """``build(processing, dtype)`` checked against HF; where TL's weight processing is what
    differs, the unprocessed model instead (with a warning); else a refusal saying what.

    Folding and centering preserve log-probabilities in exact arithmetic, so a processed
    model that misses HF's while the unprocessed one matches them is TL's processing at
    fault (TL 3.9 and 4.3 fold a square MLP, d_mlp == d_model, along the wrong axis; TL 4.3
    on GPT-NeoX). Processing is checked in float32 even for a half-precision load (in bf16
    its errors would hide in the rounding), at 1e-4 nats, or, for a model whose float32
    run alone rounds by more (deep models: SmolLM2-135M rounds by 1.25e-4),
    ``HALF_TOL_FACTOR`` x HF's own float32-vs-float64 difference
    (:func:`_hf_float32_rounding`, computed only when 1e-4 is missed). The model in
    ``expected.dtype`` is then checked against HF in that dtype, within
    ``expected.tolerance`` (half precision) or that float32 tolerance.

    Returns:
        ``(model, extra, hf_check)``: ``extra`` as ``build`` returned it for that model.

    Raises:
        UnsupportedConfigError: the model differs from HF even unprocessed; the message says
            whether a config setting or precision explains it, and the way out.
    """
    import torch

    from ..backend.version import TL_VERSION
    from ..hf_config import UnsupportedConfigError

    half = expected.hf_half_vs_float32 is not None
    name = str(expected.dtype).replace("torch.", "")
    record = {"dtype": name, "tolerance": expected.tolerance,
              "hf_half_vs_float32": expected.hf_half_vs_float32}

    def float32_tolerance(diff: float) -> float:
        if diff <= PROCESSING_TOL:
            return PROCESSING_TOL
        if "hf_float32_vs_float64" not in record:
            record["hf_float32_vs_float64"] = _hf_float32_rounding(expected)
        return max(PROCESSING_TOL, HALF_TOL_FACTOR * record["hf_float32_vs_float64"])

    flags = sorted(k for k, v in processing.items() if v)
    if flags or not half:
        model, extra = build(processing, torch.float32 if half else expected.dtype)
        processed_diff = _hf_difference(model, expected.tokens, expected.log_probs32)
        diff = processed_diff
        tol = processed_tol = float32_tolerance(processed_diff)
        if flags and not processed_diff <= processed_tol:  # NaN fails too
            del model
            processing = {k: False for k in processing}
            model, extra = build(processing, torch.float32 if half else expected.dtype)
            diff = _hf_difference(model, expected.tokens, expected.log_probs32)
            tol = float32_tolerance(diff)
            record["processing_reverted"] = (
                f"TransformerLens {TL_VERSION}'s weight processing ({', '.join(flags)}) moves "
                f"{architecture}'s log-probabilities by {processed_diff:.2e} nats (> "
                f"{processed_tol:.2g}; HF's own model of the checkpoint is the reference); "
                "loaded without it")
        if not diff <= tol:
            rounding = ("" if tol == PROCESSING_TOL else
                        f": {HALF_TOL_FACTOR:g} x HF's own float32-vs-float64 difference, "
                        f"{record['hf_float32_vs_float64']:.2e}")
            raise UnsupportedConfigError(
                f"{architecture}: the loaded model's log-probabilities differ from HF's "
                f"(float32) by {diff:.2e} nats (> {tol:.2g}{rounding}) on a probe batch"
                + (", with and without weight processing" if flags else "")
                + "; the checkpoint holds every weight, so a config setting is not honoured by "
                f"TransformerLens {TL_VERSION}. Refusing to run a different model (compare the "
                "config with docs/models.md)")
        if "processing_reverted" in record:
            # 6: _build_checked, _load_local_hf, the source's load, the dispatcher's two
            # frames, then load_model's caller
            warnings.warn(record["processing_reverted"] + " (recorded in ModelInfo.processing "
                          "and ModelInfo.hf_check)", UserWarning, stacklevel=6)
        if not half:
            return model, extra, {**record, "tolerance": tol, "max_abs_logprob_diff": diff}
        del model
    model, extra = build(processing, expected.dtype)
    diff = _hf_difference(model, expected.tokens, expected.log_probs)
    if not diff <= expected.tolerance:
        if flags:
            cause = (f"more than {HALF_TOL_FACTOR:g} x HF's own {name}-vs-float32 difference "
                     f"({expected.hf_half_vs_float32:.2e}). In float32 it matches HF, so this is "
                     f"precision: load with dtype=torch.float32")
        else:
            cause = (f"more than {HALF_TOL_FACTOR:g} x HF's own {name}-vs-float32 difference "
                     f"({expected.hf_half_vs_float32:.2e}): precision or a config setting. Load "
                     "with dtype=torch.float32 to tell them apart (if that loads, it is precision)")
        raise UnsupportedConfigError(
            f"{architecture}: the loaded model's log-probabilities differ from HF's ({name}) by "
            f"{diff:.2e} nats (> {expected.tolerance:.2g}) on a probe batch; {cause}")
    return model, extra, {**record, "max_abs_logprob_diff": diff}

def _load_local_hf(folder: Path, processing: dict, dtype):
    """A local HF checkpoint folder, offline, checked against HF's own model of it.

    Shared by both TL lines: read and refuse the config by name, refuse missing weights
    (:func:`_hf_expected`), build (TL 3.9: convert into a ``HookedTransformer``; TL 4:
    ``boot_transformers``), and check the log-probs against HF (:func:`_build_checked`).
    """
    import transformers

    from ..backend.version import by_line

    raw_cfg = _read_config(folder)
    architecture = raw_cfg["architectures"][0]
    _refuse_mla(raw_cfg, architecture)  # before the scheme lookup: say what it is
    pe = scheme_for_architecture(architecture)
    if architecture.startswith("Bert"):
        from .encoder import _load_bert

        return _load_bert(folder, str(folder), processing)
    files = checkpoint_files(folder)
    hf_config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    overrides = tl_overrides(architecture, hf_config, pe)  # refusals by name, on both lines
    expected, unexpected = _hf_expected(folder, architecture, dtype,
                                        overrides.get("n_ctx") or 32)
    build = by_line(tl3=_tl3_builder, tl4=_bridge_builder)(
        folder, architecture, pe, hf_config, overrides)
    model, (slopes, done), hf_check = _build_checked(build, processing, expected, architecture)
    weights = {"path": str(folder.resolve()), "files": files}
    if unexpected:
        weights["unused_keys"] = unexpected
    return model, ModelInfo.from_model(
        model, spec=str(folder), source="local-hf", pe=pe, architecture=architecture,
        alibi_slopes=slopes, rope_parameters=_rope_record(pe, hf_config), processing=done,
        weights=weights, hf_check=hf_check)

def _bridge_builder(folder: Path, architecture: str, pe: str, hf_config, overrides):
    """TL 4: ``build(processing, dtype) -> (model, (alibi slopes, processing done))``.

    ``TransformerBridge.boot_transformers`` on the folder, offline. HF's own modules run (its
    RoPE frequencies, its ALiBi slopes, which are the paper's), so nothing is installed;
    the weight processing TL 3.9 applies at load time is applied through
    ``enable_compatibility_mode`` with the same flags, so W_Q W_K^T is the same matrix
    under either version (docs/tl4.md).
    """
    import transformers
    from transformer_lens.model_bridge import TransformerBridge

    from ...tasks.tokenizer import build_byte_tokenizer
    from ..backend import guard_kv_cache, mark_folded

    has_tokenizer = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))

    def build(processing: dict, dtype):
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
                                bool(getattr(model.cfg, "final_rms", False)),
                                getattr(model, "adapter", None))
        model.eval()
        model.enable_compatibility_mode(disable_warnings=True,
                                        no_processing=not any(processing.values()), **processing)
        if done["fold_ln"]:
            mark_folded(model)  # TL 4 leaves the folded gains in place at 1
        model.eval()
        guard_kv_cache(model)  # refuse a KV cache that TL's bridge does not really use
        slopes = alibi_slopes(model.cfg.n_heads).tolist() if pe == "alibi" else None
        return model, (slopes, done)
    return build

def _tl3_builder(folder: Path, architecture: str, pe: str, hf_config, overrides):
    """TL 3.9: ``build(processing, dtype)``: TL's config conversion on a neutrally named view of the
    folder, our overrides, HF's weights converted by TL, exact positions installed."""
    import transformers
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens import loading_from_pretrained as tl_loading

    def build(processing: dict, dtype):
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
            with _offline():
                try:
                    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                        str(link), local_files_only=True, dtype=dtype)
                except Exception as err:  # safetensors, torch and HF each raise their own types
                    raise ValueError(f"could not read the weights in {folder}: "
                                     f"{type(err).__name__}: {err}") from None
            state_dict = tl_loading.get_pretrained_state_dict(str(link), cfg, hf_model=hf_model,
                                                              dtype=dtype)
            del hf_model
        tokenizer = None
        if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
        done = _processing_done(processing, cfg.normalization_type, bool(cfg.final_rms))
        model.load_and_process_state_dict(state_dict, **processing)
        model.eval()
        slopes = _install_positions(model, pe, architecture, hf_config)
        return model, (slopes, done)
    return build

def load(spec: str, processing: dict, dtype, revision=None):
    """:func:`posinterp.load_model`'s entry for a local HF folder (``revision`` is None)."""
    with _quiet_handled():
        return _load_local_hf(Path(spec).expanduser(), processing, dtype)
