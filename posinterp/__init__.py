"""posinterp: how transformers represent token position, as a TransformerLens plugin.

The public API is small; everything is re-exported here::

    import posinterp as pi
    model = pi.build_model(pi.preset("small", pe="nope"))
    df = pi.adjacency_by_layer(model, tokens)

Names are imported on first use (PEP 562), so ``import posinterp`` and the
``posinterp --help`` command do not load torch.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from .io import POSINTERP_VERSION as __version__  # one home: posinterp/io.py (standard library only)

# public name -> submodule that defines it
_EXPORTS = {
    **dict.fromkeys((
        "AdjacencyScore", "adjacency_by_layer", "adjacency_row", "adjacency_score",
        "cosine_self_similarity", "head_table", "induction_score", "induction_scores",
        "previous_token_score", "previous_token_scores", "repeated_random_tokens",
        "positional_symbolic_score", "probe_positions", "qk_geometry", "qk_spectrum",
        "random_tokens", "residual_hooks", "rope_frequency_profile", "similarity_by_layer",
        "site_hooks",
        "spectral_measures", "variance_by_layer"), ".analysis"),
    **dict.fromkeys(("Inspection", "inspect_heads"), ".dashboard.inspect"),
    **dict.fromkeys(("Comparison", "compare_inspections", "compare_models"), ".dashboard.compare"),
    **dict.fromkeys(("export_inspection", "load_inspection"), ".dashboard.export"),
    **dict.fromkeys(("score_parts",), ".analysis.explain"),
    **dict.fromkeys(("PRESETS", "ModelInfo", "ToyModelConfig", "alibi_slopes", "build_model",
                     "load_model", "preset"), ".models"),
    **dict.fromkeys(("tokenize_texts",), ".models.text"),
    **dict.fromkeys(("TASKS", "TaskConfig", "build_tokenizer", "make_task_data", "task_answer"),
                    ".tasks"),
    **dict.fromkeys(("load_checkpoint",), ".models.checkpoints"),
    **dict.fromkeys(("TrainConfig", "TrainResult", "train"), ".training"),
}

__all__ = [*_EXPORTS, "__version__"]

if "ipykernel.zmqshell" in sys.modules:
    # In a Jupyter kernel: import tqdm.auto quietly (posinterp._progress) before the first
    # model load makes transformers import it, warning "IProgress not found" where
    # ipywidgets is missing. Only there: elsewhere it would slow ``import posinterp``.
    importlib.import_module("._progress", __name__)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # for type checkers and IDEs; never runs
    from .analysis import (  # noqa: F401
        AdjacencyScore,
        adjacency_by_layer,
        adjacency_row,
        adjacency_score,
        cosine_self_similarity,
        head_table,
        induction_score,
        induction_scores,
        positional_symbolic_score,
        previous_token_score,
        previous_token_scores,
        probe_positions,
        qk_geometry,
        qk_spectrum,
        random_tokens,
        repeated_random_tokens,
        residual_hooks,
        rope_frequency_profile,
        similarity_by_layer,
        spectral_measures,
        variance_by_layer,
    )
    from .analysis.explain import score_parts  # noqa: F401
    from .dashboard.compare import Comparison, compare_inspections, compare_models  # noqa: F401
    from .dashboard.export import export_inspection, load_inspection  # noqa: F401
    from .dashboard.inspect import Inspection, inspect_heads  # noqa: F401
    from .models import (  # noqa: F401
        PRESETS,
        ModelInfo,
        ToyModelConfig,
        alibi_slopes,
        build_model,
        load_model,
        preset,
    )
    from .models.checkpoints import load_checkpoint  # noqa: F401
    from .models.text import tokenize_texts  # noqa: F401
    from .tasks import TASKS, TaskConfig, build_tokenizer, make_task_data, task_answer  # noqa: F401
    from .training import TrainConfig, TrainResult, train  # noqa: F401
