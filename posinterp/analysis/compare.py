"""Compare two inspections of the same input: which heads changed, and which formed.

Two models (or two checkpoints of one training run) are inspected on the same tokens
(:func:`~posinterp.analysis.inspect.inspect_heads`); per head this module gives the
change of every scalar score (B − A), the largest change of its positional kernel, the
distance between its two QK spectra, and one unit-free ``change`` that orders the heads
(docs/inspect.md, "Comparing two models"). For checkpoints of one series it lists the
heads that **formed** (or dissolved) between them: a score that crossed its threshold.

Definitions (all per head):

* ``kernel_attention_change``: max over offsets Δ of |k_B(Δ) − k_A(Δ)|, the attention
  kernel (mean weight A[i, i+Δ]); attention-weight units, in [0, 1].
* ``kernel_score_change``: the same for the pre-softmax score kernel (score units; not
  part of ``change``, whose parts are all on a 0–1 scale).
* ``spectrum_change``: the optimal-matching distance between the eigenvalue multisets
  λ (A) and μ (B) of B = W_K^T W_Q, both padded with zeros to one length n (the extra
  eigenvalues of the d_model form W_Q W_K^T are zeros):
  min_σ sqrt(mean_i |λ_i − μ_σ(i)|²) / (sqrt(mean|λ|²) + sqrt(mean|μ|²)), found with
  ``scipy.optimize.linear_sum_assignment`` (Kuhn 1955). In [0, 1] by Minkowski's
  inequality; 0 iff the spectra are equal; scaling B by c > 0 gives |c − 1| / (1 + c).
  Rotary heads: the larger of Δ = 0 and Δ = −1.
* ``change``: the largest of ``kernel_attention_change``, ``spectrum_change`` and the
  absolute changes of the previous-token, self and first-token scores and of the
  rotational mass (every offset): all unit-free on a 0–1 scale, so no weights are needed.

A head **formed** when a criterion is below its threshold in A and at or above it in B
(``dissolved``: the reverse). Default criteria (:data:`FORMATION_CRITERIA`): the
rotational mass beyond the 95th percentile of product-Ginibre random heads (a null, as
in docs/spectra.md), and a previous-token score of at least 0.5 (half the attention on
the previous token).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy.optimize import linear_sum_assignment

from ._checks import check_tokens
from .inspect import _VECTOR_METRICS, Inspection, inspect_heads

__all__ = ["FORMATION_CRITERIA", "Comparison", "compare_inspections", "compare_models",
           "input_facts", "spectrum_distance"]

# (score key prefix, threshold): a head formed when A < threshold <= B.
FORMATION_CRITERIA = (("rotational_mass_null_percentile", 95.0), ("previous_token_score", 0.5))
# Scores whose absolute change enters ``change`` (all on a 0-1 scale).
_UNIT_SCORES = ("previous_token_score", "self_score", "first_token_score", "rotational_mass")


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode() if not isinstance(p, bytes) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def input_facts(model, tokens: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
    """What makes two inspections comparable: ``d_vocab``, a digest of the tokenizer's
    vocabulary (None without a tokenizer) and a digest of the input ids and mask.

    Stored in :attr:`Inspection.meta` by :func:`inspect_heads`; digests are the first
    16 hex digits of SHA-256.
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


def spectrum_distance(lam: torch.Tensor | np.ndarray, mu: torch.Tensor | np.ndarray) -> float:
    """Normalized optimal-matching distance between two eigenvalue multisets.

    Args:
        lam: ``[n]`` complex eigenvalues of A's head; mu: ``[m]`` of B's. The shorter is
            padded with zeros (the d_model form's extra eigenvalues).

    Returns:
        min over matchings σ of sqrt(mean |λ_i − μ_σ(i)|²), divided by
        sqrt(mean|λ|²) + sqrt(mean|μ|²); in [0, 1], 0 for two all-zero spectra.
        Source: module docstring (Kuhn 1955 for the assignment).

    Raises:
        ValueError: for an empty spectrum or a non-finite eigenvalue.
    """
    a = np.asarray(lam, dtype=np.complex128).ravel()
    b = np.asarray(mu, dtype=np.complex128).ravel()
    if a.size == 0 or b.size == 0:
        raise ValueError("lam and mu must each hold at least one eigenvalue")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("lam and mu must be finite")
    n = max(a.size, b.size)
    a = np.pad(a, (0, n - a.size))
    b = np.pad(b, (0, n - b.size))
    cost = np.abs(a[:, None] - b[None, :]) ** 2
    rows, cols = linear_sum_assignment(cost)
    dist = math.sqrt(cost[rows, cols].mean())
    scale = math.sqrt((np.abs(a) ** 2).mean()) + math.sqrt((np.abs(b) ** 2).mean())
    return dist / scale if scale > 0 else 0.0


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare_inspections` found.

    Attributes:
        a, b: the two inspections (same input).
        names: display names of A and B.
        heads: one row per head, sorted by ``change`` (largest first): ``layer, head,
            change, kernel_attention_change, kernel_score_change, spectrum_change``, then
            ``delta_<score>`` = B − A for every scalar score of :meth:`Inspection.head_view`.
        kernels: ``layer, head, metric, offset, a, b, delta`` for both kernels.
        formed: ``layer, head, criterion, threshold, a, b, event`` (``formed`` or
            ``dissolved``), one row per crossing.
        layers: per-layer adjacency score ``layer, hook, a, b, delta``.
        table: the long form of ``heads`` (what is saved): ``hook, layer, head, offset,
            ablation, metric, a, b, value``; a score's rows hold A's and B's values and
            ``value`` = B − A; the rows of ``change``, ``kernel_attention_change``,
            ``kernel_score_change`` and ``spectrum_change`` hold the change in ``value``.
            Heads in the order of ``heads``.
        notes: plain sentences shown on the page.
    """

    a: Inspection
    b: Inspection
    names: tuple[str, str]
    heads: pd.DataFrame
    kernels: pd.DataFrame
    formed: pd.DataFrame
    layers: pd.DataFrame
    table: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    def _repr_html_(self) -> str:
        """The comparison page inline in a notebook (posinterp.viz.notebook)."""
        from ..viz.compare import compare_page
        from ..viz.notebook import notebook_html

        return notebook_html(compare_page(self, f"posinterp compare: {self.names[0]} vs {self.names[1]}"),
                             height=900)


def _check_comparable(a: Inspection, b: Inspection, names) -> list[str]:
    notes = []
    shape = [(x.meta.get("n_layers"), x.meta.get("n_heads")) for x in (a, b)]
    if shape[0] != shape[1]:
        raise ValueError(f"cannot compare: {names[0]} has n_layers x n_heads = {shape[0][0]} x "
                         f"{shape[0][1]} and {names[1]} has {shape[1][0]} x {shape[1][1]}; heads "
                         "are compared one to one, so both must have the same n_layers and n_heads")
    va, vb = a.meta.get("d_vocab"), b.meta.get("d_vocab")
    if va is not None and vb is not None and va != vb:
        raise ValueError(f"cannot compare: d_vocab differs ({names[0]} {va}, {names[1]} {vb}): the "
                         "same token ids are different tokens, so the input cannot be the same")
    ta, tb = a.meta.get("vocab_digest"), b.meta.get("vocab_digest")
    if ta is not None and tb is not None and ta != tb:
        raise ValueError(f"cannot compare: {names[0]} and {names[1]} have different tokenizer "
                         "vocabularies, so the same token ids are different text")
    if (ta is None) != (tb is None):
        notes.append("Only one of the two models has a tokenizer: token ids are assumed to mean "
                     "the same in both (d_vocab matches).")
    ia, ib = a.meta.get("input_digest"), b.meta.get("input_digest")
    if ia is not None and ib is not None and ia != ib:
        raise ValueError(f"cannot compare: {names[0]} and {names[1]} were inspected on different "
                         "inputs; inspect both on the same tokens and attention_mask")
    if ia is None or ib is None:
        notes.append("The inspections carry no input digest: that both saw the same input is "
                     "not verified.")
    if a.meta.get("d_head") != b.meta.get("d_head"):
        notes.append(f"d_head differs ({a.meta.get('d_head')} vs {b.meta.get('d_head')}): spectra "
                     "are compared with zeros padding the shorter one (the d_model form's spectrum).")
    return notes


def _kernel_changes(a: Inspection, b: Inspection) -> pd.DataFrame:
    keys = ["layer", "head", "metric", "offset"]
    pick = lambda t: t[t.metric.isin(["kernel_attention", "kernel_score"])][keys + ["value"]]  # noqa: E731
    k = pick(a.table).merge(pick(b.table), on=keys, how="outer", suffixes=("_a", "_b"))
    k = k.rename(columns={"value_a": "a", "value_b": "b"})
    k["delta"] = k["b"] - k["a"]
    return k.sort_values(keys, ignore_index=True).astype({"head": "int64"})


def _spectrum_changes(a: Inspection, b: Inspection) -> pd.DataFrame:
    def eig(t):
        t = t[t.metric.isin(["eigenvalue_real", "eigenvalue_imag"])]
        w = t.pivot_table(index=["layer", "head", "offset", "rank"], columns="metric", values="value",
                          dropna=False, sort=True)
        return {k: (g["eigenvalue_real"] + 1j * g["eigenvalue_imag"]).to_numpy()
                for k, g in w.reset_index().groupby(["layer", "head", "offset"], dropna=False)}

    ea, eb = eig(a.table), eig(b.table)
    rows = []
    for key in sorted(set(ea) & set(eb), key=str):
        layer, head, off = key
        rows.append(dict(layer=int(layer), head=int(head), offset=off,
                         spectrum_change=spectrum_distance(ea[key], eb[key])))
    return pd.DataFrame(rows, columns=["layer", "head", "offset", "spectrum_change"])


def _formation(wa: pd.DataFrame, wb: pd.DataFrame, criteria) -> pd.DataFrame:
    rows = []
    for prefix, threshold in criteria:
        cols = [c for c in wa.columns if c in wb.columns
                and (c == prefix or c.startswith(prefix + "@"))]
        for col in cols:
            for (layer, h, va), vb in zip(wa[["layer", "head", col]].itertuples(index=False, name=None),
                                      wb[col], strict=True):
                if pd.isna(va) or pd.isna(vb):
                    continue
                event = ("formed" if va < threshold <= vb else
                         "dissolved" if vb < threshold <= va else None)
                if event:
                    rows.append(dict(layer=int(layer), head=int(h), criterion=col, threshold=threshold,
                                     a=float(va), b=float(vb), event=event))
    return pd.DataFrame(rows, columns=["layer", "head", "criterion", "threshold", "a", "b", "event"])


def compare_inspections(a: Inspection, b: Inspection, names: tuple[str, str] = ("A", "B"),
                        criteria=FORMATION_CRITERIA) -> Comparison:
    """Per head, how much B differs from A (both inspected on the same input).

    Args:
        a, b: from :func:`~posinterp.analysis.inspect.inspect_heads` (or
            :func:`~posinterp.analysis.export.load_inspection`), same tokens and mask.
        names: display names of A and B.
        criteria: ``(score key prefix, threshold)`` pairs defining "formed" (module
            docstring); a prefix matches the score and its ``@Δ=...`` variants.

    Returns:
        :class:`Comparison`; definitions of every column in the module docstring.
        Comparing an inspection with itself gives zero changes and no formed heads.

    Raises:
        ValueError: if n_layers or n_heads differ, d_vocab or the tokenizer vocabulary
            differ, or the inputs' digests differ (not the same input), each named.
    """
    names = (str(names[0]), str(names[1]))
    notes = _check_comparable(a, b, names)
    wa, wb = a.head_view(), b.head_view()
    common = [c for c in wa.columns if c in wb.columns and c not in ("layer", "head")]
    wb = wa[["layer", "head"]].merge(wb, on=["layer", "head"], how="left")
    deltas = pd.DataFrame({f"delta_{c}": wb[c].to_numpy() - wa[c].to_numpy() for c in common})
    heads = pd.concat([wa[["layer", "head"]].reset_index(drop=True), deltas], axis=1)

    kernels = _kernel_changes(a, b)
    kmax = (kernels.assign(absd=kernels["delta"].abs())
            .groupby(["layer", "head", "metric"])["absd"].max().unstack("metric"))
    for metric in ("kernel_attention", "kernel_score"):
        col = kmax[metric] if metric in kmax else pd.Series(dtype=float)
        heads[f"{metric}_change"] = [col.get((li, h), np.nan) for li, h in zip(heads.layer, heads["head"],
                                                                           strict=True)]
    spec = _spectrum_changes(a, b)
    smax = spec.groupby(["layer", "head"])["spectrum_change"].max()
    heads["spectrum_change"] = [smax.get((li, h), np.nan) for li, h in zip(heads.layer, heads["head"],
                                                                         strict=True)]
    parts = [heads["kernel_attention_change"], heads["spectrum_change"]]
    parts += [heads[c].abs() for c in heads.columns
              if c.startswith("delta_") and c.removeprefix("delta_").split("@")[0] in _UNIT_SCORES]
    heads["change"] = pd.concat(parts, axis=1).max(axis=1, skipna=True)
    lead = ["layer", "head", "change", "kernel_attention_change", "kernel_score_change",
            "spectrum_change"]
    heads = heads[lead + [c for c in heads.columns if c not in lead]]
    heads = heads.sort_values(["change", "layer", "head"], ascending=[False, True, True],
                              ignore_index=True, na_position="last")

    def adj(t):
        return t[(t.metric == "adjacency_score") & t["head"].isna()][["layer", "hook", "value"]]
    layers = adj(a.table).merge(adj(b.table), on=["layer", "hook"], how="outer", suffixes=("_a", "_b"))
    layers = layers.rename(columns={"value_a": "a", "value_b": "b"})
    layers["delta"] = layers["b"] - layers["a"]
    formed = _formation(wa, wb, criteria)
    return Comparison(a, b, names, heads, kernels, formed, layers, _long(a, b, heads), notes)


_CHANGES = ("change", "kernel_attention_change", "kernel_score_change", "spectrum_change")


def _long(a: Inspection, b: Inspection, heads: pd.DataFrame) -> pd.DataFrame:
    """The saved long form of a comparison (DESIGN: saved results are long)."""
    keys = ["hook", "layer", "head", "offset", "ablation", "metric"]

    def scalar(t):
        t = t[t["head"].notna() & ~t.metric.isin(_VECTOR_METRICS)]
        return t[keys + ["value"]]
    scores = scalar(a.table).merge(scalar(b.table), on=keys, how="outer", suffixes=("_a", "_b"))
    scores = scores.rename(columns={"value_a": "a", "value_b": "b"})
    scores["value"] = scores["b"] - scores["a"]
    changes = heads.melt(id_vars=["layer", "head"], value_vars=list(_CHANGES), var_name="metric")
    changes["hook"] = [f"blocks.{int(layer)}.attn" for layer in changes.layer]
    order = {(int(r.layer), int(r.head)): i for i, r in enumerate(heads.itertuples())}
    out = pd.concat([changes, scores], ignore_index=True)
    out = out.astype({"layer": "int64", "head": "int64"})
    out["_order"] = [order[(la, h)] for la, h in zip(out.layer, out["head"], strict=True)]
    out = out.sort_values("_order", kind="stable", ignore_index=True).drop(columns="_order")
    return out[keys[:5] + ["metric", "a", "b", "value"]].astype({"offset": "Int64"})


def compare_models(model_a, model_b, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   *, names: tuple[str, str] = ("A", "B"), criteria=FORMATION_CRITERIA,
                   **inspect_kwargs) -> Comparison:
    """Inspect two models on the same ``tokens`` and compare them head by head.

    Args:
        model_a, model_b: causal TransformerLens models with the same n_layers, n_heads
            and vocabulary (e.g. two checkpoints of one run).
        tokens: ``[batch, pos]`` ids valid for both; attention_mask: ``[batch, pos]``.
        names: display names; criteria: as :func:`compare_inspections`.
        inspect_kwargs: passed to :func:`~posinterp.analysis.inspect.inspect_heads` for
            both (``ablate``, ``n_null``, ``seed``, ``max_pattern_tokens``, ...).

    Returns:
        :class:`Comparison`.

    Raises:
        ValueError: as :func:`compare_inspections`, and tokens either model refuses
            (ids >= d_vocab, more positions than n_ctx), checked before either model
            runs; and as :func:`~posinterp.analysis.inspect.inspect_heads`.
    """
    if "model_name" in inspect_kwargs:
        raise ValueError("model_name is set from names; pass names=(name_a, name_b)")
    facts = []
    for m in (model_a, model_b):
        cfg = m.cfg
        facts.append(Inspection(pd.DataFrame(), {}, [], [], dict(
            n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_head=cfg.d_head,
            **input_facts(m, tokens, attention_mask))))
    _check_comparable(*facts, names)  # refuse before any forward pass
    for name, m in zip(names, (model_a, model_b), strict=True):
        try:
            check_tokens(m, tokens)  # e.g. longer than B's n_ctx: refused before A runs
        except ValueError as err:
            raise ValueError(f"cannot compare: {name}: {err}") from None
    a = inspect_heads(model_a, tokens, attention_mask, model_name=str(names[0]), **inspect_kwargs)
    b = inspect_heads(model_b, tokens, attention_mask, model_name=str(names[1]), **inspect_kwargs)
    return compare_inspections(a, b, names, criteria)
