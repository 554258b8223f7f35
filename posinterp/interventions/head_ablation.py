"""Per-head ablations at scale: the loss change when each head, or one of its spectral
channels, is removed (``posinterp inspect --ablate``; docs/performance.md).

**Exact** (:func:`head_ablation_losses`). An edit in layer l leaves layers < l as they
were, so the clean pass records every block's input once and each ablation reruns only
blocks l.. (:func:`posinterp.models.backend.run_blocks_from`); the ablations of one
layer ride along the batch axis of one rerun (copy g of the batch carries ablation g).
The numbers are those of one full forward pass per ablation, to float rounding (a test
checks 1e-5 against the naive passes on both TransformerLens lines).

**Approximate** (:func:`attribution_estimates`): attribution patching (Nanda 2023,
"Attribution Patching: Activation Patching At Industrial Scale"; Syed, Rager & Conmy
2023, arXiv 2310.10348), the first-order Taylor estimate ΔL ≈ ∇_a L · (a' - a) at the
edited activation a (``hook_z`` for a zeroed head, ``hook_q`` for a removed channel),
for every ablation from one forward and one backward pass. It is a different number
from the exact loss change wherever the loss is not linear in a, so it is only ever
reported under its own name and used to choose which ablations to rerun exactly.

Ablation kinds: ``zero_head`` (the head's ``hook_z`` output set to 0) and the
projection kinds ``remove_positive_real``, ``remove_negative_real``, ``remove_complex``
(the query times I - Π_c at ``hook_q``, :mod:`posinterp.interventions.qk`) and, on RoPE
heads, ``remove_band_<band>`` (e.g. ``remove_band_p0-3``: the query's components in those
rotary pairs zeroed, as ``QKIntervention("remove_band")``;
:func:`posinterp.analysis.frequencies.band_label`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ..analysis._checks import next_token_loss
from ..analysis.channels import channel_projectors
from ..analysis.frequencies import parse_band_label
from ..analysis.spectral import CHANNELS, qk_weights
from ..models.backend import (
    capture_block_inputs,
    eager,
    eval_mode,
    final_logits,
    query_hooks,
    run_blocks_from,
    suffix_replay_matches,
    unwrap,
    z_hook,
)
from .qk import QKIntervention, _query_projector

__all__ = ["BAND_PREFIX", "HEAD_ABLATIONS", "attribution_estimates", "head_ablation_losses"]

HEAD_ABLATIONS = ("zero_head", *(f"remove_{c}" for c in CHANNELS))
BAND_PREFIX = "remove_band_"
MAX_TOKENS = 2 ** 16  # tokens per batched rerun (copies x batch x pos)


def _check(model, ablations) -> list[tuple[int, int, str]]:
    out = []
    for a in ablations:
        if len(a) != 3:
            raise ValueError(f"ablations must be (layer, head, kind) triples, got {a!r}")
        layer, head, kind = int(a[0]), int(a[1]), str(a[2])
        if kind not in HEAD_ABLATIONS and not kind.startswith(BAND_PREFIX):
            raise ValueError(f"ablation kind must be one of {HEAD_ABLATIONS} or "
                             f"'{BAND_PREFIX}<band>' (e.g. 'remove_band_p0-3'), got {kind!r}")
        if kind.startswith(BAND_PREFIX):
            parse_band_label(kind.removeprefix(BAND_PREFIX))  # names the accepted forms
        if not 0 <= layer < model.cfg.n_layers:
            raise ValueError(f"layer must be in [0, {model.cfg.n_layers - 1}], got {layer}")
        if not 0 <= head < model.cfg.n_heads:
            raise ValueError(f"head must be in [0, {model.cfg.n_heads - 1}], got {head}")
        out.append((layer, head, kind))
    return out


def _projectors(model, ablations) -> dict[tuple[int, int, str], Tensor]:
    """(I - Π_c) for every channel ablation, float64: the matrices :mod:`.qk`'s
    ``remove_<c>`` applies, from one Schur-based decomposition per head (all channels at
    once) and one read of each layer's weights."""
    wanted: dict[int, dict[int, list[str]]] = {}
    out = {}
    for layer, head, kind in ablations:
        if kind.startswith(BAND_PREFIX):  # the projector QKIntervention("remove_band") applies
            band = parse_band_label(kind.removeprefix(BAND_PREFIX))
            iv = QKIntervention("remove_band", layer, heads=(head,), band=band)
            out[(layer, head, kind)] = _query_projector(model, iv)[head]
        elif kind != "zero_head":
            wanted.setdefault(layer, {}).setdefault(head, []).append(kind)
    for layer, heads in wanted.items():
        W_Q, W_K = qk_weights(model, layer)
        for head, kinds in heads.items():
            B = W_K[head].T @ W_Q[head]
            P = channel_projectors(B)
            for kind in kinds:
                out[(layer, head, kind)] = torch.eye(B.shape[0], dtype=torch.float64) - \
                    P[kind.removeprefix("remove_")]
    return out


def _edit_hooks(model, layer: int, group, projectors, batch: int):
    """Hooks for one rerun of ``layer``: copy g of the batch gets ``group[g]``."""
    def edit_z(z, hook):  # [copies * batch, pos, head, d_head]
        z = z.clone()
        for g, (_, head, kind) in enumerate(group):
            if kind == "zero_head":
                z[g * batch:(g + 1) * batch, :, head] = 0.0
        return z

    def edit_q(q, hook):  # [copies * batch, pos, head, d_head], before any rotation
        q = q.clone()
        for g, key in enumerate(group):
            if key[2] != "zero_head":
                rows = slice(g * batch, (g + 1) * batch)
                q[rows, :, key[1]] = (q[rows, :, key[1]].double() @ projectors[key].to(q.device)
                                      ).to(q.dtype)
        return q

    hooks = []
    if any(k == "zero_head" for _, _, k in group):
        hooks.append((z_hook(model, layer), edit_z))  # verified as z_h = p_h v_h, editable
    if any(k != "zero_head" for _, _, k in group):
        hooks.append((query_hooks(model, layer)[0], edit_q))  # verified unrotated query
    return hooks


def head_ablation_losses(model, tokens: Tensor, mask: Tensor | None,
                         ablations: Sequence[tuple[int, int, str]], max_tokens: int = MAX_TOKENS,
                         on_done=None) -> tuple[float, np.ndarray, str]:
    """Exact next-token loss with each ablation applied alone, batched over a shared prefix.

    Args:
        model: a causal TransformerLens model (either line).
        tokens: ``[batch, pos]`` ids; ``mask``: ``[batch, pos]`` or None (checked by the
            caller, e.g. :func:`posinterp.inspect_heads`).
        ablations: ``(layer, head, kind)`` triples, kind in :data:`HEAD_ABLATIONS`.
        max_tokens: at most this many tokens (copies x batch x pos) per rerun.
        on_done: called with the number of ablations each rerun finished (a progress bar).

    Returns:
        ``(clean_loss, losses, route)``: losses in nats per token (mean cross-entropy over
        real next-token pairs), one per ablation; ``route`` is ``"suffix"`` (blocks from
        the ablated layer on, the replay checked against the model's logits) or
        ``"full"`` (whole forward passes, batched, where that check failed).

    Raises:
        ValueError: a malformed triple; MissingFeatureError where the model has no
            verified ``hook_z`` / ``hook_q``.
    """
    model = unwrap(model)
    ablations = _check(model, ablations)
    projectors = _projectors(model, ablations)
    batch, pos = tokens.shape
    inputs = capture_block_inputs(model, tokens, mask)
    device = inputs.logits.device
    tokens_d = tokens.to(device)
    mask_d = None if mask is None else mask.to(device)
    clean = float(next_token_loss(inputs.logits, tokens_d, mask_d))
    suffix = suffix_replay_matches(model, inputs)
    per_run = max(1, max_tokens // (batch * pos))
    if not suffix:  # whole passes hold every copy's logits at once
        per_run = max(1, min(per_run, 2 ** 28 // (batch * pos * model.cfg.d_vocab)))
    losses = np.full(len(ablations), np.nan)
    by_layer: dict[int, list[int]] = {}
    for i, (layer, _, _) in enumerate(ablations):
        by_layer.setdefault(layer, []).append(i)
    with torch.no_grad(), eager(model), eval_mode(model):
        for layer, idx in by_layer.items():
            for start in range(0, len(idx), per_run):
                chunk = idx[start:start + per_run]
                group = [ablations[i] for i in chunk]
                hooks = _edit_hooks(model, layer, group, projectors, batch)
                copies = len(group)
                with model.hooks(fwd_hooks=hooks):
                    if suffix:
                        out = run_blocks_from(model, inputs, layer,
                                              inputs.resid_pre[layer].repeat(copies, 1, 1))
                    else:
                        logits = model(tokens_d.repeat(copies, 1), attention_mask=None if mask_d is None
                                       else mask_d.repeat(copies, 1))
                for g, i in enumerate(chunk):
                    rows = slice(g * batch, (g + 1) * batch)
                    lg = final_logits(model, out[rows]) if suffix else logits[rows]
                    losses[i] = float(next_token_loss(lg, tokens_d, mask_d))
                if on_done is not None:
                    on_done(len(chunk))
    return clean, losses, "suffix" if suffix else "full"


def attribution_estimates(model, tokens: Tensor, mask: Tensor | None,
                          ablations: Sequence[tuple[int, int, str]]) -> tuple[float, np.ndarray]:
    """First-order estimates of each ablation's loss change (attribution patching).

    ΔL ≈ Σ ∂L/∂a · (a' - a) over batch, positions and the head's dims, with a the
    head's ``hook_z`` output (a' = 0) or its query at ``hook_q`` (a' = a (I - Π_c)), L
    the mean next-token loss of :func:`head_ablation_losses`. One forward and one
    backward pass for all ablations; exact where L is linear in a, otherwise an estimate
    (Nanda 2023, "Attribution Patching"; Syed et al. 2023, arXiv 2310.10348, eq. 1).

    Returns:
        ``(clean_loss, estimates)``, estimates in nats per token, one per ablation.

    Raises:
        ValueError / MissingFeatureError: as :func:`head_ablation_losses`.
    """
    from ..devices import model_device

    model = unwrap(model)
    ablations = _check(model, ablations)
    projectors = _projectors(model, ablations)
    device = model_device(model)
    tokens_d = tokens.to(device)
    mask_d = None if mask is None else mask.to(device)
    layers = sorted({layer for layer, _, _ in ablations})
    saved: dict[str, Tensor] = {}

    def keep(name):
        def hook(x, hook):
            if not x.requires_grad:  # frozen weights: the first site becomes the leaf,
                x = x.detach().requires_grad_(True)  # every later one depends on it
            saved[name] = x
            return x
        return hook

    names = {}
    for layer in layers:
        names[(layer, "z")] = z_hook(model, layer)
        names[(layer, "q")] = query_hooks(model, layer)[0]
    hooks = [(n, keep(n)) for n in dict.fromkeys(names.values())]
    with torch.enable_grad(), eager(model), eval_mode(model), model.hooks(fwd_hooks=hooks):
        logits = model(tokens_d, attention_mask=mask_d)
        loss = next_token_loss(logits, tokens_d, mask_d)
        order = list(saved)
        grads = dict(zip(order, torch.autograd.grad(loss, [saved[n] for n in order],
                                                     allow_unused=True), strict=True))
    out = np.zeros(len(ablations))
    with torch.no_grad():
        for i, (layer, head, kind) in enumerate(ablations):
            name = names[(layer, "z" if kind == "zero_head" else "q")]
            a, g = saved[name][:, :, head].double(), grads[name]
            if g is None:  # the loss does not depend on this site
                continue
            g = g[:, :, head].double()
            delta = -a if kind == "zero_head" else a @ projectors[(layer, head, kind)].to(a.device) - a
            out[i] = float((g * delta).sum())
    return float(loss.detach()), out
