"""Every spec, path and range is checked before torch is imported or a cell starts
(issue 22, item 13): one line per bad input, exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posinterp.models import PE_SCHEMES
from posinterp.specs import LLAMA2C_HEADER_BYTES, ZOO_SCHEMES, check_spec, spec_errors

SCRIPT = """
import json, sys
from posinterp.cli import main
rc = main(json.loads(sys.argv[1]))
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}))
"""


def _cli(args, tmp_path):
    env = {**os.environ, "POSINTERP_HOME": str(tmp_path / "home")}  # an empty zoo
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result, out.stderr


def test_a_bad_spec_among_good_ones_is_one_line_before_any_import(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    res, err = _cli(["spectrum", str(good), "/no/such", "zoo:rotary", "zoo:bogus",
                     "--out", str(tmp_path / "out")], tmp_path)
    assert res == {"rc": 2, "torch": False}
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("posinterp: error: ") for line in lines)
    assert "/no/such" in lines[0] and "zoo train" in lines[1] and "zoo:bogus" in lines[2]
    assert not (tmp_path / "out").exists()  # no cell started


def test_inspect_checks_its_spec_and_text_file_first(tmp_path):
    short = tmp_path / "model.bin"
    short.write_bytes(b"\0" * (LLAMA2C_HEADER_BYTES - 1))
    res, err = _cli(["inspect", str(short), "--text", "missing.txt"], tmp_path)
    assert res == {"rc": 2, "torch": False}
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "llama2.c header" in lines[0] and "--text" in lines[1]
    res, err = _cli(["inspect", str(tmp_path / "absent.bin")], tmp_path)
    assert res == {"rc": 2, "torch": False} and "no such folder or file" in err


def test_min_prev_score_range_is_checked_first(tmp_path):
    res, err = _cli(["spectrum", str(tmp_path), "--min-prev-score", "2"], tmp_path)
    assert res == {"rc": 2, "torch": False} and "--min-prev-score" in err


def test_spec_checks_agree_with_the_loaders_vocabulary(tmp_path):
    assert set(ZOO_SCHEMES) == set(PE_SCHEMES)
    assert spec_errors(["gpt2", "all-MiniLM-L6-v2", str(tmp_path)]) == []  # left to the loader
    with pytest.raises(ValueError, match="empty"):
        check_spec("  ")
    with pytest.raises(FileNotFoundError, match="zoo train"):
        check_spec("zoo:nope:3", home=tmp_path)


@pytest.mark.parametrize("spec", ["weights/model.GGUF", "run.SafeTensors", "a/b/c", "./x",
                                  "~/m.pt", "org/name", "gpt2"])
def test_the_cli_and_load_model_read_a_spec_alike(spec, tmp_path, monkeypatch):
    """One spec grammar: a spec the CLI's check takes for a path is a path to load_model too
    (a missing one is a FileNotFoundError there, never a hub lookup), and a hub name for one
    is a hub name for the other (the two once differed: only the CLI knew ``.gguf``)."""
    import posinterp.models.pretrained as pretrained

    monkeypatch.chdir(tmp_path)
    hub_calls = []
    monkeypatch.setattr(pretrained, "_load_hub", lambda name, *a: hub_calls.append(name) or
                        (_ for _ in ()).throw(LookupError("hub")))
    cli_says_path = bool(spec_errors([spec]))  # a path that does not exist is refused
    with pytest.raises((FileNotFoundError, LookupError)) as err:
        pretrained.load_model(spec)
    assert (err.type is FileNotFoundError) == cli_says_path, err.value
    assert (hub_calls == []) == cli_says_path
