"""The model surface posinterp reads, for TransformerLens 3.9 and 4.x (docs/architecture.md).

Analyses ask this module, never the TransformerLens version or a model's class:

* :func:`attention_weights` — W_Q, W_K, W_V, W_O of one layer as ``[n_heads, d_model,
  d_head]`` (W_O ``[n_heads, d_head, d_model]``), keys and values expanded over
  grouped-query heads (TL 3.9 expands them in ``attn.W_K``; a TL 4 bridge does not);
* :func:`attn_scale`, :func:`positional_type`, :func:`rotary_spec` — the score scale and
  positional scheme, as the model really computes them (TL 4 configs hold ``attn_scale
  = -1`` and ``rotary_dim = None`` as "unset" sentinels, and cannot say "alibi" for a
  native model);
* :func:`hook_meaning` — what each attention hook really carries on the loaded model,
  verified once per model by a probe (softmax of the scores hook is the pattern and an
  edit of it changes the output; q·k/attn_scale of the q/k hooks explains the pattern;
  ...) and cached on the model object; :func:`scores_hook`, :func:`rotated_qk_hooks`,
  :func:`content_qk_hooks`, :func:`query_hooks`, :func:`z_hook` answer from it and raise
  :class:`MissingFeatureError`, naming what the probe found, where no hook has the
  meaning (TL 4 native attention and OPT/GPT-Neo bridges fire ``hook_attn_scores`` after
  the softmax with the pattern; native attention never fires ``hook_rot_q``);
  :func:`install_output_edit` / :func:`pattern_edit` edit the pattern where no hook can;
* :func:`compiled_kind`, :func:`eager`, :func:`unwrap` — compiled models, whose graphs
  skip hooks, run eagerly for hook-based features;
* :func:`run_cached` — ``run_with_cache`` with an attention mask, for every model kind,
  in eval mode (:func:`eval_mode`), sites replaced by other plugins included
  (:func:`site_module`); :func:`run_reduced` — the same pass handing each hook's
  activation to a reducer as it fires (nothing cached: one layer's attention at a time),
  or with ``query_block`` in blocks of positions through the model's KV cache
  (:func:`chunked_pass`, verified by :func:`check_chunked_pass`: no ``[pos, pos]`` tensor).

docs/tl4.md lists every TL 4 hook whose meaning differs from 3.9 and what posinterp
does about it.

This package holds one job per module (docs/architecture.md, the models layer); every
name is re-exported here, so ``posinterp.models.backend.X`` is the one address callers use.
"""

from .cached import hooks_at_sites, run_cached, run_reduced, site_module
from .chunked import check_chunked_pass, chunked_pass
from .errors import MissingFeatureError
from .hooks import (
    content_qk_hooks,
    query_hooks,
    rotated_qk_hooks,
    scores_hook,
    verify_pattern_hook,
    z_hook,
)
from .kv_cache import guard_kv_cache, has_kv_cache
from .mla import check_not_mla, mla_message, mla_settings
from .modes import (
    CompiledModelError,
    _in_float32,
    check_not_wrapped,
    compiled_kind,
    eager,
    eval_mode,
    unwrap,
)
from .output_edit import arm_output_edit, install_output_edit, pattern_edit
from .probe import (
    HookMeaning,
    _allowed,
    _content,
    _explains,
    _probe_tokens,
    _qk,
    content_qk_from,
    hook_meaning,
)
from .qk_norm import QKNorm, qk_norm, refuse_qk_norm
from .replay import (
    BlockInputs,
    capture_block_inputs,
    final_logits,
    run_blocks_from,
    suffix_replay_matches,
)
from .rotary import RotarySpec, position_limit, rope_rotate, rotary_spec
from .slots import QKSlot, qk_slots
from .surface import (
    attention_input_norm_module,
    attention_weights,
    attn_scale,
    attn_soft_cap,
    bos_token_id,
    check_no_soft_cap,
    is_bridge,
    is_posinterp_attention,
    is_post_ln,
    n_kv_heads,
    positional_type,
    set_bos_token_id,
)
from .version import TL_MAJOR, TL_VERSION, by_line, hub_repo_for, major_of, unhonoured_settings
from .weights import (
    check_tl_major,
    convert_tl3_weights,
    load_weights,
    mark_folded,
    norm_gain_folded,
    process_weights,
)

__all__ = ["TL_MAJOR", "TL_VERSION", "by_line", "check_tl_major", "load_weights", "major_of",
           "BlockInputs", "CompiledModelError", "HookMeaning",
           "MissingFeatureError", "QKNorm", "QKSlot", "RotarySpec", "arm_output_edit",
           "capture_block_inputs", "check_chunked_pass", "chunked_pass", "final_logits",
           "run_blocks_from", "suffix_replay_matches",
           "attention_input_norm_module", "attention_weights", "attn_scale", "attn_soft_cap",
           "bos_token_id", "check_no_soft_cap", "check_not_mla", "check_not_wrapped", "compiled_kind",
           "content_qk_from", "content_qk_hooks", "convert_tl3_weights", "eager", "eval_mode",
           "guard_kv_cache", "has_kv_cache", "hook_meaning", "hooks_at_sites", "hub_repo_for",
           "install_output_edit", "is_bridge", "is_post_ln", "mark_folded", "mla_settings",
           "n_kv_heads", "norm_gain_folded", "pattern_edit", "position_limit", "positional_type",
           "process_weights", "qk_norm", "qk_slots", "refuse_qk_norm", "query_hooks",
           "rope_rotate", "rotary_spec", "rotated_qk_hooks", "run_cached", "run_reduced",
           "scores_hook", "set_bos_token_id", "site_module", "unhonoured_settings", "unwrap",
           "verify_pattern_hook", "z_hook"]
