"""The four synthetic position tasks of Zuo et al. (arXiv 2501.00073), as read in docs/concepts.md.

The paper's exact strings are not public; these formats are our reading:

========  ============================  ===========================================
task      input -> answer               lengths
========  ============================  ===========================================
addition  ``123+456=`` -> ``579``        operands of 1-4 digits without leading zeros,
                                         input <= 9 characters
reversal  ``rev(1234)=`` -> ``4321``     1-16 digits (``max_digits``)
indexing  ``wherex(134504392,4)=`` -> ``2``  1-9 digits, the queried digit occurs;
                                         answer = 0-based first occurrence
ordering  ``ord(31725,73125)=`` -> ``20134``  2-5 distinct digits; for each element of
                                         the reordered string, its index in the original
========  ============================  ===========================================

A sample is ``<bos> input answer <eos>``. The loss and exact-match accuracy use the
answer tokens and the EOS only.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .._validate import derive
from .tokenizer import CHAR_VOCAB, CharVocab

__all__ = ["TASKS", "TaskConfig", "TaskData", "TaskSplit", "make_task_data", "task_answer"]

Sampler = Callable[[random.Random, "TaskConfig"], str]


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _number(rng: random.Random, n: int) -> str:
    """An n-digit number without a leading zero ("0" itself is allowed for n = 1)."""
    if n == 1:
        return rng.choice("0123456789")
    return rng.choice("123456789") + _digits(rng, n - 1)


def _sample_addition(rng: random.Random, cfg: TaskConfig) -> str:
    hi = min(cfg.max_digits, 4)
    # "a+b=" has len(a) + len(b) + 2 characters; the input is at most 9 characters.
    pairs = [(a, b) for a in range(cfg.min_digits, hi + 1) for b in range(cfg.min_digits, hi + 1)
             if a + b + 2 <= 9]
    la, lb = rng.choice(pairs)
    return f"{_number(rng, la)}+{_number(rng, lb)}="


def _answer_addition(inp: str) -> str:
    a, b = inp[:-1].split("+")
    return str(int(a) + int(b))


def _sample_reversal(rng: random.Random, cfg: TaskConfig) -> str:
    return f"rev({_digits(rng, rng.randint(cfg.min_digits, cfg.max_digits))})="


def _answer_reversal(inp: str) -> str:
    return inp[4:-2][::-1]


def _sample_indexing(rng: random.Random, cfg: TaskConfig) -> str:
    s = _digits(rng, rng.randint(cfg.min_digits, min(cfg.max_digits, 9)))
    return f"wherex({s},{rng.choice(s)})="


def _answer_indexing(inp: str) -> str:
    s, q = inp[7:-2].split(",")
    return str(s.index(q))


def _sample_ordering(rng: random.Random, cfg: TaskConfig) -> str:
    n = rng.randint(max(cfg.min_digits, 2), min(cfg.max_digits, 5))
    original = rng.sample("0123456789", n)
    reordered = rng.sample(original, n)
    return f"ord({''.join(original)},{''.join(reordered)})="


def _answer_ordering(inp: str) -> str:
    original, reordered = inp[4:-2].split(",")
    return "".join(str(original.index(c)) for c in reordered)


@dataclass(frozen=True)
class _TaskSpec:
    sample: Sampler
    answer: Callable[[str], str]
    digit_range: tuple[int, int]  # the allowed (min_digits, max_digits)
    default_digits: tuple[int, int]


TASKS: dict[str, _TaskSpec] = {
    "addition": _TaskSpec(_sample_addition, _answer_addition, (1, 4), (1, 4)),
    "reversal": _TaskSpec(_sample_reversal, _answer_reversal, (1, 16), (1, 16)),
    "indexing": _TaskSpec(_sample_indexing, _answer_indexing, (1, 9), (1, 9)),
    "ordering": _TaskSpec(_sample_ordering, _answer_ordering, (2, 5), (2, 5)),
}


def _check_task(name: str) -> _TaskSpec:
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]


def task_answer(task: str, inp: str) -> str:
    """The answer string for input ``inp`` of ``task`` (docs/concepts.md).

    Raises:
        ValueError: if ``task`` is unknown.
    """
    return _check_task(task).answer(inp)


@dataclass(frozen=True)
class TaskConfig:
    """Which task, which lengths, how many samples and which seed.

    ``min_digits``/``max_digits`` default to the task's full range (docs/concepts.md): operand
    digits for addition, string digits otherwise. Train and test sets are disjoint sets
    of distinct inputs.
    """

    task: str = "reversal"
    min_digits: int | None = None
    max_digits: int | None = None
    n_train: int = 20_000
    n_test: int = 20_000
    seed: int = 0

    def __post_init__(self) -> None:
        spec = _check_task(self.task)
        lo, hi = spec.digit_range
        # follow the task through dataclasses.replace unless set (posinterp._validate.Derived)
        derive(self, "min_digits", lambda: spec.default_digits[0])
        derive(self, "max_digits", lambda: spec.default_digits[1])
        if not lo <= self.min_digits <= self.max_digits <= hi:
            raise ValueError(
                f"for task {self.task!r}, need {lo} <= min_digits <= max_digits <= {hi}, "
                f"got min_digits={self.min_digits}, max_digits={self.max_digits}"
            )
        for name in ("n_train", "n_test"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TaskConfig:
        return cls(**d)


@dataclass(frozen=True)
class TaskSplit:
    """Encoded samples of one split, right-padded.

    Attributes:
        inputs: the input strings.
        answers: the answer strings.
        tokens: ``[n, seq]`` int64 ids, ``<bos> input answer <eos> <pad>...``.
        attention_mask: ``[n, seq]`` 1 on real tokens, 0 on padding.
        answer_mask: ``[n, seq]`` 1 on answer tokens and the EOS (the loss targets).
    """

    inputs: list[str]
    answers: list[str]
    tokens: torch.Tensor
    attention_mask: torch.Tensor
    answer_mask: torch.Tensor

    def __len__(self) -> int:
        return len(self.inputs)


@dataclass(frozen=True)
class TaskData:
    config: TaskConfig
    train: TaskSplit
    test: TaskSplit
    vocab: CharVocab = field(default=CHAR_VOCAB)

    @property
    def max_len(self) -> int:
        return max(self.train.tokens.shape[1], self.test.tokens.shape[1])


def _encode(inputs: list[str], answers: list[str], vocab: CharVocab) -> TaskSplit:
    seqs = [[vocab.bos_id, *vocab.encode(i), *vocab.encode(a), vocab.eos_id]
            for i, a in zip(inputs, answers, strict=True)]
    length = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), length), vocab.pad_id, dtype=torch.long)
    attn = torch.zeros_like(tokens)
    ans = torch.zeros_like(tokens)
    for r, (s, inp) in enumerate(zip(seqs, inputs, strict=True)):
        tokens[r, : len(s)] = torch.tensor(s)
        attn[r, : len(s)] = 1
        ans[r, 1 + len(inp): len(s)] = 1
    return TaskSplit(inputs, answers, tokens, attn, ans)


def make_task_data(config: TaskConfig, vocab: CharVocab = CHAR_VOCAB,
                   max_tries_factor: int = 50) -> TaskData:
    """Sample ``n_train + n_test`` distinct inputs, deterministically from ``config.seed``.

    Each input is drawn by first choosing a length uniformly, then its characters, and
    repeats are redrawn; short lengths therefore saturate at their (small) number of
    distinct strings while long lengths stay uniform.

    Returns:
        TaskData with disjoint ``train`` and ``test`` splits.

    Raises:
        ValueError: if the configured lengths do not hold enough distinct inputs (e.g.
            reversal needs a range of at least 5 digits for 40,000 samples).
    """
    spec = _check_task(config.task)
    rng = random.Random(f"posinterp-task-{config.task}-{config.seed}")
    need = config.n_train + config.n_test
    seen: dict[str, None] = {}
    tries = 0
    while len(seen) < need:
        tries += 1
        if tries > max_tries_factor * need:
            raise ValueError(
                f"task {config.task!r} with digits {config.min_digits}..{config.max_digits} "
                f"yielded only {len(seen)} distinct inputs in {tries - 1} draws; "
                f"n_train + n_test = {need} needs a wider digit range or fewer samples"
            )
        seen.setdefault(spec.sample(rng, config), None)
    inputs = list(seen)
    answers = [spec.answer(i) for i in inputs]
    n = config.n_train
    return TaskData(
        config,
        _encode(inputs[:n], answers[:n], vocab),
        _encode(inputs[n:], answers[n:], vocab),
        vocab,
    )
