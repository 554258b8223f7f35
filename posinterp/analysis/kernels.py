"""Positional kernels, per-head attention scores and display patterns: the pure halves of
``posinterp inspect`` (:mod:`posinterp.dashboard.inspect` runs the model and tabulates them).

* :func:`attention_kernel`: per sequence, the mean attention weight (or pre-softmax score)
  at each key offset Δ = j - i <= 0 (Δ = -1 is the previous token, docs/spectra.md);
* :func:`kernel_bins`, :func:`binned_kernel`: that kernel with every lag up to
  :data:`DENSE_LAGS` and log-spaced lag bins beyond (a long input's kernel in a few
  hundred values instead of n);
* :func:`head_scores`: previous-token, self and first-token scores (queries i >= 1);
* :func:`t_interval`: the mean over sequences with a two-sided Student-t interval
  (sequences are the independent units);
* :func:`compact_pattern`, :func:`pool_pattern`, :func:`block_labels`: real tokens first,
  and long patterns pooled into tiles whose rows still sum to 1;
* :func:`null_band`: quantiles of |λ| of product-Ginibre random heads (Ginibre 1965), the
  eigenvalue plane's null band.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .._disk_cache import cached_arrays
from ..stats import t_critical
from ._attention_blocks import reduce_attention
from ._checks import check_attention_mask, lengths_from_mask
from .spectral import random_small_forms, small_form_eigenvalues

__all__ = ["DENSE_LAGS", "attention_kernel", "binned_kernel", "block_labels", "compact_pattern",
           "head_scores", "kernel_bins", "null_band", "pool_pattern", "t_interval"]

#: lags 0 .. DENSE_LAGS - 1 keep one kernel value each; longer lags are pooled into
#: BINS_PER_OCTAVE bins per doubling of the lag (each 2^(1/16) = 4.4 % wide)
DENSE_LAGS = 256
BINS_PER_OCTAVE = 16


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
    q = torch.tensor(t_critical(level, (n - 1).clamp_min(1).numpy()), dtype=torch.float64)
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
    # in query blocks: a few block-sized copies, not several of the whole tensor
    return reduce_attention(values, mask, kernel=True).kernel()


def kernel_bins(n_lags: int, dense: int = DENSE_LAGS,
                per_octave: int = BINS_PER_OCTAVE) -> list[tuple[int, int]]:
    """Lag bins ``[lo, hi)`` covering lags 0 .. ``n_lags`` - 1: one lag each below
    ``dense``, then edges ``lo_{k+1} = max(lo_k + 1, round(dense * 2^((k+1)/per_octave)))``
    (log-spaced: ``per_octave`` bins per doubling), the last cut at ``n_lags``.

    Raises:
        ValueError: ``n_lags``, ``dense`` or ``per_octave`` below 1.

    Source: posinterp's own display binning (docs/inspect.md, the positional kernel).
    """
    for name, v in (("n_lags", n_lags), ("dense", dense), ("per_octave", per_octave)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    bins = [(lag, lag + 1) for lag in range(min(dense, n_lags))]
    k, lo = 0, dense
    while lo < n_lags:
        k += 1
        hi = min(n_lags, max(lo + 1, round(dense * 2 ** (k / per_octave))))
        bins.append((lo, hi))
        lo = hi
    return bins


def binned_kernel(kernel_sum: Float[Tensor, "... lag"], kernel_count: Float[Tensor, "... lag"],
                  bins: list[tuple[int, int]]) -> Float[Tensor, "... bin"]:
    """The kernel over lag bins: per bin ``[lo, hi)``, the mean weight (or score) over
    every query-key pair whose lag i - j lies in it, i.e. the bin's summed values over
    its summed pair counts (``kernel_sum``/``kernel_count`` by lag, as
    :class:`~posinterp.analysis._attention_blocks.BlockStats` holds them); NaN where
    no pair has such a lag. A one-lag bin is :func:`attention_kernel`'s value. float64,
    in the units of the reduced values (attention weight or pre-softmax score).

    Source: the positional kernel of docs/inspect.md, pooled over each bin's pairs.
    """
    edges = torch.tensor([0] + [hi for _, hi in bins])
    cs = torch.nn.functional.pad(kernel_sum.double().cumsum(-1), (1, 0))
    cc = torch.nn.functional.pad(kernel_count.double().cumsum(-1), (1, 0))
    s = cs[..., edges[1:]] - cs[..., edges[:-1]]
    c = cc[..., edges[1:]] - cc[..., edges[:-1]]
    return torch.where(c > 0, s / c.clamp_min(1), torch.nan)


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
    if pattern.ndim != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(f"pattern must have shape [batch, head, pos, pos], got {tuple(pattern.shape)}")
    b, _, n, _ = pattern.shape
    mask = check_attention_mask(attention_mask, (b, n))
    lengths = lengths_from_mask(mask, b, n)
    if (lengths <= 1).any():
        raise ValueError(f"every sequence needs more than start=1 real tokens; "
                         f"got lengths {lengths.tolist()}")
    return reduce_attention(pattern, mask, kernel=False, scores=True).scores()


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


# The band's algorithm version in the on-disk cache (posinterp._disk_cache). 2: drawn in
# d_head space (spectral.random_small_forms), the same law as version 1.
NULL_BAND_VERSION = 2


@functools.lru_cache(maxsize=8)
def _null_band(d_model: int, d_head: int, n_heads: int, quantiles: tuple, seed: int
               ) -> tuple[float, float]:
    # seeded: drawn once per machine for each argument set (on disk), as ginibre_null
    def draw() -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        mods = np.concatenate([small_form_eigenvalues(B).abs().flatten().numpy()
                               for B, _, _ in random_small_forms(rng, n_heads, d_model, d_head)])
        return {"band": np.asarray(np.quantile(mods, quantiles), dtype=np.float64)}

    args = {"d_model": d_model, "d_head": d_head, "n_heads": n_heads,
            "quantiles": list(quantiles), "seed": seed}
    lo, hi = cached_arrays("null_band", NULL_BAND_VERSION, args, draw)["band"]
    return float(lo), float(hi)
