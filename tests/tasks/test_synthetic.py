import re

import pytest
import torch

from posinterp.tasks import CHAR_VOCAB, TASKS, TaskConfig, build_tokenizer, make_task_data
from tests.helpers import tiny_task


def independent_answer(task, inp):
    """Answers re-derived with regexes and arithmetic, not the package's parsers."""
    if task == "addition":
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", inp).groups()
        assert (a == "0" or a[0] != "0") and (b == "0" or b[0] != "0"), inp
        assert 1 <= len(a) <= 4 and 1 <= len(b) <= 4 and len(inp) <= 9
        return f"{sum(map(int, (a, b)))}"
    if task == "reversal":
        (s,) = re.fullmatch(r"rev\((\d{1,16})\)=", inp).groups()
        return "".join(reversed(s))
    if task == "indexing":
        s, q = re.fullmatch(r"wherex\((\d{1,9}),(\d)\)=", inp).groups()
        assert q in s
        return str(next(i for i, c in enumerate(s) if c == q))
    if task == "ordering":
        a, b = re.fullmatch(r"ord\((\d{2,5}),(\d{2,5})\)=", inp).groups()
        assert len(set(a)) == len(a) and sorted(a) == sorted(b) and len(inp) <= 18
        pos = {c: i for i, c in enumerate(a)}
        return "".join(str(pos[c]) for c in b)
    raise AssertionError(task)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_answers_rederived_independently(task):
    data = tiny_task(task, n=300)
    for split in (data.train, data.test):
        for inp, ans in zip(split.inputs, split.answers, strict=True):
            assert ans == independent_answer(task, inp)


def test_known_examples_from_design_doc():
    assert independent_answer("ordering", "ord(31725,73125)=") == "20134"
    from posinterp.tasks import task_answer
    assert task_answer("ordering", "ord(31725,73125)=") == "20134"
    assert task_answer("indexing", "wherex(134504392,4)=") == "2"
    assert task_answer("addition", "123+456=") == "579"
    assert task_answer("reversal", "rev(1234)=") == "4321"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_default_sizes_disjoint_and_deterministic(task):
    data = make_task_data(TaskConfig(task))
    assert len(data.train) == 20_000 and len(data.test) == 20_000
    assert not set(data.train.inputs) & set(data.test.inputs)
    assert len(set(data.train.inputs)) == 20_000
    again = make_task_data(TaskConfig(task))
    assert again.train.inputs[:50] == data.train.inputs[:50]
    other = make_task_data(TaskConfig(task, seed=1, n_train=50, n_test=50))
    assert other.train.inputs != data.train.inputs[:50]


def test_encoding_and_masks():
    data = tiny_task("reversal", n=50, max_digits=6)
    s = data.train
    tok = build_tokenizer()
    for r in range(10):
        n_real = int(s.attention_mask[r].sum())
        seq = s.tokens[r, :n_real].tolist()
        assert seq == tok(s.inputs[r] + s.answers[r])["input_ids"] + [CHAR_VOCAB.eos_id]
        assert (s.tokens[r, n_real:] == CHAR_VOCAB.pad_id).all()
        ans_pos = s.answer_mask[r].nonzero().flatten().tolist()
        assert CHAR_VOCAB.decode(s.tokens[r, ans_pos]) == s.answers[r]
        assert s.tokens[r, ans_pos[-1]] == CHAR_VOCAB.eos_id and len(ans_pos) == len(s.answers[r]) + 1
    assert s.tokens.dtype == torch.long


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(task="sorting"), "task must be one of"),
        (dict(task="reversal", max_digits=17), "max_digits"),
        (dict(task="ordering", min_digits=1), "min_digits"),
        (dict(task="reversal", n_train=0), "n_train"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskConfig(**kwargs)


def test_too_few_distinct_inputs_is_a_clear_error():
    # 1-4 digit reversal has only 11,110 distinct inputs (docs/concepts.md).
    with pytest.raises(ValueError, match="distinct inputs"):
        make_task_data(TaskConfig("reversal", max_digits=4), max_tries_factor=3)


# The alternative layouts, parsed independently: each regex rebuilds the default input.
_LAYOUTS = {
    ("indexing", "query_first"): (r"(\d),(\d{1,9})=", lambda q, s: f"wherex({s},{q})="),
    ("ordering", "reordered_first"): (r"(\d{2,5}),(\d{2,5})=", lambda r, o: f"ord({o},{r})="),
}


@pytest.mark.parametrize("task, fmt", sorted(_LAYOUTS))
def test_a_layout_holds_the_default_samples_rearranged(task, fmt):
    """Same seed, same random draws: the other layout is the default's samples laid out
    anew, each answered as the default answers its rearrangement."""
    from posinterp.tasks import task_answer

    pattern, as_default = _LAYOUTS[(task, fmt)]
    default = tiny_task(task, n=200)
    other = make_task_data(TaskConfig(task, format=fmt, n_train=200, n_test=200))
    assert other.config.format == fmt and default.config.format == TASKS[task].default_format
    for d_split, o_split in ((default.train, other.train), (default.test, other.test)):
        rebuilt = [as_default(*re.fullmatch(pattern, i).groups()) for i in o_split.inputs]
        assert rebuilt == d_split.inputs
        assert o_split.answers == d_split.answers
        assert [task_answer(task, i, fmt) for i in o_split.inputs] == o_split.answers


def test_known_examples_in_the_other_layouts():
    from posinterp.tasks import task_answer

    assert task_answer("indexing", "4,134504392=", "query_first") == "2"
    assert task_answer("ordering", "73125,31725=", "reordered_first") == "20134"


def test_format_is_checked_derived_and_keyed_as_before():
    import dataclasses

    with pytest.raises(ValueError, match=r"format for task 'indexing' must be one of "
                                         r"\['string_first', 'query_first'\], got 'rev'"):
        TaskConfig("indexing", format="rev")
    # the default follows the task through replace; a format set by hand is kept
    assert dataclasses.replace(TaskConfig("indexing"), task="ordering").format == "original_first"
    with pytest.raises(ValueError, match="format for task 'ordering'"):
        dataclasses.replace(TaskConfig("indexing", format="query_first"), task="ordering")
    # a config from before formats existed reads back as the default layout, and the key
    # of a default-layout config is the key it had then
    old = {k: v for k, v in TaskConfig("indexing").to_dict().items() if k != "format"}
    assert TaskConfig.from_dict(old) == TaskConfig("indexing", format="string_first")
    assert TaskConfig("indexing").key_dict() == old
    assert TaskConfig("indexing", format="query_first").key_dict()["format"] == "query_first"
