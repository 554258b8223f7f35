"""Causal interventions on QK circuits: spectral-channel ablation and symmetrization."""

from ..analysis.channels import CHANNELS, channel_decomposition, channel_projectors, top_k_projector
from .qk import KINDS, QKIntervention, intervene, intervention_hooks

__all__ = ["CHANNELS", "KINDS", "QKIntervention", "channel_decomposition", "channel_projectors", "intervene",
           "intervention_hooks", "top_k_projector"]

from .constraints import (  # noqa: E402
    BANS,
    CONSTRAINTS,
    RANK_MATCHED,
    TIED_CONSTRAINTS,
    ChannelBan,
    SubspaceBan,
    TiedKey,
    banned_ranks,
    constrain_qk,
    effective_x,
    match_qk_norm,
    qk_norms,
    removed_ranks,
)

__all__ += ["BANS", "CONSTRAINTS", "RANK_MATCHED", "TIED_CONSTRAINTS", "ChannelBan", "SubspaceBan",
            "TiedKey", "banned_ranks", "constrain_qk", "effective_x", "match_qk_norm", "qk_norms",
            "removed_ranks"]

from .effects import ablation_effect, per_head_interventions  # noqa: E402

__all__ += ["ablation_effect", "per_head_interventions"]

from .head_ablation import HEAD_ABLATIONS, attribution_estimates, head_ablation_losses  # noqa: E402

__all__ += ["HEAD_ABLATIONS", "attribution_estimates", "head_ablation_losses"]
