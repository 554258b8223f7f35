"""A character-level vocabulary for the synthetic tasks, wrapped as a Hugging Face tokenizer.

TransformerLens users expect ``model.to_tokens`` and ``model.to_str_tokens``; both need a
``PreTrainedTokenizerFast``. We build one locally from the vocabulary below, so nothing is
ever fetched from the hub.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["CharVocab", "CHAR_VOCAB", "BYTE_VOCAB_SIZE", "build_byte_tokenizer", "build_tokenizer"]

BYTE_VOCAB_SIZE = 256

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
# Every character any task string can contain (docs/concepts.md).
TASK_CHARS = "0123456789+=(),revwhxod"


@dataclass(frozen=True)
class CharVocab:
    """Token ids for the task alphabet: specials first (pad 0, bos 1, eos 2, unk 3)."""

    chars: str = TASK_CHARS
    specials: tuple[str, ...] = SPECIALS
    stoi: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens = list(self.specials) + list(self.chars)
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"chars must be distinct and not specials, got {self.chars!r}")
        object.__setattr__(self, "stoi", {t: i for i, t in enumerate(tokens)})

    @property
    def size(self) -> int:
        """Number of token ids (``d_vocab``)."""
        return len(self.stoi)

    @property
    def pad_id(self) -> int:
        return self.stoi[PAD]

    @property
    def bos_id(self) -> int:
        return self.stoi[BOS]

    @property
    def eos_id(self) -> int:
        return self.stoi[EOS]

    @property
    def itos(self) -> list[str]:
        return list(self.stoi)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text`` (no BOS/EOS added).

        Raises:
            ValueError: if ``text`` holds a character outside the vocabulary.
        """
        try:
            return [self.stoi[c] for c in text]
        except KeyError as err:
            raise ValueError(
                f"text contains {err.args[0]!r}, which is not in the vocabulary {self.chars!r}"
            ) from None

    def decode(self, ids: list[int] | torch.Tensor, skip_special: bool = True) -> str:
        """The string of ``ids``; specials are dropped unless ``skip_special`` is False."""
        itos = self.itos
        out = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            tok = itos[int(i)]
            if skip_special and tok in self.specials:
                continue
            out.append(tok)
        return "".join(out)


CHAR_VOCAB = CharVocab()


def build_tokenizer(vocab: CharVocab = CHAR_VOCAB):
    """A ``PreTrainedTokenizerFast`` over ``vocab`` that prepends BOS, built offline.

    ``init_kwargs`` carry ``add_bos_token=True`` and a local ``name_or_path`` so that
    TransformerLens 3.9's ``set_tokenizer`` uses it as is instead of re-loading it from
    the hub by name.

    Returns:
        transformers.PreTrainedTokenizerFast with pad/bos/eos/unk set.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=dict(vocab.stoi), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab.bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        name_or_path="posinterp-char",
        add_bos_token=True,
        padding_side="right",
    )


def build_byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` whose token id is the UTF-8 byte value (``d_vocab`` 256).

    Byte-level like GPT-2's alphabet but without merges, built offline. It has no BOS
    (the zoo trains on windows of a byte stream); ``decode`` inverts ``encode`` exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_char = _gpt2_bytes_to_unicode()
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(BYTE_VOCAB_SIZE)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, name_or_path="posinterp-bytes")


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (Radford et al. 2019, encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))
