"""Faults a long run must survive (issue 23; docs/faults.md names the test of each).

Each test injects the fault itself (a flipped bit, a zero-byte file, a write that fails
with ENOSPC/EROFS, a real file-size limit, a signal to a driver process, a held lock) and
checks the property a run guarantees: a damaged checkpoint or result is never used (it
is moved aside and named), the rerun ends exactly where an uninterrupted run ends, and
an interrupted pool leaves no work running.
"""

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posinterp.cli import main
from posinterp.executors import Cell, run_cells
from posinterp.io import FolderInUse, describe_os_error
from posinterp.models import preset
from posinterp.training import (
    CheckpointDamaged,
    TrainConfig,
    check_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    train,
)
from tests.helpers import tiny_task
from tests.test_train import rehash

ROOT = Path(__file__).resolve().parents[1]


def _cfg(**kw):
    base = dict(max_steps=12, batch_size=8, eval_every=4, n_eval=32, checkpoint_every=5,
                checkpoint_seconds=None, keep_checkpoints=3, warmup_steps=3,
                target_accuracy=None, seed=7)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def data():
    return tiny_task("reversal", n=100, max_digits=6)


@pytest.fixture(scope="module")
def reference(data):
    """The uninterrupted run, without checkpoints."""
    return train(preset("tiny"), data, _cfg(), progress=False)


def _assert_same_run(a, b):
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(),
                                 strict=True):
        assert torch.equal(x, y), name
    assert a.history.equals(b.history) and a.steps == b.steps


def _largest_weight(file: Path) -> tuple[str, int]:
    """(name, byte offset in the file) of the largest tensor of a safetensors file."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
    name = max(header, key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
    return name, 8 + n + header[name]["data_offsets"][0]


def _flip(file: Path, offset: int, mask: int = 1) -> None:
    raw = bytearray(file.read_bytes())
    raw[offset] ^= mask
    file.write_bytes(bytes(raw))


def _mantissa_bit(folder):
    # the lowest mantissa bit of a float32 weight (little-endian: its first byte)
    file = folder / "model.safetensors"
    _flip(file, _largest_weight(file)[1])


def _state_byte(folder):
    file = folder / "trainer_state.pt"
    _flip(file, file.stat().st_size // 2, 0x10)


def _empty_config(folder):
    (folder / "config.json").write_bytes(b"")


def _bad_header(folder):
    file = folder / "model.safetensors"
    raw = file.read_bytes()
    file.write_bytes(raw[:8] + b"\xff" * 8 + raw[16:])


def _inf_weight(folder):
    # a consistent checkpoint (manifest rewritten) whose weights hold an inf: non-finite
    # weights are damage even when every hash matches
    file = folder / "model.safetensors"
    raw = bytearray(file.read_bytes())
    offset = _largest_weight(file)[1]
    raw[offset:offset + 4] = struct.pack("<f", float("inf"))
    file.write_bytes(bytes(raw))
    rehash(folder)


DAMAGE = {"mantissa bit in model.safetensors": (_mantissa_bit, "model.safetensors"),
          "byte in trainer_state.pt": (_state_byte, "trainer_state.pt"),
          "zero-byte config.json": (_empty_config, "config.json"),
          "corrupted safetensors header": (_bad_header, "model.safetensors"),
          "inf weight (consistent manifest)": (_inf_weight, "model.safetensors")}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_last_good_one(
        tmp_path, data, reference, kind):
    damage, file = DAMAGE[kind]
    train(preset("tiny"), data, _cfg(), checkpoint_dir=tmp_path, progress=False)
    final = tmp_path / "step_0000012"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_0000005", "step_0000010", "step_0000012"]
    damage(final)
    with pytest.raises(CheckpointDamaged, match=rf"step_0000012/{file}"):
        load_checkpoint(final)
    with pytest.warns(UserWarning, match=rf"step_0000012/{file}.*moved it to .*broken-step_0000012"
                      rf"; resuming from .*step_0000010 \(step 10\)"):
        resumed = train(preset("tiny"), data, _cfg(), checkpoint_dir=tmp_path, progress=False)
    _assert_same_run(resumed, reference)
    assert (tmp_path / "broken-step_0000012" / file).exists()  # kept for a look, not deleted
    check_checkpoint(final, read_state=True)  # written again, whole
    model, _ = load_checkpoint(final)
    for (name, x), (_, y) in zip(model.state_dict().items(),
                                 reference.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_every_checkpoint_damaged_means_a_fresh_start_said_so(tmp_path, data, reference):
    train(preset("tiny"), data, _cfg(), checkpoint_dir=tmp_path, progress=False)
    for folder in tmp_path.glob("step_*"):
        _mantissa_bit(folder)
    with pytest.warns(UserWarning, match="training starts again from step 0"):
        resumed = train(preset("tiny"), data, _cfg(), checkpoint_dir=tmp_path, progress=False)
    _assert_same_run(resumed, reference)
    assert len(list(tmp_path.glob("broken-step_*"))) == 3


def test_leftover_temporaries_are_removed_and_the_resume_says_where(tmp_path, data, reference,
                                                                     capsys):
    train(preset("tiny"), data, _cfg(), checkpoint_dir=tmp_path, progress=False)
    # what a kill during a checkpoint or snapshot write leaves
    half = tmp_path / ".step_0000015.k3j2.tmp"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots" / ".step_0000003.safetensors.x1.tmp").write_bytes(b"\0")
    again = train(preset("tiny"), data, _cfg(), checkpoint_dir=tmp_path, progress=True)
    _assert_same_run(again, reference)
    assert not [p for p in tmp_path.rglob(".*") if p.name != ".lock"]
    assert f"[posinterp] resuming from {tmp_path / 'step_0000012'} (step 12)" in capsys.readouterr().out


def test_a_full_disk_keeps_the_last_checkpoint_and_leaves_nothing_half_written(
        tmp_path, data, reference, monkeypatch):
    import posinterp.models.checkpoints as checkpoints

    real = checkpoints._write_durably

    def full_at_step_10(file, payload):
        if "step_0000010" in file.parent.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(file, payload)

    monkeypatch.setattr(checkpoints, "_write_durably", full_at_step_10)
    with pytest.raises(OSError) as info:
        train(preset("tiny"), data, _cfg(), checkpoint_dir=tmp_path, progress=False)
    line = describe_os_error(info.value)
    assert str(tmp_path / "step_0000010") in line and "disk full" in line
    assert "step_0000005, is kept" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step_0000005"]
    check_checkpoint(tmp_path / "step_0000005", read_state=True)
    monkeypatch.undo()  # space again: the rerun resumes and ends where it would have
    _assert_same_run(train(preset("tiny"), data, _cfg(), checkpoint_dir=tmp_path,
                           progress=False), reference)


@pytest.mark.parametrize("code, cause", [(errno.EROFS, "read-only file system"),
                                         (errno.ENOSPC, "disk full"),
                                         (errno.EACCES, "not writable")])
def test_the_cli_names_the_path_and_the_cause_of_a_failed_write(tmp_path, monkeypatch, capsys,
                                                                 code, cause):
    import posinterp.io as pio

    real = pio.tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):
        if kwargs.get("prefix") == pio.WRITE_CHECK_PREFIX:  # the parse-time check's empty file
            return real(*args, dir=dir, **kwargs)
        raise OSError(code, os.strerror(code), dir)

    monkeypatch.setattr(pio.tempfile, "mkstemp", refuse)
    out = tmp_path / "out"
    assert main(["demo", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"posinterp: error: {out}: ")
    assert cause in err[0].lower()


def test_a_real_file_size_limit_is_one_error_line_with_status_2(tmp_path, data):
    """No mock: the kernel refuses writes over 1 KB (RLIMIT_FSIZE, EFBIG), as root too."""
    train(preset("tiny"), data, _cfg(max_steps=2, checkpoint_every=2),
          checkpoint_dir=tmp_path / "model" / "checkpoints", progress=False)
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024)); "
              "from posinterp.cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", script, "inspect", str(tmp_path / "model"), "--out", str(out),
         "--tokens", "8", "--batch", "2", "--no-progress"], capture_output=True, text=True,
        timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("posinterp: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert str(out) in lines[0] and "file too large" in lines[0].lower()
    assert not [p for p in out.rglob("*.tmp")]  # nothing half-written


def test_a_second_writer_is_refused_by_name(tmp_path, data):
    from posinterp.experiments import DemoConfig, run_demo

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from posinterp.io import folder_lock\n"
         "with folder_lock(sys.argv[1]):\n print('held', flush=True); time.sleep(60)",
         str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUse, match=rf"in use by another posinterp run \(process "
                           rf"{holder.pid}\)"):
            run_cells([Cell("a", dict, dict(a=1))], tmp_path, progress=False)
        with pytest.raises(FolderInUse):
            train(preset("tiny"), data, _cfg(max_steps=2), checkpoint_dir=tmp_path, progress=False)
        with pytest.raises(FolderInUse):
            run_demo(DemoConfig(preset="tiny", digits=5, max_steps=2), tmp_path, progress=False)
        assert not (tmp_path / "a.json").exists() and not (tmp_path / "run.json").exists()
    finally:
        holder.kill()
        holder.wait()
    run_cells([Cell("a", dict, dict(a=1))], tmp_path, progress=False)  # free again: runs


def test_a_damaged_result_is_set_aside_and_only_its_cell_runs_again(tmp_path):
    from tests.test_executors import _calls, square

    calls = tmp_path / "calls"
    calls.mkdir()
    cells = [Cell(f"x{x}", square, dict(x=x, calls=str(calls))) for x in range(3)]
    first = run_cells(cells, tmp_path / "out", progress=False)
    (tmp_path / "out" / "x1.json").write_bytes(b"")  # e.g. a power cut after the rename
    with pytest.warns(UserWarning, match=r"x1\.json of cell x1 is damaged.*broken-x1\.json"):
        again = run_cells(cells, tmp_path / "out", progress=False)
    assert again == first and _calls(calls) == {0: 1, 1: 2, 2: 1}
    assert (tmp_path / "out" / "broken-x1.json").exists()


@pytest.mark.parametrize("where", ["final checkpoint", "snapshot", "snapshot mantissa"])
def test_a_zoo_model_with_damaged_weights_is_not_done(tmp_path, where):
    """A flipped bit anywhere is caught, including one that leaves a snapshot readable and
    finite (its SHA-256 sidecar, written with it, no longer matches)."""
    from posinterp.experiments.zoo import ZooConfig, load_zoo_model, train_zoo
    from posinterp.tasks.corpus import stdlib_corpus

    root = tmp_path / "lib"
    root.mkdir()
    for i in range(20):
        (root / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    corpus = stdlib_corpus(root)
    cfg = ZooConfig(n_layers=1, d_model=16, n_heads=2, n_ctx=16, batch_size=4, max_steps=6,
                    eval_every=3, n_val_windows=4, n_snapshots=3, schemes=("rotary",))
    home = tmp_path / "zoo"
    df = train_zoo(cfg, home=home, progress=False, corpus=corpus)
    folder = home / "rotary-seed0"
    card = (folder / "card.json").read_bytes()
    before = {k: v.clone() for k, v in load_zoo_model("zoo:rotary", home=home)[0].state_dict().items()}
    if where == "final checkpoint":
        _mantissa_bit(latest_checkpoint(folder / "checkpoints"))
    elif where == "snapshot":
        _flip(folder / "checkpoints" / "snapshots" / "step_0000002.safetensors", 20, 0xff)
    else:
        snap = folder / "checkpoints" / "snapshots" / "step_0000002.safetensors"
        _flip(snap, _largest_weight(snap)[1])
    with pytest.raises(ValueError, match="damaged"):
        load_zoo_model("zoo:rotary" if where != "snapshot" else "zoo:rotary@2", home=home)
    with pytest.warns(UserWarning, match="card.json of cell rotary-seed0/card is damaged"):
        again = train_zoo(cfg, home=home, progress=False, corpus=corpus)
    assert again.equals(df) and (folder / "card.json").read_bytes() == card
    after = load_zoo_model("zoo:rotary", home=home)[0].state_dict()
    for name, x in before.items():
        assert torch.equal(x, after[name]), name
    load_zoo_model("zoo:rotary@2", home=home)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_pool_driver_cancels_pending_cells_and_ends_its_workers(tmp_path, sig):
    marks = tmp_path / "marks"
    marks.mkdir()
    # A shell that starts a job in the background without job control (``cmd &`` in a
    # script, ``nohup``) makes it ignore SIGINT, and Python then installs no Ctrl-C
    # handler; the driver restores it, as the terminal session of a user pressing Ctrl-C has.
    script = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from posinterp.executors import Cell, ProcessExecutor, run_cells\n"
              "from tests._signal_cells import slow_cell\n"
              "cells = [Cell(f'c{i}', slow_cell, dict(i=i, marks=sys.argv[2])) for i in range(8)]\n"
              "run_cells(cells, sys.argv[1], ProcessExecutor(2), progress=False)\n")
    # stderr to a file, not a pipe: workers left behind would hold a pipe open forever
    log = open(tmp_path / "driver.err", "w")  # noqa: SIM115 - closed below
    driver = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out"), str(marks)],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=log)
    try:
        deadline = time.monotonic() + 180  # two spawned workers import torch
        while len(list(marks.iterdir())) < 2:
            assert driver.poll() is None and time.monotonic() < deadline, "cells never started"
            time.sleep(0.1)
        driver.send_signal(sig)
        t0 = time.monotonic()
        driver.wait(timeout=60)
        stopped_in = time.monotonic() - t0
    finally:
        driver.kill()
        driver.wait()
        log.close()
    started = list(marks.iterdir())
    workers = {int(p.name.split("-")[1]) for p in started}
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if _alive(pid)], "workers left behind"
    time.sleep(5)  # a pool still running would start the pending cells now
    assert len(list(marks.iterdir())) == len(started) < 8
    # the running cells were stopped, not waited for (each takes 4 s)
    assert stopped_in < 4 and not list((tmp_path / "out").glob("c*.json"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_lost_ray_node_is_reported():
    from posinterp.executors import _report_lost_nodes

    class Cluster:  # what ray.nodes() says after one of two nodes died
        @staticmethod
        def nodes():
            return [{"NodeID": "a" * 56, "NodeManagerAddress": "10.0.0.1", "Alive": True},
                    {"NodeID": "b" * 56, "NodeManagerAddress": "10.0.0.2", "Alive": False}]

    before = {"a" * 56: "10.0.0.1", "b" * 56: "10.0.0.2"}
    with pytest.warns(UserWarning, match=r"Ray node bbbbbbbbbbbb \(10\.0\.0\.2\) was lost"):
        now = _report_lost_nodes(Cluster, before)
    assert now == {"a" * 56: "10.0.0.1"}


def test_damaged_bookkeeping_files_of_a_grid_are_set_aside_not_fatal(tmp_path):
    """A zero-byte run.json, cells/_seconds.json or cell result: the rerun warns, redoes only
    the damaged cell and writes the same tables."""
    from posinterp.executors import LocalExecutor
    from posinterp.experiments.qk_constraints import run_qk_constraints
    from tests.test_executors import _tiny_grid

    run_qk_constraints(_tiny_grid(), tmp_path, progress=False, executor=LocalExecutor())
    runs = (tmp_path / "runs.csv").read_bytes()
    for name in ("run.json", "cells/_seconds.json", "cells/absolute-none-seed0.json"):
        (tmp_path / name).write_bytes(b"")
    with pytest.warns(UserWarning, match="absolute-none-seed0.json of cell"):
        run_qk_constraints(_tiny_grid(), tmp_path, progress=False, executor=LocalExecutor())
    assert (tmp_path / "runs.csv").read_bytes() == runs
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["calls"][-1]["cells_run"] == 1 and (tmp_path / "broken-run.json").exists()
    seconds = json.loads((tmp_path / "cells" / "_seconds.json").read_text())
    assert list(seconds) == ["absolute-none-seed0"]  # the rest were lost with the damaged table
