"""Text to a padded token batch, as ``posinterp inspect --text`` tokenizes it.

One function, :func:`tokenize_texts`, shared by the command line and Python, so the same
texts give the same tokens, mask and scores in both (issue 39, item 6). TransformerLens
replaces a loaded model's tokenizer with a copy that always prepends a BOS
(``get_tokenizer_with_bos``), so ``model.tokenizer(texts)`` can give one token more
than the checkpoint's own tokenizer, and every position after it moves.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["tokenize_texts"]


def tokenize_texts(model, texts, *, max_len: int | None = None, padding_side: str = "right"):
    """Tokenize ``texts`` with the checkpoint's own tokenizer, one sequence per text.

    This is what ``posinterp inspect --text`` does with each paragraph, so the CLI and a
    notebook see the same tokens.

    **BOS and other special tokens** are exactly those the checkpoint's tokenizer adds by
    default (e.g. Llama's ``<s>`` first; nothing for GPT-2 or SmolLM2). TransformerLens's
    BOS-forcing copy of the tokenizer (``model.tokenizer`` on a loaded model) is not
    used: where the tokenizer came from a local folder (every HF, GGUF and hub load of
    :func:`posinterp.load_model`) it is loaded from that folder again, offline; a
    tokenizer built in code (posinterp's character and byte vocabularies) is used as it
    is. To have a BOS where the tokenizer adds none, put ``tokenizer.bos_token`` at the
    start of each text.

    Args:
        model: a TransformerLens model (``HookedTransformer`` or ``TransformerBridge``)
            with a tokenizer.
        texts: a list of strings (one sequence each), or one string (a batch of one).
        max_len: texts longer than this many tokens are cut to it (default the model's
            ``n_ctx``, as ``model.to_tokens`` truncates).
        padding_side: ``"right"`` (default; the CLI's) or ``"left"``. Every posinterp
            function takes either, given the mask.

    Returns:
        ``(tokens, attention_mask)``: ``tokens`` int64 ``[batch, pos]`` with ``pos`` the
        longest text's token count; ``attention_mask`` int64 ``[batch, pos]``, the
        tokenizer's own (1 = real token, 0 = padding; pads use the tokenizer's
        ``pad_token_id``, else 0). Pass the mask to every posinterp call and to
        ``run_with_cache``.

    Raises:
        ValueError: the model has no tokenizer; ``texts`` is empty, holds something other
            than strings, or a text gives no token; ``max_len`` < 1; ``padding_side``
            not ``"right"``/``"left"``.
    """
    if not isinstance(padding_side, str) or padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    ids, masks, _, tok = _encode_texts(model, texts, max_len)
    empty = [i for i, m in enumerate(masks) if not sum(m)]
    if empty:
        raise ValueError(f"texts[{empty[0]}] gives no token (an empty text?); every text must "
                         "give at least one token")
    return _pad_batch(tok, ids, masks, padding_side)


def _encode_texts(model, texts, max_len: int | None = None):
    """The token ids of each text (not padded): ``(ids, masks, cut, tokenizer)``.

    ``ids`` and ``masks`` are lists of int lists, ``cut`` the indices of texts cut to
    ``max_len``, ``tokenizer`` the one used (see :func:`tokenize_texts`, which raises
    the same errors, except that a text may give no token here).
    """
    if isinstance(texts, str):
        texts = [texts]
    if isinstance(texts, (bytes, bytearray)) or not hasattr(texts, "__iter__"):
        raise ValueError(f"texts must be a list of strings (or one string), got "
                         f"{type(texts).__name__}")
    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty; give at least one string")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise ValueError(f"texts must hold strings; texts[{bad[0]}] is "
                         f"{type(texts[bad[0]]).__name__}")
    tok = _own_tokenizer(getattr(model, "tokenizer", None))
    if tok is None:
        raise ValueError("this model has no tokenizer, so text cannot be tokenized; give token "
                         "ids instead (e.g. posinterp.random_tokens, or --tokens N on the CLI)")
    max_len = model.cfg.n_ctx if max_len is None else max_len
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be an integer >= 1 (or None for n_ctx), got {max_len!r}")
    ids, masks, cut = [], [], []
    for n, text in enumerate(texts):
        enc = tok(text)
        i = list(enc["input_ids"])
        m = list(enc.get("attention_mask", [1] * len(i)))
        if len(i) > max_len:
            cut.append(n)
            i, m = i[:max_len], m[:max_len]
        ids.append(i)
        masks.append(m)
    return ids, masks, cut, tok


def _pad_batch(tok, ids: list[list[int]], masks: list[list[int]], padding_side: str = "right"):
    """Pad token-id lists into ``(tokens [batch, pos], attention_mask [batch, pos])``
    (int64), with the tokenizer's pad id (else 0) and mask 0 on pads."""
    import torch

    pad = getattr(tok, "pad_token_id", None)
    pad = 0 if pad is None else pad
    n = max(len(i) for i in ids)
    rows = [(i + [pad] * (n - len(i)), m + [0] * (n - len(m))) if padding_side == "right"
            else ([pad] * (n - len(i)) + i, [0] * (n - len(m)) + m) for i, m in zip(ids, masks, strict=True)]
    tokens = torch.tensor([r[0] for r in rows], dtype=torch.long)
    mask = torch.tensor([r[1] for r in rows], dtype=torch.long)
    return tokens, mask


def _own_tokenizer(tok):
    """The checkpoint folder's tokenizer with its own defaults.

    TransformerLens replaces a model's tokenizer with one rebuilt with
    ``add_bos_token=True`` (``get_tokenizer_with_bos``), so ``model.tokenizer`` may
    prepend a BOS the folder's tokenizer does not add. Where the tokenizer came from a
    local folder, it is loaded from there again, offline; otherwise (tokenizers built in
    code, such as posinterp's byte and character vocabularies) it is used as it is.
    """
    if tok is None:
        return None
    folder = Path(str(getattr(tok, "name_or_path", "") or ""))
    if str(folder) not in ("", ".") and folder.is_dir():
        import transformers

        try:
            return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError):
            return tok
    return tok
