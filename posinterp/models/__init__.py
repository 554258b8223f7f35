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

from .info import ARCHITECTURE_SCHEMES, ModelInfo, scheme_for_architecture  # noqa: E402
from .pretrained import load_model  # noqa: E402

__all__ += ["ARCHITECTURE_SCHEMES", "ModelInfo", "load_model", "scheme_for_architecture"]
