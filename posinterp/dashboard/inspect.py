"""Head-by-head positional inspection: the numbers behind ``posinterp inspect``.

For every head of a model, on a batch of sequences (docs/inspect.md):

* the **positional kernel**: mean attention weight A[i, i+Δ] and mean pre-softmax score
  by key offset Δ = j - i <= 0 (Δ = -1 is the previous token, docs/spectra.md), first
  averaged over the queries of each sequence, then over sequences with a 95% Student-t
  interval (sequences are the independent units);
* previous-token, self and first-token scores (queries i >= 1);
* the induction score (Olsson et al. 2022, §2) on repeated random tokens, and on the
  input itself wherever it repeats a token;
* the QK spectrum (eigenvalues of B = W_K^T W_Q, float64; rotary heads at Δ = 0 and
  Δ = -1), its rotational measures and their percentile among product-Ginibre random
  heads of the same d_model and d_head, and a null band for the eigenvalue plane;
* optionally the loss change when the head, or each of its spectral channels, is
  removed;
* per layer, the adjacency score at the residual points and at the attention output.

Everything lands in one tidy DataFrame (:attr:`Inspection.table`); the HTML page of
:func:`posinterp.viz.inspect_page` is drawn from exactly that table.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy import stats
from torch import Tensor

from .._validate import check_indices, is_int
from ..models.backend import (
    MissingFeatureError,
    eager,
    hooks_at_sites,
    positional_type,
    scores_hook,
    unwrap,
    z_hook,
)
from ._checks import (
    check_attention_mask,
    check_tokens,
    lengths_from_mask,
    masked_scores,
    next_token_loss,
    run_cached,
)
from .adjacency import adjacency_hooks
from .explain import DEFAULT_MAX_VALUES, dashboard_score_parts
from .frequencies import (
    band_label,
    frequency_bands,
    inspection_frequency_rows,
    positional_score_hooks,
)
from .heads import induction_score, induction_targets, previous_token_score, repeated_random_tokens
from .spectral import (
    DEFAULT_EPS,
    NULL_HEADS,
    _measures_frame,
    _spectra,
    _spectrum_frame,
    eigenvalues,
    ginibre_null,
    null_percentiles,
    qk_weights,
    random_heads,
)

__all__ = ["CHANNEL_ABLATIONS", "Inspection", "PatternView", "attention_kernel", "block_labels",
           "compact_pattern",
           "head_scores", "inspect_heads", "null_band", "pool_pattern", "t_interval",
           "uniform_guess_loss"]

CHANNEL_ABLATIONS = ("remove_positive_real", "remove_negative_real", "remove_complex")
#: Random heads behind the null band of |λ| (quantiles of every eigenvalue's modulus: 200
#: heads give 200 x d_head moduli, enough for stable 5%/95% quantiles).
NULL_BAND_HEADS = 200
#: Sequences of repeated random tokens behind the ``induction_score`` (intervals over them).
INDUCTION_BATCH = 4
COLUMNS = ["model", "hook", "layer", "head", "position", "offset", "rank", "ablation", "metric",
           "value", "ci_low", "ci_high", "n_sequences"]


# --- pure functions over tensors ------------------------------------------------------------

def compact_pattern(values: Float[Tensor, "batch head query key"],
                    attention_mask: Int[Tensor, "batch pos"] | None
                    ) -> Float[Tensor, "batch head query key"]:
    """Real tokens first on both the query and the key axis (a pad is never a position).

    Entries beyond a sequence's length keep whatever the padded input held; use the
    lengths to ignore them.
    """
    mask = check_attention_mask(attention_mask, (values.shape[0], values.shape[-1]))
    if mask is None:
        return values
    order = torch.sort((mask == 0).long(), dim=-1, stable=True).indices  # [batch, pos]
    b, h, n, _ = values.shape
    rows = order[:, None, :, None].expand(b, h, n, n)
    cols = order[:, None, None, :].expand(b, h, n, n)
    return values.gather(2, rows).gather(3, cols)


def pool_pattern(pattern: Float[Tensor, "... query key"], block: int
                 ) -> Float[Tensor, "... query_block key_block"]:
    """Downsample an attention pattern into ``block`` x ``block`` tiles for display.

    Tile (I, J) is the attention that the block's average query pays to the whole key
    block: ``mean_{i in I} sum_{j in J} A[i, j]``. Each pooled row is a mean of rows that
    sum to 1, so it sums to 1 too (still an attention pattern, causal up to the diagonal
    tiles). The last block may be shorter (its own queries and keys only).

    Args:
        pattern: ``[..., n, n]`` attention weights.
        block: tokens per tile, >= 1 (1 returns the pattern unchanged).

    Returns:
        ``[..., ceil(n / block), ceil(n / block)]``, the input's dtype.

    Raises:
        ValueError: for ``block < 1`` or a pattern that is not square in its last two dims.
    """
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an integer >= 1, got {block!r}")
    n = pattern.shape[-1]
    if pattern.ndim < 2 or pattern.shape[-2] != n:
        raise ValueError(f"pattern must have shape [..., n, n], got {tuple(pattern.shape)}")
    if block == 1:
        return pattern
    m = -(-n // block)
    groups = torch.arange(n, device=pattern.device) // block  # token -> block
    onehot = torch.nn.functional.one_hot(groups, m).to(pattern.dtype)  # [n, m]
    sizes = onehot.sum(0)  # tokens per block
    # sum over the keys of each block, then the mean over the queries of each block
    return (onehot.T @ (pattern @ onehot)) / sizes[:, None]


def block_labels(str_tokens: list[str], block: int) -> list[str]:
    """Labels of :func:`pool_pattern`'s tiles: the positions each covers and its first token.

    E.g. ``"0-7 <s>"`` for the block of positions 0 to 7 starting with ``<s>``;
    ``block = 1`` returns the tokens unchanged.
    """
    if block == 1:
        return list(str_tokens)
    n = len(str_tokens)
    return [f"{a}-{min(a + block, n) - 1} {str_tokens[a]}" for a in range(0, n, block)]


def t_interval(per_sequence: Float[Tensor, "batch ..."], level: float = 0.95
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mean over dim 0 ignoring NaN, with a two-sided Student-t interval.

    Returns:
        ``(mean, low, high, n)``; ``low``/``high`` are NaN where fewer than 2 values exist.
    """
    x = per_sequence.double()
    ok = ~torch.isnan(x)
    n = ok.sum(0)
    total = torch.where(ok, x, 0.0).sum(0)
    mean = torch.where(n > 0, total / n.clamp_min(1), torch.nan)
    dev = torch.where(ok, x - mean, 0.0)
    sd = torch.sqrt((dev ** 2).sum(0) / (n - 1).clamp_min(1))
    q = torch.tensor(stats.t.ppf(0.5 + level / 2, (n - 1).clamp_min(1).numpy()), dtype=torch.float64)
    half = q * sd / n.clamp_min(1).sqrt()
    low = torch.where(n >= 2, mean - half, torch.nan)
    high = torch.where(n >= 2, mean + half, torch.nan)
    return mean, low, high, n


def attention_kernel(values: Float[Tensor, "batch head query key"],
                     attention_mask: Int[Tensor, "batch pos"] | None = None
                     ) -> Float[Tensor, "batch head lag"]:
    """Per sequence, the mean of ``values[i, i - lag]`` over its real queries i >= lag.

    ``values`` is a causal attention pattern or its pre-softmax scores; ``lag`` = i - j
    = -Δ runs over 0..pos-1. Pads are dropped first (the k-th real token is position k),
    and entries above the diagonal (masked, possibly -inf) are never read. Masked scores
    below it (``<= finfo.min``: past a sliding window, GPT-Neo's local layers) do not
    exist and are left out of the mean.

    Returns:
        ``[batch, head, pos]`` float64; NaN where a sequence has no query at that lag, or
        every query's score at that lag is masked.

    Raises:
        ValueError: for a tensor that is not ``[batch, head, pos, pos]`` or a bad mask.
    """
    if values.ndim != 4 or values.shape[-1] != values.shape[-2]:
        raise ValueError(f"values must have shape [batch, head, pos, pos], got {tuple(values.shape)}")
    b, h, n, _ = values.shape
    mask = check_attention_mask(attention_mask, (b, n))
    lengths = lengths_from_mask(mask, b, n)
    v = compact_pattern(values.detach().double(), mask)
    i = torch.arange(n)
    lag = i[:, None] - i[None, :]  # [query, key]
    valid = (lag >= 0)[None] & (i[None, :, None] < lengths[:, None, None])  # [batch, q, k]
    # A masked score (past a sliding window, GPT-Neo's local layers, a user's knockout) is
    # not a score: it is left out, and a lag where every query is masked is NaN, not -inf.
    # (checked in the input's dtype: finfo(float32).min is no mask in float64)
    valid = valid[:, None] & ~masked_scores(compact_pattern(values.detach(), mask))  # [b, h, q, k]
    flat_lag = lag.clamp_min(0).flatten()
    sums = torch.zeros(b, h, n, dtype=torch.float64)
    sums.index_add_(2, flat_lag, torch.where(valid, v, 0.0).reshape(b, h, n * n))
    counts = torch.zeros(b, h, n, dtype=torch.float64)
    counts.index_add_(2, flat_lag, valid.reshape(b, h, n * n).double())
    return torch.where(counts > 0, sums / counts.clamp_min(1), torch.nan)


def head_scores(pattern: Float[Tensor, "batch head query key"],
                attention_mask: Int[Tensor, "batch pos"] | None = None
                ) -> dict[str, Float[Tensor, "batch head"]]:
    """Previous-token, self and first-token score of every head, per sequence.

    Each is a mean over real queries i >= 1 (query 0 can only attend to itself):
    A[i, i-1] (:func:`~posinterp.analysis.previous_token_score`), A[i, i] and A[i, 0],
    where 0 is the first real token (the BOS when the input has one).

    Raises:
        ValueError: as :func:`~posinterp.analysis.previous_token_score` (a sequence with
            fewer than 2 real tokens).
    """
    b, _, n, _ = pattern.shape
    mask = check_attention_mask(attention_mask, (b, n))
    out = {"previous_token_score": previous_token_score(pattern, mask)}
    lengths = lengths_from_mask(mask, b, n)
    p = compact_pattern(pattern.detach().double(), mask)
    i = torch.arange(n)
    valid = ((i[None, :] >= 1) & (i[None, :] < lengths[:, None]))[:, None]  # [batch, 1, q]
    denom = valid.sum(-1)
    out["self_score"] = torch.where(valid, torch.diagonal(p, dim1=-2, dim2=-1), 0.0).sum(-1) / denom
    out["first_token_score"] = torch.where(valid, p[..., 0], 0.0).sum(-1) / denom
    return out


def null_band(d_model: int, d_head: int, n_heads: int = 200, quantiles=(0.05, 0.95), seed: int = 0
              ) -> tuple[float, float]:
    """Quantiles of |λ| over all eigenvalues of random heads with unit-variance entries.

    For W_Q, W_K with i.i.d. N(0, σ_Q²), N(0, σ_K²) entries the moduli scale by σ_Q σ_K,
    so a head's band is these numbers times the RMS entries of its W_Q and W_K
    (docs/spectra.md, the product-Ginibre null; Ginibre 1965). Seeded: drawn once per
    process for each argument set.

    Raises:
        ValueError: for non-positive sizes.
    """
    if min(d_model, d_head, n_heads) < 1:
        raise ValueError("d_model, d_head and n_heads must be >= 1")
    return _null_band(int(d_model), int(d_head), int(n_heads),
                      tuple(float(x) for x in quantiles), int(seed))


@functools.lru_cache(maxsize=8)
def _null_band(d_model: int, d_head: int, n_heads: int, quantiles: tuple, seed: int
               ) -> tuple[float, float]:
    # seeded: drawn once per process for each argument set, as ginibre_null
    gen = torch.Generator().manual_seed(seed)
    mods = np.concatenate([eigenvalues(q, k).abs().flatten().numpy()
                           for q, k in random_heads(gen, n_heads, d_model, d_head)])
    lo, hi = np.quantile(mods, quantiles)
    return float(lo), float(hi)


# --- the inspection --------------------------------------------------------------------------

@dataclass(frozen=True)
class PatternView:
    """One sequence's attention patterns as the page's pattern view shows them.

    Attributes:
        label: what the sequence is (e.g. ``"sequence 1"``, ``"repeated random tokens"``).
        str_tokens: the ``m`` labels (tokens, or pooled blocks: :func:`block_labels`).
        patterns: ``{layer: [head, m, m]}`` float32, the selected heads in
            ``meta["heads"]`` order, pooled into ``block`` x ``block`` tiles
            (:func:`pool_pattern`) when longer than ``max_pattern_tokens``.
        block: tokens per tile (1: not pooled).
        n_tokens: the sequence's real tokens.
    """

    label: str
    str_tokens: list[str]
    patterns: dict[int, Tensor]
    block: int = 1
    n_tokens: int = 0


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect_heads` found.

    Attributes:
        table: the tidy DataFrame (columns :data:`COLUMNS`); ``offset`` is the key offset
            Δ = j - i of kernel rows and the RoPE offset of spectral rows (NA otherwise).
        patterns: ``{layer: [head, m, m]}`` attention of the first sequence (real tokens
            only) for the pattern views; longer than ``max_pattern_tokens``, pooled into
            blocks of ``meta["pattern_block"]`` tokens (:func:`pool_pattern`), else m = n.
            Heads are ``meta["heads"]`` in that order (every head unless selected).
        str_tokens: the ``m`` labels: the tokens, or each block's positions and first
            token (:func:`block_labels`).
        notes: plain sentences about cuts and choices, shown on the page.
        meta: model facts (``n_layers``, ``n_heads``, ``pe``, ...).
        score_parts: "Explain one score": :func:`posinterp.analysis.explain.score_parts`
            of every head on the first tokens of the pattern views (None if not computed).
        pattern_views: the page's sequence picker beyond sequence 0 (:attr:`patterns`):
            :class:`PatternView` of the next input sequences and of one sequence of the
            induction score's repeated random tokens.
    """

    table: pd.DataFrame
    patterns: dict[int, Tensor]
    str_tokens: list[str]
    notes: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    score_parts: pd.DataFrame | None = None
    pattern_views: list[PatternView] = field(default_factory=list)

    def head_view(self) -> pd.DataFrame:
        """Wide view: one row per (layer, head), one column per scalar score."""
        return head_wide(self.table)

    def _repr_html_(self) -> str:
        """The ``posinterp inspect`` dashboard inline in a notebook: the page
        :func:`posinterp.viz.inspect_page` writes, in a frame (posinterp.viz.notebook)."""
        from ..viz.inspect import inspect_page
        from ..viz.notebook import notebook_html

        models = self.table["model"].dropna().unique() if "model" in self.table else []
        title = "posinterp inspect" + (f": {models[0]}" if len(models) else "")
        return notebook_html(inspect_page(self, title), height=900)


def _input_facts(model, tokens, mask) -> dict:
    from .compare import input_facts  # what makes two inspections comparable

    return input_facts(model, tokens, mask)


def score_key(metric: str, offset, ablation) -> str:
    """Column name of a scalar per-head row in the wide view (e.g. ``rotational_mass@Δ=-1``)."""
    key = metric
    if isinstance(ablation, str) and ablation:
        key += f"[{ablation}]"
    if offset is not None and not pd.isna(offset):
        key += f"@Δ={int(offset)}"
    return key


#: Metrics whose ``offset`` is the key offset Δ = j - i (the positional kernels); every other
#: offset in the table is a RoPE offset (spectral rows, frequency shares).
_KERNEL_METRICS = ("kernel_attention", "kernel_score")
#: Metrics with several rows per head at one offset and ablation (by key offset, eigenvalue
#: ``rank`` or rotary pair ``rank``): never one per-head score. The one list: the wide view,
#: the comparison and both pages read it (the pages from their embedded data).
_VECTOR_METRICS = (*_KERNEL_METRICS, "eigenvalue_real", "eigenvalue_imag", "frequency_share")


def head_wide(table: pd.DataFrame) -> pd.DataFrame:
    """The scalar per-head rows of an inspection table, one column per score."""
    t = table[table["head"].notna() & ~table.metric.isin(_VECTOR_METRICS)]
    keys = [score_key(m, o, a) for m, o, a in zip(t.metric, t.offset, t.ablation, strict=True)]
    wide = t.assign(score=keys).pivot_table(index=["layer", "head"], columns="score", values="value",
                                            sort=False)
    wide.columns.name = None
    return wide.reset_index().astype({"layer": "int64", "head": "int64"})


def _str_tokens(model, toks: Tensor) -> list[str]:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return [f"#{int(t)}" for t in toks]
    return [str(s) for s in model.to_str_tokens(toks)]


def _rows(**cols) -> pd.DataFrame:
    n = max(len(v) for v in cols.values() if isinstance(v, list | np.ndarray))
    return pd.DataFrame({k: (v if isinstance(v, list | np.ndarray) else [v] * n) for k, v in cols.items()})


def _attention_interval(per_seq: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`t_interval` of attention weights, its bounds clipped to [0, 1]: a weight's
    mean lies there, so a t-band reaching past it (few sequences, a skewed weight) says
    nothing beyond the range itself."""
    mean, low, high, n = t_interval(per_seq)
    return mean, low.clamp(0.0, 1.0), high.clamp(0.0, 1.0), n


def _kernel_rows(layer: int, hook: str, metric: str, per_seq: Tensor, max_lag: int,
                 head_ids) -> pd.DataFrame:
    interval = _attention_interval if metric == "kernel_attention" else t_interval
    mean, low, high, n = interval(per_seq[..., :max_lag])  # [head, lag]
    heads, lags = mean.shape
    return _rows(hook=hook, layer=layer, head=np.repeat(np.asarray(head_ids), lags),
                 offset=np.tile(-np.arange(lags), heads), metric=metric,
                 value=mean.flatten().numpy(), ci_low=low.flatten().numpy(),
                 ci_high=high.flatten().numpy(), n_sequences=n.flatten().numpy())


@torch.no_grad()
def _loss(model, tokens, mask, fwd_hooks=()) -> float:
    """Mean next-token cross-entropy (nats) from each real token to the next real one."""
    from ..devices import model_device, to_device
    from ..models.backend import eval_mode

    model = unwrap(model)  # a torch.compile wrapper's hooks would not fire
    device = model_device(model)
    # forward on the model's device in eval mode, scores on CPU; eagerly, so the hooks fire
    with eager(model), eval_mode(model), model.hooks(fwd_hooks=list(fwd_hooks)):
        logits = model(tokens.to(device), attention_mask=to_device(mask, device)).cpu()
    return float(next_token_loss(logits, tokens, mask))


ABLATION_METHODS = ("exact", "attribution")
ATTRIBUTION_NOTE = ("Loss changes marked 'attribution' are first-order estimates (attribution "
                    "patching, Nanda 2023: the gradient of the loss times the edit, from one "
                    "forward and one backward pass), not measured losses; the {k} largest by "
                    "size were rerun exactly and are marked 'exact'.")


def _band_kinds(model, layer: int) -> list[str]:
    """RoPE models: a head's fastest and its slowest frequency band (a quarter of the rotary
    pairs each, :func:`~posinterp.analysis.frequencies.frequency_bands`), as ablation kinds
    ``remove_band_<band>``; none on other schemes."""
    from ..models.backend import positional_type, rotary_spec

    if positional_type(model) != "rotary":
        return []
    bands = frequency_bands(rotary_spec(model, layer).inv_freq)
    # one band when there is one pair
    return [f"remove_band_{band_label(b)}" for b in dict.fromkeys((bands[0], bands[-1]))]


def _ablation_method(ablate) -> str | None:
    if ablate is False or ablate is None:
        return None
    if ablate is True:
        return "exact"
    if ablate not in ABLATION_METHODS:
        raise ValueError(f"ablate must be False, True, or one of {ABLATION_METHODS}, got {ablate!r}")
    return ablate


def _ablation_rows(model, tokens, mask, layers, method: str = "exact", exact_top_k: int = 20,
                   progress: bool = False, heads=None) -> pd.DataFrame:
    """Loss-change rows: every (layer, head, kind) exactly, or (``attribution``) estimated,
    with the ``exact_top_k`` largest estimates rerun exactly."""
    from tqdm.auto import tqdm

    from ..interventions.head_ablation import (
        HEAD_ABLATIONS,
        attribution_estimates,
        head_ablation_losses,
    )

    heads = range(model.cfg.n_heads) if heads is None else heads
    abl = [(layer, head, kind) for layer in layers for head in heads
           for kind in (*HEAD_ABLATIONS, *_band_kinds(model, layer))]
    rows = []

    def row(a, metric, value):
        layer, head, kind = a
        hook = z_hook(model, layer) if kind == "zero_head" else f"blocks.{layer}.attn"
        return dict(hook=hook, layer=layer, head=head, ablation=kind, metric=metric, value=value,
                    n_sequences=tokens.shape[0])

    if method == "attribution":
        clean, est = attribution_estimates(model, tokens, mask, abl)
        rows += [row(a, "loss_change_attribution", float(e)) for a, e in zip(abl, est, strict=True)]
        top = np.argsort(-np.abs(est), kind="stable")[:exact_top_k]
        abl = [abl[i] for i in sorted(top)]
    with tqdm(total=len(abl), disable=not progress, desc="ablations", unit="ablation",
              dynamic_ncols=True) as bar:
        clean, losses, _ = head_ablation_losses(model, tokens, mask, abl, on_done=bar.update) \
            if abl else (_loss(model, tokens, mask), np.array([]), "")
    rows += [row(a, "loss_change", float(v - clean)) for a, v in zip(abl, losses, strict=True)]
    return pd.DataFrame(rows).assign(clean_loss=clean)


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    out, start = [], None
    for a, b in zip(ids, [*ids[1:], None], strict=True):
        start = a if start is None else start
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = None
    return ", ".join(out)


def _score_rows(hook: str, layer: int, head_ids, metric: str, per_seq: Tensor) -> pd.DataFrame:
    """One row per head: the mean of an attention score over sequences (NaN ones left out)
    with its interval, clipped to [0, 1]; ``n_sequences`` counts the sequences that have it."""
    mean, low, high, n = _attention_interval(per_seq)
    return _rows(hook=hook, layer=layer, head=np.asarray(head_ids), metric=metric, value=mean.numpy(),
                 ci_low=low.numpy(), ci_high=high.numpy(), n_sequences=n.numpy())


def _view_pattern(pattern: Tensor, mask: Tensor | None, s: int, block: int) -> Tensor:
    """Sequence ``s``'s real tokens of ``[batch, head, q, k]``, pooled into ``block`` tiles."""
    n = pattern.shape[-1] if mask is None else int(mask[s].sum())
    one = compact_pattern(pattern[s:s + 1], mask[s:s + 1] if mask is not None else None)
    return pool_pattern(one[0, :, :n, :n].detach().double().cpu(), block).float()


def _induction_rows(model, layers, heads, n_wanted: int, seed: int, max_pattern_tokens: int,
                    frames: list, notes: list) -> list[PatternView]:
    """The ``induction_score`` rows (appended to ``frames``) on :data:`INDUCTION_BATCH`
    sequences of repeated random tokens, from one forward pass caching the selected
    layers' patterns; returns the pattern view of the first such sequence (none when
    ``n_wanted`` is 0 or nothing fits)."""
    from .fingerprint import _has_bos

    if n_wanted == 0:
        return []
    bos = _has_bos(model)
    n = min(n_wanted, (model.cfg.n_ctx - bos) // 2, model.cfg.d_vocab - bos)
    if n < 1:
        notes.append(f"No induction score: n_ctx = {model.cfg.n_ctx} leaves no room for a repeated "
                     "token sequence.")
        return []
    toks = repeated_random_tokens(model, INDUCTION_BATCH, n, seed=seed, bos=bos)
    notes.append(f"induction_score: mean attention from each token of the second copy to the token "
                 f"after its first occurrence (i - {n} + 1), on {INDUCTION_BATCH} sequences of {n} "
                 f"seeded random token ids (distinct, seed {seed}) repeated once"
                 f"{', a BOS first' if bos else ''} (Olsson et al. 2022, §2); "
                 "induction_score_input: the same on the input itself, where a token repeats"
                 + (f" (n cut to {n} by the model's n_ctx and vocabulary)." if n < n_wanted else "."))
    hooks = {f"blocks.{layer}.attn.hook_pattern" for layer in layers}
    cache = run_cached(model, toks, None, lambda name: name in hooks)
    pos = toks.shape[1]
    block = -(-pos // max_pattern_tokens)
    pats = {}
    for layer in layers:
        hook = f"blocks.{layer}.attn.hook_pattern"
        pattern = cache[hook][:, heads]
        frames.append(_score_rows(hook, layer, heads, "induction_score",
                                  induction_score(pattern, toks)))
        pats[layer] = _view_pattern(pattern, None, 0, block)
    label = f"repeated random tokens ({n} ids twice: induction)"
    return [PatternView(label, block_labels(_str_tokens(model, toks[0]), block), pats, block, pos)]


def uniform_guess_loss(model) -> float:
    """log(d_vocab) nats: the cross-entropy of predicting every token with equal probability.

    On uniform random tokens no predictor does better in expectation (the expected loss
    is log(d_vocab) plus the KL divergence from uniform), so a clean loss at or above it
    means the input carries nothing the model can predict.
    """
    d_vocab = getattr(model.cfg, "d_vocab_out", -1)
    return math.log(d_vocab if d_vocab and d_vocab > 0 else model.cfg.d_vocab)


def inspect_heads(
    model,
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    *,
    ablate: bool | str = False,
    exact_top_k: int = 20,
    max_offset: int | None = None,
    max_pattern_tokens: int = 96,
    n_null: int = NULL_HEADS,
    seed: int = 0,
    model_name: str = "model",
    explain_values: int = DEFAULT_MAX_VALUES,
    progress: bool = False,
    layers: int | list[int] | None = None,
    heads: int | list[int] | None = None,
    induction_tokens: int = 32,
    pattern_sequences: int = 4,
) -> Inspection:
    """Inspect every head of ``model`` on ``tokens``: kernel, scores, spectrum, ablations.

    Args:
        model: a causal TransformerLens model (``HookedTransformer`` or compatible).
        tokens: ``[batch, pos]`` ids, ``pos <= n_ctx``; every sequence needs >= 3 real
            tokens (adjacency). Intervals are over sequences, so use batch >= 2.
        attention_mask: ``[batch, pos]`` 1 for real tokens (either padding side), e.g.
            the tokenizer's own mask. Required for a padded batch.
        ablate: also measure the loss change (nats per token, real next-token pairs)
            when each head's output ``hook_z`` is zeroed, and when each of its spectral
            channels is removed (:mod:`posinterp.interventions`, Δ = 0 content form);
            on RoPE models also its fastest and its slowest frequency band
            (``remove_band``: the query's components in those rotary pairs zeroed).
            ``True`` or ``"exact"``: every one exactly (one rerun of the layers from the
            ablated one on, batched; :mod:`posinterp.interventions.head_ablation`).
            ``"attribution"``: first-order estimates for all (attribution patching, one
            forward and one backward pass; metric ``loss_change_attribution``) and exact
            ``loss_change`` only for the ``exact_top_k`` largest estimates.
        exact_top_k: with ``ablate="attribution"``, how many ablations are rerun exactly.
        max_offset: keep kernel rows for Δ >= -max_offset only (default: every offset).
        max_pattern_tokens: pattern views of a longer sequence are pooled into blocks of
            ceil(n / max_pattern_tokens) tokens (:func:`pool_pattern`; a note states the
            scale); nothing is cut.
        n_null: random heads in the product-Ginibre null of the percentiles (default
            :data:`~posinterp.analysis.spectral.NULL_HEADS`, as the fingerprint); the
            band uses at most :data:`NULL_BAND_HEADS` of them.
        seed: seed of the null.
        model_name: value of the ``model`` column.
        explain_values: bound on the numbers stored for "Explain one score" (the score
            decomposition of every head's pattern cells,
            :func:`posinterp.analysis.explain.dashboard_score_parts`): the first n
            tokens of the pattern views whose cells fit (default 200,000: about 1.7 MB of
            page); 0 computes none.
        progress: a tqdm bar on stderr for the ablations' forward passes.
        layers: inspect only these blocks (an int or a list; None: all). Everything per
            head or per layer is computed for the selection alone (patterns cached,
            spectra solved, heads ablated): at 7B scale (1,024 heads) a few layers cost a
            fraction of the whole.
        heads: in each selected block, only these heads (an int or a list; None: all).
        induction_tokens: n of the induction score's input, :data:`INDUCTION_BATCH`
            sequences of :func:`~posinterp.analysis.heads.repeated_random_tokens`
            ([BOS, r_1..r_n, r_1..r_n], seeded by ``seed``; one more forward pass). Cut to
            what ``n_ctx`` and the vocabulary allow (with a note); 0 leaves the score out.
        pattern_sequences: input sequences in the page's sequence picker (the first
            ones, each pooled as sequence 0 is); the induction input's first sequence
            is offered besides.

    Returns:
        :class:`Inspection`; its ``table`` has one row per (layer, head, metric, offset,
        rank, ablation). Metrics: ``kernel_attention``, ``kernel_score`` (by offset, with
        ``ci_low``/``ci_high``), ``previous_token_score``, ``self_score``,
        ``first_token_score`` (with intervals), ``induction_score`` (repeated random
        tokens) and ``induction_score_input`` (the input's own repeats: the mean of
        :func:`~posinterp.analysis.heads.induction_score` over the sequences that repeat
        a token, ``n_sequences`` of them; NaN where none does), ``rotational_mass``, ``phase``,
        ``antisymmetric_energy``, ``n_complex_pairs`` and ``<measure>_null_percentile``
        (rotary: offsets 0 and -1), ``eigenvalue_real``/``eigenvalue_imag`` (by
        ``rank``), ``null_band_low``/``null_band_high`` (5%/95% of a random head's |λ|
        at this head's weight scale), ``loss_change`` (by ``ablation``; with
        ``ablate``), and per layer (head NA) ``adjacency_score`` by ``hook``. RoPE
        models also get ``frequency_share`` (by rotary pair ``rank`` and offset),
        ``positional_score`` (with intervals) and per layer ``rotary_frequency``
        (:func:`~posinterp.analysis.frequencies.inspection_frequency_rows`), and with
        ``ablate`` the ablations ``remove_band_p..`` of each head's fastest and slowest
        band.

    Raises:
        ValueError: for malformed tokens or mask, a sequence with < 3 real tokens, a
            bidirectional model, ``max_offset``/``max_pattern_tokens`` < 1, a negative
            ``explain_values``/``induction_tokens``, ``pattern_sequences`` < 1, or
            ``layers``/``heads`` outside ``[0, n_layers)``/``[0, n_heads)`` or repeated
            (named, with the range).
        MissingFeatureError: (a ValueError) on a model with multi-head latent attention,
            before any forward pass (:func:`posinterp.models.backend.check_not_mla`).
    """
    from ..models.backend import check_not_mla

    if getattr(model.cfg, "attention_dir", "causal") != "causal":
        raise ValueError("inspect_heads needs a causal model (offsets j - i <= 0); this one is "
                         "bidirectional")
    check_not_mla(model, "inspect_heads")  # its spectra and kernels need per-head W_Q, W_K
    for name, v in (("max_offset", max_offset), ("max_pattern_tokens", max_pattern_tokens)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not isinstance(explain_values, int) or explain_values < 0:
        raise ValueError(f"explain_values must be an integer >= 0, got {explain_values!r}")
    if not is_int(induction_tokens) or induction_tokens < 0:
        raise ValueError(f"induction_tokens must be an integer >= 0, got {induction_tokens!r}")
    if not is_int(pattern_sequences) or pattern_sequences < 1:
        raise ValueError(f"pattern_sequences must be an integer >= 1, got {pattern_sequences!r}")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    all_layers, all_heads = layers is None, heads is None
    layers = list(range(n_layers)) if layers is None else sorted(check_indices("layers", layers, n_layers))
    heads = list(range(n_heads)) if heads is None else sorted(check_indices("heads", heads, n_heads))
    sel = (None if all_layers else layers), (None if all_heads else heads)  # for the helpers
    method = _ablation_method(ablate)
    if not is_int(exact_top_k) or exact_top_k < 0:
        raise ValueError(f"exact_top_k must be an int >= 0, got {exact_top_k!r}")
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    batch, pos = tokens.shape
    lengths = lengths_from_mask(mask, batch, pos)
    if (lengths < 3).any():
        raise ValueError(f"every sequence needs at least 3 real tokens; got lengths {lengths.tolist()}")
    max_lag = int(lengths.max()) if max_offset is None else min(int(lengths.max()), max_offset + 1)
    notes = []
    if batch < 2:
        notes.append("One sequence: intervals over sequences are not defined (shown empty).")
    if not (all_layers and all_heads):
        notes.append(f"Selected heads only: layers {_ranges(layers)} x heads {_ranges(heads)} "
                     f"({len(layers) * len(heads)} of {n_layers * n_heads}); nothing else was computed.")

    # The score kernel needs a hook verified to carry pre-softmax scores: on OPT/GPT-Neo
    # bridges and TL 4 native models hook_attn_scores carries the pattern (never trust a
    # hook by its name), and that kernel is left out with a note.
    score_hooks = {}
    for layer in layers:
        try:
            score_hooks[layer] = scores_hook(model, layer)
        except MissingFeatureError as err:
            notes.append(f"Layer {layer}: no pre-softmax score kernel ({err}).")
    pattern_hooks = {f"blocks.{layer}.attn.hook_pattern" for layer in layers}
    wanted = pattern_hooks | set(score_hooks.values())
    # RoPE: the positional score's verified q/k hooks ride on the same pass
    if positional_type(model) == "rotary":
        try:
            wanted |= positional_score_hooks(model, sel[0])
        except MissingFeatureError:
            pass  # the score is left out with a note below
    # One forward pass: patterns and scores are cached, and the adjacency hooks score each
    # residual point as the pass reaches it (nothing of theirs is kept).
    adj_hooks, adj_table = adjacency_hooks(model, tokens, mask,
                                           sites=("attn_out", "resid_mid", "resid_post"), layers=sel[0])
    with hooks_at_sites(model, adj_hooks):
        cache = run_cached(model, tokens, mask, lambda n: n in wanted)
    frames, patterns = [], {}
    first_len = int(lengths[0])
    # Longer than the browser can show: pool, never cut (every token stays in view).
    block = -(-first_len // max_pattern_tokens)
    sample = tokens[0][mask[0].bool()] if mask is not None else tokens[0]
    str_tokens = block_labels(_str_tokens(model, sample[:first_len]), block)
    if block > 1:
        notes.append(f"Pattern views show all {first_len} tokens of sequence 0 pooled into blocks "
                     f"of {block} tokens (scale 1:{block}, {len(str_tokens)} x {len(str_tokens)} "
                     "cells): a cell is the attention of the block's average query to the whole "
                     "key block, so each row still sums to 1. Kernels and scores use every token.")
    head_ids = np.asarray(heads)
    shown_seqs = list(range(1, min(batch, pattern_sequences)))
    more = {s: {} for s in shown_seqs}  # the picker's other input sequences
    for layer in layers:
        pat_hook = f"blocks.{layer}.attn.hook_pattern"
        pattern = cache[pat_hook][:, heads]  # [batch, selected head, q, k]
        frames.append(_kernel_rows(layer, pat_hook, "kernel_attention",
                                   attention_kernel(pattern, mask), max_lag, head_ids))
        if layer in score_hooks:
            frames.append(_kernel_rows(layer, score_hooks[layer], "kernel_score",
                                       attention_kernel(cache[score_hooks[layer]][:, heads], mask),
                                       max_lag, head_ids))
        per_head = head_scores(pattern, mask)
        per_head["induction_score_input"] = induction_score(pattern, tokens, mask)
        for metric, per_seq in per_head.items():
            frames.append(_score_rows(pat_hook, layer, head_ids, metric, per_seq))
        patterns[layer] = _view_pattern(pattern, mask, 0, block)
        for s in shown_seqs:
            more[s][layer] = _view_pattern(pattern, mask, s, -(-int(lengths[s]) // max_pattern_tokens))
    if not induction_targets(tokens, mask).any():
        notes.append("induction_score_input is NA: no sequence of the input repeats a token, so no "
                     "query has a token after an earlier occurrence to attend to (use text that "
                     "repeats, e.g. a passage and its repetition).")
    views = []
    for s in shown_seqs:
        n_s = int(lengths[s])
        b_s = -(-n_s // max_pattern_tokens)
        toks_s = tokens[s][mask[s].bool()] if mask is not None else tokens[s]
        views.append(PatternView(f"sequence {s}", block_labels(_str_tokens(model, toks_s), b_s),
                                 more[s], b_s, n_s))

    # Induction heads: one more pass, on repeated random tokens (Olsson et al. 2022, §2).
    views += _induction_rows(model, layers, heads, induction_tokens, seed, max_pattern_tokens,
                             frames, notes)

    # Explain one score: every head's score parts on the first tokens of the pattern views.
    # (its own clickable pattern of the first tokens, never pooled)
    shown = min(first_len, max_pattern_tokens)
    parts, note = dashboard_score_parts(model, sample[:shown], shown, explain_values, *sel)
    notes.append(note)

    # QK spectra: measures, null percentiles, eigenvalues, null band at each head's scale.
    # one solve per head for both (spectral_measures and qk_spectrum would each solve it)
    keys, lam, anti = _spectra(model, sel[0], sel[1], None, "effective")
    meas = _measures_frame(keys, lam, anti, None, DEFAULT_EPS)
    null = ginibre_null(model.cfg.d_model, model.cfg.d_head, n_heads=n_null, seed=seed)
    spec = pd.concat([meas, null_percentiles(meas, null)], ignore_index=True)
    frames.append(spec.drop(columns="position"))
    eig = _spectrum_frame(keys, lam)
    for part in ("real", "imag"):
        frames.append(eig.rename(columns={part: "value"})[["hook", "layer", "head", "offset", "rank",
                                                           "value"]].assign(metric=f"eigenvalue_{part}"))
    n_band = min(n_null, NULL_BAND_HEADS)
    lo, hi = null_band(model.cfg.d_model, model.cfg.d_head, n_heads=n_band, seed=seed)
    for layer in layers:
        W_Q, W_K = qk_weights(model, layer)
        scale = (W_Q.pow(2).mean((-1, -2)).sqrt() * W_K.pow(2).mean((-1, -2)).sqrt()).numpy()[heads]
        for metric, q in (("null_band_low", lo), ("null_band_high", hi)):
            frames.append(_rows(hook=f"blocks.{layer}.attn", layer=layer, head=head_ids,
                                metric=metric, value=scale * q))

    # RoPE heads: QK energy per rotary pair and the positional/symbolic score.
    freq_rows, freq_notes = inspection_frequency_rows(model, tokens, mask, seed, cache=cache,
                                                      layers=sel[0], heads=sel[1])
    frames.append(freq_rows)
    notes += freq_notes

    # Per layer: adjacency at the residual points and at the attention output.
    frames.append(adj_table().drop(columns="position"))

    clean_loss = None
    if method is not None:
        abl = _ablation_rows(model, tokens, mask, layers, method, exact_top_k, progress, heads)
        clean_loss = float(abl.clean_loss.iloc[0])
        if clean_loss >= uniform_guess_loss(model):
            notes.append(
                f"The clean loss, {clean_loss:.2f} nats, is at or above log(d_vocab) = "
                f"{uniform_guess_loss(model):.2f} nats, the loss of a uniform guess: the model "
                "predicts this input no better than chance (uniform random tokens cannot be "
                "predicted at all), so the loss changes below say how heads change its guesses "
                "on noise, not how it uses position. Use --text or --input sampled for "
                "loss ablations.")
        frames.append(abl.drop(columns="clean_loss"))
        if method == "attribution":
            notes.append(ATTRIBUTION_NOTE.format(k=int((abl.metric == "loss_change").sum())))
    table = pd.concat([f for f in frames if len(f)], ignore_index=True)
    for col in COLUMNS:
        if col not in table:
            table[col] = pd.NA
    table = table[COLUMNS].assign(model=model_name)
    table = table.astype({"layer": "int64", "head": "Int64", "position": "Int64", "offset": "Int64",
                          "rank": "Int64", "n_sequences": "Int64", "value": "float64",
                          "ci_low": "float64", "ci_high": "float64"})
    table["ablation"] = table["ablation"].astype("string")
    meta = dict(n_layers=n_layers, n_heads=n_heads, d_model=model.cfg.d_model, d_head=model.cfg.d_head,
                n_ctx=model.cfg.n_ctx, pe=model.cfg.positional_embedding_type, batch=batch,
                lengths=lengths.tolist(), max_lag=max_lag, n_null=n_null, n_null_band=n_band,
                seed=seed, clean_loss=clean_loss, uniform_guess_loss=uniform_guess_loss(model),
                ablate=method or False, pattern_block=block,
                exact_top_k=exact_top_k if method == "attribution" else None,
                pattern_tokens=first_len, layers=layers, heads=heads,
                **_input_facts(model, tokens, mask))
    if math.isfinite(max_lag) and max_lag < int(lengths.max()):
        notes.append(f"Kernels are kept for offsets Δ >= -{max_lag - 1} (max_offset).")
    meta["frequency_note"] = None if len(freq_rows) else freq_notes[0]  # why a card has no profile
    return Inspection(table, patterns, str_tokens, notes, meta, score_parts=parts, pattern_views=views)
