"""Seeded factories for tests: tiny models and task data, built on demand (never at import)."""

from __future__ import annotations

import torch
import transformers

from posinterp.models import build_model, preset
from posinterp.tasks import TaskConfig, make_task_data


def tiny_model(pe: str = "nope", **overrides):
    return build_model(preset("tiny", pe=pe, **overrides))


def tiny_rotary_checkpoint(root):
    """A tiny RoPE toy trained 2 steps on reversal, saved as a checkpoint folder
    ``root/ck`` (what ``posinterp inspect`` loads); returns that folder."""
    from posinterp.training import TrainConfig, train

    cfg = TrainConfig(max_steps=2, batch_size=8, eval_every=2, n_eval=16, checkpoint_every=1000,
                      warmup_steps=1, target_accuracy=None, seed=3)
    train(preset("tiny", pe="rotary"), tiny_task("reversal", n=40, max_digits=6), cfg,
          checkpoint_dir=root / "ck" / "checkpoints", progress=False)
    return root / "ck"


def tiny_task(task: str = "reversal", n: int = 200, seed: int = 0, **kw):
    return make_task_data(TaskConfig(task, n_train=n, n_test=n, seed=seed, **kw))


def random_tokens(model, batch: int, pos: int, seed: int = 0) -> torch.Tensor:
    """Random non-special token ids (ids >= 4 skip pad/bos/eos/unk)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, model.cfg.d_vocab, (batch, pos), generator=gen)


def tl_weights(config: dict, seed: int = 0, biases: bool = True, std: float = 0.3) -> dict:
    """Seeded N(0, std) weights in TL 3.9 ``HookedTransformer`` names and shapes for
    ``config`` (attention biases N(0, std), or absent without ``biases``; norm gains 1 +
    N(0, std) and LayerNorm biases N(0, std), or 1 and 0 without ``biases``), for
    ``posinterp.models.native.model_from_tl_weights``."""
    gen = torch.Generator().manual_seed(seed)
    D, H, dh, V = config["d_model"], config["n_heads"], config["d_head"], config["d_vocab"]
    kv = config.get("n_key_value_heads") or H
    M = config.get("d_mlp") or 4 * D
    k = "_" if kv != H else ""

    def r(*shape):
        return std * torch.randn(shape, generator=gen)

    sd = {"embed.W_E": r(V, D), "unembed.W_U": r(D, V), "unembed.b_U": r(V)}
    norms = ["ln_final"] + [f"blocks.{layer}.{ln}" for layer in range(config["n_layers"])
                            for ln in ("ln1", "ln2")]
    for n in norms:
        sd[f"{n}.w"] = 1 + r(D) if biases else torch.ones(D)
        if config["normalization_type"] == "LN":
            sd[f"{n}.b"] = r(D) if biases else torch.zeros(D)
    for layer in range(config["n_layers"]):
        p = f"blocks.{layer}."
        sd.update({p + "attn.W_Q": r(H, D, dh), p + f"attn.{k}W_K": r(kv, D, dh),
                   p + f"attn.{k}W_V": r(kv, D, dh), p + "attn.W_O": r(H, dh, D),
                   p + "mlp.W_in": r(D, M), p + "mlp.b_in": r(M), p + "mlp.W_out": r(M, D),
                   p + "mlp.b_out": r(D)})
        if biases:
            sd.update({p + "attn.b_Q": r(H, dh), p + f"attn.{k}b_K": r(kv, dh),
                       p + f"attn.{k}b_V": r(kv, dh), p + "attn.b_O": r(D)})
    return sd


def rotary_model(seed: int = 0, biases: bool = True, **overrides):
    """A 1-layer RoPE model of random weights (:func:`tl_weights`) on either TL line."""
    from posinterp.models.native import model_from_tl_weights

    config = dict(n_layers=1, d_model=32, n_heads=4, d_head=8, n_ctx=16, d_vocab=50, d_mlp=64,
                  act_fn="gelu", normalization_type="LN", positional_embedding_type="rotary",
                  rotary_dim=8, rotary_adjacent_pairs=False)
    config.update(overrides)
    return model_from_tl_weights(config, tl_weights(config, seed, biases=biases))


def gqa_model():
    """A 1-layer rotary model with grouped-query attention: 4 query heads, 2 KV heads."""
    return rotary_model(d_model=16, n_heads=4, n_key_value_heads=2, d_head=4, n_ctx=8,
                        d_vocab=10, d_mlp=64, act_fn="silu", normalization_type="RMS",
                        rotary_dim=4, biases=False)


HF_VOCAB = 97


def tiny_hf_configs() -> dict:
    """Tiny random HF configs, one per positional family (2 layers, default settings)."""
    return {
        # Folder names contain family substrings on purpose: TL 3.9 guesses from the path.
        "gpt2-absolute": transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=HF_VOCAB),
        "neox-rotary-pct-0.25": transformers.GPTNeoXConfig(
            num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
            rotary_pct=0.25, max_position_embeddings=64, vocab_size=HF_VOCAB),
        "llama-gqa": transformers.LlamaConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
            intermediate_size=64, max_position_embeddings=64, vocab_size=HF_VOCAB),
        "bloom-12-heads": transformers.BloomConfig(
            n_layer=2, n_head=12, hidden_size=48, vocab_size=HF_VOCAB),
    }


_N = 600  # positions: past the 512-token parity length


def _llama(**kw):
    base = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                intermediate_size=64, max_position_embeddings=_N, vocab_size=HF_VOCAB)
    return transformers.LlamaConfig(**{**base, **kw})


def _neox(**kw):
    base = dict(num_hidden_layers=1, num_attention_heads=4, hidden_size=64, intermediate_size=64,
                max_position_embeddings=_N, vocab_size=HF_VOCAB)
    return transformers.GPTNeoXConfig(**{**base, **kw})


def _opt(**kw):
    base = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64,
                word_embed_proj_dim=32, max_position_embeddings=_N, vocab_size=HF_VOCAB)
    return transformers.OPTConfig(**{**base, **kw})


def _bert(**kw):
    base = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
                max_position_embeddings=_N, vocab_size=HF_VOCAB)
    return transformers.BertConfig(**{**base, **kw})


def parity_cases() -> dict:
    """Every registered architecture, with default and non-default head/position settings.

    name -> (architecture, config factory, refusal): ``refusal`` is None where posinterp
    must match HF, else a regex of the UnsupportedConfigError that names the setting.
    tests/models/test_parity.py checks that every architecture in ARCHITECTURE_SCHEMES
    has a case here; benchmarks/parity.py prints the table.
    """
    T = transformers
    V = HF_VOCAB
    return {
        "gpt2": ("GPT2LMHeadModel", lambda: T.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, n_positions=_N, vocab_size=V), None),
        "gpt2-inverse-layer-scale": ("GPT2LMHeadModel", lambda: T.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, n_positions=_N, vocab_size=V,
            scale_attn_by_inverse_layer_idx=True), None),
        "gpt2-no-attn-scale-n-inner-40": ("GPT2LMHeadModel", lambda: T.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, n_positions=_N, vocab_size=V, n_inner=40,
            scale_attn_weights=False), None),
        "opt": ("OPTForCausalLM", _opt, None),
        "opt-post-ln": ("OPTForCausalLM", lambda: _opt(do_layer_norm_before=False),
                        "do_layer_norm_before"),
        "opt-projected": ("OPTForCausalLM", lambda: _opt(word_embed_proj_dim=16),
                          "word_embed_proj_dim"),
        "gptneo-local": ("GPTNeoForCausalLM", lambda: T.GPTNeoConfig(
            num_layers=2, num_heads=4, hidden_size=32, max_position_embeddings=_N, vocab_size=V,
            attention_types=[[["global", "local"], 1]], window_size=16), None),
        "neox": ("GPTNeoXForCausalLM", _neox, None),
        "neox-pct-0.25-base-5e5": ("GPTNeoXForCausalLM", lambda: _neox(
            rotary_pct=0.25, rotary_emb_base=500000), None),
        "neox-linear-scaling": ("GPTNeoXForCausalLM", lambda: _neox(
            rotary_pct=0.5, rope_scaling={"rope_type": "linear", "factor": 4.0}), None),
        "neox-sequential": ("GPTNeoXForCausalLM", lambda: _neox(use_parallel_residual=False), None),
        "neox-no-bias": ("GPTNeoXForCausalLM", lambda: _neox(attention_bias=False), "attention_bias"),
        "llama-gqa": ("LlamaForCausalLM", _llama, None),
        "llama-head-dim-16": ("LlamaForCausalLM", lambda: _llama(head_dim=16), None),
        "llama-base-5e5": ("LlamaForCausalLM", lambda: _llama(rope_theta=500000.0), None),
        "llama3-scaling": ("LlamaForCausalLM", lambda: _llama(
            hidden_size=64, rope_theta=50000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), None),
        "llama-dynamic": ("LlamaForCausalLM", lambda: _llama(
            rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
        "llama-yarn": ("LlamaForCausalLM", lambda: _llama(
            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64}), "rope_type='yarn'"),
        "llama-attention-bias": ("LlamaForCausalLM", lambda: _llama(attention_bias=True),
                                 "attention_bias"),
        "mistral-sliding-16": ("MistralForCausalLM", lambda: T.MistralConfig(
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
            intermediate_size=64, max_position_embeddings=_N, vocab_size=V, sliding_window=16,
            rope_theta=20000.0), None),
        "qwen2": ("Qwen2ForCausalLM", lambda: T.Qwen2Config(
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
            intermediate_size=64, max_position_embeddings=_N, vocab_size=V,
            rope_theta=12345.5), None),
        "qwen3-qk-norm": ("Qwen3ForCausalLM", lambda: T.Qwen3Config(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
            head_dim=16, intermediate_size=64, max_position_embeddings=_N, vocab_size=V,
            rope_theta=12345.5), None),
        "qwen3-sliding-16": ("Qwen3ForCausalLM", lambda: T.Qwen3Config(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, hidden_size=32,
            intermediate_size=64, max_position_embeddings=_N, vocab_size=V, use_sliding_window=True,
            sliding_window=16, max_window_layers=1), "use_sliding_window"),
        "qwen3-attention-bias": ("Qwen3ForCausalLM", lambda: T.Qwen3Config(
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
            intermediate_size=64, max_position_embeddings=_N, vocab_size=V, attention_bias=True),
            "attention_bias"),
        "gptj-rotary-dim-4": ("GPTJForCausalLM", lambda: T.GPTJConfig(
            n_layer=1, n_head=4, n_embd=32, rotary_dim=4, n_positions=_N, vocab_size=V), None),
        "bloom-6-heads": ("BloomForCausalLM", lambda: T.BloomConfig(
            n_layer=1, n_head=6, hidden_size=48, vocab_size=V), None),
        "bloom-12-heads": ("BloomForCausalLM", lambda: T.BloomConfig(
            n_layer=2, n_head=12, hidden_size=48, vocab_size=V), None),
        "bloom-post-ln-residual": ("BloomForCausalLM", lambda: T.BloomConfig(
            n_layer=1, n_head=4, hidden_size=32, vocab_size=V,
            apply_residual_connection_post_layernorm=True),
            "apply_residual_connection_post_layernorm"),
        "bert": ("BertModel", lambda: _bert(architectures=["BertModel"]), None),
        "bert-mlm": ("BertForMaskedLM", lambda: _bert(architectures=["BertForMaskedLM"]), None),
        "bert-relative": ("BertModel", lambda: _bert(architectures=["BertModel"],
                                                      position_embedding_type="relative_key"),
                          "position_embedding_type"),
    }


def save_tiny_checkpoint(architecture: str, config, folder, sharpen: float = 20.0, seed: int = 0):
    """Random weights for ``config`` saved with ``save_pretrained``; q/k weights scaled by
    ``sharpen`` so attention is sharp and position errors show in the logits."""
    torch.manual_seed(seed)
    cls = getattr(transformers, architecture)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and any(s in name for s in ("q_proj", "k_proj", "query_key_value",
                                                         "c_attn", "query.", "key.")):
                p.mul_(sharpen)
    model.save_pretrained(folder)
    return model


def set_norm_gains(model, seed: int = 1):
    """Non-unit norm gains (and LayerNorm biases) in place: a random HF model has gains of
    exactly 1, so folding them (``fold_ln``) would be a no-op and could not be tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim != 1 or not any(s in name for s in ("norm", "ln_", "layer_norm")):
                continue
            if name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.rand(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def save_sharded(model, folder, fmt: str = "safetensors", shard_size: str = "20KB"):
    """``model`` saved as several shards plus their index, as large releases ship.

    ``fmt="bin"``: ``pytorch_model-0000k-of-0000n.bin`` + ``pytorch_model.bin.index.json``
    (what older releases ship; transformers 5 writes only safetensors, so the safetensors
    shards are rewritten with ``torch.save``). Returns the index's ``weight_map``.
    """
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(folder)
    model.save_pretrained(folder, max_shard_size=shard_size)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    if fmt == "bin":
        renamed = {}
        for shard in sorted(set(index["weight_map"].values())):
            new = shard.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
            torch.save(load_file(folder / shard), folder / new)
            (folder / shard).unlink()
            renamed[shard] = new
        index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
        (folder / "model.safetensors.index.json").unlink()
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return index["weight_map"]


def write_hub_cache(cache, repo_id: str, folder, ref: str = "main", commit: str | None = None):
    """Put checkpoint ``folder`` into a Hugging Face cache as ``huggingface_hub`` lays it out:
    ``models--ORG--NAME/blobs/<sha256>``, ``snapshots/<commit>/<file>`` (links to the blobs)
    and ``refs/<ref>`` holding the commit. Returns the snapshot folder."""
    import hashlib
    import os
    import shutil
    from pathlib import Path

    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    if commit is None:  # deterministic: a hash of the contents, 40 hex digits like git's
        h = hashlib.sha1()
        for p in files:
            h.update(p.name.encode() + p.read_bytes())
        commit = h.hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for p in files:
        blob = repo / "blobs" / hashlib.sha256(p.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(p, blob)
        link = snap / p.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snap), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


def without_verified_query_hooks(monkeypatch) -> None:
    """Make the hook-meaning probe report no verified unrotated q/k (``query_qk=None``), as
    on a model whose ``hook_q``/``hook_k`` do not fire: features that need them must refuse."""
    import dataclasses

    from posinterp.models import backend

    real = backend.hook_meaning

    def no_query(m, layer):
        return dataclasses.replace(real(m, layer), query_qk=None, found="hook_q does not fire")

    patch_backend(monkeypatch, "hook_meaning", no_query)


def patch_backend(monkeypatch, name: str, value) -> None:
    """Replace ``posinterp.models.backend.<name>`` for the test: on the package and in each of
    its modules that holds the name (they call one another by their own globals)."""
    import sys

    from posinterp.models import backend

    monkeypatch.setattr(backend, name, value)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith(backend.__name__ + ".") and name in vars(mod):
            monkeypatch.setattr(mod, name, value)


def future_warnings_of(call) -> list[str]:
    """The FutureWarnings ``call()`` emits, each time (past pytest's ``ignore::FutureWarning``
    and Python's once-per-location default)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
