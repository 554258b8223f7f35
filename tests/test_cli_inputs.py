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
    monkeypatch.setitem(pretrained.SOURCES, "hub", pretrained.Source(
        lambda name, *a: hub_calls.append(name) or (_ for _ in ()).throw(LookupError("hub"))))
    cli_says_path = bool(spec_errors([spec]))  # a path that does not exist is refused
    with pytest.raises((FileNotFoundError, LookupError)) as err:
        pretrained.load_model(spec)
    assert (err.type is FileNotFoundError) == cli_says_path, err.value
    assert (hub_calls == []) == cli_says_path


# --- issue 39 item 8: every input check before the model loads -----------------------------

def _gpt2_config_only(folder, n_positions=64):
    """An HF folder as far as the early checks read it: config.json, no weights (a load
    would fail, so a refusal here cannot have come from the loader)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_positions": n_positions}))
    return folder


def _toy_run(folder, n_ctx=40):
    """A demo-like output folder, ``checkpoints/step_*/config.json`` as posinterp.train writes."""
    step = folder / "checkpoints" / "step_0000002"
    step.mkdir(parents=True)
    (step / "config.json").write_text(json.dumps({"model": {"n_ctx": n_ctx, "pe": "nope"},
                                                  "step": 2}))
    return folder


def _llama2c_header(path, seq_len=48):
    import struct

    path.write_bytes(struct.pack("<7i", 16, 32, 1, 2, 2, 32, seq_len))
    return path


def _zoo(tmp_path, n_ctx=32):
    folder = tmp_path / "home" / "zoo" / "rotary-seed0"
    folder.mkdir(parents=True)
    (folder / "card.json").write_text(json.dumps({"model": {"n_ctx": n_ctx}, "pe": "rotary"}))
    return "zoo:rotary"


@pytest.mark.parametrize("kind", ["hf", "toy", "llama2c", "zoo"])
def test_tokens_above_n_ctx_is_refused_before_torch_is_imported(tmp_path, kind):
    spec, n_ctx = {
        "hf": lambda: (str(_gpt2_config_only(tmp_path / "gpt2")), 64),
        "toy": lambda: (str(_toy_run(tmp_path / "run")), 40),
        "llama2c": lambda: (str(_llama2c_header(tmp_path / "m.bin")), 48),
        "zoo": lambda: (_zoo(tmp_path), 32),
    }[kind]()
    res, err = _cli(["inspect", spec, "--tokens", "1000", "--out", str(tmp_path / "out")], tmp_path)
    assert res == {"rc": 2, "torch": False}, err
    (line,) = err.strip().splitlines()
    assert line == (f"posinterp: error: --tokens must be <= the model's n_ctx = {n_ctx} "
                    f"({spec}), got 1000")
    assert not (tmp_path / "out").exists()
    # at n_ctx the check passes (here the loader then fails: there are no weights)
    res, err = _cli(["inspect", spec, "--tokens", str(n_ctx), "--compare", spec,
                     "--tokens", "1000"], tmp_path)
    assert res == {"rc": 2, "torch": False} and err.count("--tokens must be <=") == 2


@pytest.mark.parametrize("content, said", [
    (b"", "holds no text (empty)"),
    (b"  \n\n \t\n", "holds no text (only whitespace)"),
    ("caf\u00e9 cr\u00e8me\n\nna\u00efve".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 3"),
])
def test_an_empty_or_latin1_text_file_is_refused_first_naming_the_flag_and_file(
        tmp_path, content, said):
    text = tmp_path / "input.txt"
    text.write_bytes(content)
    res, err = _cli(["inspect", str(_gpt2_config_only(tmp_path / "gpt2")), "--text", str(text)],
                    tmp_path)
    assert res == {"rc": 2, "torch": False}
    (line,) = err.strip().splitlines()
    assert line.startswith(f"posinterp: error: --text {text}: ") and said in line


def test_a_text_that_is_not_a_regular_file_is_named_so(tmp_path):
    res, err = _cli(["inspect", str(_gpt2_config_only(tmp_path / "gpt2")), "--text",
                     os.devnull], tmp_path)
    assert res == {"rc": 2, "torch": False}
    (line,) = err.strip().splitlines()
    assert line == f"posinterp: error: --text {os.devnull}: not a regular file"


def _never_loaded(monkeypatch):
    import posinterp.models

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(posinterp.models, "load_model", load_model)


def _read_only(monkeypatch, folder):
    """``folder`` as a read-only folder reads to ``os.access`` (as root, chmod does not
    stop writes, so the permission is what is simulated, not the check)."""
    real = os.access

    def access(path, mode, *args, **kwargs):
        if os.path.abspath(path) == os.path.abspath(folder) and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def test_a_read_only_out_is_refused_at_parse_time_naming_the_flag(tmp_path, monkeypatch, capsys):
    from posinterp.cli import main

    _never_loaded(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    _read_only(monkeypatch, locked)
    spec = str(_gpt2_config_only(tmp_path / "gpt2"))
    for out in (locked, locked / "new"):  # the folder itself, or the nearest one above it
        with pytest.raises(SystemExit) as exit_:
            main(["inspect", spec, "--out", str(out)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --out: {out} cannot be written: no write permission" in err
    assert not (locked / "new").exists()
    with pytest.raises(SystemExit):  # every --out command, not only inspect
        main(["spectrum", spec, "--out", str(locked)])
    assert "argument --out:" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="the model was loaded"):  # a writable --out passes
        main(["inspect", spec, "--out", str(tmp_path / "ok"), "--no-progress"])


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_out_where_no_file_can_be_created_is_refused_even_for_root(tmp_path, monkeypatch,
                                                                       capsys):
    """os.access says yes to root for /proc (and every folder): the check creates a file,
    so ``--out /proc/new`` fails at parse time naming the flag, not after the model loads."""
    from posinterp.cli import main
    from posinterp.io import check_out_dir

    _never_loaded(monkeypatch)
    spec = str(_gpt2_config_only(tmp_path / "gpt2"))
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", spec, "--out", "/proc/posinterp-new"])
    assert exit_.value.code == 2
    assert "argument --out: /proc/posinterp-new cannot be written" in capsys.readouterr().err
    with pytest.raises(ValueError, match="out_dir /proc/posinterp-new cannot be written"):
        check_out_dir("/proc/posinterp-new", writable=True)
    # a writable folder passes and keeps nothing of the check
    check_out_dir(tmp_path / "ok", create=False, writable=True)
    assert [p.name for p in tmp_path.iterdir()] == ["gpt2"]


def test_the_python_entry_points_check_before_loading_too(tmp_path, monkeypatch):
    from posinterp.experiments.compare import run_compare
    from posinterp.experiments.inspect import run_inspect

    _never_loaded(monkeypatch)
    spec = str(_gpt2_config_only(tmp_path / "gpt2"))
    with pytest.raises(ValueError, match=r"--tokens must be <= the model's n_ctx = 64"):
        run_inspect(spec, tmp_path / "out", n_tokens=65)
    with pytest.raises(ValueError, match=r"--tokens must be <= the model's n_ctx = 64"):
        run_compare(spec, spec, tmp_path / "out", n_tokens=65)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("\u00e9t\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"--text {latin}: not UTF-8"):
        run_inspect(spec, tmp_path / "out", text=latin)
    locked = tmp_path / "locked"
    locked.mkdir()
    _read_only(monkeypatch, locked)
    for run in (lambda: run_inspect(spec, locked), lambda: run_compare(spec, spec, locked)):
        with pytest.raises(ValueError, match="cannot be written"):
            run()
    assert not (tmp_path / "out").exists()


STORIES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "stories260K.bin")


def test_the_early_n_ctx_is_the_loaded_models(tmp_path):
    """The pre-load check never refuses what the loader accepts: ``context_length`` read
    from the files equals ``model.cfg.n_ctx`` once loaded, for every kind it reads."""
    from posinterp import TrainConfig, load_model, preset, train
    from posinterp.specs import context_length
    from tests.helpers import save_tiny_checkpoint, tiny_hf_configs, tiny_task

    specs = []
    for name, arch in (("gpt2-absolute", "GPT2LMHeadModel"), ("llama-gqa", "LlamaForCausalLM"),
                       ("neox-rotary-pct-0.25", "GPTNeoXForCausalLM")):
        save_tiny_checkpoint(arch, tiny_hf_configs()[name], tmp_path / name)
        specs.append(str(tmp_path / name))
    train(preset("tiny"), tiny_task("reversal", n=20),
          TrainConfig(max_steps=2, batch_size=4, eval_every=2, n_eval=8, warmup_steps=1,
                      checkpoint_every=2), checkpoint_dir=tmp_path / "run" / "checkpoints",
          progress=False)
    specs.append(str(tmp_path / "run"))
    if os.path.isfile(STORIES):
        specs.append(STORIES)
    for spec in specs:
        model, _ = load_model(spec, device="cpu")
        assert context_length(spec) == model.cfg.n_ctx, spec


def test_reproduce_and_experiment_share_their_run_nothing_flag():
    """One name for one idea (#39 item 10): --no-compute and --tables-only on both commands."""
    from posinterp.cli import build_parser

    parser = build_parser()
    for argv, dest in ((["reproduce", "zuo2024"], "no_compute"),
                       (["experiment", "qk-constraints"], "tables_only")):
        for flag in ("--no-compute", "--tables-only"):
            assert getattr(parser.parse_args(argv + [flag]), dest) is True
        assert getattr(parser.parse_args(argv), dest) is False


def test_python_dash_m_posinterp_is_the_command():
    import subprocess
    import sys

    from posinterp.io import POSINTERP_VERSION

    out = subprocess.run([sys.executable, "-m", "posinterp", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"posinterp {POSINTERP_VERSION}"
