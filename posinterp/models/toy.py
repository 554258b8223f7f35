"""Toy ``HookedTransformer`` models with NoPE, learned absolute, RoPE or ALiBi positions.

One frozen config, one factory. Conventions follow TransformerLens 3.9; two things are
ours (docs/models.md):

* **NoPE** is invisible in a TransformerLens config (it reads as "standard"). We replace
  ``pos_embed.W_pos`` by a zero *buffer*: it is not a parameter, so no optimizer or
  weight decay can move it, and it survives ``reset_hooks()``, ``run_with_cache`` and
  ``state_dict`` round trips. The scheme itself lives in :class:`ToyModelConfig`, which
  is attached to the model as ``model.posinterp_config``.
* **ALiBi slopes.** TransformerLens 3.9 uses 2^(-8h/n) for every head count n; the ALiBi
  paper (Press et al. 2022, §3) and HF BLOOM interleave slopes when n is not a power of
  two. We install the paper's slopes, which matters for the 6-head presets.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch

from .._validate import derive, require_at_least
from ..tasks.tokenizer import BYTE_VOCAB_SIZE, CHAR_VOCAB
from .positions import alibi_slopes, install_alibi

__all__ = [
    "PE_SCHEMES", "PRESETS", "ToyModelConfig", "alibi_slopes", "build_model", "init_weights",
    "preset", "toy_state_dict",
]

PE = Literal["nope", "absolute", "rotary", "alibi"]
PE_SCHEMES: dict[str, str] = {
    # posinterp scheme -> TransformerLens positional_embedding_type
    "nope": "standard",
    "absolute": "standard",
    "rotary": "rotary",
    "alibi": "alibi",
}
NORMALIZATIONS = ("LN", "RMS", None)
TOKENIZERS: dict[str | None, int] = {"char": CHAR_VOCAB.size, "byte": BYTE_VOCAB_SIZE, None: 0}


@dataclass(frozen=True)
class ToyModelConfig:
    """Architecture and initialization of a toy decoder-only transformer.

    ``d_head`` defaults to ``d_model // n_heads`` and ``d_mlp`` to ``4 * d_model``;
    ``d_vocab`` to the size of ``tokenizer`` (``char``: the task alphabet, ``byte``: 256),
    which must be given when ``tokenizer`` is None.
    Every weight matrix and embedding is drawn from N(init_mean, init_std); biases are 0
    and normalization weights 1 (docs/concepts.md, "Initialization ablation"). The default
    std 0.02 is nanoGPT's, not TransformerLens's 0.8/sqrt(d_model).

    Raises:
        ValueError: for an unknown ``pe`` or ``normalization``, non-positive sizes,
            ``d_model`` not divisible by ``n_heads`` when ``d_head`` is derived, an odd
            ``d_head`` with RoPE, or a negative ``init_std``.
    """

    pe: PE = "nope"
    n_layers: int = 4
    d_model: int = 192
    n_heads: int = 6
    d_head: int | None = None
    d_mlp: int | None = None
    n_ctx: int = 64
    tokenizer: Literal["char", "byte"] | None = "char"
    d_vocab: int | None = None
    normalization: Literal["LN", "RMS"] | None = "LN"
    act_fn: str = "gelu"
    attn_only: bool = False
    init_mean: float = 0.0
    init_std: float = 0.02
    rotary_base: int = 10_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {list(TOKENIZERS)}, got {self.tokenizer!r}")
        if self.tokenizer is not None:
            derive(self, "d_vocab", lambda: TOKENIZERS[self.tokenizer])
        elif self.d_vocab is None:
            raise ValueError("d_vocab is required when tokenizer is None")
        if self.tokenizer is not None and self.d_vocab != TOKENIZERS[self.tokenizer]:
            raise ValueError(f"d_vocab={self.d_vocab} does not match tokenizer {self.tokenizer!r} "
                             f"({TOKENIZERS[self.tokenizer]} ids); set tokenizer=None for a custom vocab")
        if self.pe not in PE_SCHEMES:
            raise ValueError(f"pe must be one of {sorted(PE_SCHEMES)}, got {self.pe!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        require_at_least(self, ("n_layers", "d_model", "n_heads", "n_ctx", "d_vocab"))
        if (self.d_head is None or getattr(self.d_head, "key", None) == (type(self).__qualname__, "d_head")) \
                and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "choose n_heads among its divisors or give d_head explicitly")
        # Derived fields follow their inputs through dataclasses.replace (and preset
        # overrides) unless the caller sets them (posinterp._validate.Derived).
        derive(self, "d_head", lambda: self.d_model // self.n_heads)
        derive(self, "d_mlp", lambda: 4 * self.d_model)
        if self.d_head < 1:
            raise ValueError(f"d_head must be a positive integer, got {self.d_head}")
        if self.pe == "rotary" and self.d_head % 2:
            raise ValueError(f"pe='rotary' needs an even d_head, got d_head={self.d_head}")
        if self.init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {self.init_std}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ToyModelConfig:
        return cls(**d)

    @property
    def n_params(self) -> int:
        """Trainable parameters of the model ``build_model`` returns (no position table for
        NoPE/RoPE/ALiBi; TL 4's native model keeps a zero, frozen one for NoPE/ALiBi)."""
        attn = 4 * self.n_heads * self.d_model * self.d_head + 3 * self.n_heads * self.d_head \
            + self.d_model
        mlp = 0 if self.attn_only else 2 * self.d_model * self.d_mlp + self.d_mlp + self.d_model
        norm = {"LN": 2, "RMS": 1, None: 0}[self.normalization] * self.d_model
        n_norm = 1 if self.attn_only else 2
        per_layer = attn + mlp + n_norm * norm
        emb = 2 * self.d_vocab * self.d_model + self.d_vocab + norm
        pos = self.n_ctx * self.d_model if self.pe == "absolute" else 0
        return self.n_layers * per_layer + emb + pos


PRESETS: dict[str, ToyModelConfig] = {
    # nanoGPT's "baby GPT" (Zuo et al.'s model): 6 layers, 6 heads, 384 wide, ~10.6M params.
    "paper": ToyModelConfig(n_layers=6, d_model=384, n_heads=6),
    # The CPU demo: narrower than 192 loses the first-layer adjacency at init (docs/concepts.md).
    "small": ToyModelConfig(n_layers=4, d_model=192, n_heads=6),
    # For tests and smoke runs only: too narrow to show the paper's effect.
    "tiny": ToyModelConfig(n_layers=2, d_model=32, n_heads=4, n_ctx=48),
}


def preset(name: str, **overrides) -> ToyModelConfig:
    """A named preset (``paper``, ``small``, ``tiny``) with fields overridden.

    Raises:
        ValueError: for an unknown preset name or invalid overrides.
    """
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return replace(PRESETS[name], **overrides)


@torch.no_grad()
def init_weights(model, mean: float = 0.0, std: float = 0.02, seed: int = 0) -> None:
    """Draw every ``W_*`` parameter from N(mean, std); biases 0; norm weights 1.

    Each parameter has its own generator, seeded from ``seed`` and the parameter's name,
    so models that differ only in their positional scheme (an extra ``W_pos``, say) get
    identical weights everywhere else. docs/concepts.md ("Initialization ablation").
    """
    for name, p in model.named_parameters():
        p.copy_(_initial_value(name, tuple(p.shape), mean, std, seed))


def _initial_value(name: str, shape: tuple[int, ...], mean: float, std: float, seed: int) -> torch.Tensor:
    """The value :func:`init_weights` gives the TransformerLens 3.9 parameter ``name``."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith("W_"):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean
    if leaf == "w":  # LayerNorm / RMSNorm weight
        return torch.ones(shape)
    return torch.zeros(shape)  # biases, including LayerNorm "b"


def toy_parameter_shapes(config: ToyModelConfig) -> dict[str, tuple[int, ...]]:
    """Names (TransformerLens 3.9 ``HookedTransformer`` convention) and shapes of the
    parameters of the toy model for ``config``, NoPE's ``W_pos`` included (it is drawn,
    then replaced by zeros, so that every other weight is the same for every scheme)."""
    c = config
    H, D, dh, V = c.n_heads, c.d_model, c.d_head, c.d_vocab
    norm = {"LN": ("w", "b"), "RMS": ("w",), None: ()}[c.normalization]
    shapes: dict[str, tuple[int, ...]] = {"embed.W_E": (V, D), "pos_embed.W_pos": (c.n_ctx, D)}
    for layer in range(c.n_layers):
        p = f"blocks.{layer}"
        for ln in ("ln1",) if c.attn_only else ("ln1", "ln2"):
            shapes.update({f"{p}.{ln}.{leaf}": (D,) for leaf in norm})
        for w in ("W_Q", "W_K", "W_V"):
            shapes[f"{p}.attn.{w}"] = (H, D, dh)
            shapes[f"{p}.attn.b_{w[-1]}"] = (H, dh)
        shapes[f"{p}.attn.W_O"] = (H, dh, D)
        shapes[f"{p}.attn.b_O"] = (D,)
        if not c.attn_only:
            shapes.update({f"{p}.mlp.W_in": (D, c.d_mlp), f"{p}.mlp.b_in": (c.d_mlp,),
                           f"{p}.mlp.W_out": (c.d_mlp, D), f"{p}.mlp.b_out": (D,)})
    shapes.update({f"ln_final.{leaf}": (D,) for leaf in norm})
    shapes.update({"unembed.W_U": (D, V), "unembed.b_U": (V,)})
    return shapes


def toy_state_dict(config: ToyModelConfig) -> dict[str, torch.Tensor]:
    """The initial weights of the toy model for ``config``, keyed by TransformerLens 3.9
    names, as :func:`init_weights` draws them (``W_pos`` zero for NoPE and ALiBi).

    A pure function of the config: TransformerLens 4 models are built from it, so the
    same config and seed give the same weights under either version (docs/tl4.md).
    """
    sd = {name: _initial_value(name, shape, config.init_mean, config.init_std, config.seed)
          for name, shape in toy_parameter_shapes(config).items()}
    if config.pe in ("nope", "alibi"):
        sd["pos_embed.W_pos"] = torch.zeros_like(sd["pos_embed.W_pos"])
    return sd


def make_nope(model) -> None:
    """Replace ``pos_embed.W_pos`` by a zero buffer: positions carry no signal, ever."""
    pos_embed = model.pos_embed
    shape = pos_embed.W_pos.shape
    del pos_embed.W_pos
    pos_embed.register_buffer("W_pos", torch.zeros(shape, device=model.cfg.device))


def build_model(config: ToyModelConfig, tokenizer=None, device=None, dtype=None):
    """Build the toy model for ``config``, initialized from ``config.seed``.

    The weights are drawn on CPU from seeded generators and then moved to ``device``, so
    every device starts from the same model (docs/scale.md).

    With TransformerLens 3.9 a ``HookedTransformer``; with TransformerLens 4 a
    ``TransformerBridge`` around a TL-native model carrying the same weights
    (:func:`toy_state_dict`) and posinterp's attention (docs/tl4.md).

    Args:
        config: the architecture.
        tokenizer: a HF tokenizer; default: the local one named by ``config.tokenizer``.
        device: where the model lives (:func:`posinterp.devices.resolve_device`; None:
            CUDA when available, else CPU).
        dtype: the weights' dtype (:func:`posinterp.devices.resolve_dtype`; None: float32).

    Returns:
        the model, with ``model.posinterp_config = config``.
        Shapes follow TransformerLens: ``W_Q`` is ``[n_layers, n_heads, d_model, d_head]``.

    Raises:
        ValueError: from :class:`ToyModelConfig` validation, or a bad ``device``/``dtype``.
    """
    from .._rng import preserved_rng
    from ..devices import move_model, resolve_device, resolve_dtype

    device, dtype = resolve_device(device), resolve_dtype(dtype)  # fail before building
    with preserved_rng():  # TL's constructors draw from (TL 3.9: reseed) the global generators
        return move_model(_build_on_cpu(config, tokenizer), device,
                          None if dtype == torch.float32 else dtype)


def _build_on_cpu(config: ToyModelConfig, tokenizer=None):
    """:func:`build_model` on CPU in float32 (the seeded draw)."""
    from ..tasks.tokenizer import build_byte_tokenizer, build_tokenizer
    from .backend.version import by_line

    if tokenizer is None and config.tokenizer is not None:
        tokenizer = {"char": build_tokenizer, "byte": build_byte_tokenizer}[config.tokenizer]()
    return by_line(tl3=_hooked_toy, tl4=_native_toy)(config, tokenizer)


def _native_toy(config: ToyModelConfig, tokenizer):
    """TL 4: a TL-native model with posinterp's attention, from the same seeded weights."""
    from .native import build_native_toy

    return build_native_toy(config, toy_state_dict(config), tokenizer)


def _hooked_toy(config: ToyModelConfig, tokenizer):
    """TL 3.9: the ``HookedTransformer`` itself, initialized by :func:`init_weights`."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=config.n_layers,
        d_model=config.d_model,
        n_heads=config.n_heads,
        d_head=config.d_head,
        d_mlp=None if config.attn_only else config.d_mlp,
        n_ctx=config.n_ctx,
        d_vocab=config.d_vocab,
        act_fn=None if config.attn_only else config.act_fn,
        attn_only=config.attn_only,
        normalization_type=config.normalization,
        positional_embedding_type=PE_SCHEMES[config.pe],
        rotary_dim=config.d_head if config.pe == "rotary" else None,
        rotary_base=config.rotary_base,
        rotary_adjacent_pairs=False,
        init_weights=False,
        seed=config.seed,
        device="cpu",
        model_name=f"posinterp-toy-{config.pe}",
    )
    model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    init_weights(model, config.init_mean, config.init_std, config.seed)
    if config.pe in ("nope", "alibi"):
        # TransformerLens builds W_pos for ALiBi models too but never reads it; a buffer
        # keeps it out of the parameter count and the optimizer.
        make_nope(model)
    if config.pe == "alibi":
        install_alibi(model, alibi_slopes(config.n_heads))
    model.posinterp_config = config
    model.eval()
    return model
