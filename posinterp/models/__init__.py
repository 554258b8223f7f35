"""Toy models (NoPE / absolute / RoPE / ALiBi) built as TransformerLens ``HookedTransformer``."""

from .toy import (
    PE_SCHEMES,
    PRESETS,
    ToyModelConfig,
    alibi_slopes,
    build_model,
    init_weights,
    preset,
)

__all__ = [
    "PE_SCHEMES", "PRESETS", "ToyModelConfig", "alibi_slopes", "build_model", "init_weights",
    "preset",
]
