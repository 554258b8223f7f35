"""Pure metric functions over tensors, with thin TransformerLens hook plumbing."""

from .adjacency import AdjacencyScore, adjacency_by_layer, adjacency_row, adjacency_score
from .explain import score_parts, score_parts_from_qk
from .fingerprint import (
    dynamics_summary,
    fingerprint_table,
    fingerprint_test,
    head_dynamics,
    head_table,
    model_unit,
    trajectory_correlations,
)
from .frequencies import (
    pair_energy_shares,
    positional_symbolic_from_qk,
    positional_symbolic_score,
    rope_frequency_profile,
)
from .heads import (
    induction_score,
    induction_scores,
    induction_targets,
    previous_token_score,
    previous_token_scores,
    random_tokens,
    repeated_random_tokens,
    sampled_tokens,
)
from .kernels import attention_kernel, head_scores
from .onset import (
    check_distinct_snapshots,
    head_onsets,
    onset_summary,
    persistent_onset,
    run_bootstrap,
)
from .probing import ProbeConfig, fit_probe, position_features, probe_positions
from .similarity import (
    compact_real_tokens,
    cosine_self_similarity,
    residual_hooks,
    similarity_by_layer,
    site_hooks,
)
from .spectral import (
    antisymmetric_energy,
    channel_masses,
    directionality_score,
    eigenvalues,
    ginibre_null,
    null_percentiles,
    qk_convention,
    qk_geometry,
    qk_spectrum,
    rotational_measures,
    spectral_measures,
    symmetry_score,
)
from .variance import position_variance, variance_by_layer

__all__ = [
    "attention_kernel", "head_scores",
    "score_parts", "score_parts_from_qk",
    "dynamics_summary", "fingerprint_table", "fingerprint_test", "head_dynamics", "head_table",
    "model_unit", "trajectory_correlations", "channel_masses", "qk_convention",
    "check_distinct_snapshots", "head_onsets", "onset_summary", "persistent_onset",
    "run_bootstrap",
    "ProbeConfig", "fit_probe", "position_features", "probe_positions",
    "antisymmetric_energy", "eigenvalues", "ginibre_null", "null_percentiles", "qk_spectrum",
    "rotational_measures", "spectral_measures", "directionality_score", "qk_geometry", "symmetry_score",
    "pair_energy_shares", "positional_symbolic_from_qk", "positional_symbolic_score",
    "rope_frequency_profile", "position_variance", "variance_by_layer",
    "AdjacencyScore", "adjacency_by_layer", "adjacency_row", "adjacency_score",
    "previous_token_score", "previous_token_scores", "random_tokens", "sampled_tokens",
    "induction_score", "induction_scores", "induction_targets", "repeated_random_tokens",
    "compact_real_tokens", "cosine_self_similarity", "residual_hooks", "similarity_by_layer", "site_hooks",
]

from .._lazy import moved_names  # noqa: E402

# moved with the dashboard (issue 35); refused by name, pointing at the new home
__getattr__ = moved_names(__name__, {
    "Inspection": "posinterp.dashboard",
    "inspect_heads": "posinterp.dashboard",
})
