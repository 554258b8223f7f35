"""Toy models on TransformerLens 4: a ``TransformerBridge`` around a TL-native model.

TL 4.3's native model (``model_bridge/sources/native``) has no ALiBi, fires
``hook_attn_scores`` with the post-softmax pattern (edits discarded), never fires
``hook_rot_q``/``hook_rot_k``, rotates adjacent pairs, and has no unembedding bias
(docs/tl4.md). posinterp's toy models therefore swap in :class:`PosinterpAttention`, a
``NativeAttention`` whose forward computes what TL 3.9's ``HookedTransformer`` computes
for the same weights:

* RoPE on split halves (p, p + d_head/2) with TL 3.9's cos/sin tables, then
  ``hook_rot_q``/``hook_rot_k`` (``[batch, pos, head, d_head]``);
* scores q·k / sqrt(d_head), plus ALiBi ``m_h (pos_j - pos_i)`` with the paper's
  slopes and positions from the attention mask (:func:`.positions.alibi_bias`), masked
  with ``-inf``, then ``hook_attn_scores`` — pre-softmax, edits take effect;
* softmax, ``hook_pattern`` (through the bridge's ``pattern_fn`` seam), values, W_O.

The weights are :func:`.toy.toy_state_dict`'s, so a config and seed give the same
function on either TL version. NoPE keeps TL-native's position table at zero and
frozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .positions import alibi_bias, alibi_slopes
from .rope_layout import duplicate_frequencies, rotate_pairs

__all__ = ["PosinterpAttention", "build_native_from_tl", "build_native_toy", "load_tl_state_dict",
           "model_from_tl_weights"]


def _tl39_rotary_tables(rotary_dim: int, n_ctx: int, base: float, adjacent_pairs: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n_ctx, rotary_dim]`` exactly as TL 3.9's ``calculate_sin_cos_rotary``
    (float32, no scaling; split halves (p, p + rotary_dim/2) or adjacent pairs (2p, 2p+1))."""
    pos = torch.arange(n_ctx, dtype=torch.float32)
    dim = torch.arange(rotary_dim // 2, dtype=torch.float32)
    freq = base ** (dim / (rotary_dim / 2))
    freq = duplicate_frequencies(freq, adjacent_pairs)
    angles = pos[:, None] / freq[None, :]
    return torch.cos(angles), torch.sin(angles)


def _fire(hook_point, x: torch.Tensor) -> torch.Tensor:
    """Run a bridge HookPoint on ``x`` ``[batch, pos, head, d]``; a HookPoint with a
    rotary conversion expects HF's ``[batch, head, pos, d]``."""
    if getattr(hook_point, "hook_conversion", None) is None:
        return hook_point(x)
    return hook_point(x.transpose(1, 2)).transpose(1, 2)


class PosinterpAttention(nn.Module):
    """Mixin body for ``NativeAttention`` (see the module docstring); the class is made
    by :func:`_attention_class` so that importing this module does not import TL 4."""

    posinterp_attention = True
    posinterp_adjacent_pairs = False  # RoPE layout: split halves (toys) or adjacent pairs

    def forward(self, hidden_states, attention_mask=None, position_ids=None, pattern_fn=None,
                **kwargs):
        b, n, _ = hidden_states.shape
        H, Hkv, dh = self.n_heads, self.n_kv_heads, self.d_head
        hooks = self.posinterp_hooks  # the AttentionBridge wrapping this module
        # Separate key/value inputs come from PosinterpBlock (TL 3.9's three ln1 calls).
        key_input = kwargs.get("posinterp_key_input", hidden_states)
        value_input = kwargs.get("posinterp_value_input", hidden_states)
        q = self.q(hidden_states).reshape(b, n, H, dh)
        k = self.k(key_input).reshape(b, n, Hkv, dh)
        v = self.v(value_input).reshape(b, n, Hkv, dh)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("posinterp toy models take a [batch, pos] 0/1 attention_mask, got "
                             f"shape {tuple(attention_mask.shape)}")
        if self.posinterp_rotary_dim:
            pos = (torch.arange(n, device=q.device)[None].expand(b, n) if position_ids is None
                   else position_ids.to(q.device).clamp(min=0))
            rd = self.posinterp_rotary_dim
            cos, sin = self.posinterp_cos[pos][:, :, None], self.posinterp_sin[pos][:, :, None]
            adjacent = self.posinterp_adjacent_pairs

            def rope(x):
                x_rot, x_pass = x[..., :rd], x[..., rd:]
                return torch.cat([x_rot * cos + rotate_pairs(x_rot, adjacent) * sin, x_pass], dim=-1)

            q = _fire(hooks.hook_rot_q, rope(q))
            k = _fire(hooks.hook_rot_k, rope(k))
        if Hkv != H:
            k = k.repeat_interleave(H // Hkv, dim=2)
            v = v.repeat_interleave(H // Hkv, dim=2)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / self.scale
        if self.posinterp_alibi_slopes is not None:
            bias = alibi_bias(self.posinterp_alibi_slopes.to(scores.device), n, n, attention_mask)
            self.posinterp_alibi = bias  # read back by positions.alibi_bias_of (symmetrization)
            scores = scores + bias.to(scores.dtype)
        blocked = (self.causal_mask[:n, :n] if n <= self.causal_mask.shape[0] else  # ALiBi past n_ctx
                   torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1))[None, None]
        if attention_mask is not None:
            blocked = blocked | ~attention_mask.bool()[:, None, None, :]
        scores = hooks.hook_attn_scores(scores.masked_fill(blocked, float("-inf")))
        pattern = F.softmax(scores, dim=-1)
        pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
        if pattern_fn is not None:
            pattern = pattern_fn(pattern)
        z = torch.einsum("bhij,bjhd->bihd", pattern, v).reshape(b, n, H * dh)
        # No second output: the bridge would fire hook_attn_scores again with the pattern.
        return self.o(z), None


class PosinterpBlock(nn.Module):
    """Mixin body for ``NativeBlock``: TL 3.9's ``TransformerBlock`` order of operations.

    TL 3.9 normalizes the residual once per attention input (``ln1`` called for the
    queries, keys and values, the first two plus 0.0), so ``ln1``'s gradient is the sum of
    three LayerNorm backward passes; TL-native calls ``ln1`` once and sums the three
    projections' gradients before a single one. Both are exact, but they round
    differently, and training amplifies a one-ulp difference into a different model
    (docs/tl4.md, "Training"). This block repeats TL 3.9's graph, so the same seed gives
    the same gradients and the same trained weights on both lines.
    """

    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        query_input = self.ln1(hidden_states) + 0.0
        key_input = self.ln1(hidden_states) + 0.0
        value_input = self.ln1(hidden_states)
        attn_out, _ = self.attn(query_input, attention_mask=attention_mask,
                                position_ids=position_ids, posinterp_key_input=key_input,
                                posinterp_value_input=value_input)
        hidden_states = hidden_states + attn_out
        if not self.cfg.attn_only:
            hidden_states = hidden_states + self.mlp(self.ln2(hidden_states))
        return (hidden_states,)


class TL39PositionTable(nn.Embedding):
    """TL-native's position table computed as TL 3.9's ``PosEmbed`` computes it: without
    a mask the first n rows repeated over the batch (so the gradient is a sum over the
    batch, as TL 3.9's; an embedding lookup accumulates it in another order), with a mask
    an index into the table. The same values either way; see :class:`PosinterpBlock`."""

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        b, n = position_ids.shape
        plain = torch.arange(n, device=position_ids.device).expand(b, n)
        if torch.equal(position_ids, plain):
            return self.weight[:n].unsqueeze(0).expand(b, n, -1).clone()
        return self.weight[position_ids].clone()


_CLASS = None
_BLOCK_CLASS = None


def _block_class():
    global _BLOCK_CLASS
    if _BLOCK_CLASS is None:
        from transformer_lens.model_bridge.sources.native.model import NativeBlock

        _BLOCK_CLASS = type("PosinterpBlock", (PosinterpBlock, NativeBlock), {})
    return _BLOCK_CLASS


def _attention_class():
    global _CLASS
    if _CLASS is None:
        from transformer_lens.model_bridge.sources.native.model import NativeAttention

        _CLASS = type("PosinterpAttention", (PosinterpAttention, NativeAttention), {})
    return _CLASS


def _native_config(config):
    from transformer_lens import TransformerBridgeConfig

    return TransformerBridgeConfig(
        n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
        d_head=config.d_head, d_mlp=None if config.attn_only else config.d_mlp,
        n_ctx=config.n_ctx, d_vocab=config.d_vocab, act_fn=config.act_fn,
        attn_only=config.attn_only, normalization_type=config.normalization,
        # ALiBi and NoPE run on the "standard" layout (position table zero); "rotary" drops
        # the table and makes the bridge create hook_rot_q/k, which posinterp's RoPE fires.
        positional_embedding_type="rotary" if config.pe == "rotary" else "standard",
        init_weights=False, seed=config.seed,
        device="cpu", model_name=f"posinterp-toy-{config.pe}")


@torch.no_grad()
def load_tl_state_dict(native_model, sd: dict[str, torch.Tensor], n_layers: int) -> None:
    """Copy TL 3.9-named weights (``blocks.{l}.attn.W_Q`` ``[head, d_model, d_head]``, ...)
    into a TL-native model's ``nn.Linear``/``nn.Embedding`` modules.

    Raises:
        KeyError: a TL-native parameter with no TL 3.9 counterpart in ``sd``.
    """
    def flat_in(W):  # [head, d_model, d_head] -> nn.Linear weight [head * d_head, d_model]
        return W.permute(0, 2, 1).reshape(-1, W.shape[1])

    targets = {"tok_embed.weight": sd["embed.W_E"], "head.weight": sd["unembed.W_U"].T,
               "head.bias": sd["unembed.b_U"]}
    if native_model.pos is not None:
        targets["pos.weight"] = sd["pos_embed.W_pos"]
    for leaf, tl in (("weight", "w"), ("bias", "b")):
        if f"ln_final.{tl}" in sd:
            targets[f"ln_out.{leaf}"] = sd[f"ln_final.{tl}"]
    for layer in range(n_layers):
        p, t = f"layers.{layer}", f"blocks.{layer}"
        for x in "QKV":
            targets[f"{p}.attn.{x.lower()}.weight"] = flat_in(sd[f"{t}.attn.W_{x}"])
            targets[f"{p}.attn.{x.lower()}.bias"] = sd[f"{t}.attn.b_{x}"].reshape(-1)
        W_O = sd[f"{t}.attn.W_O"]
        targets[f"{p}.attn.o.weight"] = W_O.reshape(-1, W_O.shape[-1]).T
        targets[f"{p}.attn.o.bias"] = sd[f"{t}.attn.b_O"]
        for ln in ("ln1", "ln2"):
            for leaf, tl in (("weight", "w"), ("bias", "b")):
                if f"{t}.{ln}.{tl}" in sd:
                    targets[f"{p}.{ln}.{leaf}"] = sd[f"{t}.{ln}.{tl}"]
        if f"{t}.mlp.W_in" in sd:
            targets.update({f"{p}.mlp.fc_in.weight": sd[f"{t}.mlp.W_in"].T,
                            f"{p}.mlp.fc_in.bias": sd[f"{t}.mlp.b_in"],
                            f"{p}.mlp.fc_out.weight": sd[f"{t}.mlp.W_out"].T,
                            f"{p}.mlp.fc_out.bias": sd[f"{t}.mlp.b_out"]})
    params = dict(native_model.named_parameters())
    missing = sorted(set(params) - set(targets))
    if missing:
        raise KeyError(f"no TransformerLens 3.9 weight for native parameters {missing}")
    for name, value in targets.items():
        params[name].copy_(value.reshape(params[name].shape))


class _ZeroPositions(nn.Embedding):
    """The zero, frozen position table of an ALiBi toy, read at any position (every row is
    zero, so clamping the index is exact)."""

    def forward(self, ids):
        return super().forward(ids.clamp(max=self.num_embeddings - 1))


def _unbounded_length(native) -> None:
    """Let an ALiBi toy run past ``n_ctx``, as on TL 3.9 (length extrapolation is ALiBi's
    point): TL 4's NativeModel refuses longer inputs because its position and rotary
    tables stop at n_ctx, and an ALiBi toy uses neither (its bias is computed per call)."""
    import copy

    native.pos.__class__ = _ZeroPositions
    cfg = copy.copy(native.cfg)  # only the model-level length check reads this copy
    cfg.n_ctx = 2**62
    native.cfg = cfg


def build_native_toy(config, state_dict, tokenizer=None):
    """The toy model for ``config`` as a TL 4 ``TransformerBridge`` (module docstring).

    ``state_dict``: its weights under TL 3.9 names (:func:`.toy.toy_state_dict`, which
    the caller passes in, so this module does not import :mod:`.toy`, its only caller).

    Returns:
        the bridge, in eval mode, with ``model.posinterp_config = config``.
    """
    from transformer_lens.model_bridge.sources.native.model import NativeModel

    cfg = _native_config(config)
    native = NativeModel(cfg)
    # TL 3.9's unembedding has a bias; TL-native's has none.
    native.head = nn.Linear(config.d_model, config.d_vocab, bias=True)
    cls = _attention_class()
    cos = sin = inv = None
    if config.pe == "rotary":
        cos, sin = _tl39_rotary_tables(config.d_head, config.n_ctx, config.rotary_base)
        half = config.d_head // 2
        inv = 1.0 / float(config.rotary_base) ** (torch.arange(half, dtype=torch.float64) / half)
    slopes = alibi_slopes(config.n_heads) if config.pe == "alibi" else None
    for block in native.layers:
        block.__class__ = _block_class()
        attn = block.attn
        attn.__class__ = cls
        attn.posinterp_rotary_dim = config.d_head if config.pe == "rotary" else 0
        attn.register_buffer("posinterp_cos", cos, persistent=False)
        attn.register_buffer("posinterp_sin", sin, persistent=False)
        attn.posinterp_inv_freq = inv
        attn.posinterp_alibi_slopes = slopes
    if native.pos is not None:
        native.pos.__class__ = TL39PositionTable
    load_tl_state_dict(native, state_dict, config.n_layers)
    if config.pe == "alibi":
        _unbounded_length(native)
    if native.pos is not None and config.pe != "absolute":
        # NoPE/ALiBi: no learned positions; zero and frozen, so no optimizer moves it.
        native.pos.weight.requires_grad_(False)
    bridge = _bridge(native, cfg, tokenizer)
    bridge.posinterp_config = config
    bridge.eval()
    return bridge


def _install_rope(attn, rotary_dim: int, n_ctx: int, base: float, adjacent_pairs: bool) -> None:
    cos, sin = _tl39_rotary_tables(rotary_dim, n_ctx, base, adjacent_pairs)
    half = rotary_dim // 2
    attn.posinterp_rotary_dim = rotary_dim
    attn.posinterp_adjacent_pairs = adjacent_pairs
    attn.register_buffer("posinterp_cos", cos, persistent=False)
    attn.register_buffer("posinterp_sin", sin, persistent=False)
    attn.posinterp_inv_freq = 1.0 / float(base) ** (torch.arange(half, dtype=torch.float64) / half)


def build_native_from_tl(cfg, tl_state_dict: dict[str, torch.Tensor], *, rotary_adjacent_pairs: bool,
                         tokenizer=None):
    """A TL 4 ``TransformerBridge`` around a TL-native model with posinterp's attention,
    carrying a bias-free rotary checkpoint given in TL 3.9 names (llama2.c, :mod:`.llama2c`).

    TL-native supplies RMSNorm (or ``RMSPre`` after ``fold_ln``), the gated SwiGLU MLP and
    grouped-query heads; its attention is swapped for :class:`PosinterpAttention` so that
    ``hook_attn_scores`` is pre-softmax and ``hook_rot_q``/``hook_rot_k`` fire, with TL 3.9's
    RoPE tables in the layout ``rotary_adjacent_pairs`` names. The weights go through TL's
    ``convert_tl_checkpoint`` into the bridge's own keys (a strict load).

    Args:
        cfg: a ``TransformerBridgeConfig`` with ``positional_embedding_type="rotary"``.
        tl_state_dict: ``HookedTransformer`` names and shapes (``blocks.{l}.attn.W_Q``
            ``[n_heads, d_model, d_head]``, ``_W_K`` ``[n_kv_heads, d_model, d_head]``, ...);
            attention biases (``b_Q``, ...) all or none; a missing unembedding bias is 0.

    Raises:
        ValueError: a weight whose shape does not match ``cfg`` (from ``convert_tl_checkpoint``),
            or ``cfg.attn_scores_soft_cap > 0`` (posinterp's attention has no soft-cap);
            RuntimeError: a missing or extra weight (strict ``load_state_dict``).
    """
    from transformer_lens.conversion_utils import convert_tl_checkpoint
    from transformer_lens.model_bridge.sources.native.model import NativeModel

    from .._rng import preserved_rng

    cap = getattr(cfg, "attn_scores_soft_cap", -1.0)
    if isinstance(cap, (int, float)) and cap > 0:
        # PosinterpAttention computes the scores itself, without a cap: refuse, never drop it
        raise ValueError(f"attn_scores_soft_cap={cap:g} is not supported by posinterp's TL 4 "
                         "attention (it would run uncapped); TransformerLens's own native model "
                         "(transformer_lens.model_bridge.sources.native.boot) applies it")
    with preserved_rng():  # nn.Linear's default init draws; weights follow
        native = NativeModel(cfg)
    cls = _attention_class()
    biased = "blocks.0.attn.b_Q" in tl_state_dict
    for block in native.layers:
        attn = block.attn
        for lin in (attn.q, attn.k, attn.v, attn.o):
            if not biased:
                lin.bias = None  # llama2.c has no attention biases (zeros would be extra parameters)
        attn.__class__ = cls
        _install_rope(attn, cfg.rotary_dim, cfg.n_ctx, cfg.rotary_base, rotary_adjacent_pairs)
        attn.posinterp_alibi_slopes = None
    bridge = _bridge(native, cfg, tokenizer)
    converted = convert_tl_checkpoint(tl_state_dict, cfg)
    # The bridge's unembedding always has a bias; TL's own legacy loader zero-fills it too.
    converted.setdefault("unembed.bias", torch.zeros(cfg.d_vocab))
    bridge.load_state_dict(converted, strict=True)
    bridge.eval()
    return bridge


def _refuse_kv_cache(module, args, kwargs):
    """TL 4's native model takes ``past_key_values``/``past_kv_cache`` and ignores them: the
    call would run the new tokens alone, from position 0. Refuse instead."""
    from .backend.errors import MissingFeatureError

    for name in ("past_key_values", "past_kv_cache"):
        if kwargs.get(name) is not None:
            raise MissingFeatureError(
                f"TransformerLens 4's native model (model_bridge/sources/native) has no KV cache: "
                f"it ignores {name} and would run the new tokens alone from position 0; run the "
                "whole sequence (generate() does so for this model)")
    return None


def _bridge(native, cfg, tokenizer):
    """A bridge around ``native`` whose posinterp attention fires the bridge's hooks.

    The tokenizer is attached after bridging, as is: TL 4 "configures" a tokenizer it is
    given (adding a BOS token outside the vocabulary).
    """
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    bridge = build_bridge_from_module(native, architecture="TransformerLensNative", tl_config=cfg,
                                      tokenizer=None, model_name=cfg.model_name)
    bridge.tokenizer = tokenizer
    native.register_forward_pre_hook(_refuse_kv_cache, with_kwargs=True)
    for layer in range(cfg.n_layers):
        hooks = bridge.blocks[layer].attn
        # A plain attribute would register the bridge as a submodule of its own child.
        object.__setattr__(hooks.original_component, "posinterp_hooks", hooks)
    return bridge


def model_from_tl_weights(config: dict, tl_state_dict: dict[str, torch.Tensor], tokenizer=None):
    """A RoPE model running ``tl_state_dict`` (``HookedTransformer`` names and shapes) with
    ``config`` (``HookedTransformerConfig`` fields: sizes, ``normalization_type``,
    ``act_fn``, ``rotary_dim``, ``rotary_adjacent_pairs``, ``n_key_value_heads``, ...) on
    the installed TransformerLens line, unprocessed: TL 3.9's ``HookedTransformer``, or on
    TL 4 :func:`build_native_from_tl` (TL 3.9's RoPE tables and hooks). The same weights
    give the same function on either line.

    Raises:
        ValueError: a config whose ``positional_embedding_type`` is not ``"rotary"``, or
            weights that do not fit it (named by TransformerLens).
    """
    from .backend.version import by_line

    if config.get("positional_embedding_type") != "rotary":
        raise ValueError("model_from_tl_weights builds RoPE models (positional_embedding_type="
                         f"'rotary'), got {config.get('positional_embedding_type')!r}")
    build = by_line(tl3=_hooked_from_tl_weights, tl4=_native_from_tl_weights)
    return build(config, tl_state_dict, tokenizer)


def _hooked_from_tl_weights(config: dict, tl_state_dict, tokenizer):
    """TL 3.9: the ``HookedTransformer`` itself, its weights loaded unprocessed."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from .._rng import preserved_rng

    with preserved_rng():  # a seed in the config reseeds every global generator; init draws
        model = HookedTransformer(HookedTransformerConfig(**{**config, "device": "cpu"}),
                                  tokenizer=tokenizer, move_to_device=False)
    model.load_and_process_state_dict(dict(tl_state_dict), fold_ln=False,
                                      center_writing_weights=False, center_unembed=False,
                                      fold_value_biases=False)
    return model.eval()


def _native_from_tl_weights(config: dict, tl_state_dict, tokenizer):
    """TL 4: a TL-native model with posinterp's attention (:func:`build_native_from_tl`)."""
    from transformer_lens import TransformerBridgeConfig

    fields = {k: v for k, v in config.items() if k not in ("seed", "init_weights")}
    cfg = TransformerBridgeConfig(**{**fields, "device": "cpu", "init_weights": False})
    return build_native_from_tl(cfg, dict(tl_state_dict),
                                rotary_adjacent_pairs=bool(config.get("rotary_adjacent_pairs")),
                                tokenizer=tokenizer)
