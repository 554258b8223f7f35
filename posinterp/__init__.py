"""posinterp: how transformers represent token position, as a TransformerLens plugin.

The public API is small; everything is re-exported here::

    import posinterp as pi
    model = pi.build_model(pi.preset("small", pe="nope"))
    df = pi.adjacency_by_layer(model, tokens)
"""

__version__ = "0.1.0"

from .analysis import (
    AdjacencyScore,
    adjacency_by_layer,
    adjacency_row,
    adjacency_score,
    cosine_self_similarity,
    head_table,
    previous_token_score,
    previous_token_scores,
    probe_positions,
    qk_spectrum,
    random_tokens,
    residual_hooks,
    similarity_by_layer,
    spectral_measures,
    variance_by_layer,
)
from .models import (
    PRESETS,
    ModelInfo,
    ToyModelConfig,
    alibi_slopes,
    build_model,
    load_model,
    preset,
)
from .tasks import TASKS, TaskConfig, build_tokenizer, make_task_data, task_answer
from .train import TrainConfig, TrainResult, load_checkpoint, train

__all__ = [
    "AdjacencyScore", "adjacency_by_layer", "adjacency_row", "adjacency_score",
    "cosine_self_similarity", "residual_hooks", "similarity_by_layer",
    "previous_token_score", "previous_token_scores", "random_tokens",
    "head_table", "probe_positions", "qk_spectrum", "spectral_measures", "variance_by_layer",
    "PRESETS", "ModelInfo", "ToyModelConfig", "alibi_slopes", "build_model", "load_model", "preset",
    "TASKS", "TaskConfig", "build_tokenizer", "make_task_data", "task_answer",
    "TrainConfig", "TrainResult", "load_checkpoint", "train",
    "__version__",
]
