"""Running out of memory is one clear line (posinterp._memory; issue 38 item 4): the
input's size, the estimated need, the way out, exit status 2, nothing half-written."""

from pathlib import Path

import pytest

from posinterp._memory import InputTooLargeError, attention_bytes, is_out_of_memory
from posinterp.cli import main
from tests.helpers import parity_cases, save_tiny_checkpoint

ALLOCATOR = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 19327352832 "
             "bytes. Error code 12 (Cannot allocate memory)")


def test_allocation_failures_are_recognised_and_nothing_else():
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError(ALLOCATOR))
    assert is_out_of_memory(InputTooLargeError("x"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an allocator's error type


def test_the_pattern_estimate_is_its_closed_form():
    # SmolLM2-135M at 4,096 tokens: 30 x 9 x 4096^2 float32 patterns = 16.9 GiB (issue 38)
    assert attention_bytes(30, 9, 1, 4096) == 30 * 9 * 4096**2 * 4
    assert attention_bytes(2, 3, 4, 5, tensors=2, itemsize=8) == 2 * 2 * 3 * 4 * 25 * 8


@pytest.mark.parametrize("failure", [MemoryError(), RuntimeError(ALLOCATOR)])
def test_inspect_out_of_memory_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch,
                                                                    capsys, failure):
    import posinterp.dashboard.inspect as dash

    arch, make, _ = parity_cases()["gpt2"]
    save_tiny_checkpoint(arch, make(), tmp_path / "gpt2")

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(dash, "inspect_heads", fail)
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["inspect", str(tmp_path / "gpt2"), "--tokens", "24", "--batch", "3",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("posinterp: error: out of memory inspecting 3 x 24")
    assert "needs about" in err[0] and "--layers" in err[0] and "--query-block" in err[0]
    assert "Traceback" not in err[0]
    assert not out.exists()


def test_any_command_out_of_memory_is_one_line(tmp_path, monkeypatch, capsys):
    import posinterp.experiments.weights_only as wo

    arch, make, _ = parity_cases()["llama-gqa"]
    save_tiny_checkpoint(arch, make(), tmp_path / "llama")

    def fail(*args, **kwargs):
        raise RuntimeError(ALLOCATOR)

    monkeypatch.setattr(wo, "_tables", fail)
    assert main(["spectrum", str(tmp_path / "llama"), "--weights-only", "--out",
                 str(tmp_path / "o"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_peak_rss_is_the_processs_own_not_its_parents():
    """A child of a process holding 512 MiB reports its own peak; ``ru_maxrss`` there
    carries the parent's resident set across fork and exec (what once made a weights-only
    benchmark read 3.5 GB for a child that held 2.8)."""
    import subprocess
    import sys

    import torch

    held = torch.ones(2**27)  # 512 MiB, touched
    code = ("import resource; from posinterp._memory import peak_rss_mb; "
            "print(peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    own, inherited = map(float, out.stdout.split())
    assert float(held[0]) == 1.0
    assert own < 256 <= 512 <= inherited
