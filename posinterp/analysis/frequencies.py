"""RoPE heads by frequency: which rotary pairs a head's QK circuit uses, and whether the
head behaves positionally or symbolically (docs/frequencies.md).

**Frequency profile.** RoPE rotates pair p of the first ``rotary_dim`` dims of every
query and key by an angle t·θ_p at position t (θ_p radians per token, period 2π/θ_p
tokens); the other ``d_head - rotary_dim`` dims are not rotated. With row vectors
(docs/concepts.md, "QK circuit of head h"), q_i R(i) · k_j R(j) = q_i R(i - j) k_j^T,
so the head's bilinear form at key offset Δ = j - i is M(Δ) = W_Q R(-Δ) W_K^T (as in
:mod:`.spectral`). R is block diagonal, so the form splits exactly into one term per
pair plus the unrotated block:

    M(Δ) = Σ_p M_p(Δ) + M_u,   M_p(Δ) = Q_p R_p(-Δ θ_p) K_p^T,   M_u = Q_u K_u^T,

with Q_p = W_Q[:, pair p] (``d_model x 2``), K_p likewise, Q_u, K_u the unrotated columns.
Every score x_i M(Δ) x_j^T is the sum of the pairs' contributions. The share of pair p is

* of W_Q: ||Q_p||_F² / ||W_Q||_F² (``metric="W_Q"``), of W_K likewise (``"W_K"``);
* of the content-position form at offset Δ (``"qk"``):
  ||M_p(Δ)||_F² / (Σ_p' ||M_p'(Δ)||_F² + ||M_u||_F²), computed without any
  ``d_model x d_model`` matrix as tr(R_p^T G^Q_p R_p G^K_p) with the 2 x 2 Gram
  matrices G^Q_p = Q_p^T Q_p, G^K_p = K_p^T K_p (||M_u||² = tr(G^Q_u G^K_u)).

Shares of one head and metric sum to 1 (all 0 for an all-zero head, never NaN). They are
shares of the energy of the per-pair terms: the terms are not orthogonal in d_model, so
||M(Δ)||² also holds cross terms, which no pair owns. The weights follow
:data:`~.spectral.QK_CONVENTION` (the attention norm's gain folded), grouped-query keys
are expanded, and layout and frequencies are the model's own
(:func:`posinterp.models.backend.rotary_spec`), so a share does not depend on whether the
model pairs dims adjacently (GPT-J) or in split halves (GPT-NeoX).

**Positional vs symbolic score.** Urrutia et al., "Decoupling Positional and Symbolic
Attention Behavior in Transformers" (ICLR 2026, arXiv 2511.11579, §3): a head is
*positional* when its logits are invariant under a permutation of the key tokens (the
logit at key position j does not depend on which token sits there) and *symbolic* when
they are equivariant (the logit moves with the token). Their exact metric was not
reachable offline; :func:`positional_symbolic_score` is the operational version stated
in its docstring.

Sources: Su et al. 2021 (RoFormer) eq. 13-15; Barbero et al., "Round and Round We Go!
What makes Rotary Positional Encodings useful?" (ICLR 2025, arXiv 2410.06205), §4-5.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .._validate import check_indices, is_int
from ..models.rope_layout import pair_indices  # re-exported: the layout's home is models
from .spectral import qk_float64

__all__ = ["FREQUENCY_METRICS", "band_label", "frequency_bands", "inspection_frequency_rows",
           "pair_energy_shares", "pair_indices", "parse_band_label", "positional_symbolic_score",
           "positional_symbolic_from_qk", "rope_frequency_profile", "rotate"]

FREQUENCY_METRICS = ("W_Q", "W_K", "qk")
SCORE_METRICS = ("positional_score", "positional_residual", "symbolic_residual")


# --- pure functions over weights and activations --------------------------------------------

def _block(angle: Tensor) -> Tensor:
    """2 x 2 blocks of R(t) (row-vector convention of :func:`.spectral.rotary_matrix`):
    ``[[c, s], [-s, c]]`` on the pair (first, second)."""
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.stack([torch.stack([c, s], -1), torch.stack([-s, c], -1)], -2)


def pair_energy_shares(W_Q: Float[Tensor, "... d_model d_head"], W_K: Float[Tensor, "... d_model d_head"],
                       first: Tensor, second: Tensor, unrotated: Tensor,
                       inv_freq: Float[Tensor, "n_pairs"], offsets: Sequence[int] = (0,)
                       ) -> dict[str, Tensor]:
    """Energy shares of each rotary pair and of the unrotated block (module docstring).

    Args:
        W_Q: ``[..., d_model, d_head]``.
        W_K: ``[..., d_model, d_head]``, already expanded over grouped-query heads.
        first: the first index of each rotary pair, from :func:`pair_indices`.
        second: the second index of each rotary pair, from :func:`pair_indices`.
        unrotated: the unrotated dimensions, from :func:`pair_indices`.
        inv_freq: θ_p, radians per token, ``[n_pairs]``.
        offsets: key offsets Δ = j - i for the ``"qk"`` shares.

    Returns:
        ``{"W_Q": [..., n_pairs + 1], "W_K": [..., n_pairs + 1], "qk": [..., n_offsets,
        n_pairs + 1]}``, float64; the last entry is the unrotated block (0 without
        partial rotary). Each row sums to 1, or is all 0 for an all-zero head.

    Raises:
        ValueError: for mismatched shapes.
    """
    qk_float64(W_Q, W_K)  # shapes checked, as everywhere in the spectra
    if not (len(first) == len(second) == len(inv_freq)):
        raise ValueError(f"first, second and inv_freq must have one entry per pair, got "
                         f"{len(first)}, {len(second)}, {len(inv_freq)}")
    q, k = W_Q.detach().double(), W_K.detach().double()
    pair = torch.stack([first, second], -1)  # [P, 2]
    Qp, Kp = q[..., pair], k[..., pair]  # [..., d_model, P, 2]
    GQ = torch.einsum("...dpa,...dpb->...pab", Qp, Qp)  # [..., P, 2, 2]
    GK = torch.einsum("...dpa,...dpb->...pab", Kp, Kp)
    Qu, Ku = q[..., unrotated], k[..., unrotated]  # [..., d_model, r]

    def shares(parts: Tensor) -> Tensor:
        total = parts.sum(-1, keepdim=True)
        safe = torch.where(total > 0, total, torch.ones_like(total))
        return torch.where(total > 0, parts / safe, torch.zeros_like(parts))

    def column_shares(G: Tensor, U: Tensor) -> Tensor:  # ||W[:, pair]||^2 = tr G_p
        return shares(torch.cat([G.diagonal(0, -2, -1).sum(-1), U.square().sum((-2, -1))[..., None]], -1))

    out = {"W_Q": column_shares(GQ, Qu), "W_K": column_shares(GK, Ku)}
    # ||Q_u K_u^T||_F^2 = tr(G^Q_u G^K_u): r x r products only.
    e_u = ((Qu.mT @ Qu) * (Ku.mT @ Ku)).sum((-2, -1))[..., None]
    qk = []
    for off in offsets:
        R = _block(-float(off) * inv_freq.double())  # [P, 2, 2]: M_p(Δ) = Q_p R_p(-Δθ_p) K_p^T
        RtGR = R.mT @ GQ @ R
        e_p = (RtGR * GK).sum((-2, -1))  # tr(R^T G^Q R G^K), both Gram matrices symmetric
        qk.append(shares(torch.cat([e_p, e_u], -1)))
    out["qk"] = torch.stack(qk, -2)
    return out


def rotate(x: Float[Tensor, "... d_head"], positions: Tensor, first: Tensor, second: Tensor,
           inv_freq: Float[Tensor, "n_pairs"]) -> Float[Tensor, "... d_head"]:
    """x R(t): RoPE at position t (``positions`` broadcast against ``x[..., 0]``).

    new_first = first·cos(tθ_p) - second·sin(tθ_p), new_second = second·cos + first·sin,
    as TransformerLens's ``x cos + rotate(x) sin`` and :func:`.spectral.rotary_matrix`.
    Unrotated dims pass through. Float64. Source: Su et al. 2021, eq. 34.
    """
    x = x.double()
    angle = positions.double()[..., None] * inv_freq.double()  # [..., P]
    c, s = torch.cos(angle), torch.sin(angle)
    if x.numel() < 1 << 14:  # small: indexed writes cost less than building the tables
        a, b = x[..., first], x[..., second]
        out = x.clone()
        out[..., first] = a * c - b * s
        out[..., second] = b * c + a * s
        return out
    # One pass over x instead of indexed writes: x R = x * cos_d + x[partner] * sin_d,
    # with per-dim cos_d, sin_d (-sin on a pair's first dim, 1 and 0 on unrotated dims):
    # a c + b (-s) and b c + a s are a c - b s and b c + a s bit for bit.
    d, P = x.shape[-1], len(first)
    pair = torch.full((d,), P, dtype=torch.long)
    pair[first] = pair[second] = torch.arange(P)
    partner = torch.arange(d)
    partner[first], partner[second] = second, first
    sign = torch.zeros(d, dtype=torch.float64)
    sign[first], sign[second] = -1.0, 1.0
    cos_d = torch.cat([c, torch.ones_like(c[..., :1])], -1)[..., pair]
    sin_d = torch.cat([s, torch.zeros_like(s[..., :1])], -1)[..., pair] * sign
    return x * cos_d + x[..., partner] * sin_d


def positional_symbolic_from_qk(q: Float[Tensor, "head pos d_head"], k: Float[Tensor, "head pos d_head"],
                                first: Tensor, second: Tensor, inv_freq: Tensor, scale: float,
                                generator: torch.Generator, key_start: int = 0, min_keys: int = 2
                                ) -> dict[str, Tensor]:
    """Positional score of every head on one sequence, from its unrotated q and k.

    For each query i with at least ``min_keys`` keys in its window W_i = [key_start, i],
    draw a uniform random permutation σ_i of W_i (keys before ``key_start`` stay, e.g. a
    BOS sink, and are not compared). With logits l_i(j) = q_i R(i) · k_j R(j) / scale and
    the permuted logits l'_i(j) = q_i R(i) · k_{σ_i(j)} R(j) / scale (the token moved to
    j, rotated as position j), over j in W_i and all such queries:

    * positional residual D_pos = RMS(l' - l): 0 for a positional head (invariant);
    * symbolic residual D_sym = RMS(l'_i(j) - l_i(σ_i(j))): 0 for a symbolic head
      (equivariant);
    * positional score P = D_sym / (D_pos + D_sym) in [0, 1]: 1 positional, 0 symbolic,
      NaN when both are 0 (the logits are constant over the window: uniform attention,
      the one case where Urrutia et al. show the two behaviours coincide).

    Logits, not the pattern, are compared, as in Urrutia et al.'s definitions; the query
    is the same in l and l', so no per-query softmax constant enters.

    Args:
        q: ``[head, pos, d_head]`` queries before RoPE (biases included).
        k: ``[head, pos, d_head]`` keys before RoPE (biases included), expanded over
            grouped-query heads.
        generator: draws the permutations (seeded by the caller).

    Returns:
        ``{"positional_score", "positional_residual", "symbolic_residual"}``, each
        ``[head]`` float64 (residuals in logit units).

    Raises:
        ValueError: if no query has ``min_keys`` keys in its window.
    """
    n = q.shape[1]
    pos = torch.arange(n)
    q_rot = rotate(q, pos[None], first, second, inv_freq)  # [H, n, d]
    k = k.double()
    logits = torch.einsum("hid,hjd->hij", q_rot, rotate(k, pos[None], first, second, inv_freq)) / scale
    return _score_from_rotated(q_rot, k, logits, first, second, inv_freq, scale, generator,
                               key_start, min_keys)


def _score_from_rotated(q_rot: Tensor, k: Tensor, logits: Tensor, first: Tensor, second: Tensor,
                        inv_freq: Tensor, scale: float, generator: torch.Generator,
                        key_start: int, min_keys: int) -> dict[str, Tensor]:
    """:func:`positional_symbolic_from_qk` from ``[H, n, d]`` rotated queries, unrotated
    float64 keys and the ``[H, n, n]`` unpermuted logits (a caller that has them already
    checked them against the model)."""
    n = q_rot.shape[1]
    pos = torch.arange(n)
    i, j = pos[:, None], pos[None, :]
    window = (j >= key_start) & (j <= i)  # [query, key]
    rows = window.sum(-1) >= min_keys
    if not bool(rows.any()):
        raise ValueError(f"no query has min_keys={min_keys} keys at or after key_start={key_start} "
                         f"in {n} positions; use longer sequences or a smaller key_start")
    r = torch.rand(n, n, generator=generator, dtype=torch.float64)
    # Window positions first, in random order; the t-th window position is key_start + t.
    order = torch.argsort(torch.where(window, r, 2.0 + j.double()), dim=-1)
    sigma = torch.where(window, order.gather(-1, (j - key_start).clamp(0, n - 1).expand(n, n)),
                        j.expand(n, n))  # [query, key]
    keep = window & rows[:, None]
    d_pos, d_sym = (torch.sqrt(torch.from_numpy(x) / keep.sum())
                    for x in _residual_sums(q_rot, k, logits, sigma, keep, first, second,
                                            inv_freq, scale))
    total = d_pos + d_sym
    score = torch.where(total > 0, d_sym / torch.where(total > 0, total, 1.0), torch.nan)
    return {"positional_score": score, "positional_residual": d_pos, "symbolic_residual": d_sym}


def _residual_sums(q_rot: Tensor, k: Tensor, logits: Tensor, sigma: Tensor, keep: Tensor,
                   first: Tensor, second: Tensor, inv_freq: Tensor, scale: float):
    """Per head, Σ (l' - l)² and Σ (l'_i(j) - l_i(σ_i(j)))² over ``keep`` (float64 numpy),
    where l'_i(j) = (q_i R(i)) · (k_{σ_i(j)} R(j)) / scale, without rotating keys: per
    rotary pair p, with u = (q_i R(i))_p, v = (k_m)_p and c, s = cos, sin(j θ_p),
    u · v R(j) = c (u1 v1 + u2 v2) + s (u2 v1 - u1 v2); unrotated dims add q_i · k_m.
    A compiled loop (:mod:`._rotary_kernel`), one pass, no [head, query, key] temporaries.
    """
    from ._rotary_kernel import permutation_residual_sums

    n, d = q_rot.shape[1], q_rot.shape[2]
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq.double()  # [key j, P]
    used = torch.zeros(d, dtype=torch.bool)
    used[first] = used[second] = True
    rest = (~used).nonzero().flatten()
    return permutation_residual_sums(
        q_rot.double().numpy(), k.double().numpy(), logits.double().numpy(), sigma.numpy(),
        keep.numpy(), first.numpy(), second.numpy(), rest.numpy(), torch.cos(angle).numpy(),
        torch.sin(angle).numpy(), float(scale))


def frequency_bands(inv_freq: Float[Tensor, "n_pairs"], n_bands: int = 4) -> list[tuple[int, ...]]:
    """Rotary pairs in ``min(n_bands, n_pairs)`` bands, fastest first.

    Pairs are ordered by decreasing θ_p (``inv_freq``, radians per token; ties by index),
    then split into bands of sizes differing by at most one, as ``numpy.array_split``
    (with the usual θ_p = base^(-2p/d) this is bands of consecutive pairs, pair 0 the
    fastest, as docs/frequencies.md groups them).

    Raises:
        ValueError: for ``n_bands < 1`` or an empty ``inv_freq``.
    """
    if not is_int(n_bands) or n_bands < 1:
        raise ValueError(f"n_bands must be an integer >= 1, got {n_bands}")
    theta = torch.as_tensor(inv_freq, dtype=torch.float64).flatten()
    if not len(theta):
        raise ValueError("inv_freq is empty: no rotary pairs")
    order = sorted(range(len(theta)), key=lambda p: (-float(theta[p]), p))
    return [tuple(int(p) for p in part) for part in np.array_split(order, min(n_bands, len(theta)))]


def band_label(band: Sequence[int]) -> str:
    """``"p3"``, ``"p0-3"`` (consecutive pairs) or ``"p0+2"``: a band's name in tables, on
    the inspect page and in QK-constraint names (``ban_band_p0-1``). Inverse:
    :func:`parse_band_label`.

    Raises:
        ValueError: for an empty band or negative / repeated pairs.
    """
    pairs = sorted(int(p) for p in band)
    if not pairs or pairs[0] < 0 or len(set(pairs)) < len(pairs):
        raise ValueError(f"band must be non-empty distinct pair indices >= 0, got {band!r}")
    if pairs == list(range(pairs[0], pairs[-1] + 1)):
        return f"p{pairs[0]}" if len(pairs) == 1 else f"p{pairs[0]}-{pairs[-1]}"
    return "p" + "+".join(map(str, pairs))


def parse_band_label(label: str) -> tuple[int, ...]:
    """The pairs of a :func:`band_label` (``"p2"``, ``"p0-3"``, ``"p0+2"``).

    Raises:
        ValueError: for anything else, naming the accepted forms.
    """
    import re

    m = re.fullmatch(r"p(\d+)(?:-(\d+)|((?:\+\d+)+))?", str(label))
    if m is None:
        raise ValueError(f"a band is written p<pair>, p<first>-<last> or p<a>+<b>+..., e.g. "
                         f"'p0', 'p0-3', 'p0+2'; got {label!r}")
    first = int(m.group(1))
    if m.group(2) is not None:
        last = int(m.group(2))
        if last < first:
            raise ValueError(f"band {label!r}: the last pair must be >= the first")
        return tuple(range(first, last + 1))
    pairs = (first, *(int(p) for p in m.group(3).split("+")[1:])) if m.group(3) else (first,)
    if len(set(pairs)) < len(pairs):
        raise ValueError(f"band {label!r} repeats a pair")
    return tuple(sorted(pairs))


# --- model plumbing --------------------------------------------------------------------------

def _require_rotary(model, who: str) -> None:
    from ..models.backend import positional_type

    for attr in ("cfg", "blocks"):
        if not hasattr(model, attr):
            raise ValueError(f"{who} needs a TransformerLens model (HookedTransformer or "
                             f"TransformerBridge); got {type(model).__name__} without {attr!r}")
    scheme = positional_type(model)
    if scheme != "rotary":
        raise ValueError(f"{who} needs a rotary (RoPE) model; this model's positional scheme is "
                         f"{scheme!r}, which has no rotary frequency pairs")


def _select(name: str, chosen, n: int) -> list[int]:
    return list(range(n)) if chosen is None else check_indices(name, chosen, n)


def rope_frequency_profile(model, layers: int | Sequence[int] | None = None,
                           heads: int | Sequence[int] | None = None,
                           offsets: Sequence[int] = (0, -1), weights: str = "effective"
                           ) -> pd.DataFrame:
    """Share of each head's QK energy in each rotary frequency pair (module docstring).

    Weights as :func:`posinterp.analysis.spectral.qk_weights` reads them (``weights``:
    ``"effective"``, the attention norm's gain folded, or ``"stored"``), keys expanded
    over grouped-query heads; RoPE layout and θ_p from
    :func:`posinterp.models.backend.rotary_spec` per layer, so HF RoPE scaling and
    partial rotary are the model's own. The ``"qk"`` shares are reported at each key
    offset Δ in ``offsets`` (default 0, the raw W_Q W_K^T, and -1, the previous token).
    Biases are not part of the form (opt-in, docs/concepts.md); the positional score
    (:func:`positional_symbolic_score`) reads q and k with their biases.

    Returns:
        Tidy DataFrame ``hook, layer, head, pair, frequency, period, offset, metric,
        value``: ``pair`` 0 .. rotary_dim/2 - 1 (NA for the unrotated dims of a
        partial-rotary head, whose row has ``frequency`` 0 and ``period`` inf),
        ``frequency`` θ_p in radians per token, ``period`` 2π/θ_p in tokens, ``metric``
        in ``W_Q``, ``W_K``, ``qk`` (``offset`` NA for ``W_Q``/``W_K``), ``value`` a
        share in [0, 1]. The unrotated row appears only where ``rotary_dim < d_head``.

    Raises:
        ValueError: for a non-rotary model (naming its scheme), layers/heads out of
            range, a non-integer offset, or ``weights`` not in ("effective", "stored").
    """
    from ..models.backend import rotary_spec
    from .spectral import qk_weights

    _require_rotary(model, "rope_frequency_profile")
    offsets = list(offsets)
    if not offsets or not all(is_int(o) for o in offsets):
        raise ValueError(f"offsets must be a non-empty sequence of integers, got {offsets}")
    layer_ids = _select("layers", layers, model.cfg.n_layers)
    head_ids = _select("heads", heads, model.cfg.n_heads)
    d_head = model.cfg.d_head
    frames = []
    for layer in layer_ids:
        spec = rotary_spec(model, layer)
        first, second, unrot = pair_indices(d_head, spec.rotary_dim, spec.adjacent_pairs)
        W_Q, W_K = qk_weights(model, layer, None, weights)
        sh = pair_energy_shares(W_Q[head_ids], W_K[head_ids], first, second, unrot,
                                spec.inv_freq, offsets)
        P = len(first)
        n_rows = P + (1 if len(unrot) else 0)
        theta = np.concatenate([spec.inv_freq.double().numpy(), [0.0]])[:n_rows]
        with np.errstate(divide="ignore"):
            period = np.where(theta > 0, 2 * math.pi / np.where(theta > 0, theta, 1.0), np.inf)
        pair = pd.array(list(range(P)) + [pd.NA] * (n_rows - P), dtype="Int64")

        cols = {"hook": f"blocks.{layer}.attn", "layer": layer,
                "head": np.repeat(head_ids, n_rows), "pair": np.tile(pair, len(head_ids)),
                "frequency": np.tile(theta, len(head_ids)), "period": np.tile(period, len(head_ids))}
        blocks = [(sh["W_Q"], "W_Q", pd.NA), (sh["W_K"], "W_K", pd.NA)]
        blocks += [(sh["qk"][:, t], "qk", off) for t, off in enumerate(offsets)]
        for values, metric, off in blocks:
            frames.append(pd.DataFrame({**cols, "offset": off, "metric": metric,
                                        "value": values[..., :n_rows].numpy().reshape(-1)}))
    df = pd.concat(frames, ignore_index=True)
    return df.astype({"pair": "Int64", "offset": "Int64"})


def positional_symbolic_score(model, tokens: Int[Tensor, "batch pos"],
                              layers: int | Sequence[int] | None = None,
                              heads: int | Sequence[int] | None = None, key_start: int = 0,
                              min_keys: int = 2, level: float = 0.95, seed: int = 0,
                              check_tol: float | None = None,
                              attention_mask: Int[Tensor, "batch pos"] | None = None,
                              *, _cache=None) -> pd.DataFrame:
    """Positional vs symbolic score of every selected head on ``tokens``, with an interval.

    Operational version of Urrutia et al. (ICLR 2026, arXiv 2511.11579, §3; the paper's
    exact metric was not reachable offline): per sequence,
    :func:`positional_symbolic_from_qk` permutes the key tokens of each query's window at
    random and compares the head's logits with the unpermuted ones (invariant: positional)
    and with the unpermuted logits carried along by the permutation (equivariant:
    symbolic). The head's own q and k on the model's input are read from the hooks
    :func:`posinterp.models.backend.query_hooks` verified on the loaded model as the query
    and key before RoPE (never a hook trusted by its name), rotated with the model's RoPE
    (:func:`posinterp.models.backend.rotary_spec`). Before anything is reported, the
    unpermuted logits of every sequence are checked against the model's own attention on
    that input: its pre-softmax scores where a hook verified to carry them exists
    (:func:`posinterp.models.backend.scores_hook`), else the softmax of the logits
    against its verified, editable pattern hook (TransformerLens 4 native attention,
    :class:`posinterp.models.backend.HookMeaning`), so a hook that carries something else
    is caught.

    The permutation moves the key's content inside the head only: the residual stream
    that produced q and k is the model's own (positions earlier layers wrote into it stay
    with the token).

    Args:
        tokens: ``[batch, pos]`` token ids.
        attention_mask: ``[batch, pos]`` 1 for real tokens (either padding side); a pad is
            never a position: each sequence's real tokens are positions 0, 1, ... (as
            posinterp's models place them), and the check above holds the model to it.
        key_start: keys before this position are left in place and not compared (1 leaves
            a BOS token out).
        min_keys: a query enters once its window holds at least this many keys (>= 2).
        level: the two-sided level of the Student-t interval over sequences
            (:func:`posinterp.analysis.kernels.t_interval`).
        seed: seeds the permutations.
        check_tol: the largest deviation allowed between the reconstruction and the model:
            relative to max |score| against scores, absolute (a probability) against the
            pattern. None: 1e-3 for float32/64 activations, 3e-2 for float16/bfloat16 (their
            rounding, about 4e-3 per value, adds up over d_head products).

    Returns:
        Tidy DataFrame ``hook, layer, head, metric, value, ci_low, ci_high, n_sequences``
        with ``metric`` in ``positional_score`` (1 positional, 0 symbolic),
        ``positional_residual`` and ``symbolic_residual`` (logit units); ``value`` is the
        mean over sequences.

    Raises:
        ValueError: for a non-rotary model, bad tokens or mask, ``min_keys < 2``,
            ``key_start < 0``, layers/heads out of range, or sequences too short for any
            query window.
        MissingFeatureError: where the model has no hook verified as the unrotated q/k, or
            neither a pre-softmax score hook nor an editable pattern hook to check the
            reconstruction against, or the hooks do not reproduce the model's attention;
            on a model whose attention scores are soft-capped (the setting named), and on
            multi-head latent attention (MLA, named).
    """
    from ..models.backend import (
        MissingFeatureError,
        attn_scale,
        n_kv_heads,
        rotary_spec,
        run_reduced,
    )
    from ._checks import check_attention_mask, check_tokens
    from .kernels import t_interval

    _require_rotary(model, "positional_symbolic_score")
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    if not is_int(min_keys) or min_keys < 2:
        raise ValueError(f"min_keys must be an integer >= 2 (a permutation of one key is the "
                         f"identity), got {min_keys}")
    if not is_int(key_start) or key_start < 0:
        raise ValueError(f"key_start must be a non-negative integer, got {key_start}")
    layer_ids = _select("layers", layers, model.cfg.n_layers)
    head_ids = _select("heads", heads, model.cfg.n_heads)
    H, group = model.cfg.n_heads, model.cfg.n_heads // n_kv_heads(model)
    names = _score_hooks(model, layer_ids)
    real = (torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.bool().cpu())
    gen = torch.Generator().manual_seed(seed)  # drawn layer by layer, in layer order

    def layer_rows(layer, q, k, ref):
        _, _, _, is_pattern = names[layer]
        spec = rotary_spec(model, layer)
        first, second, _ = pair_indices(model.cfg.d_head, spec.rotary_dim, spec.adjacent_pairs)
        scale = attn_scale(model, layer)
        tol = check_tol if check_tol is not None else (
            1e-3 if q.dtype in (torch.float32, torch.float64) else 3e-2)
        q = q.double()  # [batch, pos, head, d_head]
        k = k.double()
        if k.shape[2] != H:  # grouped-query: hook_k carries the KV heads only
            k = k.repeat_interleave(group, dim=2)
        per_seq = {m: [] for m in SCORE_METRICS}
        # no padding: every sequence rotated at once (positions 0..pos-1 for all)
        whole = _rotated_logits(q.transpose(1, 2), k.transpose(1, 2), first, second,
                                spec.inv_freq, scale) if bool(real.all()) else None
        for b in range(tokens.shape[0]):
            r = real[b]
            if whole is not None:
                q_rot, kb, logits = (x[b] for x in whole)
            else:  # [head, n_b, d_head]: a pad is never a position
                q_rot, kb, logits = _rotated_logits(q[b, r].transpose(0, 1),
                                                    k[b, r].transpose(0, 1), first, second,
                                                    spec.inv_freq, scale)
            # the logits the score permutes are the model's own, or nothing is reported
            _check_logits(logits, ref[b].double()[:, r][:, :, r], tol, layer, MissingFeatureError,
                          is_pattern=is_pattern)
            out = _score_from_rotated(q_rot[head_ids], kb[head_ids], logits[head_ids], first,
                                      second, spec.inv_freq, scale, gen, key_start, min_keys)
            for m in SCORE_METRICS:
                per_seq[m].append(out[m])
        rows = []
        for m in SCORE_METRICS:
            mean, low, high, n = t_interval(torch.stack(per_seq[m]), level)
            for t, head in enumerate(head_ids):
                rows.append(dict(hook=f"blocks.{layer}.attn", layer=layer, head=head, metric=m,
                                 value=float(mean[t]), ci_low=float(low[t]), ci_high=float(high[t]),
                                 n_sequences=int(n[t])))
        return rows

    rows = []
    if _cache is not None:  # a run of this model on these tokens holding those hooks (inspect_heads)
        for layer in layer_ids:
            q_name, k_name, ref_name, _ = names[layer]
            rows += layer_rows(layer, _cache[q_name], _cache[k_name], _cache[ref_name])
    else:  # at hook time: each layer's q and k kept until its attention fires, then dropped
        held = {}
        reducers = []
        for layer in layer_ids:
            q_name, k_name, ref_name, _ = names[layer]
            reducers += [(q_name, lambda a, key=(layer, "q"): held.__setitem__(key, a.cpu())),
                         (k_name, lambda a, key=(layer, "k"): held.__setitem__(key, a.cpu())),
                         (ref_name, lambda a, layer=layer: layer_rows(
                             layer, held.pop((layer, "q")), held.pop((layer, "k")), a.cpu()))]
        for got in run_reduced(model, tokens, mask, reducers)[2::3]:
            rows += got
    return pd.DataFrame(rows)


def _rotated_logits(q: Tensor, k: Tensor, first: Tensor, second: Tensor, inv_freq: Tensor,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(q R(i), k, q R(i) · k R(j) / scale)`` for ``[..., head, n, d_head]`` q and k at
    positions 0..n-1, float64."""
    pos = torch.arange(q.shape[-2])
    q_rot = rotate(q, pos, first, second, inv_freq)
    logits = torch.einsum("...id,...jd->...ij", q_rot, rotate(k, pos, first, second, inv_freq))
    return q_rot, k.double(), logits / scale


def _score_hooks(model, layer_ids) -> dict[int, tuple[str, str, str, bool]]:
    """Per layer: the hooks verified on ``model`` as its unrotated q and k, the hook its
    logits are checked against (pre-softmax scores, else the pattern) and whether that is
    the pattern (:func:`positional_symbolic_score`).

    Raises:
        MissingFeatureError: as :func:`positional_symbolic_score`.
    """
    from ..models.backend import check_no_soft_cap, hook_meaning, query_hooks, scores_hook

    layer_ids = list(layer_ids)
    check_no_soft_cap(model, "positional_symbolic_score", layer_ids)  # tanh: no additive split
    names = {}
    for layer in layer_ids:
        q_name, k_name = query_hooks(model, layer)  # verified on this model, or raises
        meaning = hook_meaning(model, layer)
        if meaning.scores is None and meaning.pattern is None:
            scores_hook(model, layer)  # raises, naming what the probe found
        ref = meaning.scores if meaning.scores is not None else meaning.pattern
        names[layer] = (q_name, k_name, ref, meaning.scores is None)
    return names


def positional_score_hooks(model, layers=None) -> set[str]:
    """The hooks :func:`positional_symbolic_score` reads on every layer of ``model`` (or on
    ``layers``; a caller that runs the model anyway can cache them and pass the run on,
    as :func:`posinterp.dashboard.inspect.inspect_heads` does).

    Raises:
        MissingFeatureError: as :func:`positional_symbolic_score`.
    """
    names = _score_hooks(model, range(model.cfg.n_layers) if layers is None else layers)
    return {n for trio in names.values() for n in trio[:3]}


#: real tokens of each sequence the inspection's positional score reads: its permutations
#: cost n^2 d_head per head and sequence (minutes per layer at 4,096 tokens), so longer
#: inputs are scored on their first tokens (causal: the prefix's q, k and attention are
#: the whole input's first rows)
POSITIONAL_TOKENS = 512


def _prefix_order(mask, batch: int, pos: int, max_tokens: int) -> Tensor | None:
    """``[batch, <= max_tokens]`` indices of each sequence's first ``max_tokens`` real
    tokens, real ones first (None where every sequence is that short)."""
    lengths = torch.full((batch,), pos) if mask is None else mask.sum(-1).cpu()
    if int(lengths.max()) <= max_tokens:
        return None
    return (torch.arange(pos).expand(batch, pos) if mask is None else
            torch.sort((mask.cpu() == 0).long(), dim=-1, stable=True).indices)[:, :max_tokens]


def positional_prefix(tokens: Int[Tensor, "batch pos"], attention_mask=None,
                      max_tokens: int = POSITIONAL_TOKENS):
    """``(tokens, mask)`` of each sequence's first ``max_tokens`` real tokens, real ones
    first (the input itself where every sequence is that short): causal attention makes
    their q, k and attention those of the whole input's first tokens, so the positional
    score of this prefix is what :func:`positional_score_capture` reads of the whole
    (tests/dashboard/test_hook_time.py)."""
    batch, pos = tokens.shape
    order = _prefix_order(attention_mask, batch, pos, max_tokens)
    if order is None:
        return tokens, attention_mask
    mask = None if attention_mask is None else attention_mask.cpu().gather(1, order)
    return tokens.cpu().gather(1, order), mask


def positional_score_capture(model, tokens: Int[Tensor, "batch pos"],
                             attention_mask: Int[Tensor, "batch pos"] | None = None,
                             layers=None, max_tokens: int = POSITIONAL_TOKENS):
    """Reducers that keep, as a forward pass fires them, what
    :func:`positional_symbolic_score` reads of each layer, cut to the first ``max_tokens``
    real tokens of each sequence (whole where every sequence is that short: the same
    numbers as a cached run), so a caller that reduces the pass at hook time
    (:func:`posinterp.models.backend.run_reduced`) need not cache a pattern.

    Returns:
        ``(reducers, finish)``: ``[(hook_name, fn)]`` for ``run_reduced``, and
        ``finish(results) -> (tokens, mask, cache)`` turning their results into the
        arguments of :func:`inspection_frequency_rows` (tokens ``[batch, <= max_tokens]``,
        real tokens first).

    Raises:
        MissingFeatureError: as :func:`positional_score_hooks`.
    """
    names = _score_hooks(model, range(model.cfg.n_layers) if layers is None else layers)
    batch, pos = tokens.shape
    mask = attention_mask
    order = _prefix_order(mask, batch, pos, max_tokens)

    def cut(act, square: bool):
        if order is None:
            return act.cpu()
        o = order.to(act.device)
        if square:  # [batch, head, q, k]
            return torch.stack([act[b][:, o[b]][:, :, o[b]] for b in range(batch)]).cpu()
        return act.gather(1, o.view(batch, -1, *[1] * (act.ndim - 2)).expand(
            -1, -1, *act.shape[2:])).cpu()  # [batch, pos, ...]

    reducers = []
    for q_name, k_name, ref, _ in names.values():
        reducers += [(q_name, lambda a: cut(a, False)), (k_name, lambda a: cut(a, False)),
                     (ref, lambda a: cut(a, True))]

    def finish(results):
        cache = {name: r for (name, _), r in zip(reducers, results, strict=True)}
        if order is None:
            return tokens, attention_mask, cache
        toks = tokens.cpu().gather(1, order)
        m = None if mask is None else mask.cpu().gather(1, order)
        return toks, m, cache

    return reducers, finish


def _check_logits(pred, scores, tol, layer, error, is_pattern: bool = False) -> None:
    """Raise ``error`` unless the reconstructed ``[..., head, query, key]`` logits ``pred``
    (q R(i) · k R(j) / scale) reproduce the model's attention on the causal entries
    (j <= i): its pre-softmax ``scores`` to ``tol`` relative to their largest magnitude,
    or, with ``is_pattern``, its pattern (``scores`` holds it) as the causal softmax of
    the logits to ``tol`` in probability."""
    n = pred.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if is_pattern:
        pred = pred.masked_fill(~causal, float("-inf")).softmax(-1)
        ref = torch.ones(())
        what = "pattern"
    else:
        ref = scores[..., causal].abs().max().clamp_min(1e-12)
        what = "pre-softmax scores"
    dev = (pred - scores).abs()[..., causal].max()
    if not bool(dev <= tol * ref):
        raise error(
            f"layer {layer}: the verified hook_q/hook_k rotated with the model's RoPE do not "
            f"reproduce its {what} on this input (max deviation {float(dev):.3g} vs "
            f"{'1 (a probability)' if is_pattern else f'max |score| {float(ref):.3g}'}); "
            "positional_symbolic_score refuses it (with padding: the model may not place a "
            "sequence's real tokens at positions 0, 1, ...)")


def inspection_frequency_rows(model, tokens: Int[Tensor, "batch pos"],
                              attention_mask: Int[Tensor, "batch pos"] | None = None,
                              seed: int = 0, cache=None, layers=None, heads=None
                              ) -> tuple[pd.DataFrame, list[str]]:
    """The RoPE rows of ``posinterp inspect`` (docs/inspect.md), in its table's columns.

    ``layers``/``heads``: the selected heads only (None: every one).

    * ``frequency_share``: per head, rotary pair (``rank``; NA for the unrotated dims of a
      partial-rotary head) and offset Δ in (0, -1): the ``qk`` share of
      :func:`rope_frequency_profile` (sums to 1 per head and offset);
    * ``rotary_frequency``: per layer (``head`` NA) and pair (``rank``), θ_p in radians
      per token, for the bars' labels (period 2π/θ_p);
    * ``positional_score``: per head, :func:`positional_symbolic_score` on the inspected
      input, with its interval over sequences (keys at position 0 left out of the
      permutations when every sequence starts with the tokenizer's BOS).

    ``cache``: a run of ``model`` on ``tokens`` (with this mask) holding the hooks
    :func:`positional_score_hooks` names, when the caller has one (``inspect_heads``
    does); else the score runs the model once.

    On a model that is not RoPE, no rows and a note saying why; where the score cannot be
    checked on this model (:class:`~posinterp.models.backend.MissingFeatureError`), the
    profile alone and a note naming what is missing.
    """
    from ..models.backend import MissingFeatureError, bos_token_id, positional_type, rotary_spec

    scheme = positional_type(model)
    if scheme != "rotary":
        return pd.DataFrame(), [
            f"No frequency profile or positional/symbolic score: this model's positional "
            f"scheme is {scheme!r}, which has no rotary frequency pairs (docs/frequencies.md)."]
    notes = []
    prof = rope_frequency_profile(model, layers, heads, offsets=(0, -1))
    qk = prof[prof.metric == "qk"]
    frames = [pd.DataFrame({"hook": qk.hook, "layer": qk.layer, "head": qk["head"], "rank": qk.pair,
                            "offset": qk.offset, "metric": "frequency_share", "value": qk.value})]
    for layer in range(model.cfg.n_layers) if layers is None else layers:
        theta = rotary_spec(model, layer).inv_freq.double().numpy()
        frames.append(pd.DataFrame({"hook": f"blocks.{layer}.attn", "layer": layer,
                                    "rank": np.arange(len(theta)), "metric": "rotary_frequency",
                                    "value": theta}))
    bos = bos_token_id(model)
    firsts = [int(t[m.bool()][0]) if attention_mask is not None else int(t[0])
              for t, m in zip(tokens, attention_mask if attention_mask is not None else tokens,
                              strict=True)]
    key_start = 1 if bos is not None and all(f == bos for f in firsts) else 0
    try:
        score = positional_symbolic_score(model, tokens, layers, heads, key_start=key_start, seed=seed,
                                          attention_mask=attention_mask, _cache=cache)
    except MissingFeatureError as err:
        notes.append(f"No positional/symbolic score on this model: {err}.")
    else:
        frames.append(score[score.metric == "positional_score"])
        if key_start:
            notes.append("positional_score: the BOS at position 0 stays in place and is not "
                         "compared (key_start=1).")
    return pd.concat(frames, ignore_index=True), notes
