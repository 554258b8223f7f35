"""Training-time constraints on QK circuits, as parametrizations of W_K (and b_K).

In the tied family W_K := W_Q X (and b_K := b_Q X), every key is k = q X, so the
content score is q_i X^T q_j^T and the effective form is M = W_Q X^T W_Q^T. Constraining
X (one d_head x d_head matrix per head) constrains M by construction, for every
optimizer step, and keeps the weight-space tools truthful (``model.W_K`` is the
constrained matrix):

==========================  ===================================  ===========================
constraint                  X                                    effect on M = W_Q X^T W_Q^T
==========================  ===================================  ===========================
``tied`` (the control)      free                                 none beyond the tying
``symmetric``               (A + A^T) / 2                        M symmetric; real spectrum:
                                                                 this is also "no complex
                                                                 channel" in this family
``antisymmetric``           (A - A^T) / 2                        M antisymmetric
``no_positive_real``        -(L L^T + εI) + (A - A^T) / 2        every eigenvalue has Re < 0
``no_negative_real``        +(L L^T + εI) + (A - A^T) / 2        every eigenvalue has Re > 0
==========================  ===================================  ===========================

(For the last two: X G with G = W_Q^T W_Q is similar to G^½ X G^½, a definite symmetric
part plus a skew part, whose eigenvalues lie in one open half-plane.) Compare each with
the ``tied`` control, not with the untied model, so a comparison isolates the channel
rather than the tying. Rotary heads: the constraint holds for M(0); RoPE's phase still
rotates q against k.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._validate import check_indices

__all__ = ["CONSTRAINTS", "TiedKey", "constrain_qk", "effective_x"]

CONSTRAINTS = ("tied", "symmetric", "antisymmetric", "no_positive_real", "no_negative_real")
_EPS = 1e-3


def effective_x(kind: str, A: torch.Tensor, L: torch.Tensor | None) -> torch.Tensor:
    """X [n_heads, d_head, d_head] of a constraint from its free parameters.

    Raises:
        ValueError: for an unknown ``kind``.
    """
    skew = 0.5 * (A - A.mT)
    if kind == "tied":
        return A
    if kind == "symmetric":
        return 0.5 * (A + A.mT)
    if kind == "antisymmetric":
        return skew
    if kind in ("no_positive_real", "no_negative_real"):
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        definite = L @ L.mT + _EPS * eye
        return skew + (definite if kind == "no_negative_real" else -definite)
    raise ValueError(f"constraint must be one of {CONSTRAINTS}, got {kind!r}")


class TiedKey(nn.Module):
    """Parametrization W_K := W_Q X (or b_K := b_Q X) of one attention module.

    ``W_Q`` is read through a getter at each call (not stored as a submodule), so the
    gradient reaches W_Q and X's free parameters.
    """

    def __init__(self, kind: str, n_heads: int, d_head: int, get_source, init_scale: float = 1.0,
                 shared=None):
        super().__init__()
        if kind not in CONSTRAINTS:
            raise ValueError(f"constraint must be one of {CONSTRAINTS}, got {kind!r}")
        self.kind = kind
        self._get_source = get_source
        if shared is None:
            eye = torch.eye(d_head).expand(n_heads, d_head, d_head)
            noise = torch.randn(n_heads, d_head, d_head) * 0.1
            self.A = nn.Parameter(init_scale * (eye + noise))
            self.L = nn.Parameter(0.5 * eye.clone()) if kind.startswith("no_") else None
        else:  # the bias parametrization shares X's parameters with the weight's
            self._shared = [shared]

    def x(self) -> torch.Tensor:
        owner = self._shared[0] if hasattr(self, "_shared") else self
        return effective_x(owner.kind, owner.A, owner.L)

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        src = self._get_source()  # W_Q [n_heads, d_model, d_head] or b_Q [n_heads, d_head]
        X = self.x()
        if src.ndim == 2:
            return torch.einsum("hd,hde->he", src, X)
        return src @ X


def constrain_qk(model, kind: str, layers: list[int] | None = None) -> None:
    """Make W_K (and b_K) of every head in ``layers`` follow constraint ``kind``.

    Call before building the optimizer. The original W_K is no longer used.

    Raises:
        ValueError: for an unknown ``kind``, grouped-query attention (W_K shared by
            several query heads cannot be tied per head), or ``layers`` that are not
            distinct ints in ``[0, n_layers)`` (checked before any layer is changed).
    """
    if kind not in CONSTRAINTS:
        raise ValueError(f"constraint must be one of {CONSTRAINTS}, got {kind!r}")
    from ..models.backend import MissingFeatureError, is_bridge

    if is_bridge(model):
        raise MissingFeatureError(
            "constrain_qk parametrizes HookedTransformer's W_K parameter; a TransformerLens 4 "
            "bridge has no such parameter (W_K is a view of k.weight); use TransformerLens 3.9 "
            "for constrained training (docs/tl4.md)")
    if model.cfg.n_key_value_heads is not None:
        raise ValueError("constrain_qk needs one key per query head (no grouped-query attention)")
    # Every layer is checked before any is changed: a bad one leaves the model untouched.
    layers = (list(range(model.cfg.n_layers)) if layers is None
              else check_indices("layers", layers, model.cfg.n_layers))
    for layer in layers:
        attn = model.blocks[layer].attn
        weight = TiedKey(kind, model.cfg.n_heads, model.cfg.d_head, lambda a=attn: a.W_Q)
        parametrize.register_parametrization(attn, "W_K", weight, unsafe=True)
        if hasattr(attn, "b_K"):
            bias = TiedKey(kind, model.cfg.n_heads, model.cfg.d_head, lambda a=attn: a.b_Q,
                           shared=weight)
            parametrize.register_parametrization(attn, "b_K", bias, unsafe=True)
