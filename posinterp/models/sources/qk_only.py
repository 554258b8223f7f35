"""The q/k projections and attention-norm gains of a checkpoint, read alone (no model built).

A study of QK spectra over many large checkpoints needs only W_Q, W_K and the gain of the
norm that feeds attention: a few percent of the bytes. :func:`read_qk_weights` reads just
those tensors, lazily, from a local HF folder's safetensors files (``safetensors.safe_open``)
or from a GGUF file (``gguf.GGUFReader``'s memory map, each tensor dequantized by the gguf
package and un-permuted by transformers' own GGUF tensor processor), and returns them in
TransformerLens's per-head layout. No forward pass is run, no full model is in memory;
:func:`posinterp.analysis.spectral.qk_spectrum_from_weights` turns them into the same table
:func:`~posinterp.analysis.spectral.qk_spectrum` gives for the fully loaded model.

Supported layouts (:data:`QK_LAYOUTS`, one entry per architecture; others are refused by
name): separate ``q_proj``/``k_proj`` (Llama, Mistral, Qwen2 with its biases, Qwen3 with
its per-head ``q_norm``/``k_norm`` gains folded as
:func:`posinterp.analysis.spectral.fold_qk_norm` says, GPT-J, GPT-Neo, OPT, Phi), GPT-2's
``c_attn`` (a Conv1D, ``[d_model, 3 d_model]``, split into q, k, v), GPT-NeoX/Pythia's and
BLOOM's ``query_key_value`` (interleaved per head: ``[n_heads, 3, d_head]`` rows, not three
blocks) and Falcon's (per head, multi-query, or grouped by KV head with the new decoder
architecture). Grouped-query and multi-query K are expanded so that query head h reads KV
head h // (n_heads / n_kv_heads), as HF's ``repeat_kv``; partial rotary (NeoX's
``rotary_pct``, Phi's ``partial_rotary_factor``, GPT-J's ``rotary_dim``) is the RoPE
HF applies. GGUF files: the Llama family. Biases do not enter M = W_Q W_K^T and are not
read. Each layout is tested against the HF module's own q/k on a tiny model
(tests/models/test_qk_only.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .common import _offline, _read_config, _refuse_mla

__all__ = ["QK_LAYOUTS", "QK_ONLY_ARCHITECTURES", "LayerReader", "QKLayout", "QKWeights",
           "read_qk_weights"]



@dataclass(frozen=True)
class QKLayout:
    """Where one architecture keeps a layer's q/k weights and the norm feeding attention.

    Attributes:
        q, k: tensor names of the separate projections (``{l}`` the layer), HF ``[out,
            in]``; None where the layout is fused.
        fused: the fused q/k/v tensor's name, split by ``split(w, cfg) -> (q_rows,
            k_rows)`` (HF ``[out, in]`` rows, query heads then KV heads in order).
        norm: the gain of the norm whose output attention reads (``{l}`` the layer), or a
            callable ``cfg -> name``.
        center: True for LayerNorm (its output is mean-free), False for RMSNorm.
        conv1d: the tensors are stored ``[in, out]`` (GPT-2's Conv1D).
        qk_norm: names of per-head q/k RMSNorm gains (Qwen3), or None.
        adjacent_pairs: RoPE rotates dims (2i, 2i+1) (GPT-J) rather than split halves.
        pe: the positional scheme, or a callable ``cfg -> scheme``.
        n_kv_heads: ``cfg -> n_kv_heads`` where the config spells it its own way.
        refuse: ``cfg -> reason or None``: a setting this reader cannot honour, by name.
    """

    norm: str | Callable
    center: bool
    pe: str | Callable
    q: str | None = None
    k: str | None = None
    fused: str | None = None
    split: Callable | None = None
    conv1d: bool = False
    qk_norm: tuple[str, str] | None = None
    adjacent_pairs: bool = False
    n_kv_heads: Callable | None = None
    refuse: Callable | None = None


def _per_head_fused(w: Tensor, cfg, n_heads: int, d_head: int):
    """NeoX/BLOOM ``query_key_value`` rows: ``[n_heads, 3, d_head]``, q k v per head (HF's
    ``view(..., n_heads, 3 * head_size).chunk(3)`` / ``view(..., n_heads, 3, head_dim)``)."""
    rows = w.reshape(n_heads, 3, d_head, -1)
    return rows[:, 0].reshape(n_heads * d_head, -1), rows[:, 1].reshape(n_heads * d_head, -1)


def _gpt2_split(w: Tensor, cfg, n_heads: int, d_head: int):
    """GPT-2 ``c_attn`` rows (already ``[out, in]``): q, k, v blocks of d_model each."""
    d = n_heads * d_head
    return w[:d], w[d:2 * d]


def _falcon_kv(cfg) -> int:
    if cfg.new_decoder_architecture:
        return cfg.num_kv_heads
    return 1 if cfg.multi_query else cfg.num_attention_heads


def _falcon_split(w: Tensor, cfg, n_heads: int, d_head: int):
    """Falcon ``query_key_value`` rows as HF's ``FalconAttention._split_heads`` reads them."""
    if cfg.new_decoder_architecture:  # per KV group: its query heads, then k, then v
        kv = cfg.num_kv_heads
        rows = w.reshape(kv, n_heads // kv + 2, d_head, -1)
        return rows[:, :-2].reshape(n_heads * d_head, -1), rows[:, -2].reshape(kv * d_head, -1)
    if cfg.multi_query:  # n_heads queries, one k, one v
        rows = w.reshape(n_heads + 2, d_head, -1)
        return rows[:-2].reshape(n_heads * d_head, -1), rows[-2]
    return _per_head_fused(w, cfg, n_heads, d_head)


def _falcon_norm(cfg) -> str:
    two = cfg.new_decoder_architecture and (cfg.num_ln_in_parallel_attn or 2) == 2
    return "h.{l}.ln_attn" if (cfg.parallel_attn and two) else "h.{l}.input_layernorm"


def _opt_refuse(cfg):
    if not cfg.do_layer_norm_before:
        return ("do_layer_norm_before=False (post-LN: attention reads the previous block's "
                "output norm, not a norm of its own)")
    return None


def _phi_refuse(cfg):
    if getattr(cfg, "qk_layernorm", False):
        return "qk_layernorm=True (a LayerNorm on q and k, not an RMS gain that folds into M)"
    return None


_LLAMA = dict(q="layers.{l}.self_attn.q_proj", k="layers.{l}.self_attn.k_proj",
              norm="layers.{l}.input_layernorm", center=False, pe="rotary")

#: architecture -> :class:`QKLayout` (tensor names without the model's prefix, such as
#: ``model.`` or ``transformer.``, which is found in the files).
QK_LAYOUTS: dict[str, QKLayout] = {
    "LlamaForCausalLM": QKLayout(**_LLAMA),
    "MistralForCausalLM": QKLayout(**_LLAMA),
    "Qwen2ForCausalLM": QKLayout(**_LLAMA),
    "Qwen3ForCausalLM": QKLayout(**_LLAMA, qk_norm=("layers.{l}.self_attn.q_norm",
                                                    "layers.{l}.self_attn.k_norm")),
    "PhiForCausalLM": QKLayout(q="layers.{l}.self_attn.q_proj", k="layers.{l}.self_attn.k_proj",
                               norm="layers.{l}.input_layernorm", center=True, pe="rotary",
                               refuse=_phi_refuse),
    "GPTJForCausalLM": QKLayout(q="h.{l}.attn.q_proj", k="h.{l}.attn.k_proj", norm="h.{l}.ln_1",
                                center=True, pe="rotary", adjacent_pairs=True),
    "GPTNeoForCausalLM": QKLayout(q="h.{l}.attn.attention.q_proj", k="h.{l}.attn.attention.k_proj",
                                  norm="h.{l}.ln_1", center=True, pe="absolute"),
    "OPTForCausalLM": QKLayout(q="layers.{l}.self_attn.q_proj", k="layers.{l}.self_attn.k_proj",
                               norm="layers.{l}.self_attn_layer_norm", center=True,
                               pe="absolute", refuse=_opt_refuse),
    "GPT2LMHeadModel": QKLayout(fused="h.{l}.attn.c_attn", split=_gpt2_split, conv1d=True,
                                norm="h.{l}.ln_1", center=True, pe="absolute"),
    "GPTNeoXForCausalLM": QKLayout(fused="layers.{l}.attention.query_key_value",
                                   split=_per_head_fused, norm="layers.{l}.input_layernorm",
                                   center=True, pe="rotary"),
    "BloomForCausalLM": QKLayout(fused="h.{l}.self_attention.query_key_value",
                                 split=_per_head_fused, norm="h.{l}.input_layernorm",
                                 center=True, pe="alibi"),
    "FalconForCausalLM": QKLayout(fused="h.{l}.self_attention.query_key_value",
                                  split=_falcon_split, norm=_falcon_norm, center=True,
                                  pe=lambda cfg: "alibi" if cfg.alibi else "rotary",
                                  n_kv_heads=_falcon_kv),
}
QK_ONLY_ARCHITECTURES = tuple(QK_LAYOUTS)
# GGUF files are read through llama.cpp's tensor names, the Llama family's only
GGUF_QK_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                         "Qwen3ForCausalLM")
# architectures whose q and k pass a per-head RMSNorm (gain = weight) before RoPE
_QK_NORM = tuple(a for a, lay in QK_LAYOUTS.items() if lay.qk_norm)


@dataclass(frozen=True)
class QKWeights:
    """W_Q, W_K (stored, float64) and attention-norm gains of every layer, each read from
    its file when indexed (:class:`LayerReader`), so a spectrum holds one layer at a time.

    Attributes:
        W_Q, W_K: per layer ``[n_heads, d_model, d_head]``; W_K already expanded over
            grouped-query heads (query head h reads KV head h // (n_heads / n_kv_heads),
            as HF's ``repeat_kv``).
        gain: per layer ``[d_model]``, the gain of the RMSNorm feeding attention.
        center: False (RMSNorm does not centre).
        qk_norm: per layer a :class:`~posinterp.models.backend.QKNorm` (gains
            ``[n_heads, d_head]``, keys expanded) for qk-norm architectures, else None.
        pe, rotary_dim, adjacent_pairs, inv_freq: the RoPE the model applies
            (``inv_freq`` ``[rotary_dim / 2]``, HF's frequencies).
        source: what was read (path, format, the weight files transformers' loader reads
            there (``files``, HF folders: :func:`posinterp.models.sources.hf_files.checkpoint_files`),
            tensor count, bytes of those tensors).
    """

    spec: str
    architecture: str
    pe: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    W_Q: Sequence[Tensor]
    W_K: Sequence[Tensor]
    gain: Sequence[Tensor]
    center: bool
    rotary_dim: int | None
    adjacent_pairs: bool | None
    inv_freq: Tensor | None
    source: dict = field(default_factory=dict)
    qk_norm: Sequence | None = None


class LayerReader(Sequence):
    """One tensor per layer, read from its file each time it is indexed and never kept:
    memory is one layer's, whatever the depth (docs/scale.md). ``read(layer)`` returns it."""

    def __init__(self, n_layers: int, read: Callable[[int], object]):
        self._n, self._read = n_layers, read

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(self._n))]
        if not -self._n <= layer < self._n:
            raise IndexError(f"layer {layer} out of range for {self._n} layers")
        return self._read(layer % self._n)


def _per_head(w: Tensor, n: int, d_head: int) -> Tensor:
    """HF ``[n * d_head, d_model]`` (out, in) -> TL ``[n, d_model, d_head]``."""
    return w.double().reshape(n, d_head, -1).transpose(1, 2).contiguous()


def _attr(value, hf_config):
    return value(hf_config) if callable(value) else value


def _assemble(spec, architecture, hf_config, read: Callable[[str, int], Tensor], kinds,
              source) -> QKWeights:
    """QKWeights whose per-layer tensors ``read(kind, layer)`` fetches on access (kinds
    ``q``, ``k`` (HF ``[out, in]`` rows), ``g`` and, for qk-norm architectures, ``qn``,
    ``kn``)."""
    from ..backend import QKNorm
    from ..hf_config import hf_rotary_inv_freq

    layout = QK_LAYOUTS[architecture]
    n_heads = hf_config.num_attention_heads
    n_kv = (layout.n_kv_heads(hf_config) if layout.n_kv_heads else
            getattr(hf_config, "num_key_value_heads", None) or n_heads)
    d_model = hf_config.hidden_size
    d_head = getattr(hf_config, "head_dim", None) or d_model // n_heads
    n_layers = hf_config.num_hidden_layers
    pe = _attr(layout.pe, hf_config)
    # refuses unsupported RoPE settings; HF's own frequencies, partial rotary included
    inv_freq = hf_rotary_inv_freq(architecture, hf_config) if pe == "rotary" else None

    def per_head(gain):
        return gain.double().expand(n_heads, d_head).clone()

    def k_of(layer):
        return _per_head(read("k", layer), n_kv, d_head).repeat_interleave(n_heads // n_kv, dim=0)

    norms = (LayerReader(n_layers, lambda i: QKNorm(per_head(read("qn", i)), per_head(read("kn", i)),
                                                    "per head", "RMSNorm (gain w)"))
             if "qn" in kinds else None)
    return QKWeights(spec=str(spec), architecture=architecture, pe=pe,
                     n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, d_model=d_model, d_head=d_head,
                     W_Q=LayerReader(n_layers, lambda i: _per_head(read("q", i), n_heads, d_head)),
                     W_K=LayerReader(n_layers, k_of),
                     gain=LayerReader(n_layers, lambda i: read("g", i).double()),
                     center=layout.center,
                     rotary_dim=None if inv_freq is None else 2 * inv_freq.numel(),
                     adjacent_pairs=None if inv_freq is None else layout.adjacent_pairs,
                     inv_freq=None if inv_freq is None else inv_freq.double(), source=source,
                     qk_norm=norms)


def _check_architecture(spec, architecture: str, supported=QK_ONLY_ARCHITECTURES) -> None:
    if architecture not in supported:
        raise ValueError(f"{spec}: weights-only spectra support {list(supported)}, "
                         f"not {architecture}; load the whole model instead (without --weights-only)")


def _names(layout: QKLayout, hf_config) -> dict[str, str]:
    """kind -> tensor name pattern (``{l}``, no prefix) of what a layer's read needs."""
    parts = {"g": _attr(layout.norm, hf_config)}
    parts |= {"fused": layout.fused} if layout.fused else {"q": layout.q, "k": layout.k}
    if layout.qk_norm:
        parts |= {"qn": layout.qk_norm[0], "kn": layout.qk_norm[1]}
    return {kind: name + ".weight" for kind, name in parts.items()}


def _prefix(keys, pattern: str, folder) -> str:
    """The model's prefix (``model.``, ``transformer.``, ``gpt_neox.``, or none) as the
    files spell layer 0's tensor ``pattern``."""
    want = pattern.format(l=0)
    found = sorted(k[: -len(want)] for k in keys if k == want or k.endswith("." + want))
    if not found:
        raise ValueError(f"{folder}: no tensor named *{want} (the layout of this architecture)")
    return min(found, key=len)


def _read_folder(folder: Path) -> QKWeights:
    import transformers
    from safetensors import safe_open

    from .hf_files import safetensors_files

    raw = _read_config(folder)
    architecture = raw["architectures"][0]
    _refuse_mla(raw, architecture)  # named, not "load the whole model instead"
    _check_architecture(folder, architecture)
    hf_config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    layout = QK_LAYOUTS[architecture]
    if layout.refuse and (why := layout.refuse(hf_config)):
        raise ValueError(f"{folder}: weights-only spectra of {architecture} with {why} are "
                         "not supported")
    files, weight_map = safetensors_files(folder)  # the files HF's loader reads, in its order
    n_layers = hf_config.num_hidden_layers
    parts = _names(layout, hf_config)
    if weight_map:
        keys = set(weight_map)
    else:
        try:
            with safe_open(str(folder / files[0]), framework="pt") as f:
                keys = set(f.keys())
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{folder / files[0]}: cannot read its tensors "
                             f"({type(err).__name__}: {err})") from None
    prefix = _prefix(keys, next(v for k, v in parts.items() if k != "g"), folder)

    def where(kind, layer):
        key = prefix + parts[kind].format(l=layer)
        return folder / (weight_map.get(key, files[0]) if weight_map else files[0]), key

    # Every tensor is found and sized from the files' headers now, so a missing or damaged
    # one is refused before any spectrum is computed; the bytes are read layer by layer.
    nbytes = 0
    for file in sorted({where(kind, i)[0] for kind in parts for i in range(n_layers)}):
        try:
            with safe_open(str(file), framework="pt") as f:
                present = set(f.keys())
                for kind in parts:
                    for i in range(n_layers):
                        at, key = where(kind, i)
                        if at != file:
                            continue
                        if key not in present:
                            raise ValueError(f"{file}: tensor {key} is missing")
                        sl = f.get_slice(key)
                        nbytes += _numel(sl.get_shape()) * _DTYPE_BYTES.get(sl.get_dtype(), 4)
        except ValueError:
            raise
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{file}: cannot read its tensors ({type(err).__name__}: {err})") from None

    def tensor(kind, layer):
        file, key = where(kind, layer)
        try:
            with safe_open(str(file), framework="pt") as f:
                w = f.get_tensor(key)
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{file}: cannot read tensor {key} "
                             f"({type(err).__name__}: {err})") from None
        return w.T if layout.conv1d and kind in ("q", "k", "fused") else w

    n_heads = hf_config.num_attention_heads
    d_head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads

    def read(kind, layer):
        if kind in ("q", "k") and layout.fused:  # the fused tensor, split as HF splits it
            q, k = layout.split(tensor("fused", layer), hf_config, n_heads, d_head)
            return q if kind == "q" else k
        return tensor(kind, layer)

    return _assemble(folder, architecture, hf_config, read, parts,
                     {"path": str(folder.resolve()), "format": "safetensors", "files": files,
                      "tensors": len(parts) * n_layers, "bytes": nbytes})


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def _read_gguf(path: Path) -> QKWeights:
    import transformers
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from .gguf import _hf_architecture, _open

    # a memory map: only the tensors read below are touched; truncated or corrupt files
    # and unknown families are refused by name first
    reader, header = _open(path)
    with _offline():
        architecture = _hf_architecture(path, header)
        _check_architecture(path, architecture, GGUF_QK_ARCHITECTURES)
        hf_config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    import gguf

    tensors = {t.name: t for t in reader.tensors}
    proc = TENSOR_PROCESSORS.get(header["architecture"], TensorProcessor)(config={
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": hf_config.num_key_value_heads})
    parts = {"q": "attn_q", "k": "attn_k", "g": "attn_norm"}
    if architecture in _QK_NORM:  # llama.cpp's names for Qwen3's per-head q/k norms
        parts |= {"qn": "attn_q_norm", "kn": "attn_k_norm"}
    n_layers = hf_config.num_hidden_layers
    nbytes = 0
    for i in range(n_layers):  # all present, before any is dequantized
        for part in parts.values():
            name = f"blk.{i}.{part}.weight"
            if name not in tensors:
                raise ValueError(f"{path}: tensor {name} is missing")
            nbytes += int(tensors[name].n_bytes)

    def read(kind, layer):
        name = f"blk.{layer}.{parts[kind]}.weight"
        t = tensors[name]
        w = gguf.dequantize(t.data, t.tensor_type)
        # llama.cpp permutes q/k rows; transformers' processor undoes it (as from_pretrained)
        w = proc.process(weights=w, name=name).weights
        return torch.from_numpy(w.copy()).float()

    return _assemble(path, architecture, hf_config, read, parts,
                     {"path": str(path.resolve()), "format": "gguf", "file_type": header["file_type"],
                      "dequantized": True, "tensors": len(parts) * n_layers, "bytes": nbytes})


def read_qk_weights(spec: str | os.PathLike) -> QKWeights:
    """W_Q, W_K and attention-norm gains of a local checkpoint, without loading the model.

    Args:
        spec: a local HF folder with safetensors weights, or a ``.gguf`` file.

    Returns:
        :class:`QKWeights` (float64; GGUF weights dequantized, an approximation of the
        released float weights).

    Raises:
        FileNotFoundError: a missing path, or a folder without safetensors files.
        ValueError: an architecture outside :data:`QK_ONLY_ARCHITECTURES` (named), a
            truncated/corrupt file, or a missing tensor.
        ImportError: a GGUF file without the ``gguf`` package (naming how to install it).
        posinterp.models.hf_config.UnsupportedConfigError: a RoPE setting posinterp does
            not reproduce.
    """
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {path}")
        return _read_gguf(path)
    if path.is_dir():
        return _read_folder(path)
    raise FileNotFoundError(f"weights-only spectra need a local HF folder or a .gguf file; "
                            f"no such folder or file: {spec}")
