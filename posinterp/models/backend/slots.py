"""Where a layer stores W_Q, b_Q, W_K, b_K (:func:`qk_slots`), for training-time
reparametrization, with TL 3.9's per-head layout reachable by reshapes on either line."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils import parametrize

from .errors import MissingFeatureError
from .mla import check_not_mla
from .surface import _attn, is_bridge, n_kv_heads


@dataclass(frozen=True)
class QKSlot:
    """One of a layer's ``W_Q``, ``b_Q``, ``W_K``, ``b_K`` as the parameter that stores it:
    ``getattr(module, name)``, which ``torch.nn.utils.parametrize`` can reparametrize.

    TL 3.9 stores them per head (``[n, d_model, d_head]``, ``[n, d_head]``); TL 4 bridges
    as ``nn.Linear`` weights (``[n * d_head, d_model]``, ``[n * d_head]``, row h * d_head
    + e, the layout of TL's ``convert_tl_checkpoint``). :meth:`to_tl` and
    :meth:`from_tl` convert between the stored layout and TL 3.9's by reshapes only, so a
    function of the per-head tensors has the same values and gradients on either line;
    ``to_tl`` returns a view (in-place edits reach the parameter). ``n`` is ``n_heads`` for
    queries and the stored key heads for keys (``n_kv_heads`` under grouped-query attention).
    """

    module: torch.nn.Module
    name: str
    n: int
    d_head: int
    flat: bool

    def to_tl(self, t: Tensor) -> Tensor:
        if not self.flat:
            return t
        if t.ndim == 1:
            return t.view(self.n, self.d_head)
        return t.view(self.n, self.d_head, t.shape[-1]).transpose(1, 2)

    def from_tl(self, t: Tensor) -> Tensor:
        if not self.flat:
            return t
        if t.ndim == 2:
            return t.reshape(-1)
        return t.transpose(1, 2).reshape(-1, t.shape[1])


def qk_slots(model, layer: int) -> dict[str, QKSlot | None]:
    """Where ``layer`` stores ``W_Q``, ``b_Q``, ``W_K``, ``b_K`` (None: no such bias), for
    training-time reparametrization (:func:`posinterp.interventions.constraints.constrain_qk`).

    TL 3.9: the attention's own parameters (``_W_K``/``_b_K`` under grouped-query
    attention). TL 4: the ``nn.Linear`` the bridge's ``attn.q`` / ``attn.k`` wrap, which
    the forward pass multiplies by: native attention's ``q``/``k``, an HF module's
    ``q_proj``/``k_proj``, or, where HF fuses q, k and v (GPT-2's ``c_attn``, GPT-NeoX's
    and BLOOM's ``query_key_value``), the split projections TransformerLens 4 builds and
    runs instead of the fused one. A bridge's ``attn.W_Q`` is a reshaped copy;
    parametrizing it would change nothing. The per-head view of each weight is checked
    against the bridge's own ``attn.W_Q`` / ``attn.W_K`` once, so a projection in another
    layout is refused rather than reparametrized wrongly.

    Raises:
        MissingFeatureError: a bridge whose ``attn.q`` / ``attn.k`` wrap no ``nn.Linear``
            of shape ``[heads * d_head, d_model]`` in TL's per-head row order.
    """
    check_not_mla(model, "training-time QK constraints (qk_slots)")
    H, dh = model.cfg.n_heads, model.cfg.d_head
    if not is_bridge(model):
        attn = _attn(model, layer)
        gqa = hasattr(attn, "_W_K")
        out = {"W_Q": QKSlot(attn, "W_Q", H, dh, False),
               "W_K": QKSlot(attn, "_W_K" if gqa else "W_K", n_kv_heads(model), dh, False)}
        for b, stored in (("b_Q", "b_Q"), ("b_K", "_b_K" if gqa else "b_K")):
            out[b] = QKSlot(attn, stored, H if b == "b_Q" else n_kv_heads(model), dh, False) \
                if isinstance(getattr(attn, stored, None), torch.nn.Parameter) \
                or hasattr(getattr(attn, "parametrizations", {}), stored) else None
        return out
    attn = _attn(model, layer)
    out = {}
    for tl, n in (("Q", H), ("K", n_kv_heads(model))):
        wrapped = getattr(attn, tl.lower(), None)
        lin = getattr(wrapped, "original_component", wrapped)
        if not isinstance(lin, torch.nn.Linear) or tuple(lin.weight.shape) != (n * dh, model.cfg.d_model):
            raise MissingFeatureError(
                f"training-time QK constraints reparametrize the nn.Linear that computes "
                f"{tl.lower()} ([{n} * {dh}, {model.cfg.d_model}]); layer {layer}'s attn."
                f"{tl.lower()} wraps {type(lin).__name__}, which posinterp does not reparametrize")
        slot = QKSlot(lin, "weight", n, dh, True)
        _check_slot_layout(model, layer, tl, slot)
        out[f"W_{tl}"] = slot
        has_bias = getattr(lin, "bias", None) is not None or \
            hasattr(getattr(lin, "parametrizations", {}), "bias")
        out[f"b_{tl}"] = QKSlot(lin, "bias", n, dh, True) if has_bias else None
    return out


def _check_slot_layout(model, layer: int, tl: str, slot: QKSlot) -> None:
    """Refuse a projection whose per-head view is not the bridge's own ``attn.W_{tl}``
    (TransformerLens's reading of the same weight): the reparametrization would then
    constrain other numbers than the analyses read."""
    if parametrize.is_parametrized(slot.module, slot.name):
        return  # constrained already: checked when it was registered
    with torch.no_grad():
        mine = slot.to_tl(slot.module.weight).detach().cpu()
        theirs = getattr(_attn(model, layer), f"W_{tl}").detach().cpu()
    if mine.shape != theirs.shape or not torch.equal(mine, theirs.to(mine.dtype)):
        raise MissingFeatureError(
            f"layer {layer}'s {tl.lower()} projection is not stored in TransformerLens's per-head "
            f"row order (its [{slot.n} * {slot.d_head}, d_model] weight read per head is not "
            f"attn.W_{tl}); posinterp does not reparametrize it")
