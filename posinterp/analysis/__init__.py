"""Pure metric functions over tensors, with thin TransformerLens hook plumbing."""

from .adjacency import AdjacencyScore, adjacency_by_layer, adjacency_row, adjacency_score
from .heads import previous_token_score, previous_token_scores, random_tokens
from .similarity import (
    compact_real_tokens,
    cosine_self_similarity,
    residual_hooks,
    similarity_by_layer,
)

__all__ = [
    "AdjacencyScore", "adjacency_by_layer", "adjacency_row", "adjacency_score",
    "previous_token_score", "previous_token_scores", "random_tokens",
    "compact_real_tokens", "cosine_self_similarity", "residual_hooks", "similarity_by_layer",
]
