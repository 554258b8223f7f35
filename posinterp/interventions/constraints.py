"""Training-time constraints on QK circuits, as parametrizations (docs/interventions.md).

Two families, each with its own control. Every constraint is stated on the effective
form M = W_Q W_K^T acting on the normalized residual (the norm gain folded in,
:data:`posinterp.analysis.spectral.QK_CONVENTION`).

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
from .channels import channel_projector

__all__ = ["BANS", "BandBan", "CONSTRAINTS", "TIED_CONSTRAINTS", "ChannelBan", "TiedKey",
           "constrain_qk", "effective_x", "match_qk_norm", "qk_norms"]

TIED_CONSTRAINTS = ("tied", "symmetric", "antisymmetric", "left_half_plane", "right_half_plane")
BANS = ("ban_positive_real", "ban_negative_real", "ban_complex")
CONSTRAINTS = TIED_CONSTRAINTS + BANS
BAND_BAN = "ban_band"
# old names said "no <channel>" but banned a half-plane: refuse them with the reason
_RENAMED = {"no_positive_real": "left_half_plane", "no_negative_real": "right_half_plane"}
_EPS = 1e-3


def _check_kind(kind: str) -> None:
    if kind in _RENAMED:
        raise ValueError(f"constraint {kind!r} was renamed {_RENAMED[kind]!r}: it bans a whole "
                         f"half-plane, not one channel; for a single-channel ban use "
                         f"'ban_{kind.removeprefix('no_')}'")
    if kind not in (*CONSTRAINTS, BAND_BAN):
        raise ValueError(f"constraint must be one of {(*CONSTRAINTS, BAND_BAN)}, got {kind!r}")


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
    with a random spectrum like the untied model's, not near the identity.
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
        from ..analysis.spectral import effective_weights

        W_Q, W_K, gain, center = self._get_weights()
        key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in (W_Q, W_K, gain)
                    if t is not None)
        if key != self._key:
            if W_K.shape[0] != W_Q.shape[0]:  # grouped keys: query head h reads h // group
                W_K = W_K.repeat_interleave(W_Q.shape[0] // W_K.shape[0], dim=0)
            q = effective_weights(W_Q, gain, center).cpu().numpy()
            k = effective_weights(W_K, gain, center).cpu().numpy()
            eye = np.eye(q.shape[-1])
            P = np.stack([eye - channel_projector(k[h].T @ q[h], self.channel)
                          for h in range(q.shape[0])])
            self._P = torch.from_numpy(P).to(W_Q.dtype).to(W_Q.device)
            self._key = key
        return self._P

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        P = self.projector()  # a constant: no gradient through the eigen-decomposition
        slot = self._slot
        x = original if slot is None else slot.to_tl(original)
        out = torch.einsum("hd,hde->he", x, P) if x.ndim == 2 else x @ P  # b_Q / W_Q
        return out if slot is None else slot.from_tl(out)


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
                 generator: torch.Generator | None = None, band=None) -> None:
    """Make every head in ``layers`` follow constraint ``kind`` (see the module docstring).

    Tied kinds parametrize W_K (and b_K) as W_Q X; bans parametrize W_Q (and b_Q) as
    W_Q° (I - Π_c); ``ban_band`` parametrizes W_Q (and b_Q) as W_Q° D, zeroing the rotary
    pairs ``band`` of every RoPE head. Call before building the optimizer. ``generator``
    seeds X's initial values (tied kinds).

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
            TransformerLens's per-head row order (:func:`~posinterp.models.backend.qk_slots`).
        ValueError: ``ban_band`` on a model that is not RoPE, without a non-empty
            ``band`` of pair indices in range, or ``band`` with another kind.
    """
    from ..analysis.spectral import attention_input_norm
    from ..devices import model_device
    from ..models.backend import n_kv_heads, qk_slots

    _check_kind(kind)
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
    slots = {layer: qk_slots(model, layer) for layer in layers}
    for layer in layers:
        q, bq, k, bk = (slots[layer][n] for n in ("W_Q", "b_Q", "W_K", "b_K"))
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


@torch.no_grad()
def match_qk_norm(model, target: torch.Tensor, rtol: float = 1e-6, max_iter: int = 50
                  ) -> torch.Tensor:
    """Rescale every head so its effective ||M||_F equals ``target`` ``[n_layers, n_heads]``.

    Scales the free parameters the constraint leaves (W_Q for untied and banned heads,
    X's A and L for tied ones), so the constraint still holds exactly. Exact in one step
    where M is linear in the scaled parameter; iterated for the half-planes. A head whose
    M is 0 (a ban that removed its whole spectrum) cannot be scaled and stays 0: compare
    the returned norms with ``target``.

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
    for _ in range(max_iter):
        now = qk_norms(model)
        ratio = torch.where(now > 0, target / now.clamp_min(1e-300), torch.ones_like(now))
        if ((ratio - 1).abs() <= rtol).all():
            break
        for layer in range(shape[0]):
            for head in range(shape[1]):
                _scale_head(model, layer, head, float(ratio[layer, head]))
    return qk_norms(model)
