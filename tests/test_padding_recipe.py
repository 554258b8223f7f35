"""Issue 11 case 9: a mask built as ``tokens != pad_token_id`` drops BOS wherever the
tokenizer uses one id for BOS and padding (GPT-2, Pythia). The demo and docs take the
tokenizer's own attention mask instead."""

import importlib.util
import re
from pathlib import Path

import tokenizers
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
RECIPE = re.compile(r"(!=|\.ne\()\s*[\w.\[\]\"']*pad(_token)?_id", re.I)


def _demo():
    spec = importlib.util.spec_from_file_location(
        "adjacency_demo", ROOT / "demos" / "adjacency_in_your_workflow.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the demo runs only under __main__
    return module


def gpt2_style_tokenizer():
    """Word-level, built offline, with GPT-2's convention: one id for BOS, EOS and pad."""
    eot = "<|endoftext|>"
    vocab = {eot: 0, **{w: i + 1 for i, w in enumerate("the cat sat on a mat".split())}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=eot))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=eot, eos_token=eot, pad_token=eot)


def test_no_pad_id_mask_recipe_in_docs_demos_or_code():
    files = [*ROOT.glob("docs/**/*.md"), *ROOT.glob("demos/*.py"), *ROOT.glob("posinterp/**/*.py"),
             ROOT / "README.md"]
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in files if f.exists()
            for i, line in enumerate(f.read_text().splitlines(), 1) if RECIPE.search(line)]
    assert hits == []


def test_recipe_is_detected():
    assert RECIPE.search("mask = (tokens != model.tokenizer.pad_token_id).long()")
    assert RECIPE.search("tokens.ne(tok.pad_token_id)")


def test_demo_mask_keeps_bos_when_pad_is_bos():
    tok = gpt2_style_tokenizer()
    assert tok.pad_token_id == tok.bos_token_id
    texts = ["the cat sat on a mat", "a cat sat"]
    tokens, mask = _demo().tokens_and_mask(tok, texts)
    lengths = torch.tensor([7, 4])  # BOS + words
    assert mask.sum(-1).tolist() == lengths.tolist()
    first_real = tokens.shape[1] - lengths  # left padding
    assert (tokens[torch.arange(2), first_real] == tok.bos_token_id).all()
    assert (mask[torch.arange(2), first_real] == 1).all()  # BOS stays in the mask
    # The rejected recipe drops exactly those BOS tokens.
    assert ((tokens != tok.pad_token_id).long().sum(-1) == lengths - 1).all()
