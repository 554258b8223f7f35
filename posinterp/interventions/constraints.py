"""Training-time constraints on QK circuits, as parametrizations (docs/interventions.md).

Two families, each with its own control. Every constraint is stated on the effective
form M = W_Q W_K^T acting on the normalized residual (the norm gain folded in,
:data:`posinterp.models.qk_convention.QK_CONVENTION`).

**Single-channel bans on untied weights** (control: the untied model, ``none``).
W_Q := W_Q° (I - Π_c), b_Q := b_Q° (I - Π_c), with Π_c B's spectral projector onto
channel c (:mod:`.channels`) computed from the current weights at every forward pass
and treated as a constant (detached) in the backward pass (docs/concepts.md, "Spectral channels"):
an eigen-projector's own gradient blows up where real eigenvalues merge into a complex
pair. Because Π_c commutes with B, the banned head's small form is
B' = B (I - Π_c): channel c's eigenvalues become 0 and every other eigenvalue is kept
exactly, so exactly one channel is removed, after every optimizer step.

==========================  ===============================================================
ban                          effect on M
==========================  ===============================================================
``ban_positive_real``        no positive-real eigenvalue; all others as learned
``ban_negative_real``        no negative-real eigenvalue; all others as learned
``ban_complex``              no complex pair (no rotational channel); real ones as learned
==========================  ===============================================================

**The tied family** W_K := W_Q X, b_K := b_Q X (control: ``tied``, X free). Every
key is k = q X, so M = W_Q X^T W_Q^T and constraining X constrains M by construction.
These constrain *more* than one channel, and their names say what they constrain:

==========================  ===================================  ===========================
constraint                  X                                    effect on M
==========================  ===================================  ===========================
``tied`` (the control)      free                                 none beyond the tying
``symmetric``               (A + A^T) / 2                        M symmetric (real spectrum;
                                                                 a strict subset of "no
                                                                 complex channel")
``antisymmetric``           (A - A^T) / 2                        M antisymmetric
``left_half_plane``         -(L L^T + εI) + (A - A^T) / 2        every eigenvalue Re < 0
                                                                 (bans the whole right
                                                                 half-plane, complex
                                                                 pairs included)
``right_half_plane``        +(L L^T + εI) + (A - A^T) / 2        every eigenvalue Re > 0
==========================  ===================================  ===========================

**Rank-matched controls of the bans** (``rank_matched_<channel>``; control: the untied
model). W_Q := W_Q° (I - U U^T), b_Q := b_Q° (I - U U^T), with U [d_head, r_h] an
orthonormal basis of a random subspace of the query's d_head space, drawn per head from
``generator`` (Haar: QR of a Gaussian matrix, signs fixed) and then *fixed* (a constant).
The rank r_h is the rank of the matched channel's projector Π_c at the call, i.e. of the
ban ``ban_<channel>`` applied to the same weights at init: the number of eigenvalues of
the head's B in channel c (a complex pair counts 2), read as trace(Π_c)
(:func:`banned_ranks`). The control removes as many dimensions of q as the ban removes
at init, but ones unrelated to B's spectrum: q U = 0 at every step, so the removed
subspace carries no energy, and M' = W_Q° (I - U U^T) W_K^T. (The ban's Π_c follows the
weights, so the rank it removes can change during training; the control's stays r_h.)
``ban_random_subspace`` with ``rank`` (an int, or ``[n_layers, n_heads]`` ints) is the
same construction with the ranks given.

**Frequency-band bans on RoPE heads** (``ban_band`` with ``band=(p, ...)``; control: the
untied model). W_Q := W_Q° D, b_Q := b_Q° D, with D the fixed diagonal that zeroes the
query's dims of rotary pairs p (as the layer pairs them). RoPE turns each pair within its
own plane, so the banned pairs' terms of every score are exactly 0 at every offset and
step (issue 28; the inference-time ``remove_band`` of :mod:`.qk` in training).

(For the half-planes: B = X^T S with S = W_Q^T C G² C W_Q positive semi-definite is
similar to S^½ X^T S^½, a definite symmetric part plus a skew part.) Rotary heads: the
constraint holds for M(0); RoPE's phase still rotates q against k.

Initial scale: :func:`match_qk_norm` rescales each head's free parameters so that every
family starts from a given ||M||_F per head (the untied model's, times a stated factor).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from .._validate import check_indices
from ..analysis.channels import channel_projector
from ..analysis.spectral import CHANNELS

__all__ = ["BANS", "BandBan", "CONSTRAINTS", "RANDOM_SUBSPACE", "RANK_MATCHED",
           "TIED_CONSTRAINTS", "ChannelBan", "SubspaceBan", "TiedKey", "banned_ranks",
           "constrain_qk", "effective_x", "match_qk_norm", "qk_norms", "random_subspaces",
           "emptied_heads", "resize_removed_subspaces",
           "removed_energy", "removed_ranks"]

TIED_CONSTRAINTS = ("tied", "symmetric", "antisymmetric", "left_half_plane", "right_half_plane")
BANS = tuple(f"ban_{c}" for c in CHANNELS)
# the random-subspace control of each ban, its rank read off the ban's projector
RANK_MATCHED = tuple(f"rank_matched_{b.removeprefix('ban_')}" for b in BANS)
CONSTRAINTS = TIED_CONSTRAINTS + BANS + RANK_MATCHED
BAND_BAN = "ban_band"
RANDOM_SUBSPACE = "ban_random_subspace"  # the same construction, ranks given
# old names said "no <channel>" but banned a half-plane: refuse them with the reason
_RENAMED = {"no_positive_real": "left_half_plane", "no_negative_real": "right_half_plane"}
_EPS = 1e-3


_QK_NORM_WHY = ("the norm rescales q and k by their own root-mean-square after the projection, so a "
                "constraint on W_Q, W_K no longer fixes the content form")


def _check_kind(kind: str) -> None:
    if kind in _RENAMED:
        raise ValueError(f"constraint {kind!r} was renamed {_RENAMED[kind]!r}: it bans a whole "
                         f"half-plane, not one channel; for a single-channel ban use "
                         f"'ban_{kind.removeprefix('no_')}'")
    if kind not in (*CONSTRAINTS, BAND_BAN, RANDOM_SUBSPACE):
        raise ValueError(f"constraint must be one of {(*CONSTRAINTS, BAND_BAN, RANDOM_SUBSPACE)}, "
                         f"got {kind!r}")


def effective_x(kind: str, A: torch.Tensor, L: torch.Tensor | None) -> torch.Tensor:
    """X [n_heads, d_head, d_head] of a tied-family constraint from its free parameters.

    Raises:
        ValueError: for a ``kind`` not in :data:`TIED_CONSTRAINTS`.
    """
    skew = 0.5 * (A - A.mT)
    if kind == "tied":
        return A
    if kind == "symmetric":
        return 0.5 * (A + A.mT)
    if kind == "antisymmetric":
        return skew
    if kind in ("left_half_plane", "right_half_plane"):
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        definite = L @ L.mT + _EPS * eye
        return skew + (definite if kind == "right_half_plane" else -definite)
    raise ValueError(f"tied constraint must be one of {TIED_CONSTRAINTS}, got {kind!r}")


class TiedKey(nn.Module):
    """Parametrization W_K := W_Q X (or b_K := b_Q X) of one attention module.

    ``W_Q`` is read through a getter at each call (not stored as a submodule), so the
    gradient reaches W_Q and X's free parameters. A and L start as Ginibre matrices
    (i.i.d. N(0, 1/d_head)) times ``init_scale``, so the tied control's B = X^T S starts
    with a random spectrum like the untied model's, not near the identity; drawn from
    ``generator`` (None: torch's global generator, which advances).
    """

    def __init__(self, kind: str, n_heads: int, d_head: int, get_source, init_scale: float = 1.0,
                 shared=None, generator: torch.Generator | None = None, from_tl=None):
        super().__init__()
        self._from_tl = from_tl  # per-head result -> the stored layout (TL 4: nn.Linear's)
        if kind not in TIED_CONSTRAINTS:
            raise ValueError(f"tied constraint must be one of {TIED_CONSTRAINTS}, got {kind!r}")
        self.kind = kind
        self._get_source = get_source
        if shared is None:
            def ginibre():
                return torch.randn(n_heads, d_head, d_head, generator=generator) / d_head ** 0.5
            self.A = nn.Parameter(init_scale * ginibre())
            self.L = nn.Parameter(init_scale ** 0.5 * ginibre()) if kind.endswith("half_plane") \
                else None
        else:  # the bias parametrization shares X's parameters with the weight's
            self._shared = [shared]

    def x(self) -> torch.Tensor:
        owner = self._shared[0] if hasattr(self, "_shared") else self
        return effective_x(owner.kind, owner.A, owner.L)

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        src = self._get_source()  # W_Q [n_heads, d_model, d_head] or b_Q [n_heads, d_head]
        X = self.x()
        out = torch.einsum("hd,hde->he", src, X) if src.ndim == 2 else src @ X
        return out if self._from_tl is None else self._from_tl(out)


class ChannelBan(nn.Module):
    """Parametrization W_Q := W_Q° (I - Π_c) (or b_Q := b_Q° (I - Π_c)), Π_c detached.

    Π_c is recomputed from the current effective weights whenever they changed (keyed
    on the tensors' version counters, so the weight and the bias of one step share it)
    and enters the graph as a constant.
    """

    def __init__(self, channel: str, get_weights, shared=None, slot=None):
        super().__init__()
        self.channel = channel
        # -> (W_Q° [n_heads, d_model, d_head], W_K [n_kv_heads, d_model, d_head], gain or
        # None, center), views of the parameters (so their version counters key the cache)
        self._get_weights = get_weights
        self._shared = [shared] if shared is not None else None
        self._slot = slot  # backend.QKSlot: the stored layout <-> TL 3.9's per-head one
        self._key, self._P = None, None

    def projector(self) -> torch.Tensor:
        """I - Π_c per head, [n_heads, d_head, d_head], float32 on the weights' device."""
        if self._shared is not None:
            return self._shared[0].projector()
        W_Q, W_K, gain, center = self._get_weights()
        key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in (W_Q, W_K, gain)
                    if t is not None)
        if key != self._key:
            P = _keep_projectors(W_Q, W_K, gain, center, self.channel)
            self._P = torch.from_numpy(P).to(W_Q.dtype).to(W_Q.device)
            self._key = key
        return self._P

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        P = self.projector()  # a constant: no gradient through the eigen-decomposition
        slot = self._slot
        x = original if slot is None else slot.to_tl(original)
        out = torch.einsum("hd,hde->he", x, P) if x.ndim == 2 else x @ P  # b_Q / W_Q
        return out if slot is None else slot.from_tl(out)


def _keep_projectors(W_Q, W_K, gain, center, channel: str) -> np.ndarray:
    """I - Π_c of every head's B = W_K^T W_Q (effective weights), ``[n_heads, d_head,
    d_head]`` float64 numpy; grouped keys are repeated to their query heads."""
    from ..analysis.spectral import effective_weights

    if W_K.shape[0] != W_Q.shape[0]:  # grouped keys: query head h reads h // group
        W_K = W_K.repeat_interleave(W_Q.shape[0] // W_K.shape[0], dim=0)
    q = effective_weights(W_Q.detach(), gain, center).cpu().numpy()
    k = effective_weights(W_K.detach(), gain, center).cpu().numpy()
    eye = np.eye(q.shape[-1])
    return np.stack([eye - channel_projector(k[h].T @ q[h], channel) for h in range(q.shape[0])])


@torch.no_grad()
def banned_ranks(model, channel: str) -> torch.Tensor:
    """Rank of the projector Π_c that ``ban_<channel>`` would remove from each head now,
    ``[n_layers, n_heads]`` int64: the number of eigenvalues of the head's B = W_K^T W_Q
    (effective weights, as :class:`ChannelBan` computes Π_c) in channel c, a complex pair
    counting 2, read as trace(Π_c) (a projector's trace is its rank), rounded.

    Reads the model's current effective W_Q (a parametrized one through its
    parametrization). Source: docs/concepts.md, "Spectral channels".

    Raises:
        ValueError: for a ``channel`` not in :data:`posinterp.interventions.CHANNELS`.
    """
    from ..models.backend import attention_weights, refuse_qk_norm
    from ..models.qk_convention import attention_input_norm

    if channel not in CHANNELS:
        raise ValueError(f"channel must be one of {CHANNELS}, got {channel!r}")
    refuse_qk_norm(model, "banned_ranks", _QK_NORM_WHY)
    out = []
    for layer in range(model.cfg.n_layers):
        w = attention_weights(model, layer)
        gain, center, _ = attention_input_norm(model, layer)
        keep = _keep_projectors(w["W_Q"], w["W_K"], gain, center, channel)
        d = keep.shape[-1]
        out.append([round(d - float(np.trace(P))) for P in keep])
    return torch.tensor(out, dtype=torch.int64)


def random_subspaces(ranks, d_head: int, generator: torch.Generator | None = None
                     ) -> torch.Tensor:
    """Orthogonal projectors Π_U = U U^T onto Haar-random subspaces, one per entry of
    ``ranks`` (``[n_heads]`` ints in [0, d_head]), ``[n_heads, d_head, d_head]`` float64.

    Every head draws a full d_head x d_head Gaussian matrix from ``generator`` whatever
    its rank (so one rank does not shift the next head's draw); U is the first r columns
    of its Q factor with the signs of R's diagonal folded in (Haar measure: Mezzadri
    2007, "How to generate random matrices from the classical compact groups", §4).
    """
    out = []
    for r in ranks:
        G = torch.randn(d_head, d_head, generator=generator, dtype=torch.float64)
        Q, R = torch.linalg.qr(G)
        U = (Q * torch.sign(torch.diagonal(R)))[:, : int(r)]
        out.append(U @ U.mT)
    return torch.stack(out)


class SubspaceBan(nn.Module):
    """Parametrization W_Q := W_Q° (I - Π_U) (or b_Q := b_Q° (I - Π_U)) with Π_U a fixed
    orthogonal projector per head (``removed`` ``[n_heads, d_head, d_head]``, a buffer):
    q Π_U = 0 at every step, and the gradient reaching W_Q° is exactly G (I - Π_U)."""

    def __init__(self, removed: torch.Tensor, slot=None):
        super().__init__()
        eye = torch.eye(removed.shape[-1], dtype=removed.dtype)
        self.register_buffer("removed", removed.clone())
        self.register_buffer("keep", eye - removed)
        self._slot = slot  # backend.QKSlot: the stored layout <-> TL 3.9's per-head one

    def projector(self) -> torch.Tensor:
        """I - Π_U per head, ``[n_heads, d_head, d_head]`` (as :meth:`ChannelBan.projector`)."""
        return self.keep

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        slot = self._slot
        x = original if slot is None else slot.to_tl(original)
        P = self.keep.to(x.dtype)
        out = torch.einsum("hd,hde->he", x, P) if x.ndim == 2 else x @ P  # b_Q / W_Q
        return out if slot is None else slot.from_tl(out)


def _resized(P: torch.Tensor, r: int, generator) -> torch.Tensor:
    """Π_U grown or shrunk to rank ``r``, nested: kept directions stay (growing adds
    Haar-random ones orthogonal to U; shrinking keeps a Haar-random r-dim subspace of U)."""
    d = P.shape[-1]
    w, V = torch.linalg.eigh(P)
    U = V[:, w > 0.5]
    now = U.shape[1]
    if r > now:
        G = torch.randn(d, r - now, generator=generator, dtype=torch.float64)
        G = G - U @ (U.mT @ G)
        Q, R = torch.linalg.qr(G)
        U = torch.cat([U, Q * torch.sign(torch.diagonal(R))], dim=1)
    elif r < now:
        G = torch.randn(now, now, generator=generator, dtype=torch.float64)
        Q, R = torch.linalg.qr(G)
        U = U @ (Q * torch.sign(torch.diagonal(R)))[:, :r]
    return U @ U.mT


@torch.no_grad()
def resize_removed_subspaces(model, ranks, generator: torch.Generator | None = None) -> int:
    """Set each head's removed random subspace (a :class:`SubspaceBan`:
    ``rank_matched_<channel>``, ``ban_random_subspace``) to rank ``ranks[layer, head]``
    (``[n_layers, n_heads]`` ints in [0, d_head]), nested: a growing subspace keeps its
    directions and adds Haar-random ones orthogonal to them, a shrinking one keeps a
    Haar-random subspace of itself. The query weight W_Q° (I - Π_U) changes only in the
    directions added or released. The rank-tracked controls of the learning-speed
    experiment call this as the paired ban's rank changes (issue 37 item 6).

    Returns:
        The number of heads whose rank changed.

    Raises:
        ValueError: ``ranks`` of another shape or outside [0, d_head], or a layer whose
            W_Q has no :class:`SubspaceBan`.
    """
    from ..models.backend import qk_slots

    shape, d = (model.cfg.n_layers, model.cfg.n_heads), model.cfg.d_head
    ranks = torch.as_tensor(ranks)
    if (tuple(ranks.shape) != shape or ranks.is_floating_point()
            or bool(((ranks < 0) | (ranks > d)).any())):
        raise ValueError(f"ranks must be [n_layers, n_heads] = {list(shape)} ints in "
                         f"[0, d_head = {d}], got {ranks.tolist()!r}")
    bans = []
    for layer in range(shape[0]):
        slots = qk_slots(model, layer)
        found = [s.module.parametrizations[s.name][0] for s in (slots["W_Q"], slots["b_Q"])
                 if s is not None and parametrize.is_parametrized(s.module, s.name)]
        if not found or not isinstance(found[0], SubspaceBan):
            raise ValueError(f"layer {layer}'s W_Q has no random-subspace ban to resize "
                             f"(constrain_qk with {RANK_MATCHED[0]!r} or {RANDOM_SUBSPACE!r} first)")
        bans.append(found)
    changed = 0
    for layer, found in enumerate(bans):
        removed = found[0].removed.detach().cpu().double()
        new = removed.clone()
        for head in range(shape[1]):
            r = int(ranks[layer, head])
            if round(float(torch.diagonal(removed[head]).sum())) != r:
                new[head] = _resized(removed[head], r, generator)
                changed += 1
        for ban in found:  # W_Q's and b_Q's share the subspace
            ban.removed.copy_(new.to(ban.removed))
            ban.keep.copy_((torch.eye(d, dtype=torch.float64) - new).to(ban.keep))
    return changed


@torch.no_grad()
def removed_ranks(model) -> torch.Tensor:
    """Rank each head's QK constraint removes from q now, ``[n_layers, n_heads]`` int64:
    d_head - trace(I - Π_c) of a :class:`ChannelBan` (its current Π_c), trace(Π_U) of a
    :class:`SubspaceBan`, the number of zeroed dims of a :class:`BandBan`, 0 elsewhere."""
    from ..models.backend import qk_slots

    rows = []
    for layer in range(model.cfg.n_layers):
        q = qk_slots(model, layer)["W_Q"]
        row = [0] * model.cfg.n_heads
        if parametrize.is_parametrized(q.module, q.name):
            p = q.module.parametrizations[q.name][0]
            if isinstance(p, ChannelBan):
                P = p.projector().double()
                row = [round(P.shape[-1] - float(t)) for t in torch.diagonal(P, 0, -2, -1).sum(-1)]
            elif isinstance(p, SubspaceBan):
                row = [round(float(t)) for t in torch.diagonal(p.removed, 0, -2, -1).sum(-1)]
            elif isinstance(p, BandBan):
                row = [int((p.keep == 0).sum())] * model.cfg.n_heads
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


@torch.no_grad()
def removed_energy(model) -> torch.Tensor:
    """Energy of each head's query weights in its removed subspace, ||W_Q Π_U||_F² /
    ||W_Q°||_F² (W_Q the weight the model uses, W_Q° the free parameter behind it),
    ``[n_layers, n_heads]`` float64; NaN for heads without a :class:`SubspaceBan`. 0 up to
    float rounding at every step (also for a head whose whole d_head is removed, where
    W_Q itself is 0 up to rounding)."""
    from ..models.backend import qk_slots

    out = torch.full((model.cfg.n_layers, model.cfg.n_heads), float("nan"), dtype=torch.float64)
    for layer in range(model.cfg.n_layers):
        q = qk_slots(model, layer)["W_Q"]
        if parametrize.is_parametrized(q.module, q.name):
            p = q.module.parametrizations[q.name][0]
            if isinstance(p, SubspaceBan):
                free = q.to_tl(q.module.parametrizations[q.name].original).double().cpu()
                W = q.to_tl(getattr(q.module, q.name)).double().cpu()  # [n, d_model, d_head]
                cut = (W @ p.removed.double().cpu()).pow(2).sum((-1, -2))
                out[layer] = cut / free.pow(2).sum((-1, -2)).clamp_min(1e-300)
    return out


class BandBan(nn.Module):
    """Parametrization W_Q := W_Q° D (or b_Q := b_Q° D): D zeroes the query dims ``dims``
    of every head (a constant; gradients reach the other dims exactly)."""

    def __init__(self, dims: list[int], d_head: int, slot=None):
        super().__init__()
        keep = torch.ones(d_head)
        keep[dims] = 0.0
        self.register_buffer("keep", keep)
        self._slot = slot  # backend.QKSlot: the stored layout <-> TL 3.9's per-head one

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        slot = self._slot
        x = original if slot is None else slot.to_tl(original)
        out = x * self.keep.to(x.dtype)  # W_Q [n, d_model, d_head] or b_Q [n, d_head]
        return out if slot is None else slot.from_tl(out)


def constrain_qk(model, kind: str, layers: list[int] | None = None,
                 generator: torch.Generator | None = None, band=None, rank=None) -> None:
    """Make every head in ``layers`` follow constraint ``kind`` (see the module docstring).

    Tied kinds parametrize W_K (and b_K) as W_Q X; bans parametrize W_Q (and b_Q) as
    W_Q° (I - Π_c); ``ban_band`` parametrizes W_Q (and b_Q) as W_Q° D, zeroing the rotary
    pairs ``band`` of every RoPE head; ``rank_matched_<channel>`` parametrizes W_Q (and
    b_Q) as W_Q° (I - U U^T), U a random subspace per head of the rank of that head's
    Π_c on the weights at the call (:func:`banned_ranks`); ``ban_random_subspace`` does
    the same with ``rank`` given (an int for every head, or ``[n_layers, n_heads]``
    ints). Call before building the optimizer. ``generator`` seeds X's initial values
    (tied kinds) and the random subspaces (drawn on CPU, layer by layer, head by head);
    None draws them from torch's global CPU generator, which advances as any torch draw
    does (the one posinterp call that uses the global generator: pass a seeded
    ``torch.Generator`` for a reproducible call that leaves the caller's state alone).

    The parametrization is registered on the parameter that stores the weight
    (:func:`posinterp.models.backend.qk_slots`): TL 3.9's ``attn.W_Q``/``W_K``, or on TL 4
    the ``nn.Linear`` weight the bridge's ``attn.q``/``attn.k`` wrap (native attention's
    ``q``/``k``; an HF module's ``q_proj``/``k_proj`` or the split projections TL 4 runs
    in place of a fused ``c_attn``/``query_key_value``), reshaped to TL 3.9's per-head
    layout and back, so the same weights give the same forward pass and gradients on
    either line (tests/interventions/test_constraints.py).

    Raises:
        ValueError: for an unknown ``kind`` (the old names ``no_positive_real`` /
            ``no_negative_real`` name their replacement), grouped-query attention with a
            tied kind (W_K shared by several query heads cannot be tied per head), or
            ``layers`` that are not distinct ints in ``[0, n_layers)`` (checked before
            any layer is changed).
        MissingFeatureError: a bridge whose q/k projections are not ``nn.Linear`` in
            TransformerLens's per-head row order (:func:`~posinterp.models.backend.qk_slots`),
            or a qk-norm model (the norm undoes any constraint on the weights' scale).
        ValueError: ``ban_band`` on a model that is not RoPE, without a non-empty
            ``band`` of pair indices in range, or ``band`` with another kind;
            ``ban_random_subspace`` without ``rank`` or with ranks outside [0, d_head]
            or of another shape, or ``rank`` with another kind.
    """
    from ..devices import model_device
    from ..models.backend import n_kv_heads, qk_slots, refuse_qk_norm
    from ..models.qk_convention import attention_input_norm

    _check_kind(kind)
    refuse_qk_norm(model, "constrain_qk", _QK_NORM_WHY)
    if kind in TIED_CONSTRAINTS and n_kv_heads(model) != model.cfg.n_heads:
        raise ValueError("tied constraints need one key per query head (no grouped-query "
                         "attention); the ban_* constraints work with grouped keys")
    # Every layer is checked before any is changed: a bad one leaves the model untouched.
    layers = (list(range(model.cfg.n_layers)) if layers is None
              else check_indices("layers", layers, model.cfg.n_layers))
    band_dims = {}
    if kind == BAND_BAN or band is not None:
        from .qk import QKIntervention, check_intervention
        from .qk import band_dims as dims_of

        if kind != BAND_BAN:
            raise ValueError(f"band applies only to constraint {BAND_BAN!r}, got {kind!r}")
        for layer in layers:  # the same checks as the inference-time remove_band
            iv = QKIntervention("remove_band", layer, band=band)
            check_intervention(model, iv)
            band_dims[layer] = dims_of(model, layer, iv.band)
    removed = _subspace_projectors(model, kind, layers, generator, rank)
    slots = {layer: qk_slots(model, layer) for layer in layers}
    for layer in layers:
        q, bq, k, bk = (slots[layer][n] for n in ("W_Q", "b_Q", "W_K", "b_K"))
        if layer in removed:
            dev = model_device(model)
            dtype = _tl_dtype(q)
            ban = SubspaceBan(removed[layer].to(dtype), slot=q).to(dev)
            parametrize.register_parametrization(q.module, q.name, ban, unsafe=True)
            if bq is not None:
                parametrize.register_parametrization(
                    bq.module, bq.name, SubspaceBan(removed[layer].to(dtype), slot=bq).to(dev),
                    unsafe=True)
            continue
        if kind == BAND_BAN:
            d = model.cfg.d_head
            parametrize.register_parametrization(
                q.module, q.name, BandBan(band_dims[layer], d, slot=q).to(model_device(model)),
                unsafe=True)
            if bq is not None:
                parametrize.register_parametrization(
                    bq.module, bq.name, BandBan(band_dims[layer], d, slot=bq).to(model_device(model)),
                    unsafe=True)
            continue
        if kind in BANS:
            channel = kind.removeprefix("ban_")

            def weights(q=q, k=k, lay=layer):
                gain, center, _ = attention_input_norm(model, lay)
                W_Q = q.to_tl(q.module.parametrizations[q.name].original).detach()
                return (W_Q, k.to_tl(getattr(k.module, k.name)).detach(), gain, center)

            ban = ChannelBan(channel, weights, slot=q)
            parametrize.register_parametrization(q.module, q.name, ban, unsafe=True)
            if bq is not None:
                parametrize.register_parametrization(
                    bq.module, bq.name, ChannelBan(channel, None, ban, slot=bq), unsafe=True)
            continue
        # X is drawn on CPU from ``generator`` (the same X on every device), then moved.
        weight = TiedKey(kind, model.cfg.n_heads, model.cfg.d_head,
                         lambda q=q: q.to_tl(getattr(q.module, q.name)), generator=generator,
                         from_tl=k.from_tl if k.flat else None).to(model_device(model))
        parametrize.register_parametrization(k.module, k.name, weight, unsafe=True)
        if bk is not None and bq is not None:
            bias = TiedKey(kind, model.cfg.n_heads, model.cfg.d_head,
                           lambda b=bq: b.to_tl(getattr(b.module, b.name)), shared=weight,
                           from_tl=bk.from_tl if bk.flat else None)
            parametrize.register_parametrization(bk.module, bk.name, bias, unsafe=True)


def _tl_dtype(slot) -> torch.dtype:
    return getattr(slot.module, slot.name).dtype


def _subspace_projectors(model, kind: str, layers: list[int], generator, rank
                         ) -> dict[int, torch.Tensor]:
    """{layer: Π_U [n_heads, d_head, d_head] float64} for the random-subspace kinds, else {};
    every rank is checked (and the subspaces drawn) before any layer is changed."""
    shape = (model.cfg.n_layers, model.cfg.n_heads)
    if kind not in (*RANK_MATCHED, RANDOM_SUBSPACE):
        if rank is not None:
            raise ValueError(f"rank applies only to constraint {RANDOM_SUBSPACE!r}, got {kind!r}")
        return {}
    d = model.cfg.d_head
    if kind in RANK_MATCHED:
        if rank is not None:
            raise ValueError(f"{kind!r} reads its ranks off the ban's projector; rank applies "
                             f"only to {RANDOM_SUBSPACE!r}")
        ranks = banned_ranks(model, kind.removeprefix("rank_matched_"))
    else:
        if rank is None:
            raise ValueError(f"{RANDOM_SUBSPACE!r} needs rank (an int, or [n_layers, n_heads] "
                             f"= {list(shape)} ints in [0, d_head = {d}])")
        ranks = torch.as_tensor(rank)
        if ranks.ndim == 0:
            ranks = ranks.expand(shape)
        if (tuple(ranks.shape) != shape or ranks.is_floating_point() or ranks.is_complex()
                or bool(((ranks < 0) | (ranks > d)).any())):
            raise ValueError(f"rank must be an int or [n_layers, n_heads] = {list(shape)} ints "
                             f"in [0, d_head = {d}], got {rank!r}")
    return {layer: random_subspaces(ranks[layer].tolist(), d, generator) for layer in layers}


@torch.no_grad()
def qk_norms(model) -> torch.Tensor:
    """||M||_F of every head's effective QK form (offset 0), ``[n_layers, n_heads]`` float64.

    Source: :func:`posinterp.analysis.spectral.qk_weights` (effective convention).
    """
    from ..analysis.spectral import qk_weights

    out = []
    for layer in range(model.cfg.n_layers):
        W_Q, W_K = qk_weights(model, layer)
        # ||W_Q W_K^T||_F^2 = tr(W_Q^T W_Q W_K^T W_K): no d_model^2 matrix
        out.append(((W_Q.mT @ W_Q) * (W_K.mT @ W_K)).sum((-1, -2)).clamp_min(0).sqrt())
    return torch.stack(out)


@torch.no_grad()
def _scale_head(model, layer: int, head: int, s: float) -> None:
    """Scale head ``head``'s free QK parameters so that M scales by about ``s``."""
    from ..models.backend import qk_slots

    slots = qk_slots(model, layer)
    q, k = slots["W_Q"], slots["W_K"]
    if parametrize.is_parametrized(k.module, k.name):  # tied: M = W_Q X^T W_Q^T is linear in X
        tk = k.module.parametrizations[k.name][0]
        tk.A[head] *= s
        if tk.L is not None:  # X = skew(A) ± (L L^T + εI): nearly linear; iterated
            tk.L[head] *= s ** 0.5
    elif parametrize.is_parametrized(q.module, q.name):
        # ban: Π_c is scale-free, so M' = W_Q° (I - Π_c) W_K^T is linear
        q.to_tl(q.module.parametrizations[q.name].original)[head] *= s
    else:  # the parameter itself (a bridge's attn.W_Q is a copy: writes to it are lost)
        q.to_tl(getattr(q.module, q.name))[head] *= s


# A banned head whose ||M|| is below this fraction of ||W_Q°|| ||W_K|| (its unconstrained
# factors; ||M|| <= ||W_Q°|| ||W_K|| always) holds rounding residue only: its whole d_head
# was removed. Random factors give about 1/sqrt(d_model) (0.016 at d_model 4096); an
# emptied toy head measured ||M|| = 1.5e-17 (tests/interventions/test_constraints.py).
EMPTIED_RTOL = 1e-5


@torch.no_grad()
def emptied_heads(model) -> torch.Tensor:
    """``[n_layers, n_heads]`` bool: heads whose ban left M = 0 up to rounding (see
    :data:`EMPTIED_RTOL`). Only a ban (a parametrized W_Q = W_Q° P) can empty a head.
    A scale-free measure of such a head (channel masses, symmetry) is one of rounding
    residue: report it as that of M = 0.

    Raises:
        Nothing beyond what :func:`qk_norms` raises.
    """
    from ..models.backend import qk_slots

    now = qk_norms(model)
    out = torch.zeros(now.shape, dtype=torch.bool)
    for layer in range(model.cfg.n_layers):
        slots = qk_slots(model, layer)
        q, k = slots["W_Q"], slots["W_K"]
        if not parametrize.is_parametrized(q.module, q.name):
            continue
        W_Q0 = q.to_tl(q.module.parametrizations[q.name].original).detach().double()
        W_K = k.to_tl(getattr(k.module, k.name)).detach().double()
        if W_K.shape[0] != W_Q0.shape[0]:  # grouped-query attention: one W_K per group
            W_K = W_K.repeat_interleave(W_Q0.shape[0] // W_K.shape[0], dim=0)
        scale = W_Q0.flatten(1).norm(dim=1) * W_K.flatten(1).norm(dim=1)
        out[layer] = now[layer] <= EMPTIED_RTOL * scale.cpu()
    return out


@torch.no_grad()
def match_qk_norm(model, target: torch.Tensor, rtol: float = 1e-6, max_iter: int = 50
                  ) -> torch.Tensor:
    """Rescale every head so its effective ||M||_F equals ``target`` ``[n_layers, n_heads]``.

    Scales the free parameters the constraint leaves (W_Q for untied and banned heads,
    X's A and L for tied ones), so the constraint still holds exactly. Exact in one step
    where M is linear in the scaled parameter; iterated for the half-planes. A head whose
    M is 0 (a ban or subspace that removed its whole d_head) cannot be scaled and stays
    as it is: its M is rounding residue (||M|| at most ``EMPTIED_RTOL`` times
    ||W_Q°|| ||W_K||, the unconstrained factors), which scaling up to ``target`` would
    turn into a full-norm head of noise. Compare the returned norms with ``target``.

    Returns:
        The norms reached, ``[n_layers, n_heads]`` float64.

    Raises:
        ValueError: for a ``target`` of the wrong shape or with non-positive entries.
    """
    shape = (model.cfg.n_layers, model.cfg.n_heads)
    target = torch.as_tensor(target, dtype=torch.float64)
    if tuple(target.shape) != shape or not (target > 0).all():
        raise ValueError(f"target must be a positive [n_layers, n_heads] = {list(shape)} tensor, "
                         f"got shape {list(target.shape)}")
    emptied = emptied_heads(model)
    for _ in range(max_iter):
        now = qk_norms(model)
        ratio = torch.where((now > 0) & ~emptied, target / now.clamp_min(1e-300),
                            torch.ones_like(now))
        if ((ratio - 1).abs() <= rtol).all():
            break
        for layer in range(shape[0]):
            for head in range(shape[1]):
                _scale_head(model, layer, head, float(ratio[layer, head]))
    return qk_norms(model)
