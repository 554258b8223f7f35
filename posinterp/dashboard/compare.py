"""Compare two inspections of the same input: which heads changed, and which formed.

Two models (or two checkpoints of one training run) are inspected on the same tokens
(:func:`~posinterp.dashboard.inspect.inspect_heads`); per head this module gives the
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
  Rotary heads: the larger over the offsets both sides have (Δ = 0 and Δ = −1 for two
  rotary models, Δ = 0 alone across schemes: below).
* ``change``: the largest of ``kernel_attention_change``, ``spectrum_change`` and the
  absolute changes of the previous-token, self and first-token scores and of the
  rotational mass (every offset): all unit-free on a 0–1 scale, so no weights are needed.

**Across positional schemes** (a rotary model and one without rotation: absolute, ALiBi,
NoPE) only what both sides define is compared. A head without rotation has one QK form,
the raw W_Q W_K^T (its spectral rows carry no offset); a rotary head's form at Δ = 0 is
W_Q R(0) W_K^T, the same raw W_Q W_K^T. So a metric whose rows have no offset on one side
and offset 0 on the other is compared at Δ = 0 (keys ``@Δ=0``); kernels keep their key
offsets. What only one side defines (Δ = −1 spectra and measures, frequency shares, the
positional score, band ablations, a missing score kernel) is not compared:
:attr:`Comparison.skipped` lists it and a note names it, as a note names every head whose
change has no value, and every formation criterion that could not be evaluated.

A head **formed** when a criterion is below its threshold in A and at or above it in B
(``dissolved``: the reverse). Default criteria (:data:`FORMATION_CRITERIA`): the
rotational mass beyond the 95th percentile of product-Ginibre random heads (a null, as
in docs/spectra.md), and a previous-token score of at least 0.5 (half the attention on
the previous token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy.optimize import linear_sum_assignment

from ..analysis._checks import check_tokens
from .inspect import Inspection, input_facts, inspect_heads
from .schema import _CHANGE_SCORES, _KERNEL_METRICS, _VECTOR_METRICS, head_wide, score_key

__all__ = ["FORMATION_CRITERIA", "Comparison", "compare_inspections", "compare_models",
           "spectrum_distance"]

# (score key prefix, threshold): a head formed when A < threshold <= B.
FORMATION_CRITERIA = (("rotational_mass_null_percentile", 95.0), ("previous_token_score", 0.5))


_SKIPPED_COLUMNS = ["quantity", "metric", "offset", "ablation", "side", "only_in"]


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
        a: the first inspection.
        b: the second, on the same input.
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
            Heads in the order of ``heads``. A quantity only one side defines keeps that
            side's value and has no ``value`` (it is listed in ``skipped``).
        notes: plain sentences shown on the page (and printed by the CLI), including
            what was not compared and why.
        skipped: what only one side defines, so was not compared: ``quantity`` (a score
            key as in ``heads``, ``eigenvalues@Δ=<offset>`` for a spectrum, a kernel's or
            ``frequency_share@Δ=<offset>``'s metric), ``metric``, ``offset``, ``ablation``,
            ``side`` (``"a"`` or ``"b"``, the side that has it) and ``only_in`` (its name).
        compared: A's and B's per-head table rows as compared: a side without RoPE
            offsets has its spectral rows labelled Δ = 0 when the other side is rotary
            (module docstring); the page is drawn from these.
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
    skipped: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=_SKIPPED_COLUMNS))
    compared: tuple[pd.DataFrame, pd.DataFrame] | None = None

    def _repr_html_(self) -> str:
        """The comparison page inline in a notebook (posinterp.viz.notebook)."""
        from ..viz.notebook import notebook_html
        from .compare_html import compare_page

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


def _align_offsets(ta: pd.DataFrame, tb: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, list, list]:
    """A's and B's per-head rows with their RoPE offsets lined up across schemes.

    A head without rotation has one QK form, the raw W_Q W_K^T (spectral rows with offset
    NA); a rotary head's Δ = 0 form is the same W_Q W_K^T. A metric (not a kernel, whose
    offsets are key offsets) with only NA offsets on one side, and offset 0 and no NA on
    the other, gets offset 0 on the NA side. Returns both tables and, per side, the
    metrics relabelled.
    """
    ta, tb = (t[t["head"].notna()] for t in (ta, tb))

    def facts(t):
        rope = t[~t.metric.isin(_KERNEL_METRICS)]
        na = rope.offset.isna()
        zero = (rope.offset == 0).fillna(False).astype(bool)
        return na.groupby(rope.metric).all(), zero.groupby(rope.metric).any(), na.groupby(rope.metric).any()

    fa, fb = facts(ta), facts(tb)
    out = []
    for t, (all_na, _, _), (_, has_zero, any_na) in ((ta, fa, fb), (tb, fb, fa)):
        metrics = sorted(m for m in all_na.index[all_na.to_numpy(bool)]
                         if has_zero.get(m, False) and not any_na.get(m, True))
        if metrics:
            t = t.copy()
            t.loc[t.metric.isin(metrics), "offset"] = 0
        out.append((t, metrics))
    (ta, ma), (tb, mb) = out
    return ta, tb, ma, mb


def _quantities(t: pd.DataFrame) -> pd.DataFrame:
    """What one side's per-head rows define: one row per quantity (module docstring)."""
    kinds = t.metric.where(~t.metric.isin(["eigenvalue_real", "eigenvalue_imag"]), "eigenvalues")
    q = pd.DataFrame({"metric": kinds, "offset": t.offset.astype("Int64"),
                      "ablation": t.ablation.astype("string")})
    q.loc[q.metric.isin(_KERNEL_METRICS), "offset"] = pd.NA  # key offsets: compared where both have one
    q = q.drop_duplicates(ignore_index=True)
    q["quantity"] = [score_key(m, o, a) for m, o, a in zip(q.metric, q.offset, q.ablation, strict=True)]
    return q


def _skipped(ta: pd.DataFrame, tb: pd.DataFrame, names) -> pd.DataFrame:
    qa, qb = _quantities(ta), _quantities(tb)
    rows = []
    for mine, other, side, name in ((qa, qb, "a", names[0]), (qb, qa, "b", names[1])):
        only = mine[~mine.quantity.isin(set(other.quantity))]
        rows.append(only.assign(side=side, only_in=name))
    return pd.concat(rows, ignore_index=True)[_SKIPPED_COLUMNS].sort_values(
        ["side", "offset", "quantity"], ignore_index=True, na_position="last")


def _head_ids(frame: pd.DataFrame, limit: int = 8) -> str:
    ids = [f"L{int(la)}H{int(h)}" for la, h in zip(frame.layer, frame["head"], strict=True)]
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def _schema_notes(names, relabelled, skipped: pd.DataFrame) -> list[str]:
    """Say how two schemes were lined up and what only one side defines."""
    notes = []
    for side, other in ((0, 1), (1, 0)):
        if relabelled[side]:
            notes.append(
                f"{names[other]} is rotary and {names[side]} is not: a head without rotation has one "
                "QK form, the raw W_Q W_K^T, which is what a rotary head's form at Δ = 0 is "
                f"(R(0) = I), so {names[side]}'s spectra and spectral measures are compared with "
                f"{names[other]}'s at Δ = 0 (keys @Δ=0).")
    for side, name in zip("ab", names, strict=True):
        rows = skipped[skipped.side == side]
        if rows.empty:
            continue
        parts = []
        for off in sorted(rows.offset.dropna().unique(), reverse=True):
            at = rows[rows.offset == off]
            parts.append(f"at Δ = {int(off)}: " + ", ".join(
                m if pd.isna(a) else f"{m}[{a}]" for m, a in zip(at.metric, at.ablation, strict=True)))
        plain = rows[rows.offset.isna()]
        if len(plain):
            parts.append(", ".join(plain.quantity))
        why = (" spectrum_change is the distance at the offsets both sides have."
               if (rows.metric == "eigenvalues").any() else "")
        notes.append(f"Not compared, as only {name} defines them: {'; '.join(parts)}.{why}")
    return notes


def _missing_notes(heads: pd.DataFrame, wa: pd.DataFrame, wb: pd.DataFrame, names) -> list[str]:
    """One note per column of ``heads`` with a missing value: which heads, and why."""
    notes = []
    for col in heads.columns:
        if col in ("layer", "head") or not heads[col].isna().any():
            continue
        miss = heads[col].isna().to_numpy()
        if col.startswith("delta_"):
            key = col.removeprefix("delta_")
            na_a, na_b = wa[key].isna().to_numpy(), wb[key].isna().to_numpy()
            why = np.where(na_a & na_b, f"neither {names[0]} nor {names[1]} has a value",
                           np.where(na_a, f"{names[0]} has no value", f"{names[1]} has no value"))
        elif col == "spectrum_change":
            why = np.full(len(heads), f"no offset at which both {names[0]} and {names[1]} have a spectrum")
        elif col == "change":
            why = np.full(len(heads), "none of its parts has a value")
        else:
            why = np.full(len(heads), f"no offset at which both {names[0]} and {names[1]} have a "
                                      f"{col.removesuffix('_change')} value")
        for reason in dict.fromkeys(why[miss]):
            sel = miss & (why == reason)
            notes.append(f"{col} has no value for {int(sel.sum())} of {len(heads)} heads "
                         f"({_head_ids(heads[sel])}): {reason}.")
    return notes


def _kernel_changes(ta: pd.DataFrame, tb: pd.DataFrame) -> pd.DataFrame:
    keys = ["layer", "head", "metric", "offset"]
    pick = lambda t: t[t.metric.isin(_KERNEL_METRICS)][keys + ["value"]]  # noqa: E731
    k = pick(ta).merge(pick(tb), on=keys, how="outer", suffixes=("_a", "_b"))
    k = k.rename(columns={"value_a": "a", "value_b": "b"})
    k["delta"] = k["b"] - k["a"]
    return k.sort_values(keys, ignore_index=True).astype({"head": "int64"})


def _spectrum_changes(ta: pd.DataFrame, tb: pd.DataFrame) -> pd.DataFrame:
    def eig(t):
        t = t[t.metric.isin(["eigenvalue_real", "eigenvalue_imag"])]
        if t.empty:
            return {}
        w = t.pivot_table(index=["layer", "head", "offset", "rank"], columns="metric", values="value",
                          dropna=False, sort=True)
        return {k: (g["eigenvalue_real"] + 1j * g["eigenvalue_imag"]).to_numpy()
                for k, g in w.reset_index().groupby(["layer", "head", "offset"], dropna=False)}

    ea, eb = eig(ta), eig(tb)
    rows = []
    for key in sorted(set(ea) & set(eb), key=str):
        layer, head, off = key
        rows.append(dict(layer=int(layer), head=int(head), offset=off,
                         spectrum_change=spectrum_distance(ea[key], eb[key])))
    return pd.DataFrame(rows, columns=["layer", "head", "offset", "spectrum_change"])


def _formation(wa: pd.DataFrame, wb: pd.DataFrame, criteria, names) -> tuple[pd.DataFrame, list[str]]:
    rows, notes = [], []
    for prefix, threshold in criteria:
        in_b = {c for c in wb.columns if c == prefix or c.startswith(prefix + "@")}
        cols = [c for c in wa.columns if c in in_b]
        if not cols:
            notes.append(f"Formation criterion {prefix} (threshold {threshold:g}) is not evaluated: "
                         f"{names[0]} and {names[1]} have no score of that name in common.")
        for col in cols:
            missing = []
            for (layer, h, va), vb in zip(wa[["layer", "head", col]].itertuples(index=False, name=None),
                                      wb[col], strict=True):
                if pd.isna(va) or pd.isna(vb):
                    missing.append((layer, h))
                    continue
                event = ("formed" if va < threshold <= vb else
                         "dissolved" if vb < threshold <= va else None)
                if event:
                    rows.append(dict(layer=int(layer), head=int(h), criterion=col, threshold=threshold,
                                     a=float(va), b=float(vb), event=event))
            if missing:
                frame = pd.DataFrame(missing, columns=["layer", "head"])
                notes.append(f"Formation criterion {col} is not evaluated for {len(missing)} heads "
                             f"({_head_ids(frame)}): {names[0]} or {names[1]} has no value there.")
    return (pd.DataFrame(rows, columns=["layer", "head", "criterion", "threshold", "a", "b", "event"]),
            notes)


def compare_inspections(a: Inspection, b: Inspection, names: tuple[str, str] = ("A", "B"),
                        criteria=FORMATION_CRITERIA) -> Comparison:
    """Per head, how much B differs from A (both inspected on the same input).

    Args:
        a: from :func:`~posinterp.dashboard.inspect.inspect_heads` (or
            :func:`~posinterp.dashboard.export.load_inspection`).
        b: the same, on the same tokens and mask as ``a``.
        names: display names of A and B.
        criteria: ``(score key prefix, threshold)`` pairs defining "formed" (module
            docstring); a prefix matches the score and its ``@Δ=...`` variants.

    Returns:
        :class:`Comparison`; definitions of every column in the module docstring.
        Comparing an inspection with itself gives zero changes and no formed heads.
        Across positional schemes only what both define is compared (module docstring);
        what was skipped is in ``skipped`` and ``notes``, and every missing value in
        ``heads`` has a note naming its heads and cause.

    Raises:
        ValueError: if n_layers or n_heads differ, d_vocab or the tokenizer vocabulary
            differ, or the inputs' digests differ (not the same input), each named.
    """
    names = (str(names[0]), str(names[1]))
    notes = _check_comparable(a, b, names)
    ta, tb, rel_a, rel_b = _align_offsets(a.table, b.table)
    skipped = _skipped(ta, tb, names)
    notes += _schema_notes(names, (rel_a, rel_b), skipped)
    wa, wb = head_wide(ta), head_wide(tb)
    extra = wb.merge(wa[["layer", "head"]], on=["layer", "head"], how="left", indicator=True)
    extra = extra[extra["_merge"] == "left_only"]
    if len(extra):
        notes.append(f"{len(extra)} heads have scores in {names[1]} only and are not compared "
                     f"({_head_ids(extra)}).")
    common = [c for c in wa.columns if c in wb.columns and c not in ("layer", "head")]
    wb = wa[["layer", "head"]].merge(wb, on=["layer", "head"], how="left")
    deltas = pd.DataFrame({f"delta_{c}": wb[c].to_numpy() - wa[c].to_numpy() for c in common})
    heads = pd.concat([wa[["layer", "head"]].reset_index(drop=True), deltas], axis=1)

    kernels = _kernel_changes(ta, tb)
    kmax = (kernels.assign(absd=kernels["delta"].abs())
            .groupby(["layer", "head", "metric"])["absd"].max().unstack("metric"))
    for metric in _KERNEL_METRICS:
        col = kmax[metric] if metric in kmax else pd.Series(dtype=float)
        heads[f"{metric}_change"] = [col.get((li, h), np.nan) for li, h in zip(heads.layer, heads["head"],
                                                                           strict=True)]
    spec = _spectrum_changes(ta, tb)
    smax = spec.groupby(["layer", "head"])["spectrum_change"].max()
    heads["spectrum_change"] = [smax.get((li, h), np.nan) for li, h in zip(heads.layer, heads["head"],
                                                                         strict=True)]
    parts = [heads["kernel_attention_change"], heads["spectrum_change"]]
    parts += [heads[c].abs() for c in heads.columns
              if c.startswith("delta_") and c.removeprefix("delta_").split("@")[0] in _CHANGE_SCORES]
    heads["change"] = pd.concat(parts, axis=1).max(axis=1, skipna=True)
    lead = ["layer", "head", "change", "kernel_attention_change", "kernel_score_change",
            "spectrum_change"]
    heads = heads[lead + [c for c in heads.columns if c not in lead]]
    notes += _missing_notes(heads, wa, wb, names)  # heads still in wa's order here
    heads = heads.sort_values(["change", "layer", "head"], ascending=[False, True, True],
                              ignore_index=True, na_position="last")

    def adj(t):
        return t[(t.metric == "adjacency_score") & t["head"].isna()][["layer", "hook", "value"]]
    layers = adj(a.table).merge(adj(b.table), on=["layer", "hook"], how="outer", suffixes=("_a", "_b"))
    layers = layers.rename(columns={"value_a": "a", "value_b": "b"})
    layers["delta"] = layers["b"] - layers["a"]
    formed, formed_notes = _formation(wa, wb, criteria, names)
    notes += formed_notes
    return Comparison(a, b, names, heads, kernels, formed, layers, _long(ta, tb, heads), notes,
                      skipped, (ta, tb))


_CHANGES = ("change", "kernel_attention_change", "kernel_score_change", "spectrum_change")


def _long(ta: pd.DataFrame, tb: pd.DataFrame, heads: pd.DataFrame) -> pd.DataFrame:
    """The saved long form of a comparison (DESIGN: saved results are long), from the
    per-head rows as compared (:func:`_align_offsets`)."""
    keys = ["hook", "layer", "head", "offset", "ablation", "metric"]

    def scalar(t):
        t = t[t["head"].notna() & ~t.metric.isin(_VECTOR_METRICS)]
        return t[keys + ["value"]]
    scores = scalar(ta).merge(scalar(tb), on=keys, how="outer", suffixes=("_a", "_b"))
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
        model_a: a causal TransformerLens model.
        model_b: a causal TransformerLens model with ``model_a``'s n_layers, n_heads and
            vocabulary (e.g. two checkpoints of one run).
        tokens: ``[batch, pos]`` ids valid for both.
        attention_mask: ``[batch, pos]``, 1 for real tokens, 0 for padding.
        names: display names of A and B.
        criteria: as :func:`compare_inspections`.
        inspect_kwargs: passed to :func:`~posinterp.dashboard.inspect.inspect_heads` for
            both (``ablate``, ``n_null``, ``seed``, ``max_pattern_tokens``, ...).

    Returns:
        :class:`Comparison`.

    Raises:
        ValueError: as :func:`compare_inspections`, and tokens either model refuses
            (ids >= d_vocab, more positions than n_ctx), checked before either model
            runs; and as :func:`~posinterp.dashboard.inspect.inspect_heads`.
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
