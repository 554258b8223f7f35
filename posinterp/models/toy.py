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

from .._validate import require_at_least
from ..tasks.tokenizer import BYTE_VOCAB_SIZE, CHAR_VOCAB
from .positions import alibi_slopes, install_alibi

__all__ = [
    "PE_SCHEMES", "PRESETS", "ToyModelConfig", "alibi_slopes", "build_model", "init_weights",
    "preset",
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
        if self.d_vocab is None:
            if self.tokenizer is None:
                raise ValueError("d_vocab is required when tokenizer is None")
            object.__setattr__(self, "d_vocab", TOKENIZERS[self.tokenizer])
        elif self.tokenizer is not None and self.d_vocab != TOKENIZERS[self.tokenizer]:
            raise ValueError(f"d_vocab={self.d_vocab} does not match tokenizer {self.tokenizer!r} "
                             f"({TOKENIZERS[self.tokenizer]} ids); set tokenizer=None for a custom vocab")
        if self.pe not in PE_SCHEMES:
            raise ValueError(f"pe must be one of {sorted(PE_SCHEMES)}, got {self.pe!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        require_at_least(self, ("n_layers", "d_model", "n_heads", "n_ctx", "d_vocab"))
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "choose n_heads among its divisors or give d_head explicitly")
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        elif self.d_head < 1:
            raise ValueError(f"d_head must be a positive integer, got {self.d_head}")
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
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
        """Parameter count of the model ``build_model`` returns (NoPE's W_pos excluded)."""
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
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("W_"):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)
        elif leaf == "w":  # LayerNorm / RMSNorm weight
            p.fill_(1.0)
        else:  # biases, including LayerNorm "b"
            p.zero_()


def make_nope(model) -> None:
    """Replace ``pos_embed.W_pos`` by a zero buffer: positions carry no signal, ever."""
    pos_embed = model.pos_embed
    shape = pos_embed.W_pos.shape
    del pos_embed.W_pos
    pos_embed.register_buffer("W_pos", torch.zeros(shape, device=model.cfg.device))


def build_model(config: ToyModelConfig, tokenizer=None):
    """Build a ``HookedTransformer`` for ``config``, initialized from ``config.seed``.

    Args:
        config: the architecture.
        tokenizer: a HF tokenizer; default: the local one named by ``config.tokenizer``.

    Returns:
        transformer_lens.HookedTransformer with ``model.posinterp_config = config``.
        Shapes follow TransformerLens: ``W_Q`` is ``[n_layers, n_heads, d_model, d_head]``.

    Raises:
        ValueError: from :class:`ToyModelConfig` validation.
    """
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from ..tasks.tokenizer import build_byte_tokenizer, build_tokenizer

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
    if tokenizer is None and config.tokenizer is not None:
        tokenizer = {"char": build_tokenizer, "byte": build_byte_tokenizer}[config.tokenizer]()
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
