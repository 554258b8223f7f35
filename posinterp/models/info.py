"""What a loaded model's positions are: the scheme registry and :class:`ModelInfo`.

A TransformerLens config cannot tell NoPE from learned absolute positions and does not
say where weights came from, so every loader returns a ``ModelInfo`` alongside the
model; analyses record it with their results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["ARCHITECTURE_SCHEMES", "ModelInfo", "scheme_for_architecture"]

# HF architecture -> positional scheme. A registry, not an if/elif chain. A row here is a
# promise: tests/models/test_parity.py loads a tiny checkpoint of every listed architecture
# (default and non-default settings) and checks it against HF, so add the parity case
# with the row. Phi and Gemma are not listed: TL 3.9 drops Phi's partial rotary factor from
# transformers-5 configs and loads Gemma only by official hub name.
ARCHITECTURE_SCHEMES: dict[str, str] = {
    "GPT2LMHeadModel": "absolute",
    "OPTForCausalLM": "absolute",
    "GPTNeoForCausalLM": "absolute",
    "BertModel": "absolute",
    "BertForMaskedLM": "absolute",
    "GPTNeoXForCausalLM": "rotary",
    "LlamaForCausalLM": "rotary",
    "MistralForCausalLM": "rotary",
    "Qwen2ForCausalLM": "rotary",
    "Qwen3ForCausalLM": "rotary",
    "GPTJForCausalLM": "rotary",
    "BloomForCausalLM": "alibi",
}


def scheme_for_architecture(architecture: str) -> str:
    """Positional scheme (``absolute``/``rotary``/``alibi``) of an HF architecture name.

    Raises:
        ValueError: for an architecture not in :data:`ARCHITECTURE_SCHEMES`.
    """
    if architecture not in ARCHITECTURE_SCHEMES:
        raise ValueError(
            f"architecture {architecture!r} has no known positional scheme; known: "
            f"{sorted(ARCHITECTURE_SCHEMES)} (add it to ARCHITECTURE_SCHEMES)")
    return ARCHITECTURE_SCHEMES[architecture]


@dataclass(frozen=True)
class ModelInfo:
    """Provenance and positional facts of a loaded model.

    Attributes:
        spec: what the user asked for (hub name, path, ``zoo:...``).
        source: ``hub``, ``local-hf``, ``gguf``, ``llama2c``, ``toy`` or ``zoo``.
        architecture: HF architecture name (or ``posinterp-toy``, ``llama2c``).
        pe: ``nope``, ``absolute``, ``rotary`` or ``alibi``.
        causal: False for bidirectional encoders (BERT).
        n_heads, n_kv_heads, d_head: attention shape (``n_kv_heads < n_heads`` is GQA).
        rotary_dim, rotary_adjacent_pairs, rotary_base: RoPE details (None otherwise);
            ``rotary_adjacent_pairs`` True pairs dims (2i, 2i+1) (llama2.c/GPT-J),
            False pairs (i, i + rotary_dim/2) (GPT-NeoX/HF Llama).
        alibi_slopes: per-head ALiBi slopes actually used, or None.
        rope_parameters: the HF config's RoPE settings (type, base, partial fraction,
            scaling) that the installed frequencies follow, or None.
        processing: weight-processing flags (fold_ln, center_writing_weights, ...).
        qk_convention: how spectra read W_Q, W_K for this model (one convention for
            every loader: the norm gain folded in, LayerNorm's centering applied; says
            whether the loader or posinterp.spectral folds it), from
            :func:`posinterp.models.qk_convention.qk_convention`.
        weights: where the weights came from (path or hub id and revision; for HF folders
            ``files``, the weight files transformers read there, in its precedence:
            :func:`posinterp.models.checkpoint.checkpoint_files`; for llama2.c files,
            sha256); for GGUF files also ``file_type``
            (e.g. ``MOSTLY_Q4_1``), ``tensor_types``, ``dequantized: True`` and the cache
            ``folder`` (:mod:`posinterp.models.gguf`).
        hf_check: for HF checkpoints, the load-time comparison with HF's own model on a
            probe batch: ``dtype``, ``max_abs_logprob_diff`` and ``tolerance`` (nats),
            ``hf_half_vs_float32`` (HF's own half-precision vs float32 difference, which
            scales the tolerance; None in float32), and ``processing_reverted`` where TL's
            weight processing moved the log-probs and the model was loaded without it.
    """

    spec: str
    source: str
    architecture: str
    pe: str
    causal: bool
    n_heads: int
    n_kv_heads: int
    d_head: int
    rotary_dim: int | None = None
    rotary_adjacent_pairs: bool | None = None
    rotary_base: float | None = None
    alibi_slopes: tuple[float, ...] | None = None
    rope_parameters: dict | None = None
    processing: dict = field(default_factory=dict)
    qk_convention: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)
    hf_check: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_model(cls, model, *, spec: str, source: str, pe: str, architecture: str | None = None,
                   causal: bool = True, alibi_slopes=None, rope_parameters: dict | None = None,
                   processing: dict | None = None,
                   weights: dict | None = None, hf_check: dict | None = None) -> ModelInfo:
        """Fill the attention/rotary fields from ``model.cfg``, and the QK convention."""
        from .backend import is_bridge, rotary_spec
        from .qk_convention import qk_convention

        cfg = model.cfg
        rotary = pe == "rotary"
        spec_ = rotary_spec(model) if rotary and is_bridge(model) else None
        return cls(
            spec=spec, source=source,
            architecture=architecture or str(getattr(cfg, "original_architecture", None)
                                              or getattr(cfg, "architecture", "")),
            pe=pe, causal=causal, n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_key_value_heads or cfg.n_heads, d_head=cfg.d_head,
            # TL 4 configs leave rotary_dim unset: read what the attention applies.
            rotary_dim=(spec_.rotary_dim if spec_ else cfg.rotary_dim) if rotary else None,
            rotary_adjacent_pairs=(spec_.adjacent_pairs if spec_ else bool(cfg.rotary_adjacent_pairs))
            if rotary else None,
            # TL 4 configs keep the default base; the HF config's is the one applied.
            rotary_base=float((rope_parameters or {}).get("rope_theta", cfg.rotary_base))
            if rotary else None,
            alibi_slopes=tuple(float(s) for s in alibi_slopes) if alibi_slopes is not None else None,
            rope_parameters=dict(rope_parameters) if rope_parameters else None,
            processing=dict(processing or {}), qk_convention=qk_convention(model),
            weights=dict(weights or {}), hf_check=dict(hf_check or {}),
        )
