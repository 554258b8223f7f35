"""One spec grammar (issue 35): posinterp.specs classifies a spec and parses a zoo spec, and
every reader of specs agrees with it: load_model's table of sources, the CLI's early check
(check_spec), context_length, and the zoo loader."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import pytest

from posinterp.specs import (
    ZooSpec,
    check_spec,
    context_length,
    parse_zoo_spec,
    spec_kind,
)

PKG = Path(__file__).resolve().parents[1] / "posinterp"
BAD_ZOO = "zoo spec must look like"

# spec, spec_kind, load_model's route (a SOURCES key, or the exception it raises before any
# source runs), check_spec's outcome (None: accepted, or the exception), revision
CASES = [
    ("hf", "folder", "local-hf", None, None),
    ("./hf", "folder", "local-hf", None, None),
    ("run", "folder", "toy", None, None),
    ("m.gguf", "gguf", "gguf", None, None),
    ("weights/model.GGUF", "gguf", "gguf", FileNotFoundError, None),  # the source says it is missing
    ("model.bin", "llama2c", "llama2c", None, None),
    ("short.bin", "llama2c", "llama2c", ValueError, None),  # shorter than the header
    ("gone.bin", "llama2c", "llama2c", FileNotFoundError, None),
    ("notes.txt", "file", FileNotFoundError, FileNotFoundError, None),
    ("run.SafeTensors", "missing", FileNotFoundError, FileNotFoundError, None),
    ("a/b/c", "missing", FileNotFoundError, FileNotFoundError, None),
    ("~/posinterp-no-such-model.pt", "missing", FileNotFoundError, FileNotFoundError, None),
    ("gpt2", "hub", "hub", None, None),
    ("EleutherAI/pythia-70m", "hub", "hub", None, None),
    ("EleutherAI/pythia-70m", "hub", "hub", None, "step1000"),
    ("hf", "folder", ValueError, None, "step1000"),  # revision: hub names only
    ("zoo:rotary", "zoo", "zoo", FileNotFoundError, None),  # not trained under this home
    ("zoo:alibi:2@100", "zoo", "zoo", FileNotFoundError, None),
    ("zoo:rotary", "zoo", ValueError, FileNotFoundError, "main"),
    ("zoo:foo", "zoo", "zoo", ValueError, None),  # the zoo source refuses it
    ("zoo:rotary:x", "zoo", "zoo", ValueError, None),
    ("zoo:rotary@x", "zoo", "zoo", ValueError, None),
    ("minilm", "minilm", "minilm", None, None),
    ("all-MiniLM-L6-v2", "minilm", "minilm", None, None),
    ("  ", ValueError, ValueError, ValueError, None),
    (" model.bin ", "llama2c", "llama2c", None, None),  # a pasted path's stray spaces
    ("MODEL.BIN", "llama2c", "llama2c", None, None),  # any case, as .gguf
]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A working folder holding one spec of every local kind."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path / "home"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "n_positions": 64}')
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "run" / "model.safetensors").write_bytes(b"")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "model.bin").write_bytes(struct.pack("<7i", 8, 16, 1, 2, 2, 32, 48))
    (tmp_path / "MODEL.BIN").write_bytes(struct.pack("<7i", 8, 16, 1, 2, 2, 32, 48))
    (tmp_path / "short.bin").write_bytes(b"1234")
    (tmp_path / "notes.txt").write_text("not a model")
    return tmp_path


def _outcome(call):
    try:
        return call()
    except (ValueError, FileNotFoundError, LookupError) as err:
        return type(err)


@pytest.mark.parametrize("spec, kind, route, checked, revision", CASES)
def test_every_spec_reader_classifies_a_spec_alike(tree, monkeypatch, spec, kind, route, checked,
                                                   revision):
    from posinterp.models import pretrained

    routed = []
    for key, source in pretrained.SOURCES.items():
        monkeypatch.setitem(pretrained.SOURCES, key, pretrained.Source(
            lambda s, processing, dtype, rev, key=key: routed.append((key, s, processing, rev))
            or (_ for _ in ()).throw(LookupError(key)), source.processed))
    assert _outcome(lambda: spec_kind(spec)) == kind
    got = _outcome(lambda: pretrained.load_model(spec, revision=revision))
    assert got is LookupError if isinstance(route, str) else got is route, (got, routed)
    assert [r[0] for r in routed] == ([route] if isinstance(route, str) else [])
    if routed:
        key, passed, processing, rev = routed[0]
        assert passed == spec.strip() and rev == revision
        assert set(processing.values()) == {key != "llama2c"}  # run.c runs the raw weights
    assert _outcome(lambda: check_spec(spec, home=tree / "home")) is checked
    assert context_length(spec, home=tree / "home") == (
        64 if spec in ("hf", "./hf") else 48 if spec.strip().lower() == "model.bin" else None)


@pytest.mark.parametrize("spec", [None, 3, 2.5, ["hf"]])
def test_a_spec_that_is_not_a_string_or_path_is_a_type_error_everywhere(spec):
    from posinterp.models import load_model

    for read in (spec_kind, check_spec, lambda s: load_model(s)):
        with pytest.raises(TypeError, match="spec must be a str or os.PathLike"):
            read(spec)
    assert context_length(spec) is None  # raises nothing, by contract


def test_an_empty_posinterp_home_is_unset(monkeypatch):
    from posinterp.specs import cache_home, zoo_home

    monkeypatch.setenv("POSINTERP_HOME", "")
    assert zoo_home().is_absolute() and cache_home().is_absolute()


@pytest.mark.parametrize("spec, want", [
    ("zoo:rotary", ZooSpec("rotary", 0, None)), ("zoo:alibi:2@100", ZooSpec("alibi", 2, 100)),
    ("zoo:nope:3", ZooSpec("nope", 3, None)), ("zoo:absolute@0", ZooSpec("absolute", 0, 0)),
    ("zoo:rotary:", ZooSpec("rotary", 0, None)), ("zoo:rotary@", ZooSpec("rotary", 0, None)),
    ("zoo:foo", None), ("zoo:rotary:x", None), ("zoo:rotary@x", None), ("zoo:", None),
    ("zoo:rotary:-1", None),
])
def test_one_zoo_parser_and_every_zoo_reader_agrees(tmp_path, spec, want):
    from posinterp.experiments.zoo import load_zoo_model

    if want is None:
        with pytest.raises(ValueError, match=BAD_ZOO) as parsed:
            parse_zoo_spec(spec)
        for reader in (lambda: check_spec(spec, home=tmp_path),
                       lambda: load_zoo_model(spec, home=tmp_path)):
            with pytest.raises(ValueError) as err:
                reader()
            assert str(err.value) == str(parsed.value)
        assert context_length(spec, home=tmp_path) is None
        return
    assert parse_zoo_spec(spec) == want
    assert parse_zoo_spec(want.at(want.step)) == want
    for reader in (lambda: check_spec(spec, home=tmp_path),
                   lambda: load_zoo_model(spec, home=tmp_path)):
        with pytest.raises(FileNotFoundError, match=f"{want.pe}-seed{want.seed}"):
            reader()


def _defs_and_calls():
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            yield path.relative_to(PKG).as_posix(), node


def test_the_grammar_has_one_home():
    """One path-vs-hub classifier (two once differed: only the CLI's knew ``.gguf``) and one
    reader of the zoo grammar: nothing outside specs.py strips the ``zoo:`` prefix
    (:func:`posinterp.specs.parse_zoo_spec` does)."""
    classifiers = sorted(f"{rel}:{node.name}" for rel, node in _defs_and_calls()
                         if isinstance(node, ast.FunctionDef) and "looks_local" in node.name)
    assert classifiers == ["specs.py:looks_local"]
    zoo_readers = sorted({
        rel for rel, node in _defs_and_calls()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "removeprefix"
        and any(isinstance(a, ast.Constant) and a.value == "zoo:" for a in node.args)})
    assert zoo_readers == ["specs.py"]
