"""Load llama2.c checkpoints (Karpathy's ``run.c`` format) as a TransformerLens model:
a ``HookedTransformer`` on TL 3.9, a ``TransformerBridge`` around TL's native model with
posinterp's attention on TL 4 (:func:`.native.build_native_from_tl`); the same weights
and the same weight processing either way.

Format (legacy version 0): a header of 7 little-endian int32 (dim, hidden_dim,
n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the
classifier is not shared with the token embedding), then float32 arrays: token
embedding [vocab, dim]; rms_att [layer, dim]; wq [layer, dim, dim]; wk, wv [layer,
n_kv_heads*head_size, dim]; wo [layer, dim, dim]; rms_ffn [layer, dim]; w1 [layer,
hidden, dim]; w2 [layer, dim, hidden]; w3 [layer, hidden, dim]; rms_final [dim]; then
legacy RoPE tables (2 * seq_len * head_size/2 floats, ignored); then wcls [vocab, dim]
when not shared. Linear weights are stored [out, in].

Architecture: pre-RMSNorm (eps 1e-5), SwiGLU (w2(silu(w1 x) * w3 x)), no biases,
grouped-query attention, RoPE with base 10000 on adjacent pairs (2i, 2i+1) over the
whole head, scores scaled by 1/sqrt(head_size).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..info import ModelInfo
from .common import _processing_done

__all__ = ["BOS_ID", "Llama2cHeader", "load_llama2c", "read_llama2c"]

HEADER_INTS = 7
BOS_ID = 1  # run.c starts every sequence with token 1 (its tokenizer is not in the .bin)


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int

    @property
    def shared_classifier(self) -> bool:
        return self.vocab_size > 0

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads


def _sizes(h: Llama2cHeader) -> list[tuple[str, tuple[int, ...]]]:
    v, d, f, L, hs = abs(h.vocab_size), h.dim, h.hidden_dim, h.n_layers, h.head_size
    kv = h.n_kv_heads * hs
    parts = [
        ("token_embedding", (v, d)), ("rms_att", (L, d)), ("wq", (L, d, d)), ("wk", (L, kv, d)),
        ("wv", (L, kv, d)), ("wo", (L, d, d)), ("rms_ffn", (L, d)), ("w1", (L, f, d)),
        ("w2", (L, d, f)), ("w3", (L, f, d)), ("rms_final", (d,)),
        ("freq_cis", (2 * h.seq_len * hs // 2,)),
    ]
    if not h.shared_classifier:
        parts.append(("wcls", (v, d)))
    return parts


def read_llama2c(path: str | Path) -> tuple[Llama2cHeader, dict[str, torch.Tensor]]:
    """Read a llama2.c ``.bin`` file into its header and float32 arrays (``[out, in]``).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: if the header is implausible or the file size does not match it
            (a truncated or foreign file); the message names the file and both sizes.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"llama2.c checkpoint {path} does not exist")
    raw = path.read_bytes()
    if len(raw) < 4 * HEADER_INTS:
        raise ValueError(f"{path}: {len(raw)} bytes is too short for a llama2.c header "
                         f"({4 * HEADER_INTS} bytes of int32)")
    header = Llama2cHeader(*np.frombuffer(raw[: 4 * HEADER_INTS], dtype="<i4").tolist())
    ok = (header.dim > 0 and header.n_heads > 0 and header.dim % header.n_heads == 0
          and 0 < header.n_kv_heads <= header.n_heads and header.n_heads % header.n_kv_heads == 0
          and header.n_layers > 0 and header.hidden_dim > 0 and header.seq_len > 0
          and header.vocab_size != 0)
    if not ok:
        raise ValueError(f"{path}: header {header} is not a valid llama2.c (version 0) header")
    parts = _sizes(header)
    expected = 4 * (HEADER_INTS + sum(int(np.prod(s)) for _, s in parts))
    if len(raw) != expected:
        raise ValueError(f"{path}: file has {len(raw)} bytes but its header {header} implies "
                         f"{expected} (truncated or not a llama2.c checkpoint)")
    arrays: dict[str, torch.Tensor] = {}
    offset = 4 * HEADER_INTS
    for name, shape in parts:
        n = int(np.prod(shape))
        arr = np.frombuffer(raw, dtype="<f4", count=n, offset=offset).reshape(shape)
        arrays[name] = torch.from_numpy(arr.copy())
        offset += 4 * n
    return header, arrays


def _state_dict(h: Llama2cHeader, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hs, nh, nkv = h.head_size, h.n_heads, h.n_kv_heads
    sd: dict[str, torch.Tensor] = {"embed.W_E": w["token_embedding"]}
    for layer in range(h.n_layers):
        p = f"blocks.{layer}"
        # [out = head * hs, in] -> [head, in, hs]
        sd[f"{p}.attn.W_Q"] = w["wq"][layer].reshape(nh, hs, h.dim).transpose(1, 2)
        sd[f"{p}.attn._W_K"] = w["wk"][layer].reshape(nkv, hs, h.dim).transpose(1, 2)
        sd[f"{p}.attn._W_V"] = w["wv"][layer].reshape(nkv, hs, h.dim).transpose(1, 2)
        # [out, in = head * hs] -> [head, hs, out]
        sd[f"{p}.attn.W_O"] = w["wo"][layer].reshape(h.dim, nh, hs).permute(1, 2, 0)
        sd[f"{p}.ln1.w"] = w["rms_att"][layer]
        sd[f"{p}.ln2.w"] = w["rms_ffn"][layer]
        sd[f"{p}.mlp.W_gate"] = w["w1"][layer].T
        sd[f"{p}.mlp.W_in"] = w["w3"][layer].T
        sd[f"{p}.mlp.W_out"] = w["w2"][layer].T
    sd["ln_final.w"] = w["rms_final"]
    sd["unembed.W_U"] = (w["token_embedding"] if h.shared_classifier else w["wcls"]).T
    return sd


def _bridge_config(header: Llama2cHeader, name: str, processing: dict):
    from transformer_lens import TransformerBridgeConfig

    return TransformerBridgeConfig(
        d_model=header.dim, d_head=header.head_size, n_heads=header.n_heads,
        n_key_value_heads=header.n_kv_heads if header.n_kv_heads != header.n_heads else None,
        d_mlp=header.hidden_dim, n_layers=header.n_layers, n_ctx=header.seq_len,
        d_vocab=abs(header.vocab_size), act_fn="silu", gated_mlp=True,
        # TL 3.9 turns folded RMS norms into RMSPre (no gain); TL-native has that norm too.
        normalization_type="RMSPre" if processing["fold_ln"] else "RMS", final_rms=True,
        eps=1e-5, positional_embedding_type="rotary", rotary_dim=header.head_size,
        rotary_adjacent_pairs=True, rotary_base=10000, init_weights=False,
        device="cpu", model_name=name)


def _load_bridge(header: Llama2cHeader, arrays, name: str, processing: dict):
    """TL 4: TL's own ``ProcessWeights.process_weights`` on the TL 3.9-named weights (the
    same tensors TL 3.9's ``load_and_process_state_dict`` gives, bitwise; folded gains
    become ones and are dropped, as TL 3.9 drops them), then a native bridge."""
    from transformer_lens.weight_processing import ProcessWeights

    from ..native import build_native_from_tl

    sd = _state_dict(header, arrays)

    cfg = _bridge_config(header, name, processing)
    if any(processing.values()):
        sd = ProcessWeights.process_weights(dict(sd), _bridge_config(header, name, {"fold_ln": False}),
                                            **processing)
    if processing["fold_ln"]:
        sd = {k: v for k, v in sd.items() if not k.endswith((".ln1.w", ".ln2.w", "ln_final.w"))}
    return build_native_from_tl(cfg, sd, rotary_adjacent_pairs=True)


def load_llama2c(path: str | Path, *, fold_ln: bool = False, center_writing_weights: bool = False,
                 center_unembed: bool = False, fold_value_biases: bool = False,
                 device=None, dtype=None):
    """Build a TransformerLens model from a llama2.c checkpoint, offline.

    TL 3.9: a ``HookedTransformer``. TL 4: a ``TransformerBridge`` around TL's native
    model (RMSNorm, SwiGLU, grouped-query heads) with posinterp's attention, which applies
    RoPE on adjacent pairs with TL 3.9's tables, fires ``hook_rot_q``/``hook_rot_k`` and a
    pre-softmax ``hook_attn_scores`` (docs/tl4.md). The weight processing flags mean what
    they mean in TL 3.9's ``load_and_process_state_dict``.

    The weights are read and processed on CPU in float32, then moved to ``device``
    (:func:`posinterp.devices.resolve_device`; None: CUDA when available, else CPU) and
    ``dtype`` (None: float32).

    Source: Karpathy's llama2.c (``run.c``/``export.py`` legacy format). Shapes follow
    TransformerLens: ``W_Q`` ``[n_layers, n_heads, d_model, d_head]``; with grouped-query
    attention ``blocks[l].attn._W_K`` is ``[n_kv_heads, d_model, d_head]`` (TL 3.9; TL 4's
    ``attn.W_K`` has the same shape).

    The model records llama2.c's BOS id (1, :data:`BOS_ID`) where TransformerLens would
    read a tokenizer's: :func:`posinterp.models.backend.bos_token_id` gives it, so inputs
    built "BOS first" start with it.

    Returns:
        ``(model, info_fields)``: the model and a dict with ``weights`` provenance
        (path, sha256) and the header.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_llama2c`; ValueError for a bad
            ``device``/``dtype``.
    """
    from ..._rng import preserved_rng
    from ...devices import move_model, resolve_device
    from ..backend import set_bos_token_id
    from ..backend.version import by_line

    device = resolve_device(device)
    processing = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                      center_unembed=center_unembed, fold_value_biases=fold_value_biases)
    header, arrays = read_llama2c(path)
    with preserved_rng():  # TL 3.9's HookedTransformer draws initial values it then replaces
        model = by_line(tl3=_load_hooked, tl4=_load_bridge)(header, arrays, Path(path).stem,
                                                             processing)
    move_model(model.eval(), device, dtype)
    set_bos_token_id(model, BOS_ID)  # no tokenizer in the .bin to say so
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return model, {"weights": {"path": str(Path(path).resolve()), "sha256": digest},
                   "header": header}


def _load_hooked(header: Llama2cHeader, arrays: dict[str, torch.Tensor], name: str,
                 processing: dict):
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        d_model=header.dim, d_head=header.head_size, n_heads=header.n_heads,
        n_key_value_heads=header.n_kv_heads if header.n_kv_heads != header.n_heads else None,
        d_mlp=header.hidden_dim, n_layers=header.n_layers, n_ctx=header.seq_len,
        d_vocab=abs(header.vocab_size), act_fn="silu", gated_mlp=True,
        normalization_type="RMS", final_rms=True, eps=1e-5,
        positional_embedding_type="rotary", rotary_dim=header.head_size,
        rotary_adjacent_pairs=True, rotary_base=10000,
        original_architecture="LlamaForCausalLM", model_name=name,
        tokenizer_name=None, default_prepend_bos=False, device="cpu",
    )
    model = HookedTransformer(cfg, move_to_device=False)
    sd = _state_dict(header, arrays)
    if cfg.n_key_value_heads is None:  # without grouped-query heads TL 3.9 names them W_K/W_V
        sd = {k.replace("attn._W_", "attn.W_"): v for k, v in sd.items()}
    model.load_and_process_state_dict(sd, **processing)
    return model


def load(spec: str, processing: dict, dtype=None, revision=None):
    """:func:`posinterp.load_model`'s entry for a llama2.c ``.bin`` file (built in float32;
    processing as the caller asked, default none: run.c runs the raw weights)."""
    return _load_llama2c(Path(spec).expanduser(), processing)


def _load_llama2c(path: Path, processing: dict):
    model, extra = load_llama2c(path, **processing)
    done = _processing_done(processing, model.cfg.normalization_type, bool(model.cfg.final_rms))
    return model, ModelInfo.from_model(
        model, spec=str(path), source="llama2c", pe="rotary", architecture="llama2c",
        processing=done, weights=extra["weights"])
