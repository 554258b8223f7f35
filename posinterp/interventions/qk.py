"""Inference-time interventions on QK circuits, as TransformerLens hooks.

Kinds (docs/concepts.md):

* ``remove_positive_real`` / ``remove_negative_real`` / ``remove_complex``: score with
  q (I - Π_c) k^T, by replacing each selected head's query
  with q (I - Π_c) at ``hook_q`` (before any rotation). Π_c is applied to the whole
  query (weights and bias). For RoPE heads Π_c comes from the unrotated B, so this
  ablates the channels of M(0), the content form; the positional phase that RoPE adds
  between q and k survives.
* ``remove_all``: every channel and the null remainder (q · 0): the content term is 0
  (where B is singular a nilpotent part of M still scores, so removing only the three
  channels would leave it). The bias and ALiBi parts of the score remain.
* ``keep_top_k``: q Π_top-k instead.
* ``symmetric`` / ``antisymmetric``: the content score c_ij = q_i · k_j / attn_scale is
  replaced by (c_ij ± c_ji) / 2 before masking, recomputed from the captured q and k
  (``hook_rot_q``/``hook_rot_k`` for RoPE: the *content-symmetric* variant, in which
  RoPE's phase channel survives), then the ALiBi bias is added unchanged and the mask
  re-applied. ``rope_variant="offset"`` symmetrizes M(Δ) for every offset instead,
  which removes the phase.

Use :func:`intervene` as a context manager, or :func:`intervention_hooks` with
``model.run_with_hooks``. Weights are never modified, so the model is restored exactly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from .._validate import is_int
from ..analysis._checks import masked_scores
from ..analysis.spectral import model_rotary_matrix, qk_weights
from ..models.backend import (
    attn_scale,
    positional_type,
    rotated_qk_hooks,
    scores_hook,
    scores_include_bias,
)
from ..models.positions import alibi_bias_of
from .channels import channel_projectors, top_k_projector

__all__ = ["KINDS", "QKIntervention", "check_intervention", "intervene", "intervention_hooks"]

PROJECTION_KINDS = ("remove_positive_real", "remove_negative_real", "remove_complex",
                    "remove_all", "keep_top_k")
SCORE_KINDS = ("symmetric", "antisymmetric")
KINDS = PROJECTION_KINDS + SCORE_KINDS


@dataclass(frozen=True)
class QKIntervention:
    """One intervention on some heads of one layer.

    Raises:
        ValueError: for an unknown ``kind`` or ``rope_variant``, ``keep_top_k``
            without ``k >= 1``, a non-int or negative ``layer``, or non-int ``heads``.
            Ranges against a model are checked by :func:`check_intervention`.
    """

    kind: str
    layer: int
    heads: tuple[int, ...] | None = None  # None: every head
    k: int | None = None
    rope_variant: str = "content"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.rope_variant not in ("content", "offset"):
            raise ValueError(f"rope_variant must be 'content' or 'offset', got {self.rope_variant!r}")
        if self.kind == "keep_top_k" and (self.k is None or self.k < 1):
            raise ValueError(f"keep_top_k needs k >= 1, got k={self.k}")
        if not is_int(self.layer):
            raise ValueError(f"layer must be an int, got {self.layer!r}")
        if self.layer < 0:
            raise ValueError(f"layer must be >= 0, got {self.layer}")
        if self.k is not None and self.kind != "keep_top_k":
            raise ValueError(f"k applies only to kind='keep_top_k', got kind={self.kind!r}")
        if is_int(self.heads):
            object.__setattr__(self, "heads", (self.heads,))
        if self.heads is not None:
            heads = tuple(self.heads)
            if not all(is_int(h) for h in heads):
                # int() would silently turn head 1.5 into head 1.
                raise ValueError(f"heads must be ints (or None for every head), got {heads!r}")
            object.__setattr__(self, "heads", tuple(int(h) for h in heads))
        object.__setattr__(self, "layer", int(self.layer))


def check_intervention(model, iv: QKIntervention) -> list[int]:
    """The heads ``iv`` acts on, after checking its layer and heads against ``model``.

    Raises:
        ValueError: for a layer outside ``[0, n_layers)``, a head outside ``[0, n_heads)``
            or a ``keep_top_k`` ``k`` above ``d_head``, naming the allowed range; for
            every kind, before any weight is read.
    """
    if not isinstance(iv, QKIntervention):
        raise ValueError(f"interventions must be QKIntervention objects, got {type(iv).__name__}")
    if not 0 <= iv.layer < model.cfg.n_layers:
        raise ValueError(f"layer must be in [0, {model.cfg.n_layers - 1}], got {iv.layer}")
    heads = list(range(model.cfg.n_heads)) if iv.heads is None else list(iv.heads)
    bad = [h for h in heads if not 0 <= h < model.cfg.n_heads]
    if bad:
        raise ValueError(f"heads must be in [0, {model.cfg.n_heads - 1}], got {bad}")
    if iv.kind == "keep_top_k" and iv.k > model.cfg.d_head:
        raise ValueError(f"k must be <= d_head = {model.cfg.d_head} (B has that many eigenvalues), "
                         f"got {iv.k}")
    return heads


def _query_projector(model, iv: QKIntervention) -> dict[int, Float[Tensor, "d_head d_head"]]:
    heads = check_intervention(model, iv)
    W_Q, W_K = qk_weights(model, iv.layer)
    out = {}
    for h in heads:
        B = W_K[h].T @ W_Q[h]
        if iv.kind == "keep_top_k":
            out[h] = top_k_projector(B, iv.k)
            continue
        if iv.kind == "remove_all":
            # every channel *and* the null remainder (a nilpotent part of M scores too):
            # I - (Π_pos + Π_neg + Π_complex + Π_null) = 0, so the content term is 0
            out[h] = torch.zeros_like(B)
            continue
        P = channel_projectors(B)
        out[h] = torch.eye(B.shape[0], dtype=torch.float64) - P[iv.kind.removeprefix("remove_")]
    return out


def _projection_hook(projectors: dict[int, Tensor]):
    def hook(q, hook):  # q: [batch, pos, head, d_head]
        q = q.clone()
        for h, P in projectors.items():
            q[:, :, h] = (q[:, :, h].double() @ P.to(q.device)).to(q.dtype)
        return q
    return hook


def _score_hooks(model, iv: QKIntervention):
    heads = check_intervention(model, iv)
    rotary = positional_type(model) == "rotary"
    offset_variant = rotary and iv.rope_variant == "offset"
    captured: dict[str, Tensor] = {}
    prefix = f"blocks.{iv.layer}.attn."
    # Hooks whose meaning differs across TL versions come from the backend, which raises
    # (naming the missing feature) where a model has no pre-softmax or rotated-q/k hook.
    scores_name = scores_hook(model, iv.layer)
    if offset_variant or not rotary:
        q_name, k_name = prefix + "hook_q", prefix + "hook_k"
    else:
        q_name, k_name = rotated_qk_hooks(model, iv.layer)
    bias_in_scores = scores_include_bias(model, iv.layer)

    def capture(name):
        def hook(x, hook):
            captured[name] = x.detach()
            return x
        return hook

    sign = 1.0 if iv.kind == "symmetric" else -1.0
    scale = attn_scale(model, iv.layer)

    def offset_terms(q, k):
        """RoPE with unrotated q, k: o[i, j] = q_i R(i - j) k_j (the model's own score) and
        s[i, j] = q_j R(i - j) k_i = x_i M(Δ)^T x_j^T, over every offset t = i - j."""
        n = q.shape[1]
        o = torch.zeros(q.shape[0], q.shape[2], n, n, dtype=torch.float64, device=q.device)
        s = torch.zeros_like(o)
        for t in range(-(n - 1), n):
            R = model_rotary_matrix(model, t, iv.layer).to(q.device)
            qt = q @ R  # [batch, pos, head, d_head]: q_p R(t)
            i = torch.arange(max(0, t), min(n, n + t), device=q.device)
            j = i - t
            o[:, :, i, j] = torch.einsum("bphd,bphd->bhp", qt[:, i], k[:, j])
            s[:, :, i, j] = torch.einsum("bphd,bphd->bhp", qt[:, j], k[:, i])
        return o, s

    def content_terms(q, k):
        if offset_variant:
            return offset_terms(q, k)
        direct = torch.einsum("bihd,bjhd->bhij", q, k)
        return direct, direct.transpose(-1, -2)  # c_ji at [i, j]

    def replace(scores, hook):  # [batch, head, query, key]
        if scores.shape[-1] != scores.shape[-2]:
            raise ValueError("symmetrization needs the full square score matrix; it cannot "
                             "run with a KV cache (generate with use_past_kv_cache=False)")
        q, k = captured[q_name][:, :, heads].double(), captured[k_name][:, :, heads].double()
        if model.cfg.n_key_value_heads is not None and k.shape[2] != len(heads):
            raise ValueError("grouped-query keys must be expanded before symmetrization")
        direct, transposed = content_terms(q, k)
        content = 0.5 * (direct + sign * transposed) / scale
        n = scores.shape[-1]
        if bias_in_scores:
            # A bridged HF ALiBi model (BLOOM) adds its bias inside the scores and exposes it
            # nowhere else: it is the score minus the content q_i·k_j / scale it started from.
            content = content + (scores[:, heads].double() - direct / scale)
        else:
            # The bias the model added in this very call (mask positions, any length).
            bias = alibi_bias_of(model, iv.layer)
            if bias is not None:
                content = content + bias[:, heads].to(scores.device).double()
        causal = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
        # Padding masks are not visible to hooks: keep every entry the model, or a user's
        # hook that ran before this one, masked (-inf in TransformerLens, finfo.min in HF).
        keep = causal & ~masked_scores(scores[:, heads])
        scores = scores.clone()
        scores[:, heads] = torch.where(keep, content.to(scores.dtype),
                                       torch.tensor(float("-inf"), dtype=scores.dtype,
                                                    device=scores.device))
        return scores

    if model.cfg.n_key_value_heads is not None:
        # hook_k / hook_rot_k carry only the KV heads: expand to query heads first.
        reps = model.cfg.n_heads // model.cfg.n_key_value_heads
        inner = capture(k_name)

        def capture_k(x, hook):
            inner(torch.repeat_interleave(x, reps, dim=2), hook)
            return x
        k_hook = capture_k
    else:
        k_hook = capture(k_name)
    return [(q_name, capture(q_name)), (k_name, k_hook), (scores_name, replace)]


def intervention_hooks(model, interventions) -> list[tuple[str, object]]:
    """``(hook name, hook fn)`` pairs for ``model.run_with_hooks(fwd_hooks=...)``.

    Raises:
        ValueError: for out-of-range layers/heads, for every kind (checked by
            :func:`check_intervention` before any weight is read or forward pass run).
    """
    interventions = ([interventions] if isinstance(interventions, QKIntervention)
                     else list(interventions))
    for iv in interventions:  # every one, before any weight is read or hook built
        check_intervention(model, iv)
    hooks = []
    for iv in interventions:
        if iv.kind in PROJECTION_KINDS:
            hooks.append((f"blocks.{iv.layer}.attn.hook_q",
                          _projection_hook(_query_projector(model, iv))))
        else:
            hooks.extend(_score_hooks(model, iv))
    return hooks


@contextlib.contextmanager
def intervene(model, interventions):
    """Run the model with the interventions inside the block, exactly as before after it.

    Uses TransformerLens's ``model.hooks`` context, which removes only the hooks it
    added: hooks the user registered before stay in place and keep firing.

    Raises:
        ValueError: see :func:`intervention_hooks`.
    """
    with model.hooks(fwd_hooks=intervention_hooks(model, interventions)):
        yield model
