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
* ``remove_band`` / ``keep_band`` (RoPE heads): zero the query's components in the
  rotary pairs listed in ``band`` (or in every other rotary pair and the unrotated dims)
  at ``hook_q``, before the rotation. RoPE rotates each pair within its own plane, so the
  removed pairs contribute exactly 0 to every score, at every offset (Su et al. 2021,
  RoFormer eq. 34; issue 28). Pair p is dims (2p, 2p+1) or (p, p + rotary_dim/2), as the
  layer applies it (:func:`posinterp.models.backend.rotary_spec`); its frequency is
  ``inv_freq[p]`` radians per token (:func:`posinterp.analysis.rope_frequency_profile`
  lists them).
* ``symmetric`` / ``antisymmetric``: the content score c_ij = q_i · k_j / attn_scale is
  replaced by (c_ij ± c_ji) / 2, recomputed from the captured q and k
  (``hook_rot_q``/``hook_rot_k`` for RoPE: the *content-symmetric* variant, in which
  RoPE's phase channel survives) and applied as a delta d = new - old content to the
  scores, so the ALiBi bias, the mask and every edit a hook made before (a user's bias
  or knockout) survive unchanged. ``rope_variant="offset"`` symmetrizes M(Δ) for every
  offset instead, which removes the phase. On a soft-capped model (Gemma-2's
  ``attn_logit_softcapping``, TL's ``attn_scores_soft_cap``: score term T tanh(c / T))
  the content is symmetrized inside the cap, d = T tanh(c' / T) - T tanh(c / T); the
  projection kinds edit q, which the model's own cap then sees, so every kind is exact
  there. Where a model has no pre-softmax score hook
  (OPT/GPT-Neo bridges and native models on TL 4) the same delta is applied exactly at
  the pattern, softmax(s + d) = p e^d / Σ p e^d (:func:`reweight_pattern`, which states
  its limit).

Every hook used is one whose meaning was verified on the loaded model
(:func:`posinterp.models.backend.hook_meaning`), never one trusted by its name.

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
from ..analysis.channels import channel_projectors, top_k_projector
from ..analysis.spectral import CHANNELS, model_rotary_matrix, qk_weights
from ..models.backend import (
    arm_output_edit,
    attn_scale,
    check_not_wrapped,
    content_qk_from,
    content_qk_hooks,
    eager,
    hook_meaning,
    install_output_edit,
    pattern_edit,
    positional_type,
    query_hooks,
    rotary_spec,
    scores_hook,
)
from ..models.rope_layout import pair_dims

__all__ = ["BAND_KINDS", "KINDS", "QKIntervention", "band_dims", "check_intervention", "intervene",
           "intervention_hooks", "reweight_pattern"]

PROJECTION_KINDS = (*(f"remove_{c}" for c in CHANNELS),
                    "remove_all", "keep_top_k", "remove_band", "keep_band")
BAND_KINDS = ("remove_band", "keep_band")
SCORE_KINDS = ("symmetric", "antisymmetric")
KINDS = PROJECTION_KINDS + SCORE_KINDS


@dataclass(frozen=True)
class QKIntervention:
    """One intervention on some heads of one layer.

    ``band``: the rotary pair indices of ``remove_band`` / ``keep_band`` (and only those).

    Raises:
        ValueError: for an unknown ``kind`` or ``rope_variant``, ``keep_top_k``
            without ``k >= 1``, a band kind without a non-empty ``band`` of distinct
            non-negative ints (or ``band`` with another kind), a non-int or negative
            ``layer``, or non-int ``heads``. Ranges against a model are checked by
            :func:`check_intervention`.
    """

    kind: str
    layer: int
    heads: tuple[int, ...] | None = None  # None: every head
    k: int | None = None
    rope_variant: str = "content"
    band: tuple[int, ...] | None = None

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
        if self.kind in BAND_KINDS:
            band = (self.band,) if is_int(self.band) else tuple(self.band or ())
            if not band or not all(is_int(p) and p >= 0 for p in band) or len(set(band)) < len(band):
                raise ValueError(f"{self.kind} needs band: a non-empty tuple of distinct rotary "
                                 f"pair indices >= 0, got band={self.band!r}")
            object.__setattr__(self, "band", tuple(int(p) for p in band))
        elif self.band is not None:
            raise ValueError(f"band applies only to kind in {BAND_KINDS}, got kind={self.kind!r}")
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
    if iv.kind in BAND_KINDS:
        if positional_type(model) != "rotary":
            raise ValueError(f"{iv.kind} needs a RoPE model; this model's positional scheme is "
                             f"{positional_type(model)!r}")
        n_pairs = rotary_spec(model, iv.layer).rotary_dim // 2
        bad = [p for p in iv.band if p >= n_pairs]
        if bad:
            raise ValueError(f"band must hold rotary pair indices in [0, {n_pairs - 1}], got {bad}")
    if iv.kind == "keep_top_k" and iv.k > model.cfg.d_head:
        raise ValueError(f"k must be <= d_head = {model.cfg.d_head} (B has that many eigenvalues), "
                         f"got {iv.k}")
    return heads


def band_dims(model, layer: int, band) -> list[int]:
    """The d_head dims of rotary pairs ``band`` in ``layer``, as the layer pairs them."""
    spec = rotary_spec(model, layer)
    return sorted(d for p in band for d in pair_dims(p, spec.rotary_dim, spec.adjacent_pairs))


def _query_projector(model, iv: QKIntervention) -> dict[int, Float[Tensor, "d_head d_head"]]:
    heads = check_intervention(model, iv)
    if iv.kind in BAND_KINDS:
        keep = torch.ones(model.cfg.d_head, dtype=torch.float64)
        dims = band_dims(model, iv.layer, iv.band)
        if iv.kind == "remove_band":
            keep[dims] = 0.0
        else:
            keep = torch.zeros_like(keep)
            keep[dims] = 1.0
        return {h: torch.diag(keep) for h in heads}
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


def _content_delta(model, iv: QKIntervention, heads, offset_variant, q, k):
    """d_ij = new content - old content (``[batch, len(heads), query, key]``, float64 score
    units): ((c_ij ± c_ji)/2 - c_ij) / attn_scale, from the call's q and k.

    On a soft-capped model (score term T tanh(c / T), :func:`~posinterp.models.backend.
    attn_soft_cap`) the content is symmetrized inside the cap, as the model would score
    it: d = T tanh(c' / T) - T tanh(c / T), c' = (c_ij ± c_ji) / 2.
    """
    old, new = _content_pair(model, iv, offset_variant, q, k)
    cap = hook_meaning(model, iv.layer).soft_cap
    if cap is None:
        return new - old
    return cap * (torch.tanh(new / cap) - torch.tanh(old / cap))


def _content_pair(model, iv: QKIntervention, offset_variant, q, k):
    """(c, c'): the call's content term c_ij and its (anti)symmetrized c'_ij, float64
    ``[batch, head, query, key]`` in score units (q·k / attn_scale)."""
    scale = attn_scale(model, iv.layer)
    sign = 1.0 if iv.kind == "symmetric" else -1.0
    if offset_variant:
        # RoPE with unrotated q, k: o[i, j] = q_i R(i - j) k_j (the model's own score) and
        # s[i, j] = q_j R(i - j) k_i = x_i M(Δ)^T x_j^T, over every offset t = i - j.
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
        return o / scale, 0.5 * (sign * s + o) / scale
    direct = torch.einsum("bihd,bjhd->bhij", q, k)
    return direct / scale, 0.5 * (sign * direct.transpose(-1, -2) + direct) / scale


def _score_hooks(model, iv: QKIntervention):
    """Symmetrization as a delta on the content term only: s'_ij = s_ij + d_ij, so every
    bias, mask and upstream edit of the scores (a user's hook, ALiBi) survives unchanged.

    Three routes, chosen by what the model's hooks were verified to carry
    (:func:`~posinterp.models.backend.hook_meaning`): at the pre-softmax scores hook; where
    there is none, at an editable pattern hook (TL 4 native models) with p'_ij = p_ij
    e^{d_ij} / Σ_j p_ij e^{d_ij} (exactly softmax(s + d)); where that is not editable
    either (OPT/GPT-Neo bridges on TL 4), at the attention module's output, with the
    same p' and the output moved by Σ_h (p' - p)_h v_h W_O,h.
    """
    heads = check_intervention(model, iv)
    rotary = positional_type(model) == "rotary"
    offset_variant = rotary and iv.rope_variant == "offset"
    meaning = hook_meaning(model, iv.layer)
    # Hooks come from the backend, verified on this model; each raises naming the
    # missing feature where the model has no hook of that meaning.
    # The content variant needs the rotated q/k of this call (hook_rot_q/k, or hook_q/k
    # with the call's cos/sin tables); the offset variant the unrotated q/k.
    names = query_hooks(model, iv.layer) if offset_variant else content_qk_hooks(model, iv.layer)
    if meaning.scores is None and meaning.pattern is None and not meaning.output_edit:
        scores_hook(model, iv.layer)  # raises, naming what the probe found
    captured: dict[str, Tensor] = {}
    H = model.cfg.n_heads

    def capture(name):
        def hook(x, hook):
            captured[name] = x.detach()
            return x
        return hook

    def delta():
        q, k = content_qk_from(names, captured, H)  # grouped-query keys expanded
        return _content_delta(model, iv, heads, offset_variant, q[:, :, heads], k[:, :, heads])

    def square(n_query, n_key):
        if n_query != n_key:
            raise ValueError("symmetrization needs the full square score matrix; it cannot "
                             "run with a KV cache (generate with use_past_kv_cache=False)")

    hooks = [(name, capture(name)) for name in names]
    if meaning.scores is not None:
        def add_delta(scores, hook):  # [batch, head, query, key]
            square(scores.shape[-2], scores.shape[-1])
            d = delta().to(scores.device)
            # Masked entries (the model's mask, or a user's knockout: -inf or finfo.min)
            # stay as they are; the causal upper triangle is masked by the model.
            keep = ~masked_scores(scores[:, heads])
            scores = scores.clone()
            scores[:, heads] = torch.where(keep, scores[:, heads].double() + d,
                                           scores[:, heads].double()).to(scores.dtype)
            return scores
        return hooks + [(meaning.scores, add_delta)]

    def reweight(old):  # [batch, head, query, key] float64 -> the pattern of s + d
        square(old.shape[-2], old.shape[-1])
        return reweight_pattern(old, delta().to(old.device))

    if meaning.pattern is not None:
        def edit_pattern(pattern, hook):  # [batch, head, query, key]
            pattern = pattern.clone()
            pattern[:, heads] = reweight(pattern[:, heads].double()).to(pattern.dtype)
            return pattern
        return hooks + [(meaning.pattern, edit_pattern)]

    def arm(v, hook):
        arm_output_edit(model, iv.layer, pattern_edit(model, iv.layer, heads, reweight, v.detach()))
        return v
    install_output_edit(model, iv.layer)
    return hooks + [(f"blocks.{iv.layer}.attn.hook_v", arm)]


def reweight_pattern(pattern: Float[Tensor, "batch head query key"],
                     delta: Float[Tensor, "batch head query key"],
                     tol: float = 1e-6) -> Float[Tensor, "batch head query key"]:
    """softmax(s + d) from p = softmax(s): p'_ij = p_ij e^{d_ij} / Σ_j p_ij e^{d_ij}, in
    float64 (unitless probabilities; ``delta`` in score units).

    Exact where p_ij > 0. A masked key has p_ij = 0 and keeps it, as it must; an allowed
    key whose probability underflowed to 0 in the model's dtype (its score more than about
    87 nats below the row's largest in float32) also stays at 0, which is wrong by at most
    tiny · e^{d_ij} / Σ_j p_ij e^{d_ij} (tiny: the dtype's smallest subnormal). Where that
    bound exceeds ``tol`` for some entry the intervention is refused.

    Raises:
        ValueError: where the bound above exceeds ``tol`` (the score-hook route has no such
            limit; the models affected have no pre-softmax hook).
    """
    p = pattern.double()
    logp = torch.where(p > 0, p.log(), torch.tensor(float("-inf"), dtype=torch.float64,
                                                      device=p.device))
    logits = logp + torch.where(p > 0, delta, torch.zeros_like(delta))
    lse = torch.logsumexp(logits, -1, keepdim=True)
    new = torch.exp(logits - lse)
    new = torch.where(torch.isfinite(lse), new, p)  # an all-zero row stays as it was
    tiny = torch.finfo(pattern.dtype).smallest_normal * torch.finfo(pattern.dtype).eps
    n = p.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=p.device).tril()
    zero = (p == 0) & causal & (p > 0).any(-2, keepdim=True)  # not a key masked for every query
    if zero.any():
        bound = (tiny * torch.exp(delta - lse))[zero.expand_as(delta)]
        if bound.numel() and float(bound.max()) > tol:
            raise ValueError(
                f"the intervention would raise an attention probability that underflowed to 0 "
                f"in {pattern.dtype} (error bound {float(bound.max()):.1e} > {tol:g}); this "
                "model has no pre-softmax score hook, so posinterp edits the pattern and "
                "cannot recover it: run the model in float64")
    return new


def intervention_hooks(model, interventions) -> list[tuple[str, object]]:
    """``(hook name, hook fn)`` pairs for ``model.run_with_hooks(fwd_hooks=...)``.

    Each hook is one whose meaning was verified on this model
    (:func:`posinterp.models.backend.hook_meaning`).

    Raises:
        ValueError: for out-of-range layers/heads, for every kind (checked by
            :func:`check_intervention` before any weight is read or forward pass run).
        MissingFeatureError: (a ValueError) where the model has no hook with the meaning
            an intervention needs, or for a ``torch.compile(model)`` wrapper (pass
            ``model._orig_mod``).
    """
    interventions = ([interventions] if isinstance(interventions, QKIntervention)
                     else list(interventions))
    for iv in interventions:  # every one, before any weight is read or hook built
        check_intervention(model, iv)
    check_not_wrapped(model, "a QK intervention")
    hooks = []
    for iv in interventions:
        if iv.kind in PROJECTION_KINDS:
            # hook_q verified as the unrotated query whose edits take effect
            q_name, _ = query_hooks(model, iv.layer)
            hooks.append((q_name, _projection_hook(_query_projector(model, iv))))
        else:
            hooks.extend(_score_hooks(model, iv))
    return hooks


@contextlib.contextmanager
def intervene(model, interventions):
    """Run the model with the interventions inside the block, exactly as before after it.

    Uses TransformerLens's ``model.hooks`` context, which removes only the hooks it
    added: hooks the user registered before stay in place and keep firing.

    A model compiled in place with ``model.compile()`` runs eagerly inside the block (its
    compiled graph would skip the hooks) and compiled again after it.

    Raises:
        ValueError: see :func:`intervention_hooks`.
    """
    hooks = intervention_hooks(model, interventions)
    # A model compiled in place (model.compile()) runs eagerly inside the block, so the
    # hooks fire; a torch.compile(model) wrapper is refused by intervention_hooks.
    with eager(model), model.hooks(fwd_hooks=hooks):
        yield model
