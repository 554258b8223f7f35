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

Everything lands in one tidy DataFrame (:attr:`Inspection.table`, columns
:data:`posinterp.dashboard.schema.COLUMNS`); the HTML page of
:func:`posinterp.dashboard.inspect_page` is drawn from exactly that table. The pure
functions behind the numbers (kernels, head scores, pooled patterns, the null band) are in
:mod:`posinterp.analysis.kernels`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from .._validate import check_indices, is_int
from ..analysis._attention_blocks import (
    AUTO_BLOCK_TOKENS,
    AttentionReduction,
    reduce_attention,
    resolve_query_block,
)
from ..analysis._checks import (
    check_attention_mask,
    check_tokens,
    lengths_from_mask,
    next_token_loss,
    run_reduced,
)
from ..analysis.adjacency import adjacency_hooks
from ..analysis.frequencies import (
    POSITIONAL_TOKENS,
    band_label,
    frequency_bands,
    inspection_frequency_rows,
    positional_prefix,
    positional_score_capture,
)
from ..analysis.heads import induction_targets, repeated_random_tokens
from ..analysis.kernels import (
    DENSE_LAGS,
    binned_kernel,
    block_labels,
    kernel_bins,
    null_band,
    t_interval,
)
from ..analysis.spectral import (
    CHANNELS,
    DEFAULT_EPS,
    NULL_HEADS,
    _measures_frame,
    _spectra,
    _spectrum_frame,
    ginibre_null,
    null_percentiles,
    qk_weights,
)
from ..models.backend import (
    MissingFeatureError,
    eager,
    positional_type,
    scores_hook,
    unwrap,
    z_hook,
)
from .explain import DEFAULT_MAX_VALUES, dashboard_score_parts
from .schema import COLUMNS, head_wide

__all__ = ["CHANNEL_ABLATIONS", "Inspection", "PatternView", "input_facts", "inspect_heads",
           "uniform_guess_loss"]

CHANNEL_ABLATIONS = tuple(f"remove_{c}" for c in CHANNELS)
#: Random heads behind the null band of |λ| (quantiles of every eigenvalue's modulus: 200
#: heads give 200 x d_head moduli, enough for stable 5%/95% quantiles).
NULL_BAND_HEADS = 200
#: Inputs this long (tokens per sequence) get a progress bar per layer of the main pass
LAYER_PROGRESS_TOKENS = 1024
#: Sequences of repeated random tokens behind the ``induction_score`` (intervals over them).
INDUCTION_BATCH = 4


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
        :func:`posinterp.dashboard.inspect_page` writes, in a frame (posinterp.viz.notebook)."""
        from ..viz.notebook import notebook_html
        from .inspect_html import inspect_page

        models = self.table["model"].dropna().unique() if "model" in self.table else []
        title = "posinterp inspect" + (f": {models[0]}" if len(models) else "")
        return notebook_html(inspect_page(self, title), height=900)


class _Ticking:
    """A row reducer (``add``/``result``) that calls ``tick`` after each block it adds."""

    def __init__(self, reducer, tick):
        self.reducer, self.tick = reducer, tick

    def add(self, rows, row_start):
        self.reducer.add(rows, row_start)
        self.tick()

    def result(self):
        return self.reducer.result()


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode() if not isinstance(p, bytes) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def input_facts(model, tokens: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
    """What makes two inspections comparable: ``d_vocab``, a digest of the tokenizer's
    vocabulary (None without a tokenizer) and a digest of the input ids and mask.

    Stored in :attr:`Inspection.meta` by :func:`inspect_heads` and checked by
    :func:`posinterp.dashboard.compare.compare_inspections`; digests are the first 16 hex
    digits of SHA-256.
    """
    tok = getattr(model, "tokenizer", None)
    vocab = None
    if tok is not None and hasattr(tok, "get_vocab"):
        vocab = _digest(sorted(tok.get_vocab().items()))
    t = tokens.detach().cpu().long()
    t = t[None] if t.ndim == 1 else t  # as check_tokens reads one sequence
    m = None if attention_mask is None else attention_mask.detach().cpu().long()
    if m is not None and bool((m == 1).all()):
        m = None  # an all-ones mask is no mask: same input
    return dict(d_vocab=int(model.cfg.d_vocab), vocab_digest=vocab,
                input_digest=_digest(tuple(t.shape), t.numpy().tobytes(),
                                     None if m is None else m.numpy().tobytes()))


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


def _kernel_rows(layer: int, hook: str, metric: str, stats, bins, head_ids) -> pd.DataFrame:
    """One row per lag bin (``offset`` = -(the bin's first lag); :func:`kernel_bins`):
    mean over sequences of each sequence's binned kernel, with its interval."""
    interval = _attention_interval if metric == "kernel_attention" else t_interval
    per_seq = binned_kernel(stats.kernel_sum, stats.kernel_count, bins)
    mean, low, high, n = interval(per_seq)  # [head, bin]
    heads, n_bins = mean.shape
    first = np.asarray([lo for lo, _ in bins])
    return _rows(hook=hook, layer=layer, head=np.repeat(np.asarray(head_ids), n_bins),
                 offset=np.tile(-first, heads), metric=metric,
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


def _induction_rows(model, layers, heads, n_wanted: int, seed: int, max_pattern_tokens: int,
                    frames: list, notes: list) -> list[PatternView]:
    """The ``induction_score`` rows (appended to ``frames``) on :data:`INDUCTION_BATCH`
    sequences of repeated random tokens, from one forward pass caching the selected
    layers' patterns; returns the pattern view of the first such sequence (none when
    ``n_wanted`` is 0 or nothing fits)."""
    from ..analysis.heads import _has_bos

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
    pos = toks.shape[1]
    block = -(-pos // max_pattern_tokens)
    hooks = [f"blocks.{layer}.attn.hook_pattern" for layer in layers]
    stats = run_reduced(model, toks, None, [
        (h, lambda p: reduce_attention(p[:, heads], None, kernel=False, tokens=toks,
                                       views={0: block})) for h in hooks])
    pats = {}
    for layer, hook, st in zip(layers, hooks, stats, strict=True):
        frames.append(_score_rows(hook, layer, heads, "induction_score", st.induction_score()))
        pats[layer] = st.views[0]
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
    max_positional_tokens: int = POSITIONAL_TOKENS,
    query_block: int | str | None = "auto",
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
            Offsets beyond -:data:`~posinterp.analysis.kernels.DENSE_LAGS` + 1 are pooled
            into log-spaced bins (:func:`~posinterp.analysis.kernels.kernel_bins`; a note
            says so): a row's ``offset`` is its bin's nearest one.
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
            :func:`posinterp.dashboard.explain.dashboard_score_parts`): the first n
            tokens of the pattern views whose cells fit (default 200,000: about 1.7 MB of
            page); 0 computes none.
        progress: tqdm bars on stderr: the main pass's layers (inputs of at least
            :data:`LAYER_PROGRESS_TOKENS` tokens) and the ablations' forward passes.
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
        max_positional_tokens: RoPE models' ``positional_score`` reads the first this
            many real tokens of each sequence (its permutations cost n² d_head per head;
            a note says when it cut). Everything else reads every token.
        query_block: run the pass this many positions at a time through the model's KV
            cache (:func:`posinterp.models.backend.run_reduced`): each layer's kernels,
            scores and views are reduced from the rows each block fires, so no layer's
            ``[pos, pos]`` pattern is made (memory O(block x pos) per head); ``"auto"``
            (default): blocks of 512 past 2,048 tokens where the model's pass in blocks
            is verified, else the whole pattern of one layer at a time; None: never.

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
            bidirectional model, ``max_offset``/``max_pattern_tokens``/``n_null`` < 1, a negative
            ``explain_values``/``induction_tokens``, ``pattern_sequences`` < 1, or
            ``layers``/``heads`` outside ``[0, n_layers)``/``[0, n_heads)`` or repeated
            (named, with the range), a bad ``query_block``.
        MissingFeatureError: (a ValueError) on a model with multi-head latent attention,
            before any forward pass (:func:`posinterp.models.backend.check_not_mla`); an
            int ``query_block`` on a model whose pass in blocks is refused
            (:func:`posinterp.models.backend.check_chunked_pass`).
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
    if not is_int(max_positional_tokens) or max_positional_tokens < 3:
        raise ValueError(f"max_positional_tokens must be an integer >= 3, got {max_positional_tokens!r}")
    if not is_int(pattern_sequences) or pattern_sequences < 1:
        raise ValueError(f"pattern_sequences must be an integer >= 1, got {pattern_sequences!r}")
    if not is_int(n_null) or n_null < 1:
        raise ValueError(f"n_null must be an integer >= 1, got {n_null!r}")
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
    bins = kernel_bins(max_lag)  # one row per lag up to DENSE_LAGS, log-spaced bins beyond
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
    # RoPE: the positional score's verified q/k hooks ride on the same pass (their first
    # max_positional_tokens real tokens)
    block_rows = resolve_query_block(model, pos, query_block)
    if query_block == "auto" and block_rows is None and pos > AUTO_BLOCK_TOKENS:
        # the whole pattern of one layer at a time: right numbers, more memory; say so
        notes.append(f"{pos} tokens ran each layer's whole attention pattern at once: this "
                     "model's pass in query blocks is not available (backend.check_chunked_pass).")
    capture = None
    if positional_type(model) == "rotary":
        # in blocks, the q/k and attention of the first tokens come from their own short
        # pass (causal: the same numbers), as no block holds their square pattern
        pos_toks, pos_mask = ((tokens, mask) if block_rows is None else
                              positional_prefix(tokens, mask, max_positional_tokens))
        try:
            capture = positional_score_capture(model, pos_toks, pos_mask, sel[0],
                                               max_positional_tokens)
        except MissingFeatureError:
            pass  # the score is left out with a note below
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
    view_blocks = {0: block, **{s: -(-int(lengths[s]) // max_pattern_tokens) for s in shown_seqs}}

    def chosen(act):  # the selected heads of [batch, head, q, k] (a view when all are)
        return act if all_heads else act[:, heads]

    # One forward pass, reduced at hook time: each layer's pattern and scores become its
    # kernels, scores and pooled views as the pass makes them, and are dropped (memory:
    # one layer's attention, not every layer's); the adjacency hooks score each residual
    # point the same way.
    from .._progress import tqdm

    # a bar per layer (and block) where the input is long enough for a pass to take a while
    n_blocks = 1 if block_rows is None else -(-pos // block_rows)
    bar = tqdm(total=len(layers) * n_blocks, desc="layers" if n_blocks == 1 else "layer blocks",
               unit="layer" if n_blocks == 1 else "block", leave=False,
               disable=not progress or pos < LAYER_PROGRESS_TOKENS)
    pick = None if all_heads else list(heads)

    def rows(**kw):
        return AttentionReduction(batch, len(heads), pos, mask, select=pick, **kw)

    reducers = [(f"blocks.{layer}.attn.hook_pattern",
                 _Ticking(rows(scores=True, tokens=tokens, views=view_blocks), bar.update))
                for layer in layers]
    reducers += [(score_hooks[layer], rows()) for layer in layers if layer in score_hooks]
    n_stats = len(reducers)
    adj_hooks, adj_table = adjacency_hooks(model, tokens, mask,
                                           sites=("attn_out", "resid_mid", "resid_post"), layers=sel[0])
    reducers += [(name, lambda a, fn=fn: fn(a, hook=None)) for name, fn in adj_hooks]
    pos_results = []
    if capture is not None and block_rows is None:  # rides on the same pass
        reducers += capture[0]
    try:
        results = run_reduced(model, tokens, mask, reducers, query_block=block_rows)
        if capture is not None:
            pos_results = (results[-len(capture[0]):] if block_rows is None else
                           run_reduced(model, pos_toks, pos_mask, capture[0]))
    finally:
        bar.close()
    stats = dict(zip([name for name, _ in reducers[:n_stats]], results[:n_stats], strict=True))
    pos_inputs = capture[1](pos_results) if capture else None
    frames, patterns = [], {}
    more = {s: {} for s in shown_seqs}  # the picker's other input sequences
    for layer in layers:
        pat_hook = f"blocks.{layer}.attn.hook_pattern"
        st = stats[pat_hook]
        frames.append(_kernel_rows(layer, pat_hook, "kernel_attention", st, bins, head_ids))
        if layer in score_hooks:
            frames.append(_kernel_rows(layer, score_hooks[layer], "kernel_score",
                                       stats[score_hooks[layer]], bins, head_ids))
        per_head = st.scores()
        per_head["induction_score_input"] = st.induction_score()
        for metric, per_seq in per_head.items():
            frames.append(_score_rows(pat_hook, layer, head_ids, metric, per_seq))
        patterns[layer] = st.views[0]
        for s in shown_seqs:
            more[s][layer] = st.views[s]
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
    if pos_inputs is not None:
        pos_tokens, pos_mask, pos_cache = pos_inputs
    else:  # no verified q/k hooks: the rows say why (no pass is run for them)
        pos_tokens, pos_mask, pos_cache = tokens, mask, None
    freq_rows, freq_notes = inspection_frequency_rows(model, pos_tokens, pos_mask, seed,
                                                      cache=pos_cache, layers=sel[0], heads=sel[1])
    cut = pos_inputs is not None and pos_tokens.shape[1] < pos
    if cut and (freq_rows.metric == "positional_score").any():
        freq_notes.append(f"positional_score: on the first {pos_tokens.shape[1]} real tokens of each "
                          f"sequence (max_positional_tokens; its permutations cost n^2 d_head per head).")
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
                kernel_dense_lags=DENSE_LAGS if len(bins) < max_lag else None,
                **input_facts(model, tokens, mask))
    if math.isfinite(max_lag) and max_lag < int(lengths.max()):
        notes.append(f"Kernels are kept for offsets Δ >= -{max_lag - 1} (max_offset).")
    if len(bins) < max_lag:
        notes.append(f"Kernels hold every offset down to Δ = -{DENSE_LAGS - 1}, then "
                     f"{len(bins) - DENSE_LAGS} log-spaced offset bins (16 per doubling) down to "
                     f"Δ = -{max_lag - 1}: a row's offset is its bin's nearest offset, the bin "
                     "runs to the next row's, and its value is the mean over every query-key "
                     "pair in the bin.")
    meta["frequency_note"] = None if len(freq_rows) else freq_notes[0]  # why a card has no profile
    return Inspection(table, patterns, str_tokens, notes, meta, score_parts=parts, pattern_views=views)
