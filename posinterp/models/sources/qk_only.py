"""The q/k projections and attention-norm gains of a checkpoint, read alone (no model built).

A study of QK spectra over many large checkpoints needs only W_Q, W_K and the gain of the
norm that feeds attention: a few percent of the bytes. :func:`read_qk_weights` reads just
those tensors, lazily, from a local HF folder's safetensors files (``safetensors.safe_open``)
or from a GGUF file (``gguf.GGUFReader``'s memory map, each tensor dequantized by the gguf
package and un-permuted by transformers' own GGUF tensor processor), and returns them in
TransformerLens's per-head layout. No forward pass is run, no full model is in memory;
:func:`posinterp.analysis.spectral.qk_spectrum_from_weights` turns them into the same table
:func:`~posinterp.analysis.spectral.qk_spectrum` gives for the fully loaded model.

Supported: the Llama family layout (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``: ``model.layers.{l}.self_attn.{q,k}_proj`` and
``input_layernorm``, RMSNorm, RoPE on split halves; Qwen3's per-head
``self_attn.{q,k}_norm`` gains too, folded as
:func:`posinterp.analysis.spectral.fold_qk_norm` says). Others are refused by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .common import _offline, _read_config, _refuse_mla

__all__ = ["QK_ONLY_ARCHITECTURES", "LayerReader", "QKWeights", "read_qk_weights"]

QK_ONLY_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                         "Qwen3ForCausalLM")
# architectures whose q and k pass a per-head RMSNorm (gain = weight) before RoPE
_QK_NORM = ("Qwen3ForCausalLM",)


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


def _assemble(spec, architecture, hf_config, read: Callable[[str, int], Tensor], kinds,
              source) -> QKWeights:
    """QKWeights whose per-layer tensors ``read(kind, layer)`` fetches on access (kinds
    ``q``, ``k``, ``g`` and, for qk-norm architectures, ``qn``, ``kn``)."""
    from ..backend import QKNorm
    from ..hf_config import hf_rotary_inv_freq
    from ..info import scheme_for_architecture

    n_heads = hf_config.num_attention_heads
    n_kv = hf_config.num_key_value_heads or n_heads
    d_model = hf_config.hidden_size
    d_head = getattr(hf_config, "head_dim", None) or d_model // n_heads
    n_layers = hf_config.num_hidden_layers
    inv_freq = hf_rotary_inv_freq(architecture, hf_config)  # refuses unsupported RoPE settings

    def per_head(gain):
        return gain.double().expand(n_heads, d_head).clone()

    def k_of(layer):
        return _per_head(read("k", layer), n_kv, d_head).repeat_interleave(n_heads // n_kv, dim=0)

    norms = (LayerReader(n_layers, lambda i: QKNorm(per_head(read("qn", i)), per_head(read("kn", i)),
                                                    "per head", "RMSNorm (gain w)"))
             if "qn" in kinds else None)
    return QKWeights(spec=str(spec), architecture=architecture, pe=scheme_for_architecture(architecture),
                     n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, d_model=d_model, d_head=d_head,
                     W_Q=LayerReader(n_layers, lambda i: _per_head(read("q", i), n_heads, d_head)),
                     W_K=LayerReader(n_layers, k_of),
                     gain=LayerReader(n_layers, lambda i: read("g", i).double()), center=False,
                     rotary_dim=2 * inv_freq.numel(), adjacent_pairs=False,
                     inv_freq=inv_freq.double(), source=source, qk_norm=norms)


def _check_architecture(spec, architecture: str) -> None:
    if architecture not in QK_ONLY_ARCHITECTURES:
        raise ValueError(f"{spec}: weights-only spectra support {list(QK_ONLY_ARCHITECTURES)}, "
                         f"not {architecture}; load the whole model instead (without --weights-only)")


def _read_folder(folder: Path) -> QKWeights:
    import transformers
    from safetensors import safe_open

    from .hf_files import safetensors_files

    raw = _read_config(folder)
    architecture = raw["architectures"][0]
    _refuse_mla(raw, architecture)  # named, not "load the whole model instead"
    _check_architecture(folder, architecture)
    hf_config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    files, weight_map = safetensors_files(folder)  # the files HF's loader reads, in its order
    n_layers = hf_config.num_hidden_layers
    parts = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "g": "input_layernorm"}
    if architecture in _QK_NORM:
        parts |= {"qn": "self_attn.q_norm", "kn": "self_attn.k_norm"}

    def where(kind, layer):
        key = f"model.layers.{layer}.{parts[kind]}.weight"
        return folder / (weight_map[key] if weight_map else files[0]), key

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

    def read(kind, layer):
        file, key = where(kind, layer)
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(key)
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{file}: cannot read tensor {key} "
                             f"({type(err).__name__}: {err})") from None

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
        _check_architecture(path, architecture)
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
        ImportError: a GGUF file without the ``gguf`` package (naming ``posinterp[gguf]``).
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
