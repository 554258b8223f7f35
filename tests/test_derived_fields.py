"""Derived config fields follow the fields they derive from (DESIGN.md §6, "Configs with
derived fields"), through ``preset`` overrides and ``dataclasses.replace``, unless set."""

import dataclasses
import json
import pickle

import pytest

from posinterp.experiments.demo import DemoConfig
from posinterp.models import ToyModelConfig, preset
from posinterp.tasks import TaskConfig
from posinterp.tasks.tokenizer import BYTE_VOCAB_SIZE


@pytest.mark.parametrize("name", ["paper", "small", "tiny"])
@pytest.mark.parametrize("width", [96, 384, 768])
def test_preset_width_override_rederives_head_and_mlp(name, width):
    cfg = preset(name, d_model=width)
    assert cfg.d_head == width // cfg.n_heads
    assert cfg.d_mlp == 4 * width
    # and the built architecture is the one the config names
    assert cfg == ToyModelConfig(**{**cfg.to_dict()})


def test_replace_rederives_and_keeps_what_the_caller_set():
    base = ToyModelConfig(d_model=192, n_heads=6)
    assert (base.d_head, base.d_mlp) == (32, 768)
    wider = dataclasses.replace(base, d_model=384)
    assert (wider.d_head, wider.d_mlp) == (64, 1536)
    more_heads = dataclasses.replace(wider, n_heads=12)
    assert more_heads.d_head == 32
    # set by the caller: kept through later replaces
    fixed = ToyModelConfig(d_model=192, n_heads=6, d_head=16, d_mlp=100)
    moved = dataclasses.replace(fixed, d_model=384)
    assert (moved.d_head, moved.d_mlp) == (16, 100)
    # an explicit value equal to the derived one is still the caller's
    same = dataclasses.replace(ToyModelConfig(d_model=192, n_heads=6, d_head=32), d_model=384)
    assert same.d_head == 32


def test_vocab_follows_the_tokenizer():
    cfg = dataclasses.replace(preset("tiny"), tokenizer="byte")
    assert cfg.d_vocab == BYTE_VOCAB_SIZE


def test_non_divisible_width_after_replace_names_the_fields():
    with pytest.raises(ValueError, match="d_model=100 is not divisible by n_heads=6"):
        preset("small", d_model=100)


def test_derived_values_are_plain_ints_outside():
    cfg = preset("small", d_model=384)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["d_head"] == 64 and d["d_mlp"] == 1536
    assert repr(cfg).count("d_head=64") == 1
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and dataclasses.replace(again, d_model=192).d_head == 32
    assert ToyModelConfig.from_dict(d) == cfg


def test_task_digit_range_follows_the_task():
    rev = TaskConfig(task="reversal")
    add = dataclasses.replace(rev, task="addition")
    assert (add.min_digits, add.max_digits) == (TaskConfig(task="addition").min_digits,
                                                TaskConfig(task="addition").max_digits)
    kept = dataclasses.replace(TaskConfig(task="reversal", min_digits=6, max_digits=6), seed=3)
    assert (kept.min_digits, kept.max_digits) == (6, 6)


def test_demo_settings_follow_quick():
    quick = DemoConfig(quick=True)
    full = dataclasses.replace(quick, quick=False)
    assert (full.digits, full.max_steps, full.n_test) == (8, 3000, None)
    back = dataclasses.replace(full, quick=True)
    assert (back.digits, back.max_steps, back.n_test) == (6, 600, 5000)
    assert dataclasses.replace(DemoConfig(quick=True, digits=7), quick=False).digits == 7


def test_a_value_derived_elsewhere_is_the_callers_choice():
    """A derived value passed to another config (or another field) is an explicit value
    there: TaskConfig(min_digits=demo.digits) keeps the demo's length."""
    demo = DemoConfig(quick=True)
    task = TaskConfig("reversal", min_digits=demo.digits, max_digits=demo.digits)
    assert (task.min_digits, task.max_digits) == (6, 6)
    assert dataclasses.replace(task, seed=1).min_digits == 6
    cfg = ToyModelConfig(d_model=192, n_heads=6, d_mlp=preset("small").d_head)  # another field
    assert dataclasses.replace(cfg, d_model=384).d_mlp == 32
