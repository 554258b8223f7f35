"""Read what an HF config says about heads and positions, and refuse what we cannot honour.

TransformerLens 3.9's converters drop or guess several of these values (docs/models.md):
GPT-NeoX's ``rotary_emb_base``, an explicit ``head_dim``, the context length of configs
written by transformers 5.x (no ``n_ctx``; RoPE keys moved into ``rope_parameters``), RoPE
scaling, and whole features such as Llama's attention biases. So posinterp reads them
from the config itself (through ``transformers.AutoConfig``, which normalizes old and new
key names) and overrides TL's values; a setting neither can run exactly is refused by
name. The parity test (tests/models/test_parity.py) checks every supported architecture
against HF with non-default values of these settings.
"""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_ROPE_TYPES", "UnsupportedConfigError", "check_supported", "hf_rotary_inv_freq",
           "tl_overrides"]

# RoPE types whose frequencies do not depend on the input length: HF computes them once,
# so a fixed table reproduces them. "dynamic" and "longrope" change with the length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Settings TL's weight conversion ignores, per architecture: (attribute, value TL assumes).
_ASSUMED = {
    "LlamaForCausalLM": (("attention_bias", False), ("mlp_bias", False)),
    "MistralForCausalLM": (),
    "Qwen2ForCausalLM": (("use_sliding_window", False),),
    "Qwen3ForCausalLM": (("use_sliding_window", False), ("attention_bias", False)),
    "OPTForCausalLM": (("do_layer_norm_before", True), ("enable_bias", True)),
    "GPTNeoXForCausalLM": (("attention_bias", True),),
    "BloomForCausalLM": (("apply_residual_connection_post_layernorm", False),),
    "GPT2LMHeadModel": (("add_cross_attention", False),),
    # TL's BERT is absolute-position, GELU, encoder-only.
    "BertModel": (("position_embedding_type", "absolute"), ("hidden_act", "gelu"),
                  ("is_decoder", False)),
    "BertForMaskedLM": (("position_embedding_type", "absolute"), ("hidden_act", "gelu"),
                        ("is_decoder", False)),
}


class UnsupportedConfigError(ValueError):
    """A config setting posinterp cannot run exactly (a ``ValueError`` naming the setting)."""


def _rope_parameters(hf_config) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return dict(params)


def _head_dim(hf_config) -> int:
    explicit = getattr(hf_config, "head_dim", None)
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    return hf_config.hidden_size // hf_config.num_attention_heads


def _rotary_dim(architecture: str, hf_config) -> int:
    if architecture == "GPTJForCausalLM":
        return hf_config.rotary_dim or hf_config.hidden_size // hf_config.num_attention_heads
    fraction = _rope_parameters(hf_config).get("partial_rotary_factor", 1.0)
    return int(_head_dim(hf_config) * fraction)  # HF's own rounding


# Config fields with which transformers runs a decoder-only architecture with a
# bidirectional (non-causal) mask: masking_utils.create_causal_mask falls back to
# create_bidirectional_mask for ``is_causal=False`` (any architecture using it: every
# causal LM posinterp lists); Gemma-2/3 read ``use_bidirectional_attention``.
_BIDIRECTIONAL = (("is_causal", False), ("use_bidirectional_attention", True))


def _refuse_bidirectional(architecture: str, hf_config) -> None:
    if architecture.startswith("Bert"):
        return  # encoders are bidirectional by design (loaded as such)
    for name, bidirectional in _BIDIRECTIONAL:
        if getattr(hf_config, name, None) is bidirectional:
            raise UnsupportedConfigError(
                f"{architecture} with {name}={bidirectional!r} runs with a bidirectional "
                "attention mask in transformers (every token attends to every other, as in an "
                "embedding model or a prefix-LM), but TransformerLens builds "
                f"{architecture} with a causal mask, so the loaded model would be another model "
                "(its log-probabilities differ from HF's). posinterp loads it only as the causal LM: "
                f"if the checkpoint was trained causally, remove {name!r} from config.json (or set "
                f"it to {not bidirectional!r}); a bidirectional checkpoint cannot be loaded (the "
                "bidirectional encoder posinterp loads is BERT: BertModel, BertForMaskedLM)")


def check_supported(architecture: str, hf_config) -> None:
    """Refuse, by name, a config setting that TransformerLens would silently drop.

    Checked before any weight is read or compared with HF.

    Raises:
        UnsupportedConfigError: the setting, its value and what TL assumes (on TL 4 also
            the settings its bridge ignores, :func:`.backend.unhonoured_settings`); a
            bidirectional mask (``is_causal=False``, ``use_bidirectional_attention=True``)
            on a causal architecture.
    """
    from .backend.version import TL_VERSION, unhonoured_settings

    _refuse_bidirectional(architecture, hf_config)
    for name, assumed in _ASSUMED.get(architecture, ()):
        value = getattr(hf_config, name, assumed)
        if value != assumed:
            raise UnsupportedConfigError(
                f"{architecture} with {name}={value!r} is not supported: TransformerLens's "
                f"conversion assumes {name}={assumed!r}, so the numbers would be wrong")
    for name, assumed, why in unhonoured_settings(architecture):
        value = getattr(hf_config, name, assumed)
        if value != assumed:
            raise UnsupportedConfigError(
                f"{architecture} with {name}={value!r} is not supported on TransformerLens "
                f"{TL_VERSION}: {why} (it assumes {name}={assumed!r}), so the numbers would be "
                "wrong; TransformerLens 3.9 runs it")
    if architecture == "OPTForCausalLM" and hf_config.word_embed_proj_dim != hf_config.hidden_size:
        raise UnsupportedConfigError(
            f"OPTForCausalLM with word_embed_proj_dim={hf_config.word_embed_proj_dim} != "
            f"hidden_size={hf_config.hidden_size} (project_in/project_out) is not supported")
    rope = _rope_parameters(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfigError(
            f"{architecture} with rope_type={rope_type!r} is not supported; supported: "
            f"{SUPPORTED_ROPE_TYPES} ('dynamic' and 'longrope' change with the input length, "
            "'yarn' also rescales the attention logits)")


def tl_overrides(architecture: str, hf_config, pe: str) -> dict:
    """HookedTransformerConfig fields read from ``hf_config``, to override TL's conversion.

    Args:
        architecture: the HF architecture name (``config.architectures[0]``).
        hf_config: a ``transformers`` config (``AutoConfig.from_pretrained``).
        pe: posinterp's positional scheme for the architecture.

    Returns:
        dict with ``d_head``, ``n_key_value_heads``, ``n_ctx`` where the config has a
        length, GPT-2's ``d_mlp`` when ``n_inner`` is set, and for RoPE ``rotary_dim``,
        ``rotary_base``, ``rotary_adjacent_pairs``.

    Raises:
        UnsupportedConfigError: a setting TL would silently drop (named in the message).
    """
    check_supported(architecture, hf_config)
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    out = {"d_head": _head_dim(hf_config), "n_key_value_heads": kv if kv != heads else None}
    n_ctx = getattr(hf_config, "max_position_embeddings", None)
    if n_ctx:
        out["n_ctx"] = int(n_ctx)
    if architecture == "GPT2LMHeadModel" and getattr(hf_config, "n_inner", None):
        out["d_mlp"] = int(hf_config.n_inner)  # TL 3.9 assumes 4 * n_embd
    if pe == "rotary":
        out["rotary_dim"] = _rotary_dim(architecture, hf_config)
        out["rotary_base"] = float(_rope_parameters(hf_config).get("rope_theta", 10000.0))
        out["rotary_adjacent_pairs"] = architecture == "GPTJForCausalLM"
    return out


def hf_rotary_inv_freq(architecture: str, hf_config) -> torch.Tensor:
    """The RoPE inverse frequencies HF uses for this config, ``[rotary_dim / 2]`` float32.

    ``default``: ``1 / base^(2p / rotary_dim)`` as HF's ``compute_default_rope_parameters``
    (GPT-J: base 10000, as its ``create_sinusoidal_positions``); other supported types
    through ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``, HF's own code.
    Source: Su et al. 2021 (RoFormer) eq. 15; HF ``modeling_rope_utils``.

    Raises:
        UnsupportedConfigError: a RoPE type outside :data:`SUPPORTED_ROPE_TYPES`, or one
            whose attention scaling is not 1.
    """
    check_supported(architecture, hf_config)
    rope = _rope_parameters(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    dim = _rotary_dim(architecture, hf_config)
    if rope_type == "default":
        base = 10000.0 if architecture == "GPTJForCausalLM" else rope.get("rope_theta", 10000.0)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    if scaling != 1.0:
        raise UnsupportedConfigError(f"rope_type={rope_type!r} with attention scaling {scaling} "
                                     "is not supported")
    return inv_freq.float()
