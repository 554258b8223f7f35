"""Position probes: can a small MLP read a token's position from given features?

Zuo et al. 2024 (arXiv 2501.00073) compare cosine-similarity features with embedding
variance (Chi et al. 2023). Features per real token k (docs/concepts.md, "Position probe"):

* ``cosine``: the window C_{k,k-1}, ..., C_{k,k-w} (diagonal excluded), zeros before the
  start, plus the validity mask of those offsets. Never the whole row padded to n_ctx:
  its padding length alone encodes k.
* ``mask_only``: the validity mask alone, the control the cosine probe must beat (it
  reveals min(k, w) and nothing else).
* ``variance``: the variance over d_model of the residual (and attention output).
* ``variance_window``: those variances at k, k-1, ..., k-w (zeros before the start) plus
  the validity mask: the variance signal with as many features as the cosine window
  (2w vs 2w + 2 or 3w + 2), so a win of the cosine probe is not a feature-count effect.
* ``variance_matched``: the residual's variance at k, k-1, ..., k-w+1 (zeros before the
  start) plus the validity mask: exactly the cosine window's 2w features, from the same
  activation, so the two differ only in *what* each feature measures (Zuo et al.'s
  comparison, made count-matched).
* ``cosine_shuffled``: the cosine window with its similarity columns taken from another
  token (one seeded permutation of all tokens), validity mask kept: the cosine probe's
  feature count and value distribution with no link to the token's own position beyond
  the mask.
* ``raw``: the residual vector.

Two probe families read the same features: ``mlp``, a 4-layer MLP with MSE loss and
early stopping on a validation split (:func:`fit_probe`, the paper's), and ``ridge``,
closed-form ridge regression with its penalty chosen on the validation split
(:func:`fit_ridge_probe`), so a verdict does not hang on one probe's capacity. Splits
are by sequence. Scores: NRMSE = RMSE / (max position - min position) and Pearson r, on
held-out sequences; :func:`null_nrmse` is the score of predicting the train mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy import stats
from torch import Tensor

from .._rng import preserved_rng
from .._validate import check_indices
from ._checks import check_attention_mask, check_tokens, lengths_from_mask, on_cpu, run_cached
from .similarity import compact_real_tokens, cosine_self_similarity

__all__ = ["FAMILIES", "FEATURES", "ProbeConfig", "ProbeResult", "fit_probe", "fit_ridge_probe",
           "min_sequences", "null_nrmse", "position_features", "probe_positions",
           "sequence_split"]

FEATURES = ("cosine", "mask_only", "variance", "raw", "variance_window", "cosine_shuffled",
            "variance_matched")
FAMILIES = ("mlp", "ridge")
RIDGE_ALPHAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)


def position_features(
    resid: Float[Tensor, "batch pos d_model"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    kind: str = "cosine",
    window: int = 8,
    attn_out: Float[Tensor, "batch pos d_model"] | None = None,
) -> tuple[Float[Tensor, "n feat"], Int[Tensor, "n"], Int[Tensor, "n"]]:
    """Features, positions and sequence ids of every real token.

    Args:
        resid: residual stream at one hook.
        attention_mask: 1 for real tokens (either padding side).
        kind: one of :data:`FEATURES`.
        window: w, the number of preceding offsets for ``cosine``/``mask_only``.
        attn_out: optional attention output at the same layer; ``variance`` then has
            two columns (residual, attention output).

    Returns:
        ``(X [n, f] float32, y [n] positions, groups [n] sequence index)``.

    Raises:
        ValueError: for an unknown ``kind``, ``window < 1`` or malformed inputs.
    """
    if kind not in FEATURES:
        raise ValueError(f"kind must be one of {FEATURES}, got {kind!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if resid.ndim != 3:
        raise ValueError(f"resid must have shape [batch, pos, d_model], got {tuple(resid.shape)}")
    batch, pos, _ = resid.shape
    resid, attn_out, attention_mask = on_cpu(resid), on_cpu(attn_out), on_cpu(attention_mask)
    mask = check_attention_mask(attention_mask, (batch, pos))
    lengths = lengths_from_mask(mask, batch, pos)
    k = torch.arange(pos)
    real = k[None, :] < lengths[:, None]  # after compaction, real tokens come first
    offsets = torch.arange(1, window + 1)
    valid = (k[:, None] - offsets[None, :] >= 0).float()  # [pos, w]
    if kind in ("cosine", "mask_only", "cosine_shuffled"):
        feats = valid.expand(batch, pos, window)
        if kind != "mask_only":
            C = cosine_self_similarity(resid, mask)  # [batch, pos, pos]
            idx = (k[:, None] - offsets[None, :]).clamp(min=0)  # [pos, w]
            sims = torch.gather(C, 2, idx.expand(batch, pos, window))
            # No nan_to_num: a NaN inside the window means NaN activations, which
            # fit_probe must refuse, not read as similarity 0.
            sims = torch.where(valid.bool(), sims, 0.0)
            if kind == "cosine_shuffled":  # another real token's window, same for every seed
                flat = sims[real]
                perm = torch.randperm(len(flat), generator=torch.Generator().manual_seed(0))
                sims = sims.clone()
                sims[real] = flat[perm]
            feats = torch.cat([sims, feats], -1)
    elif kind == "variance_matched":
        var = compact_real_tokens(resid.double(), mask).var(-1, unbiased=False)  # [batch, pos]
        lag = torch.arange(0, window)
        idx = (k[:, None] - lag[None, :]).clamp(min=0)  # [pos, w]
        v = torch.gather(var[:, None, :].expand(batch, pos, pos), 2, idx.expand(batch, pos, window))
        v = torch.where((k[:, None] - lag[None, :] >= 0), v, 0.0)
        feats = torch.cat([v, valid.double().expand(batch, pos, window)], -1)
    elif kind == "variance_window":
        acts = [resid] + ([attn_out] if attn_out is not None else [])
        cols = []
        for act in acts:
            var = compact_real_tokens(act.double(), mask).var(-1, unbiased=False)  # [batch, pos]
            lag = torch.arange(0, window + 1)
            idx = (k[:, None] - lag[None, :]).clamp(min=0)  # [pos, w + 1]
            v = torch.gather(var[:, None, :].expand(batch, pos, pos), 2,
                             idx.expand(batch, pos, window + 1))
            cols.append(torch.where((k[:, None] - lag[None, :] >= 0), v, 0.0))
        feats = torch.cat(cols + [valid.double().expand(batch, pos, window)], -1)
    elif kind == "variance":
        cols = [compact_real_tokens(resid.double(), mask).var(-1, unbiased=False)]
        if attn_out is not None:
            cols.append(compact_real_tokens(attn_out.double(), mask).var(-1, unbiased=False))
        feats = torch.stack(cols, -1)
    else:
        feats = compact_real_tokens(resid.double(), mask)
    groups = torch.arange(batch)[:, None].expand(batch, pos)
    y = k[None, :].expand(batch, pos)
    return feats[real].float(), y[real], groups[real]


def _split_sizes(n: int, fractions) -> tuple[int, int, int]:
    n_tr = max(1, round(fractions[0] * n))
    n_va = max(1, round(fractions[1] * n))
    return n_tr, n_va, n - n_tr - n_va


def min_sequences(fractions=(0.6, 0.2, 0.2)) -> int:
    """Smallest number of sequences whose split by ``fractions`` leaves no part empty.

    4 for the default (0.6, 0.2, 0.2): 3 sequences round to 2/1/0.

    Raises:
        ValueError: for fractions that are not 3 positive numbers summing to 1.
    """
    if len(fractions) != 3 or any(not f > 0 for f in fractions):
        raise ValueError(f"fractions must be 3 positive numbers (train, val, test), got {fractions}")
    if abs(sum(fractions) - 1) > 1e-9:
        raise ValueError(f"fractions must sum to 1, got {fractions}")
    n = 3
    while min(_split_sizes(n, fractions)) < 1:
        n += 1
    return n


def sequence_split(groups: Int[Tensor, "n"], seed: int = 0, fractions=(0.6, 0.2, 0.2)
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Boolean train/val/test masks over items, splitting whole sequences.

    Every part holds at least one sequence: an empty test split would score NaN (or
    an r of 0.0 that reads as "no position information"), so too few sequences are
    refused instead.

    Raises:
        ValueError: with fewer sequences than :func:`min_sequences` (the message says
            how many are needed), or fractions that are not 3 positive numbers summing
            to 1.
    """
    need = min_sequences(fractions)
    uniq = torch.unique(groups)
    if len(uniq) < need:
        raise ValueError(f"need at least {need} sequences to split by sequence into non-empty "
                         f"train/val/test parts with fractions {tuple(fractions)}, got {len(uniq)}")
    perm = uniq[torch.randperm(len(uniq), generator=torch.Generator().manual_seed(seed))]
    n_tr, n_va, _ = _split_sizes(len(uniq), fractions)
    parts = perm[:n_tr], perm[n_tr:n_tr + n_va], perm[n_tr + n_va:]
    return tuple(torch.isin(groups, p) for p in parts)


@dataclass(frozen=True)
class ProbeConfig:
    """A 4-layer MLP probe (3 hidden ReLU layers) trained with Adam on MSE."""

    hidden: int = 64
    lr: float = 3e-3
    max_epochs: int = 300
    patience: int = 20
    batch_size: int = 256


@dataclass(frozen=True)
class ProbeResult:
    """Held-out scores: ``nrmse`` (RMSE / position range), ``pearson_r``, ``n_test``.

    ``pearson_r`` is NaN when the probe's test predictions are constant (r is undefined
    there; 0.0 would read as "no position information"): look at ``nrmse``.
    """

    nrmse: float
    pearson_r: float
    n_test: int
    epochs: int


def fit_probe(X: Float[Tensor, "n feat"], y: Int[Tensor, "n"], groups: Int[Tensor, "n"],
              seed: int = 0, config: ProbeConfig = ProbeConfig()) -> ProbeResult:
    """Fit the position probe on train sequences, stop early on val, score on test.

    Training needs gradients, so they are enabled here whatever the caller's context:
    notebooks wrap analysis code in ``torch.no_grad()`` or ``torch.inference_mode()``
    (whose tensors are copied out of inference mode first).

    Source: Zuo et al. 2024 (arXiv 2501.00073), probing section; docs/concepts.md.

    Raises:
        ValueError: for mismatched lengths, non-finite ``X``, positions that are all
            equal (NRMSE divides by their range), or too few sequences for a non-empty
            test split (see :func:`sequence_split`).
    """
    with torch.inference_mode(False), torch.enable_grad():
        # clone: an inference tensor cannot enter autograd, even outside inference mode
        return _fit_probe(X.clone(), y.clone(), groups.clone(), seed, config)


def _fit_probe(X, y, groups, seed: int, config: ProbeConfig) -> ProbeResult:
    """See :func:`fit_probe`."""
    _check_probe_inputs(X, y, groups)
    tr, va, te = sequence_split(groups, seed)
    Xf = X.float()
    mu, sd = Xf[tr].mean(0), Xf[tr].std(0)
    # A feature constant on the train split (e.g. a window offset that no train token
    # reaches) is left unscaled: dividing by a clamped 1e-6 would blow any test value up
    # by 1e6 and the probe's error with it.
    sd = torch.where(sd > 1e-6, sd, torch.ones_like(sd))
    Xn = (Xf - mu) / sd
    yf = y.float()
    y_mu, y_sd = yf[tr].mean(), yf[tr].std().clamp_min(1e-6)
    yn = (yf - y_mu) / y_sd
    h = config.hidden
    with preserved_rng():  # nn.Linear draws its initial values from the global generator
        torch.default_generator.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(X.shape[1], h), torch.nn.ReLU(),
                                  torch.nn.Linear(h, h), torch.nn.ReLU(),
                                  torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 1))
    opt = torch.optim.Adam(net.parameters(), lr=config.lr)
    gen = torch.Generator().manual_seed(seed)
    best, best_state, bad, epoch = float("inf"), None, 0, 0
    tr_idx = tr.nonzero().flatten()
    for epoch in range(1, config.max_epochs + 1):  # noqa: B007 (reported below)
        net.train()
        for chunk in tr_idx[torch.randperm(len(tr_idx), generator=gen)].split(config.batch_size):
            loss = torch.nn.functional.mse_loss(net(Xn[chunk]).squeeze(-1), yn[chunk])
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            val = torch.nn.functional.mse_loss(net(Xn[va]).squeeze(-1), yn[va]).item()
        if val < best - 1e-6:
            best, bad = val, 0
            best_state = {k: v.clone() for k, v in net.state_dict().items()}
        else:
            bad += 1
            if bad >= config.patience:
                break
    net.load_state_dict(best_state)
    with torch.no_grad():
        pred = (net(Xn[te]).squeeze(-1) * y_sd + y_mu).double().numpy()
    target = yf[te].double().numpy()
    nrmse, r = _scores(pred, target, float(yf.max() - yf.min()))  # span > 0, checked above
    return ProbeResult(nrmse=nrmse, pearson_r=r, n_test=int(te.sum()), epochs=epoch)


def _check_probe_inputs(X, y, groups) -> None:
    if not len(X) == len(y) == len(groups):
        raise ValueError(f"X, y, groups must have equal length, got {len(X)}, {len(y)}, {len(groups)}")
    if not torch.isfinite(X).all():
        raise ValueError("X must be finite (no NaN/inf features)")
    if len(y) == 0 or int(y.max()) == int(y.min()):
        raise ValueError("positions are all equal (or there are none): nothing to probe, and "
                         "NRMSE = RMSE / (max - min position) is undefined")


def _scores(pred: np.ndarray, target: np.ndarray, span: float) -> tuple[float, float]:
    rmse = float(np.sqrt(np.mean((pred - target) ** 2)))
    # r is undefined for a constant prediction or target: NaN, never a silent 0.0.
    defined = np.ptp(pred) > 0 and np.ptp(target) > 0
    r = float(stats.pearsonr(pred, target).statistic) if defined else float("nan")
    return rmse / span, r


def fit_ridge_probe(X: Float[Tensor, "n feat"], y: Int[Tensor, "n"], groups: Int[Tensor, "n"],
                    seed: int = 0, alphas=RIDGE_ALPHAS) -> ProbeResult:
    """Ridge regression of position on ``X``: features standardized on the train split,
    an intercept, the penalty ``alpha`` (on the standardized weights) chosen from
    ``alphas`` by validation MSE, scored on the test split. The same split as
    :func:`fit_probe` for the same ``seed``; ``epochs`` is 0 (closed form, float64).

    Source: Hoerl & Kennard 1970 (ridge); the linear probe beside Zuo et al.'s MLP.

    Raises:
        ValueError: as :func:`fit_probe`, or for empty or non-positive ``alphas``.
    """
    _check_probe_inputs(X, y, groups)
    if len(alphas) == 0 or any(not a > 0 for a in alphas):
        raise ValueError(f"alphas must be positive numbers, got {alphas}")
    tr, va, te = sequence_split(groups, seed)
    Xd, yd = X.double().numpy(), y.double().numpy()
    tr, va, te = tr.numpy(), va.numpy(), te.numpy()
    mu, sd = Xd[tr].mean(0), Xd[tr].std(0)
    sd = np.where(sd > 1e-6, sd, 1.0)  # a constant train column stays unscaled (fit_probe)
    Z = (Xd - mu) / sd
    y_mu = yd[tr].mean()
    A, b = Z[tr], yd[tr] - y_mu
    gram, rhs = A.T @ A, A.T @ b
    best = None
    for alpha in alphas:
        w = np.linalg.solve(gram + alpha * np.eye(len(gram)), rhs)
        val = float(np.mean((Z[va] @ w + y_mu - yd[va]) ** 2))
        if best is None or val < best[0]:
            best = (val, w)
    pred = Z[te] @ best[1] + y_mu
    nrmse, r = _scores(pred, yd[te], float(yd.max() - yd.min()))
    return ProbeResult(nrmse=nrmse, pearson_r=r, n_test=int(te.sum()), epochs=0)


def null_nrmse(y: Int[Tensor, "n"], groups: Int[Tensor, "n"], seed: int = 0) -> float:
    """NRMSE of the no-feature predictor (the train split's mean position) on the test
    split of :func:`sequence_split` with ``seed``: the score a probe gets from nothing.

    Raises:
        ValueError: as :func:`fit_probe` (all-equal positions, too few sequences).
    """
    _check_probe_inputs(torch.zeros(len(y), 1), y, groups)
    tr, _, te = sequence_split(groups, seed)
    yd = y.double()
    rmse = float(torch.sqrt(((yd[te] - yd[tr].mean()) ** 2).mean()))
    return rmse / float(yd.max() - yd.min())


@torch.no_grad()
def _activations(model, tokens, mask, layer):
    resid = f"blocks.{layer}.hook_resid_post" if layer >= 0 else "blocks.0.hook_resid_pre"
    names = {resid} | ({f"blocks.{layer}.hook_attn_out"} if layer >= 0 else set())
    cache = run_cached(model, tokens, mask, names)  # names: replaced sites read too
    return cache[resid], (cache[f"blocks.{layer}.hook_attn_out"] if layer >= 0 else None), resid


def probe_positions(model, tokens: Int[Tensor, "batch pos"],
                    attention_mask: Int[Tensor, "batch pos"] | None = None,
                    layers: list[int] | None = None, features=FEATURES, window: int = 8,
                    seeds=(0, 1, 2), config: ProbeConfig = ProbeConfig(),
                    families=("mlp",), null: bool = False) -> pd.DataFrame:
    """Probe position from each feature set at each layer's ``resid_post``, over seeds,
    with each probe family of ``families`` (:data:`FAMILIES`).

    Works on any TransformerLens model. Layer -1 is the embedding; by default every layer
    and the embedding, the baseline a layer's probe must beat. ``null``: also a row per
    seed, ``feature="no_feature"``, ``probe="constant"``, at the first of ``layers``, metric
    ``nrmse``: the score of predicting the train mean (:func:`null_nrmse`; it reads no
    activation, so one layer holds it).

    Returns:
        Tidy DataFrame ``hook, layer, head, position, metric, value, feature, seed, probe``
        with ``metric`` in ``nrmse``, ``pearson_r``.

    Raises:
        ValueError: for an unknown feature or family, ``layers`` that are not distinct
            ints in ``[-1, n_layers)``, or too few sequences (see :func:`sequence_split`).
    """
    bad = [f for f in families if f not in FAMILIES]
    if bad or not len(families):
        raise ValueError(f"families must be a non-empty subset of {FAMILIES}, got {families}")
    tokens = check_tokens(model, tokens)
    mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
    # -1 is the embedding; -2 must not silently become it too.
    # The embedding (-1) is the baseline row: whatever a probe reads there is not built
    # by attention (a task template alone can place tokens), so it is always scored.
    layers = ([-1, *range(model.cfg.n_layers)] if layers is None
              else check_indices("layers", layers, model.cfg.n_layers, start=-1))
    rows = []
    for layer in layers:
        resid, attn_out, hook = _activations(model, tokens, mask, layer)
        for feature in features:
            X, y, groups = position_features(resid, mask, feature, window, attn_out)
            for seed in seeds:
                for family in families:
                    res = (fit_probe(X, y, groups, seed, config) if family == "mlp"
                           else fit_ridge_probe(X, y, groups, seed))
                    for metric in ("nrmse", "pearson_r"):
                        rows.append(dict(hook=hook, layer=layer, head=pd.NA, position=pd.NA,
                                         metric=metric, value=getattr(res, metric),
                                         feature=feature, seed=seed, probe=family))
        if null and layer == layers[0]:
            _, y, groups = position_features(resid, mask, "mask_only", window)
            for seed in seeds:
                rows.append(dict(hook=hook, layer=layer, head=pd.NA, position=pd.NA,
                                 metric="nrmse", value=null_nrmse(y, groups, seed),
                                 feature="no_feature", seed=seed, probe="constant"))
    return pd.DataFrame(rows).astype({"head": "Int64", "position": "Int64"})
