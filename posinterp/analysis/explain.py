"""Explain one score: a head's pre-softmax attention score split into parts that add up.

For head h of layer l, query position i and key position j of one sequence, with the
conventions of docs/concepts.md (row vectors, TransformerLens's W_Q, b_Q, attn_scale s):

    score_ij = (q_i R(i)) · (k_j R(j)) / s + a_ij,

where q_i, k_j are the head's query and key before any rotation (biases included), R(t)
is RoPE's rotation at position t (the identity for other schemes) and a_ij ALiBi's bias
m_h (j - i) (0 for other schemes); masked cells (j > i) are not scores. Write
q_i = u_i + b_Q and k_j = v_j + b_K, with b_Q, b_K the *effective* biases
b = b_stored + b_ln W_stored (the attention norm's bias folded in, as TransformerLens's
``fold_ln`` writes it), so u_i = x̂_i W_Q^eff is the weight part acting on the normalized
residual x̂ (:data:`posinterp.analysis.spectral.QK_CONVENTION`). Then

    score_ij = u_i R(i)·v_j R(j)/s                      (weights: the content term)
             + u_i R(i)·b_K R(j)/s  [q_dot_b_K]
             + b_Q R(i)·v_j R(j)/s  [b_Q_dot_k]
             + b_Q R(i)·b_K R(j)/s  [b_Q_dot_b_K]
             + a_ij                 [alibi]

and the weight term is split two ways, each exact:

* **by spectral channel** (``view="channel"``, every head): with Π_c the spectral
  projectors of B = W_K^eff^T W_Q^eff (:func:`posinterp.analysis.channels.channel_projectors`:
  positive-real, negative-real, complex pairs, and the null remainder, which sum to I),
  part c is u_i Π_c R(i)·v_j R(j)/s. Π_c acts on the query before the rotation, so for
  RoPE heads these are the channels of M(0), the content form, and part c is exactly
  the score change of the ``remove_<c>`` intervention on the weight part
  (:mod:`posinterp.interventions.qk`; docs/concepts.md, "Spectral channels"). The
  ``null`` part is the content no eigenvalue carries (nonzero only where B is singular
  with a nilpotent block; docs/concepts.md).
* **by rotary frequency pair** (``view="rotary_pair"``, RoPE heads): RoPE rotates each
  pair (first[p], second[p]) in its own plane by t·θ_p, so the dot product splits into
  one term per pair, (u_i R(i))_p·(v_j R(j))_p / s = Re(z_u conj(z_v) e^{i(i-j)θ_p}) / s
  with z = x_first + i x_second, plus the unrotated dims of a partial-rotary head
  (``unrotated``). Pair indices, layout and θ_p are the model's own
  (:func:`posinterp.models.backend.rotary_spec`, as :mod:`.frequencies`).

Both views share the bias and ALiBi parts, so the parts of either view sum to the score.

Sources: Vaswani et al. 2017, eq. 1 (scaled dot product); Su et al. 2021 (RoFormer),
eq. 34 (per-pair rotation); Press et al. 2022, §3 (ALiBi); Elhage et al. 2021,
"A Mathematical Framework for Transformer Circuits" (the QK circuit W_Q W_K^T).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .._validate import check_indices
from ..models.rope_layout import pair_indices
from .frequencies import rotate
from .spectral import CHANNELS, NULL_CHANNEL

__all__ = ["BIAS_PARTS", "CHANNEL_PARTS", "score_parts", "score_parts_from_qk"]

CHANNEL_PARTS = (*CHANNELS, NULL_CHANNEL)
BIAS_PARTS = ("q_dot_b_K", "b_Q_dot_k", "b_Q_dot_b_K")
VIEWS = ("channel", "rotary_pair")
COLUMNS = ["hook", "layer", "head", "query", "key", "offset", "view", "part", "pair", "frequency",
           "metric", "value"]


# --- the pure function ------------------------------------------------------------------------

def score_parts_from_qk(
    q: Float[Tensor, "n d_head"], k: Float[Tensor, "n d_head"],
    b_Q: Float[Tensor, "d_head"], b_K: Float[Tensor, "d_head"],
    projectors: dict[str, Float[Tensor, "d_head d_head"]], scale: float, *,
    rotary: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    query_pos: Int[Tensor, "n"] | None = None, key_pos: Int[Tensor, "n"] | None = None,
    alibi: Float[Tensor, "n"] | None = None,
) -> dict[str, Tensor]:
    """The parts of n scores of one head, one (query, key) pair per row (module docstring).

    Args:
        q: ``[n, d_head]`` the query at pair r's query position, before any rotation,
            biases included (what ``hook_q`` carries once verified,
            :func:`posinterp.models.backend.query_hooks`).
        k: ``[n, d_head]`` the key at pair r's key position, likewise (``hook_k``).
        b_Q: ``[d_head]`` the effective query bias (stored bias plus the attention norm's
            bias times the stored weight); u = q - b_Q is the weight part.
        b_K: ``[d_head]`` the effective key bias, likewise.
        projectors: ``{"positive_real", "negative_real", "complex", "null"}`` ->
            ``[d_head, d_head]`` spectral projectors of B = W_K^T W_Q (they sum to I;
            :func:`posinterp.analysis.channels.channel_projectors`).
        scale: attn_scale s, the divisor of q·k (usually sqrt(d_head)).
        rotary: ``(first, second, unrotated, inv_freq)`` for a RoPE head
            (:func:`posinterp.analysis.frequencies.pair_indices` and θ_p in radians per
            token), None otherwise.
        query_pos: ``[n]`` query position (token index) of each pair, for RoPE.
        key_pos: ``[n]`` key position (token index) of each pair, for RoPE.
        alibi: ``[n]`` the positional bias a_ij added to each score (logits), or None.

    Returns:
        float64 ``[n]`` tensors: one per channel part (:data:`CHANNEL_PARTS`), per bias part
        (:data:`BIAS_PARTS`), ``alibi`` (zeros without it) and ``total`` (their sum, the
        score in logits); for RoPE also ``pair`` ``[n, n_pairs]`` and ``unrotated`` ``[n]``,
        which with the bias and ALiBi parts sum to the same total.

    Raises:
        ValueError: for mismatched shapes, a non-positive ``scale``, missing projectors,
            or RoPE without positions.
    """
    if q.ndim != 2 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [n, d_head], got {tuple(q.shape)} and {tuple(k.shape)}")
    n, d = q.shape
    if tuple(b_Q.shape) != (d,) or tuple(b_K.shape) != (d,):
        raise ValueError(f"b_Q and b_K must be [d_head={d}], got {tuple(b_Q.shape)} and {tuple(b_K.shape)}")
    missing = [c for c in CHANNEL_PARTS if c not in projectors]
    if missing:
        raise ValueError(f"projectors must hold {CHANNEL_PARTS}; missing {missing}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if alibi is not None and tuple(alibi.shape) != (n,):
        raise ValueError(f"alibi must be [n={n}], got {tuple(alibi.shape)}")
    rot = None
    if rotary is not None:
        if query_pos is None or key_pos is None or query_pos.shape != (n,) or key_pos.shape != (n,):
            raise ValueError(f"a RoPE head needs query_pos and key_pos of shape [n={n}]")
        rot = (rotary, query_pos.cpu(), key_pos.cpu())
    parts = _parts_of_heads(q[None], k[None], b_Q[None], b_K[None],
                            {c: projectors[c][None] for c in CHANNEL_PARTS}, scale, rot,
                            None if alibi is None else alibi[None])
    return {key: val[0] for key, val in parts.items()}


def _parts_of_heads(q: Tensor, k: Tensor, b_Q: Tensor, b_K: Tensor, projectors: dict,
                    scale: float, rot, alibi: Tensor | None) -> dict[str, Tensor]:
    """:func:`score_parts_from_qk` for ``[H, n, d_head]`` q and k, ``[H, d_head]`` biases,
    ``[H, d_head, d_head]`` projectors and ``[H, n]`` ALiBi of H heads at once
    (:func:`score_parts` splits every head of a layer in one go); ``rot``: None or
    ``((first, second, unrotated, inv_freq), query_pos, key_pos)``. Returns ``[H, ...]``."""
    H, n, d = q.shape
    q, k = q.detach().double().cpu(), k.detach().double().cpu()
    bq, bk = b_Q.detach().double().cpu()[:, None], b_K.detach().double().cpu()[:, None]
    u, v = q - bq, k - bk
    if rot is not None:
        (first, second, unrot, inv_freq), query_pos, key_pos = rot

        def rq(x: Tensor) -> Tensor:
            return rotate(x.expand(H, n, d), query_pos, first, second, inv_freq)

        def rk(x: Tensor) -> Tensor:
            return rotate(x.expand(H, n, d), key_pos, first, second, inv_freq)
    else:
        def rq(x: Tensor) -> Tensor:
            return x.expand(H, n, d)
        rk = rq

    def dot(a: Tensor, b: Tensor) -> Tensor:
        return (a * b).sum(-1) / scale

    ru, rv = rq(u), rk(v)
    out = {c: dot(rq(u @ projectors[c].double().cpu()), rv) for c in CHANNEL_PARTS}
    out["q_dot_b_K"] = dot(ru, rk(bk))
    out["b_Q_dot_k"] = dot(rq(bq), rv)
    out["b_Q_dot_b_K"] = dot(rq(bq), rk(bk))
    out["alibi"] = (torch.zeros(H, n, dtype=torch.float64) if alibi is None
                    else alibi.detach().double().cpu())
    out["total"] = sum(out[c] for c in (*CHANNEL_PARTS, *BIAS_PARTS, "alibi"))
    if rot is not None:
        prod = ru * rv / scale  # [H, n, d_head]
        out["pair"] = prod[..., first] + prod[..., second]
        out["unrotated"] = prod[..., unrot].sum(-1)
    return out


# --- model plumbing ---------------------------------------------------------------------------

def _norm_bias(model, layer: int) -> Tensor | None:
    """The bias of the LayerNorm feeding ``layer``'s attention, if it is still there
    (``LN``; ``LNPre``/RMS have none: folded by the loader, or no bias)."""
    from ..models.backend import attention_input_norm_module

    if model.cfg.normalization_type != "LN":
        return None
    norm, _ = attention_input_norm_module(model, layer)
    b = getattr(norm, "b", None)
    return None if b is None else b.detach().cpu().double()


def _select(name: str, chosen, n: int) -> list[int]:
    return list(range(n)) if chosen is None else check_indices(name, chosen, n)


def _one_sequence(model, tokens: Tensor, attention_mask) -> Tensor:
    from ._checks import check_attention_mask, check_tokens

    tokens = check_tokens(model, tokens)
    if tokens.shape[0] != 1:
        raise ValueError(f"tokens must be one sequence ([pos] or [1, pos]), got batch {tokens.shape[0]}")
    mask = check_attention_mask(attention_mask, tuple(tokens.shape))
    if mask is not None:  # a pad is never a position: the k-th real token is position k
        tokens = tokens[:, mask[0].bool()]
    if tokens.shape[1] < 1:
        raise ValueError("tokens holds no real token")
    return tokens


def score_parts(model, tokens: Int[Tensor, "pos"], layers: int | Sequence[int] | None = None,
                heads: int | Sequence[int] | None = None, queries: int | Sequence[int] | None = None,
                keys: int | Sequence[int] | None = None, *,
                attention_mask: Int[Tensor, "pos"] | None = None,
                check_tol: float | None = None) -> pd.DataFrame:
    """Split heads' pre-softmax scores on one sequence into parts that sum to the score.

    One forward pass caches the heads' queries and keys from the hooks verified to carry
    them before any rotation (:func:`posinterp.models.backend.query_hooks`), never a hook
    trusted by its name; :func:`score_parts_from_qk` does the split (module docstring:
    channel view for every head, frequency-pair view for RoPE heads, bias and ALiBi
    parts apart). The sum is checked against the model's own pre-softmax score
    (:func:`posinterp.models.backend.scores_hook`) or, where the model has no such hook
    (TL 4 native attention), softmax of each query's row of sums against its pattern.

    Args:
        tokens: one sequence, ``[pos]`` or ``[1, pos]`` token ids.
        layers: which layers (default: all).
        heads: which heads of each layer (default: all).
        queries: query positions (default: all).
        keys: key positions (default: all); every pair with key <= query is explained
            (later keys are masked: not scores).
        attention_mask: ``[pos]`` 1 for real tokens: pads are dropped first, so positions
            count real tokens.
        check_tol: the largest deviation allowed between the sums and the model's scores,
            relative to max(1, max |score|) (or absolute, on pattern probabilities); None:
            1e-3 for float32/64 activations, 3e-2 for half precision.

    Returns:
        Tidy DataFrame :data:`COLUMNS`: ``hook`` (``blocks.{l}.attn``), ``layer``, ``head``,
            ``query``, ``key``, ``offset`` = key - query (Δ <= 0), then

            * ``metric="score_part"``: ``view`` ``channel`` or ``rotary_pair``, ``part`` (a
              channel of :data:`CHANNEL_PARTS`, a bias part of :data:`BIAS_PARTS`, ``alibi``
              on ALiBi models, ``pair`` with its ``pair`` index and ``frequency`` θ_p in
              radians per token, ``unrotated`` for partial rotary), ``value`` in logits. The
              parts of one view of one cell sum to its ``score_total``.
            * ``metric="score_total"`` (the sum), ``"model_score"`` (the model's own score;
              NaN where it has no pre-softmax score hook), ``"pattern"`` (its attention
              weight), with ``view``/``part`` NA.

    Raises:
        ValueError: bad tokens or indices, a bidirectional model.
        MissingFeatureError: where no hook is verified to carry the unrotated query and
            key, on a model whose attention scores are soft-capped (the setting named:
            T tanh(q·k / T) has no additive parts), on multi-head latent attention (MLA,
            named), or where the sums do not reproduce the model's scores.
    """
    from ..models.backend import (
        MissingFeatureError,
        attention_weights,
        attn_scale,
        check_no_soft_cap,
        content_qk_from,
        hook_meaning,
        positional_type,
        query_hooks,
        rotary_spec,
    )
    from ..models.positions import alibi_bias_of
    from ._checks import masked_scores, run_cached
    from .channels import channel_projectors
    from .spectral import qk_weights

    if getattr(model.cfg, "attention_dir", "causal") != "causal":
        raise ValueError("score_parts needs a causal model; this one is bidirectional")
    tokens = _one_sequence(model, tokens, attention_mask)
    n = tokens.shape[1]
    layer_ids = _select("layers", layers, model.cfg.n_layers)
    head_ids = _select("heads", heads, model.cfg.n_heads)
    q_ids = _select("queries", queries, n)
    k_ids = set(_select("keys", keys, n))
    H = model.cfg.n_heads
    scheme = positional_type(model)
    check_no_soft_cap(model, "score_parts", layer_ids)  # tanh(content): no additive parts
    names = {}
    for layer in layer_ids:  # verified hooks, asked before the pass (the probe runs its own)
        m = hook_meaning(model, layer)
        names[layer] = (query_hooks(model, layer), m.scores, f"blocks.{layer}.attn.hook_pattern")
    wanted = {h for trio in names.values() for h in (*trio[0], *trio[1:]) if h is not None}
    cache = run_cached(model, tokens, None, lambda name: name in wanted)
    # every allowed key of each selected query: the check needs whole rows
    qi = torch.tensor([i for i in q_ids for _ in range(i + 1)], dtype=torch.long)
    kj = torch.tensor([j for i in q_ids for j in range(i + 1)], dtype=torch.long)
    frames = []
    for layer in layer_ids:
        (q_name, k_name), s_name, p_name = names[layer]
        q_all, k_all = content_qk_from((q_name, k_name), cache, H)  # [1, pos, head, d_head]
        scale = attn_scale(model, layer)
        stored = attention_weights(model, layer)
        b_ln = _norm_bias(model, layer)
        b_Q, b_K = stored["b_Q"], stored["b_K"]  # [head, d_head], K expanded
        if b_ln is not None:
            b_Q = b_Q + torch.einsum("d,hde->he", b_ln, stored["W_Q"])
            b_K = b_K + torch.einsum("d,hde->he", b_ln, stored["W_K"])
        W_Q, W_K = qk_weights(model, layer)  # effective: the spectra's convention
        rotary, freq = None, None
        if scheme == "rotary":
            spec = rotary_spec(model, layer)
            first, second, unrot = pair_indices(model.cfg.d_head, spec.rotary_dim, spec.adjacent_pairs)
            rotary, freq = (first, second, unrot, spec.inv_freq), spec.inv_freq.double().numpy()
        alibi = alibi_bias_of(model, layer) if scheme == "alibi" else None  # this pass's bias
        alibi = None if alibi is None else alibi.detach().cpu()  # on the model's device
        # every selected head of the layer split at once
        projs = [channel_projectors(W_K[head].T @ W_Q[head]) for head in head_ids]
        hs = list(head_ids)
        heads_parts = _parts_of_heads(
            q_all[0, qi][:, hs].transpose(0, 1), k_all[0, kj][:, hs].transpose(0, 1),
            b_Q[hs], b_K[hs], {c: torch.stack([P[c] for P in projs]) for c in CHANNEL_PARTS},
            scale, None if rotary is None else (rotary, qi, kj),
            None if alibi is None else alibi[0][hs][:, qi, kj].double().cpu())
        for t, head in enumerate(head_ids):
            parts = {key: val[t] for key, val in heads_parts.items()}
            model_score = (cache[s_name][0, head, qi, kj] if s_name is not None
                           else torch.full((len(qi),), torch.nan, dtype=torch.float64))
            # a masked cell (past a sliding window) is no score: it is left out
            live = ~masked_scores(model_score)
            model_score = model_score.double()
            pattern = cache[p_name][0, head, qi, kj].double()
            _check(parts["total"], model_score, pattern, qi, live, cache[q_name].dtype, check_tol,
                   layer, head, MissingFeatureError)
            keep = torch.tensor([int(j) in k_ids for j in kj], dtype=torch.bool) & live
            frames.append(_cell_rows(layer, head, qi[keep], kj[keep],
                                     {key: val[keep] for key, val in parts.items()},
                                     model_score[keep], pattern[keep], scheme, freq,
                                     rotary is not None and len(rotary[2]) > 0))
    df = pd.DataFrame({c: np.concatenate([f[c] for f in frames]) for c in COLUMNS})
    df["pair"] = df["pair"].astype("Int64").mask(df["pair"] < 0)  # -1 marks "no pair"
    return df.astype({"layer": "int64", "head": "int64", "query": "int64", "key": "int64",
                      "offset": "int64", "pair": "Int64", "value": "float64"})


def _check(total, model_score, pattern, qi, live, dtype, tol, layer, head, error) -> None:
    """Raise ``error`` unless the sums reproduce the model's scores on the ``live``
    (unmasked) cells, or, without a score hook, softmax of each query's row of sums
    reproduces its pattern on the keys it attends to (pattern > 0)."""
    if tol is None:
        tol = 1e-3 if dtype in (torch.float32, torch.float64) else 3e-2
    if not bool(torch.isnan(model_score).all()):
        dev = float((total - model_score)[live].abs().max())
        ref = max(1.0, float(model_score[live].abs().max()))
        ok, what = dev <= tol * ref, f"max |sum - score| {dev:.3g} (max |score| {ref:.3g})"
    else:
        probs = torch.zeros_like(total)
        for i in qi.unique():
            row = (qi == i) & (pattern > 0)
            probs[row] = total[row].softmax(-1)
        dev = float((probs - pattern).abs().max())
        ok, what = dev <= tol, f"max |softmax(sums) - pattern| {dev:.3g}"
    if not ok:
        raise error(f"layer {layer} head {head}: the parts do not reproduce the model's scores "
                    f"({what}); this attention is not q·k/attn_scale + ALiBi (e.g. soft-capped "
                    "logits), so score_parts refuses it")


def _cell_rows(layer, head, qi, kj, parts, model_score, pattern, scheme, freq, partial
               ) -> dict[str, np.ndarray]:
    """One head's rows as column arrays (one DataFrame is built at the end: thousands of
    small frames cost seconds)."""
    specs = []  # (values, metric, view, part, pair, frequency)
    shared = [*BIAS_PARTS, *(("alibi",) if scheme == "alibi" else ())]
    for c in (*CHANNEL_PARTS, *shared):
        specs.append((parts[c], "score_part", "channel", c, -1, np.nan))
    if "pair" in parts:
        for p in range(parts["pair"].shape[1]):
            specs.append((parts["pair"][:, p], "score_part", "rotary_pair", "pair", p, float(freq[p])))
        if partial:  # the dims RoPE leaves alone (rotary_dim < d_head)
            specs.append((parts["unrotated"], "score_part", "rotary_pair", "unrotated", -1, 0.0))
        for c in shared:
            specs.append((parts[c], "score_part", "rotary_pair", c, -1, np.nan))
    for values, metric in ((parts["total"], "score_total"), (model_score, "model_score"),
                           (pattern, "pattern")):
        specs.append((values, metric, None, None, -1, np.nan))
    n, r = len(qi), len(specs)

    def meta(k):
        return np.repeat(np.array([sp[k] for sp in specs], dtype=object), n)

    return {"hook": np.full(n * r, f"blocks.{layer}.attn", dtype=object),
            "layer": np.full(n * r, layer), "head": np.full(n * r, head),
            "query": np.tile(qi.numpy(), r), "key": np.tile(kj.numpy(), r),
            "offset": np.tile((kj - qi).numpy(), r), "view": meta(2), "part": meta(3),
            "pair": np.repeat(np.array([sp[4] for sp in specs]), n),
            "frequency": np.repeat(np.array([sp[5] for sp in specs], dtype=float), n),
            "metric": meta(1), "value": np.concatenate([sp[0].numpy() for sp in specs])}
