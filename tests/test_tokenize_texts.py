"""``posinterp.tokenize_texts`` is the CLI's tokenization (issue 39, item 6): the same
texts give the same tokens and mask through ``posinterp inspect --text`` and through
Python, and both are the checkpoint folder's own tokenizer with its defaults (HF's
``AutoTokenizer`` read from the folder: an independent reference), not TransformerLens's
BOS-forcing copy."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch
import transformers

import posinterp as pi
from posinterp.cli import main
from tests.helpers import tiny_hf_configs
from tests.test_inspect_text import _tokenizer

ROOT = Path(__file__).resolve().parents[1]
PARAGRAPHS = ["the cat sat on a mat", "the dog ran far and the cat sat", "a dog ran"]


class _Captured(Exception):
    pass


@pytest.fixture(scope="module", params=[False, True], ids=["no-bos", "bos-first"])
def folder(request, tmp_path_factory):
    """A tiny GPT-2 with a word-level tokenizer: GPT-2's convention (no BOS added) or a
    Llama-like one whose post-processor puts <s> first."""
    path = tmp_path_factory.mktemp("gpt2-absolute")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_hf_configs()["gpt2-absolute"]).save_pretrained(path)
    _tokenizer(request.param).save_pretrained(path)
    return path


def _cli_batch(folder, tmp_path, monkeypatch):
    """The tokens and mask ``posinterp inspect --text`` hands to the inspection."""
    import posinterp.dashboard.inspect as inspect_mod

    seen = {}

    def capture(model, tokens, mask, **kwargs):
        seen.update(tokens=tokens, mask=mask)
        raise _Captured

    monkeypatch.setattr(inspect_mod, "inspect_heads", capture)
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(PARAGRAPHS) + "\n", encoding="utf-8")
    with pytest.raises(_Captured):
        main(["inspect", str(folder), "--text", str(text), "--out", str(tmp_path / "out"),
              "--no-progress"])
    return seen["tokens"], seen["mask"]


def test_cli_and_python_give_the_same_tokens_and_mask(folder, tmp_path, monkeypatch):
    cli_tokens, cli_mask = _cli_batch(folder, tmp_path, monkeypatch)
    model, _ = pi.load_model(folder, device="cpu")
    tokens, mask = pi.tokenize_texts(model, PARAGRAPHS)
    assert torch.equal(tokens, cli_tokens) and torch.equal(mask, cli_mask)
    assert tokens.dtype == mask.dtype == torch.long and tokens.shape == mask.shape
    # both are the folder's own tokenizer with its defaults, right-padded
    own = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    want = own(PARAGRAPHS, padding=True, padding_side="right", return_tensors="pt")
    assert torch.equal(tokens, want["input_ids"]) and torch.equal(mask, want["attention_mask"])
    # left padding: the same real tokens, right-aligned
    left, left_mask = pi.tokenize_texts(model, PARAGRAPHS, padding_side="left")
    for row in range(len(PARAGRAPHS)):
        assert left[row][left_mask[row].bool()].tolist() == tokens[row][mask[row].bool()].tolist()
        assert left_mask[row].tolist() == sorted(mask[row].tolist())  # pads first
    # one string is a batch of one; max_len cuts
    one, one_mask = pi.tokenize_texts(model, PARAGRAPHS[1], max_len=3)
    assert one.tolist() == [want["input_ids"][1][:3].tolist()] and one_mask.tolist() == [[1, 1, 1]]


def test_errors_name_the_argument(folder):
    model, _ = pi.load_model(folder, device="cpu")
    for bad, said in (([], "texts is empty"), ([PARAGRAPHS[0], 3], r"texts\[1\] is int"),
                      (b"the cat", "list of strings")):
        with pytest.raises(ValueError, match=said):
            pi.tokenize_texts(model, bad)
    with pytest.raises(ValueError, match="padding_side must be 'right' or 'left'"):
        pi.tokenize_texts(model, PARAGRAPHS, padding_side="middle")
    with pytest.raises(ValueError, match="max_len must be an integer >= 1"):
        pi.tokenize_texts(model, PARAGRAPHS, max_len=0)
    no_tokenizer = types.SimpleNamespace(tokenizer=None, cfg=model.cfg)
    with pytest.raises(ValueError, match="this model has no tokenizer"):
        pi.tokenize_texts(no_tokenizer, PARAGRAPHS)


def test_the_docs_recipes_tokenize_with_it():
    """The getting-started recipe gave one token more than the CLI on a GGUF model
    (TransformerLens's forced BOS): every docs recipe that turns text into tokens uses
    ``pi.tokenize_texts``, none calls ``model.tokenizer(...)`` itself."""
    pages = [ROOT / "docs" / "getting-started.md", ROOT / "docs" / "inspect.md",
             ROOT / "docs" / "models.md", ROOT / "demos" / "real_model.py"]
    own_call = re.compile(r"model\.tokenizer\(")
    assert [str(p.relative_to(ROOT)) for p in pages if own_call.search(p.read_text())] == []
    assert "pi.tokenize_texts(model, texts)" in (ROOT / "docs" / "getting-started.md").read_text()
