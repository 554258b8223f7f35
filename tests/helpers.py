"""Seeded factories for tests: tiny models and task data, built on demand (never at import)."""

from __future__ import annotations

import torch
import transformers

from posinterp.models import build_model, preset
from posinterp.tasks import TaskConfig, make_task_data


def tiny_model(pe: str = "nope", **overrides):
    return build_model(preset("tiny", pe=pe, **overrides))


def tiny_task(task: str = "reversal", n: int = 200, seed: int = 0, **kw):
    return make_task_data(TaskConfig(task, n_train=n, n_test=n, seed=seed, **kw))


def random_tokens(model, batch: int, pos: int, seed: int = 0) -> torch.Tensor:
    """Random non-special token ids (ids >= 4 skip pad/bos/eos/unk)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, model.cfg.d_vocab, (batch, pos), generator=gen)


def gqa_model():
    """A 1-layer rotary model with grouped-query attention: 4 query heads, 2 KV heads."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(n_layers=1, d_model=16, n_heads=4, n_key_value_heads=2,
                                  d_head=4, n_ctx=8, d_vocab=10, act_fn="silu",
                                  normalization_type="RMS", positional_embedding_type="rotary",
                                  rotary_dim=4, seed=0)
    return HookedTransformer(cfg)


HF_VOCAB = 97


def tiny_hf_configs() -> dict:
    """Tiny random HF configs, one per positional family (also used by benchmarks/parity.py)."""
    return {
        # Folder names contain family substrings on purpose: TL 3.9 guesses from the path.
        "gpt2-absolute": transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=32, n_positions=64, n_ctx=64, vocab_size=HF_VOCAB),
        "neox-rotary-pct-0.25": transformers.GPTNeoXConfig(
            num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
            rotary_pct=0.25, max_position_embeddings=64, vocab_size=HF_VOCAB),
        "llama-gqa": transformers.LlamaConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
            intermediate_size=64, max_position_embeddings=64, vocab_size=HF_VOCAB),
        "bloom-12-heads": transformers.BloomConfig(
            n_layer=2, n_head=12, hidden_size=48, vocab_size=HF_VOCAB),
    }
