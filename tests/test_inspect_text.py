"""inspect --text tokenizes as the checkpoint's own tokenizer does by default (issue 22,
item 14): TransformerLens's copy forces a BOS the folder's tokenizer does not add."""

from __future__ import annotations

import pytest
import tokenizers
import transformers

from posinterp.experiments.inspect import text_batch
from posinterp.models import load_model
from tests.helpers import tiny_hf_configs

WORDS = "the cat sat on a mat and dog ran far".split()
TEXT = "the cat sat on a mat\n\nthe dog ran far and the cat sat"


def _tokenizer(bos_first: bool):
    """Word-level, offline: GPT-2's convention (no BOS by default) or a Llama-like one
    whose post-processor puts <s> first."""
    vocab = {"<|endoftext|>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    if bos_first:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)])
    bos = "<s>" if bos_first else "<|endoftext|>"
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                                eos_token="<|endoftext|>", pad_token="<|endoftext|>")


@pytest.mark.parametrize("bos_first", [False, True])
def test_text_is_tokenized_with_the_folders_defaults(tmp_path, bos_first):
    folder = tmp_path / "gpt2-absolute"
    transformers.AutoModelForCausalLM.from_config(tiny_hf_configs()["gpt2-absolute"]).save_pretrained(folder)
    _tokenizer(bos_first).save_pretrained(folder)
    own = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model, _ = load_model(folder)
    tokens, mask, notes = text_batch(model, TEXT)
    for row, para in zip(range(tokens.shape[0]), TEXT.split("\n\n"), strict=True):
        want = own(para)["input_ids"]  # the folder's tokenizer, its defaults
        assert tokens[row][mask[row].bool()].tolist() == want
    note = [n for n in notes if n.startswith("Special tokens added")]
    assert len(note) == 1
    if bos_first:
        assert "'<s>'" in note[0] and "at the start" in note[0]
    else:
        assert note[0].endswith(": none.")
