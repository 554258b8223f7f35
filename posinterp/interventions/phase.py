"""Remove RoPE from chosen heads: their scores use q and k before the rotation.

For a RoPE head the score is q_i R(j - i) k_j^T / scale: the rotation R is the only
place position enters (RoFormer, Su et al. 2021, eq. 16). Replacing the rotated q and k of
a head by the unrotated ones leaves its content form M(0) = W_Q W_K^T and removes the
phase, so a head that still attends by position afterwards does so through content, and
one that loses its positional pattern was routing through RoPE's phase (issue 25, the
phase ablation of a symmetric-M head).
"""

from __future__ import annotations

from ..models import backend

__all__ = ["rope_removed_hooks"]


def rope_removed_hooks(model, layer: int, heads) -> list[tuple[str, object]]:
    """``(hook name, fn)`` pairs for ``run_with_hooks``/``model.hooks`` that give ``heads``
    of ``layer`` their unrotated q and k (the hooks :func:`backend.query_hooks` verified,
    ``[batch, pos, head, d_head]``) in place of the rotated ones (:func:`backend.rotated_qk_hooks`); every
    other head, and everything else in the model, is untouched.

    Grouped-query models share a key head between query heads: removing RoPE from one
    query head's key would change its group's, so they are refused.

    Raises:
        ValueError: for a model whose scheme is not rotary, an out-of-range layer or head,
            or a grouped-query model.
        MissingFeatureError: where the model has no rotated q/k hooks, or no hooks
            verified as the unrotated q/k (:func:`backend.query_hooks`).
    """
    from .._validate import check_indices

    if backend.positional_type(model) != "rotary":
        raise ValueError(f"a rotary model is needed; this model's positional scheme is "
                         f"{backend.positional_type(model)!r}")
    (layer,) = check_indices("layer", layer, model.cfg.n_layers)
    heads = check_indices("heads", heads, model.cfg.n_heads)
    if backend.n_kv_heads(model) != model.cfg.n_heads:
        raise ValueError("rope_removed_hooks needs one key head per query head; this model has "
                         f"{backend.n_kv_heads(model)} key/value heads for {model.cfg.n_heads} "
                         "query heads (grouped-query attention)")
    rot_q, rot_k = backend.rotated_qk_hooks(model, layer)
    q_name, k_name = backend.query_hooks(model, layer)  # verified as q, k before RoPE
    plain = {}

    def keep(name):
        def hook(x, hook):
            plain[name] = x.detach()
            return x
        return hook

    def restore(name):
        def hook(x, hook):
            x = x.clone()
            x[:, :, heads] = plain.pop(name)[:, :, heads].to(x.dtype)
            return x
        return hook

    return [(q_name, keep("q")), (k_name, keep("k")),
            (rot_q, restore("q")), (rot_k, restore("k"))]
