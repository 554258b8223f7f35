"""Check a loaded model against Hugging Face transformers, token for token.

``hf_parity(folder)`` loads a local HF checkpoint twice, once through
:func:`posinterp.load_model` and once through ``transformers`` itself, runs both on the
same random tokens under several attention masks and lengths, and returns the largest
log-probability difference at real (unmasked) positions. A number posinterp computes on
a model is only as right as this table: it is the test every supported architecture has
to pass (tests/models/test_parity.py) and a check users can run on their own folders.
"""

from __future__ import annotations

import inspect
import os

import pandas as pd
import torch

__all__ = ["DEFAULT_LENGTHS", "PADDINGS", "hf_parity", "parity_mask"]

PADDINGS = ("none", "left", "right", "gap")


def parity_mask(padding: str, batch: int, n: int) -> torch.Tensor:
    """A ``[batch, n]`` 0/1 attention mask; row 0 is always unpadded.

    ``left``/``right``: rows 1.. lose 3 (then 5, ...) tokens on that side; ``gap``: row
    1 has zeros strictly inside the sequence (positions n//2 - 1 .. n//2 + 1), so the
    tokens after the gap are at mask positions 3 lower than their indices.

    Raises:
        ValueError: an unknown ``padding`` (allowed: :data:`PADDINGS`) or ``n < 8``.
    """
    if padding not in PADDINGS:
        raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
    if n < 8:
        raise ValueError(f"n must be >= 8 for the padded masks, got {n}")
    mask = torch.ones(batch, n, dtype=torch.long)
    for row in range(1, batch):
        pad = 1 + 2 * row
        if padding == "left":
            mask[row, :pad] = 0
        elif padding == "right":
            mask[row, n - pad:] = 0
        elif padding == "gap":
            mask[row, n // 2 - 1: n // 2 + 2] = 0
    return mask


def _hf_log_probs(hf, tokens, mask) -> torch.Tensor:
    kwargs = {"attention_mask": mask}
    if "position_ids" in inspect.signature(hf.forward).parameters:
        # HF models take position ids as given (GPT-2 ignores the mask for them); a pad is
        # never a position (docs/concepts.md), so the k-th real token is position k.
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf(tokens, **kwargs).logits.double().log_softmax(-1)


DEFAULT_LENGTHS = (8, 64, 512)


def hf_parity(folder: str | os.PathLike, *, lengths=None, paddings=PADDINGS, batch: int = 2,
              seed: int = 0, **load_kwargs) -> pd.DataFrame:
    """Max |log-prob difference| between ``load_model(folder)`` and HF on the same inputs.

    Args:
        folder: a local HF checkpoint (``config.json`` + weights) of a causal LM, or a hub
            name (pass ``revision=`` in ``load_kwargs``), read from the Hugging Face cache.
        lengths: sequence lengths to try (each >= 8). Default: 8, 64 and 512, those
            that fit the model's ``n_ctx`` (its ``n_ctx`` itself if none fits).
        paddings: masks from :func:`parity_mask` (``none``, ``left``, ``right``, ``gap``).
        batch: sequences per input (>= 2, so padded rows sit next to an unpadded one).
        seed: seed of the random token ids.
        load_kwargs: passed to :func:`posinterp.load_model` (weight processing, dtype).

    Returns:
        Tidy DataFrame, one row per (length, padding): ``architecture``, ``length``,
        ``padding``, ``metric``, ``value``. Causal LMs: "max_abs_logprob_diff" (nats, over
        the vocabulary); bidirectional encoders (BERT): "max_abs_hidden_diff" (the last
        hidden state). Only real positions (mask 1) are compared; HF runs eager attention.

    Raises:
        Whatever :func:`posinterp.load_model` raises for the folder (a refused setting
        is a ValueError naming it); ValueError for ``batch < 2``, a length below 8, or
        a length past ``n_ctx`` for a model with a position limit
        (:func:`~posinterp.models.backend.position_limit`; not ALiBi, not HF's computed
        RoPE on TL 4).
    """
    import transformers

    from .backend import position_limit
    from .pretrained import load_model

    if batch < 2:
        raise ValueError(f"batch must be >= 2, got {batch}")
    model, info = load_model(folder, **load_kwargs)
    n_ctx = model.cfg.n_ctx
    if lengths is None:
        lengths = tuple(n for n in DEFAULT_LENGTHS if n <= n_ctx) or (n_ctx,)
    limit = position_limit(model)  # None: no table to run past (ALiBi, HF's computed RoPE)
    too_long = [n for n in lengths if limit is not None and n > limit]
    if too_long:
        raise ValueError(f"lengths {too_long} are past this model's n_ctx={limit}; pass "
                         f"lengths <= {limit}")
    auto = transformers.AutoModelForCausalLM if info.causal else transformers.AutoModel
    # The folder load_model read: for a hub name, the cache's snapshot of that revision.
    source = info.weights.get("path", str(folder))
    hf = auto.from_pretrained(source, local_files_only=True, attn_implementation="eager",
                              dtype=model.cfg.dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        tokens = torch.randint(0, model.cfg.d_vocab, (batch, n), generator=gen)
        for padding in paddings:
            mask = parity_mask(padding, batch, n)
            got, want, metric = (_causal_pair if info.causal else _encoder_pair)(model, hf, tokens, mask)
            diff = (got - want).abs().amax(-1)[mask.bool()].max().item()
            rows.append(dict(architecture=info.architecture, length=n, padding=padding,
                             metric=metric, value=diff))
    return pd.DataFrame(rows)


def _causal_pair(model, hf, tokens, mask):
    from ..devices import model_device

    device = model_device(model)  # the TL model may be on CUDA; HF's reference stays on CPU
    with torch.no_grad():
        got = model(tokens.to(device), attention_mask=mask.to(device)).cpu().double().log_softmax(-1)
    return got, _hf_log_probs(hf, tokens, mask), "max_abs_logprob_diff"


def _encoder_pair(model, hf, tokens, mask):
    """BERT: TL's encoder has no trained LM head here, so compare the last hidden state.
    HF BERT counts positions by index even under padding; TL's encoder does too."""
    last = f"blocks.{model.cfg.n_layers - 1}.hook_normalized_resid_post"
    from ..models.backend import run_cached

    with torch.no_grad():
        cache = run_cached(model, tokens, mask, last)  # CPU activations, from any device
        want = hf(tokens, attention_mask=mask).last_hidden_state
    return cache[last].double(), want.double(), "max_abs_hidden_diff"
