"""Every command that writes an ``--out`` folder takes its lock (issue 34, item 5).

docs/faults.md: two runs into one output folder, the second is refused at once. A holder
process keeps the lock as a concurrent run would; each command into that folder must exit
with the lock error (status 2) before doing any work and leave the first run's files as
they were. Work is made to fail loudly here, so a command that ignores the lock cannot
pass by being slow or by writing identical files.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import posinterp.executors
import posinterp.models
import posinterp.models.sources.qk_only
from posinterp.cli import main
from posinterp.experiments import dynamics, fingerprint_families, qk_constraints, spectrum, zuo2024
from posinterp.experiments.zoo import family_set
from posinterp.io import FolderInUse, output_lock
from tests.helpers import parity_cases, save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m") / "llama"
    arch, make, _ = parity_cases()["llama-gqa"]
    save_tiny_checkpoint(arch, make(), folder)
    return folder


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model, reading weights or running cells fails the test: a refused command
    must stop before any of them."""
    def started(*args, **kwargs):
        raise AssertionError("the command started work in a folder another run holds")

    monkeypatch.setattr(posinterp.models, "load_model", started)
    monkeypatch.setattr(posinterp.models.sources.qk_only, "read_qk_weights", started)
    for module in (posinterp.executors, spectrum, fingerprint_families, dynamics, zuo2024,
                   qk_constraints):
        monkeypatch.setattr(module, "run_cells", started)
    monkeypatch.setattr(spectrum, "load_model", started)
    monkeypatch.setattr(dynamics, "train_zoo", started)


def _hold(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder``'s lock, as a concurrent run would."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from posinterp.io import folder_lock\n"
         "with folder_lock(sys.argv[1]):\n print('held', flush=True); time.sleep(120)",
         str(folder)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "held"
    return holder


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _commands(llama, out, tmp_path):
    fset = family_set("design1")
    return {
        # (argv, the folder the command writes and locks)
        "inspect": (["inspect", str(llama), "--tokens", "8", "--batch", "2"], out),
        "inspect --compare": (["inspect", str(llama), "--compare", str(llama), "--tokens", "8",
                               "--batch", "2"], out),
        "spectrum": (["spectrum", str(llama)], out),
        "spectrum --weights-only": (["spectrum", str(llama), "--weights-only"], out),
        "zoo fingerprint": (["zoo", "fingerprint", "--home", str(tmp_path / "home")],
                            out / fset.folder),
        "zoo dynamics": (["zoo", "dynamics", "--home", str(tmp_path / "home"), "--seeds", "1"],
                         out / "dynamics"),
        "reproduce zuo2024": (["reproduce", "zuo2024", "--quick"], out),
        "experiment qk-constraints": (["experiment", "qk-constraints", "--quick"], out),
        "experiment qk-constraints --restore-from": (
            ["experiment", "qk-constraints", "--quick", "--restore-from",
             str(ROOT / "docs" / "reproductions" / "data" / "qk-constraints")], out),
        "demo": (["demo", "--quick"], out),
    }


@pytest.mark.parametrize("command", ["inspect", "inspect --compare", "spectrum",
                                     "spectrum --weights-only", "zoo fingerprint", "zoo dynamics",
                                     "reproduce zuo2024", "experiment qk-constraints",
                                     "experiment qk-constraints --restore-from", "demo"])
def test_a_command_into_a_held_out_folder_is_refused_and_writes_nothing(
        command, llama, tmp_path, capsys, no_work):
    out = tmp_path / "out"
    argv, locked = _commands(llama, out, tmp_path)[command]
    locked.mkdir(parents=True)
    (locked / "heads.csv").write_text("the first run's table\n")
    holder = _hold(locked)
    try:
        before = _snapshot(out)
        assert main([*argv, "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another posinterp run (process {holder.pid})" in err
        assert _snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


def test_output_lock_refuses_a_second_holder_and_removes_only_a_folder_it_made(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError), output_lock(out):
        assert (out / ".lock").is_file()
        raise RuntimeError("a bad spec, found after the lock")
    assert not out.exists()  # bad input leaves no empty folder behind
    with output_lock(out):
        with pytest.raises(FolderInUse, match="in use by another posinterp run"), output_lock(out):
            pass
        (out / "heads.csv").write_text("x")
    with pytest.raises(RuntimeError), output_lock(out):
        raise RuntimeError
    assert (out / "heads.csv").read_text() == "x"  # a folder with results is kept
    with pytest.raises(ValueError, match="out_dir .* is a file"), output_lock(out / "heads.csv"):
        pass
