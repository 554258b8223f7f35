"""Running out of memory, said in one line: what the input was, about what it needed,
and the way out (issue 38 item 4).

A CPU allocator failure reaches Python as ``MemoryError`` or as a ``RuntimeError`` from
torch's ``DefaultCPUAllocator`` ("can't allocate memory"); a GPU one as
``torch.OutOfMemoryError``. :func:`is_out_of_memory` recognises all three;
:class:`InputTooLargeError` carries the sentence a command prints (exit status 2).
"""

from __future__ import annotations

__all__ = ["InputTooLargeError", "attention_bytes", "gib", "is_out_of_memory", "peak_rss_mb"]

_ALLOCATOR = ("can't allocate memory", "DefaultCPUAllocator", "out of memory",
              "not enough memory")


class InputTooLargeError(MemoryError):
    """The input needs more memory than this machine has; the message names its size, the
    estimated need and what to change."""


def is_out_of_memory(err: BaseException) -> bool:
    """True for an allocation failure (``MemoryError``, torch's CPU allocator's
    ``RuntimeError``, ``torch.OutOfMemoryError``), False for anything else."""
    if isinstance(err, MemoryError):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _ALLOCATOR)


def attention_bytes(n_layers: int, n_heads: int, batch: int, n_tokens: int,
                    tensors: int = 1, itemsize: int = 4) -> int:
    """Bytes of ``tensors`` cached ``[batch, head, query, key]`` tensors (patterns,
    scores) of ``n_layers`` layers: n_layers x n_heads x batch x n_tokens^2 x itemsize
    each."""
    return tensors * n_layers * n_heads * batch * n_tokens * n_tokens * itemsize


def gib(n: int) -> str:
    """Bytes as GiB with one decimal (``"18.0 GiB"``)."""
    return f"{n / 2**30:.1f} GiB"


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB (what benchmarks report).

    Linux's ``VmHWM``, not ``getrusage``'s ``ru_maxrss``: a child started by a process
    with a large resident set inherits that set's size in ``ru_maxrss`` (Linux keeps the
    larger across ``fork`` and ``exec``), so a benchmark whose parent had just written a
    12 GB checkpoint read 3.5 GB for a child that never held more than 2.8 GB. Elsewhere
    (no ``/proc``) ``ru_maxrss``, in the platform's unit (kB on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
