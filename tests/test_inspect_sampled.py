"""`posinterp inspect --input sampled`: the model's own seeded samples from its BOS."""

import json
from types import SimpleNamespace

import pandas as pd
import pytest

from posinterp.cli import main
from posinterp.experiments.inspect import _bos_id, run_inspect


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.helpers import tiny_rotary_checkpoint

    return tiny_rotary_checkpoint(tmp_path_factory.mktemp("sampled"))


def test_sampled_input_is_recorded_and_reproducible(checkpoint, tmp_path):
    a = run_inspect(str(checkpoint), tmp_path / "a", input_kind="sampled", n_tokens=10, batch=3,
                    seed=4, progress=False)
    b = run_inspect(str(checkpoint), tmp_path / "b", input_kind="sampled", n_tokens=10, batch=3,
                    seed=4, progress=False)
    meta = json.loads((tmp_path / "a" / "run.json").read_text())
    assert meta["input"].startswith("3 samples of 10 tokens from the model itself")
    pd.testing.assert_frame_equal(a.table, b.table)  # same seed, same samples, same table
    random = run_inspect(str(checkpoint), tmp_path / "c", n_tokens=10, batch=3, seed=4, progress=False)
    assert not a.table.value.equals(random.table.value)


def test_sampled_and_text_are_exclusive_and_bad_kinds_named(checkpoint, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("rev(123)=321\n")
    with pytest.raises(ValueError, match="--input sampled and --text"):
        run_inspect(str(checkpoint), tmp_path / "o", text=text, input_kind="sampled", progress=False)
    with pytest.raises(ValueError, match="--input must be 'random' or 'sampled'"):
        run_inspect(str(checkpoint), tmp_path / "o", input_kind="natural", progress=False)
    assert main(["inspect", str(checkpoint), "--input", "sampled", "--text", str(text),
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert not (tmp_path / "o").exists()


def test_bos_id_comes_from_the_tokenizer_or_the_loader():
    from posinterp.models.backend.surface import BOS_ATTRIBUTE

    tok = SimpleNamespace(bos_token_id=7)
    assert _bos_id(SimpleNamespace(tokenizer=tok, **{BOS_ATTRIBUTE: 1})) == 7
    assert _bos_id(SimpleNamespace(tokenizer=None, **{BOS_ATTRIBUTE: 1})) == 1
    with pytest.raises(ValueError, match="needs a BOS token id"):
        _bos_id(SimpleNamespace(tokenizer=None))
