"""Exact positional machinery installed into TransformerLens models: ALiBi and RoPE.

TransformerLens 3.9 computes both itself, and in several cases not as the checkpoint was
trained (docs/models.md, "What posinterp fixes"):

* **ALiBi.** TL uses 2^(-8h/n) slopes for every head count, rebuilds the bias with those
  slopes whenever the input is longer than its cache, and measures distance in token
  indices, so a gap inside the attention mask shifts every later key. We install the
  ALiBi paper's slopes (= HF BLOOM's) and add ``slopes[h] * (pos_j - pos_i)`` computed
  per call from the mask positions (the k-th real token is position k), at any length.
* **RoPE.** TL's converters drop config values (GPT-NeoX's base, RoPE scaling) and its
  own frequency formula rounds differently from HF's. We install the cos/sin tables
  computed from the inverse frequencies HF uses, and refuse inputs longer than the
  table instead of letting TL regrow it with its own formula.

Both are plain torch hooks on the attention modules, so ``model.reset_hooks()`` does not
remove them; the analyses read the frequencies and the bias back through
:func:`rotary_inv_freq` and :func:`alibi_bias_of`.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .rope_layout import duplicate_frequencies

__all__ = ["alibi_bias", "alibi_bias_of", "alibi_slopes", "install_alibi", "install_rotary",
           "rotary_inv_freq"]


def alibi_slopes(n_heads: int) -> Float[Tensor, "n_heads"]:
    """ALiBi head slopes m_h, shape ``[n_heads]``, float64, unitless (logit per token).

    Press, Smith & Lewis, "Train Short, Test Long" (ICLR 2022), §3: a geometric sequence
    starting at 2^(-8/n) for n a power of two; otherwise the slopes of the closest lower
    power of two, then every other slope of the next power of two (as in HF BLOOM's
    ``build_alibi_tensor``).

    Raises:
        ValueError: if ``n_heads < 1``.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(closest)
    if closest != n_heads:
        slopes += power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


def _remove_installed(attn, name: str) -> None:
    """Installing twice must not add the bias twice: drop the earlier hooks first."""
    for handle in getattr(attn, name, ()):
        handle.remove()


def _has_gap(mask: Tensor) -> bool:
    """True if some row has a 0 strictly between two 1s (its real tokens are not contiguous)."""
    n = mask.shape[-1]
    real = mask.bool()
    idx = torch.arange(n, device=mask.device)
    first = torch.where(real, idx, n).amin(-1)
    last = torch.where(real, idx, -1).amax(-1)
    count = real.sum(-1)
    return bool(((count > 0) & (last - first + 1 != count)).any())


def alibi_bias(slopes: Float[Tensor, "n_heads"], query_ctx: int, key_ctx: int,
               attention_mask: Int[Tensor, "batch key_ctx"] | None = None
               ) -> Float[Tensor, "batch_or_1 n_heads query_ctx key_ctx"]:
    """ALiBi bias ``slopes[h] * (pos_j - pos_i)`` for keys j at or before query i, else 0.

    Positions count real tokens (``cumsum(mask) - 1``); without a mask, or when every
    row's real tokens are contiguous (left or right padding), they are token indices and
    one ``[1, n_heads, query, key]`` bias serves the batch. Queries are the last
    ``query_ctx`` keys (a KV cache holds the earlier ones). Source: Press et al. 2022, §3;
    the per-row constant differs from HF BLOOM's ``slope * pos_j``, which softmax ignores.

    Raises:
        ValueError: if ``attention_mask`` does not have ``key_ctx`` columns.
    """
    device = slopes.device
    if attention_mask is not None and attention_mask.shape[-1] != key_ctx:
        raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns, expected "
                         f"key_ctx={key_ctx}")
    if attention_mask is None or not _has_gap(attention_mask):
        pos = torch.arange(key_ctx, device=device)[None]
    else:
        pos = attention_mask.to(device).long().cumsum(-1) - 1
    dist = (pos[:, None, :] - pos[:, -query_ctx:, None]).clamp(max=0)  # [b, query, key]
    return slopes.to(torch.float32)[None, :, None, None] * dist[:, None].to(torch.float32)


def install_alibi(model, slopes: Float[Tensor, "n_heads"]) -> None:
    """Make every block add ``alibi_bias(slopes, ...)`` to its pre-softmax scores.

    A forward pre-hook on each attention module reads the call's ``attention_mask`` and
    key length, stores the exact bias as ``attn.posinterp_alibi`` and hands TL an all-zero
    ``attn.alibi`` of the right size (so TL's own slopes never enter); a forward hook on
    ``attn.hook_attn_scores``, registered before any user hook, adds the bias. So
    ``hook_attn_scores`` shows masked scores plus ``m_h (j - i)`` in positions, at any
    length, as TL's convention has it.

    Raises:
        ValueError: if ``slopes`` does not have one entry per head.
    """
    if slopes.shape != (model.cfg.n_heads,):
        raise ValueError(f"slopes must have shape ({model.cfg.n_heads},), got {tuple(slopes.shape)}")
    slopes = slopes.detach().clone()

    def set_bias(module, args, kwargs):
        key_input = kwargs["key_input"] if "key_input" in kwargs else args[1]
        query_input = kwargs["query_input"] if "query_input" in kwargs else args[0]
        key_ctx = key_input.shape[1]
        past = kwargs.get("past_kv_cache_entry")
        if past is not None and getattr(past, "past_keys", None) is not None:
            key_ctx += past.past_keys.shape[1]
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.shape[-1] != key_ctx:
            mask = None if mask.shape[-1] < key_ctx else mask[:, -key_ctx:]
        device = key_input.device
        module.posinterp_alibi = alibi_bias(slopes.to(device), query_input.shape[1], key_ctx, mask)
        module.alibi = torch.zeros(1, 1, 1, device=device).expand(1, key_ctx, key_ctx)

    def add_bias(hook_point, args, scores):
        attn = hook_point.posinterp_owner
        return scores + attn.posinterp_alibi.to(scores.dtype)

    for block in model.blocks:
        attn = block.attn
        _remove_installed(attn, "posinterp_alibi_handles")
        # A plain attribute would register attn as a submodule of its own hook point.
        object.__setattr__(attn.hook_attn_scores, "posinterp_owner", attn)
        attn.posinterp_alibi_handles = (
            attn.register_forward_pre_hook(set_bias, with_kwargs=True),
            attn.hook_attn_scores.register_forward_hook(add_bias))


def alibi_bias_of(model, layer: int) -> Float[Tensor, "batch_or_1 n_heads query key"] | None:
    """The ALiBi bias block ``layer`` added in its current (or last) forward call.

    None for models without ALiBi. Read it inside a hook of that call.

    Raises:
        ValueError: an ALiBi model whose bias posinterp did not install (e.g. built by TL
            directly): its TL bias uses TL's slopes and index distances.
    """
    from .backend.surface import is_bridge, positional_type

    if positional_type(model) != "alibi":
        return None
    attn = model.blocks[layer].attn
    if is_bridge(model):  # posinterp's TL 4 toy attention keeps it on the wrapped module
        attn = getattr(attn, "original_component", attn)
    bias = getattr(attn, "posinterp_alibi", None)
    if bias is None:
        raise ValueError("this ALiBi model has no posinterp bias: build it with posinterp "
                         "(build_model / load_model) or call install_alibi(model, slopes)")
    return bias


def install_rotary(model, inv_freq: Float[Tensor, "half_rotary_dim"]) -> None:
    """Replace every block's RoPE tables by ``cos/sin(pos * inv_freq)`` for pos < n_ctx.

    ``inv_freq`` are the inverse frequencies HF computes (with the config's base, partial
    rotary fraction and scaling), multiplied with positions in float32 exactly as HF does;
    the layout follows ``cfg.rotary_adjacent_pairs``. Each attention module keeps them as
    ``attn.posinterp_inv_freq`` (for M(Δ) in spectra), and a pre-hook refuses inputs longer
    than the table, which TL would otherwise regrow with its own formula.
    Source: Su et al. 2021 (RoFormer) eq. 34; HF ``modeling_rope_utils``.

    Raises:
        ValueError: if ``inv_freq`` does not have ``rotary_dim / 2`` entries.
    """
    cfg = model.cfg
    half = cfg.rotary_dim // 2
    if inv_freq.shape != (half,):
        raise ValueError(f"inv_freq must have rotary_dim/2 = {half} entries, got {tuple(inv_freq.shape)}")
    inv = inv_freq.to(torch.float32)
    freqs = torch.arange(cfg.n_ctx, dtype=torch.float32)[:, None] * inv[None, :]  # [n_ctx, half]
    table = duplicate_frequencies(freqs, cfg.rotary_adjacent_pairs)
    n_ctx = cfg.n_ctx

    def refuse_long(module, args, kwargs):
        key_input = kwargs["key_input"] if "key_input" in kwargs else args[1]
        n = key_input.shape[1]
        past = kwargs.get("past_kv_cache_entry")
        if past is not None and getattr(past, "past_keys", None) is not None:
            n += past.past_keys.shape[1]
        if n > n_ctx:
            raise ValueError(f"input of {n} positions is longer than this RoPE model's n_ctx="
                             f"{n_ctx} (max_position_embeddings); its rotary tables stop there")

    for block in model.blocks:
        attn = block.attn
        device, dtype = attn.rotary_cos.device, attn.rotary_cos.dtype
        attn.rotary_cos = table.cos().to(device, dtype)
        attn.rotary_sin = table.sin().to(device, dtype)
        attn.posinterp_inv_freq = inv.double()
        _remove_installed(attn, "posinterp_rotary_handles")
        attn.posinterp_rotary_handles = (attn.register_forward_pre_hook(refuse_long, with_kwargs=True),)


def rotary_inv_freq(model, layer: int = 0) -> Float[Tensor, "half_rotary_dim"]:
    """Inverse frequencies (radians per position, float64) of ``layer``'s RoPE.

    Those installed by :func:`install_rotary` (every posinterp loader of HF checkpoints),
    else TL's formula ``base^(-2p / rotary_dim)`` (toy models and llama2.c files, whose
    tables TL builds that way).

    Raises:
        ValueError: for a non-rotary model, or TL RoPE scaling (NTK-by-parts, YaRN, linear
            factor, dynamic NTK) on a model without installed frequencies.
    """
    cfg = model.cfg
    if cfg.positional_embedding_type != "rotary":
        raise ValueError(f"rotary_inv_freq needs a rotary model; positional_embedding_type is "
                         f"{cfg.positional_embedding_type!r}")
    installed = getattr(model.blocks[layer].attn, "posinterp_inv_freq", None)
    if installed is not None:
        return installed
    scaled = [name for name in ("use_NTK_by_parts_rope", "use_yarn_rope", "use_dynamic_ntk_rope")
              if getattr(cfg, name, False)]
    if getattr(cfg, "rotary_scaling_factor", 1.0) != 1.0:
        scaled.append("rotary_scaling_factor")
    if scaled:
        raise ValueError(f"RoPE scaling {scaled} of a TL-built model is not modelled; load the "
                         "model with posinterp.load_model, which installs HF's frequencies")
    half = cfg.rotary_dim // 2
    return 1.0 / float(cfg.rotary_base) ** (torch.arange(half, dtype=torch.float64) / half)
