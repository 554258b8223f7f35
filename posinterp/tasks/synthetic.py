"""The four synthetic position tasks of Zuo et al. (arXiv 2501.00073), as read in docs/concepts.md.

The paper's exact strings are not public; these formats are our reading. Each task has a
default format (first below) and may have others (``TaskConfig.format``):

========  ==============  ==================================  ===============================
task      format          input -> answer                     lengths
========  ==============  ==================================  ===============================
addition  infix           ``123+456=`` -> ``579``              operands of 1-4 digits without
                                                              leading zeros, input <= 9 chars
reversal  rev             ``rev(1234)=`` -> ``4321``           1-16 digits (``max_digits``)
indexing  string_first    ``wherex(134504392,4)=`` -> ``2``    1-9 digits, the queried digit
          query_first     ``4,134504392=`` -> ``2``            occurs; answer = 0-based first
                                                              occurrence
ordering  original_first  ``ord(31725,73125)=`` -> ``20134``   2-5 distinct digits; for each
          reordered_first ``73125,31725=`` -> ``20134``        element of the reordered string,
                                                              its index in the original
========  ==============  ==================================  ===============================

Every format of a task draws the same random choices in the same order, so one seed gives
the same strings (and answers) in each format, only laid out differently. The query-first
layouts exist because the 4-layer NoPE model of ``posinterp reproduce zuo2024 --quick``
does not learn the default indexing layout in 4,000 steps and learns the query-first one
in about 2,000 (benchmarks/zuo_task_formats.py).

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


def _draw_indexing(rng: random.Random, cfg: TaskConfig) -> tuple[str, str]:
    """(string, queried digit)."""
    s = _digits(rng, rng.randint(cfg.min_digits, min(cfg.max_digits, 9)))
    return s, rng.choice(s)


def _answer_indexing(s: str, q: str) -> str:
    return str(s.index(q))


def _draw_ordering(rng: random.Random, cfg: TaskConfig) -> tuple[str, str]:
    """(original, reordered)."""
    n = rng.randint(max(cfg.min_digits, 2), min(cfg.max_digits, 5))
    original = rng.sample("0123456789", n)
    return "".join(original), "".join(rng.sample(original, n))


def _answer_ordering(original: str, reordered: str) -> str:
    return "".join(str(original.index(c)) for c in reordered)


@dataclass(frozen=True)
class _Format:
    sample: Sampler
    answer: Callable[[str], str]


@dataclass(frozen=True)
class _TaskSpec:
    formats: dict[str, _Format]  # the first is the default
    digit_range: tuple[int, int]  # the allowed (min_digits, max_digits)
    default_digits: tuple[int, int]

    @property
    def default_format(self) -> str:
        return next(iter(self.formats))


TASKS: dict[str, _TaskSpec] = {
    "addition": _TaskSpec({"infix": _Format(_sample_addition, _answer_addition)}, (1, 4), (1, 4)),
    "reversal": _TaskSpec({"rev": _Format(_sample_reversal, _answer_reversal)}, (1, 16), (1, 16)),
    "indexing": _TaskSpec({
        "string_first": _Format(lambda rng, c: "wherex({},{})=".format(*_draw_indexing(rng, c)),
                                lambda inp: _answer_indexing(*inp[7:-2].split(","))),
        "query_first": _Format(
            lambda rng, c: "{1},{0}=".format(*_draw_indexing(rng, c)),
            lambda inp: _answer_indexing(*reversed(inp[:-1].split(",")))),
    }, (1, 9), (1, 9)),
    "ordering": _TaskSpec({
        "original_first": _Format(lambda rng, c: "ord({},{})=".format(*_draw_ordering(rng, c)),
                                  lambda inp: _answer_ordering(*inp[4:-2].split(","))),
        "reordered_first": _Format(
            lambda rng, c: "{1},{0}=".format(*_draw_ordering(rng, c)),
            lambda inp: _answer_ordering(*reversed(inp[:-1].split(",")))),
    }, (2, 5), (2, 5)),
}


def _check_task(name: str) -> _TaskSpec:
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]


def _check_format(task: str, spec: _TaskSpec, fmt: str | None) -> _Format:
    fmt = spec.default_format if fmt is None else fmt
    if fmt not in spec.formats:
        raise ValueError(f"format for task {task!r} must be one of {list(spec.formats)}, "
                         f"got {fmt!r}")
    return spec.formats[fmt]


def task_answer(task: str, inp: str, format: str | None = None) -> str:
    """The answer string for input ``inp`` of ``task`` in ``format`` (None: the task's
    default; the formats are in this module's docstring and docs/concepts.md).

    Raises:
        ValueError: if ``task`` or ``format`` is unknown.
    """
    spec = _check_task(task)
    return _check_format(task, spec, format).answer(inp)


@dataclass(frozen=True)
class TaskConfig:
    """Which task, which lengths, how many samples and which seed.

    ``min_digits``/``max_digits`` default to the task's full range (docs/concepts.md): operand
    digits for addition, string digits otherwise. ``format`` is the input layout (this
    module's table: ``string_first`` or ``query_first`` for indexing, ``original_first`` or
    ``reordered_first`` for ordering); it defaults to the task's first. Train and test sets
    are disjoint sets of distinct inputs.

    Raises:
        ValueError: for an unknown task or format, digits outside the task's range, or
            fewer than one sample.
    """

    task: str = "reversal"
    min_digits: int | None = None
    max_digits: int | None = None
    n_train: int = 20_000
    n_test: int = 20_000
    seed: int = 0
    format: str | None = None

    def __post_init__(self) -> None:
        spec = _check_task(self.task)
        lo, hi = spec.digit_range
        # follow the task through dataclasses.replace unless set (posinterp._validate.Derived)
        derive(self, "min_digits", lambda: spec.default_digits[0])
        derive(self, "max_digits", lambda: spec.default_digits[1])
        derive(self, "format", lambda: spec.default_format)
        _check_format(self.task, spec, self.format)
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

    def key_dict(self) -> dict:
        """:meth:`to_dict` without ``format`` where it is the task's default: the settings as
        they were keyed before tasks had formats, so results keyed then stay valid (their
        one layout was the default)."""
        d = self.to_dict()
        if self.format == _check_task(self.task).default_format:
            del d["format"]
        return d

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
    fmt = _check_format(config.task, _check_task(config.task), config.format)
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
        seen.setdefault(fmt.sample(rng, config), None)
    inputs = list(seen)
    answers = [fmt.answer(i) for i in inputs]
    n = config.n_train
    return TaskData(
        config,
        _encode(inputs[:n], answers[:n], vocab),
        _encode(inputs[n:], answers[n:], vocab),
        vocab,
    )
