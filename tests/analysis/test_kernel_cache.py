"""numba's on-disk cache never stops the adjacency kernel (issue 22, item 10).

Each case runs the kernel in a fresh interpreter whose cache folder (NUMBA_CACHE_DIR) is
a temporary folder the test damages: a truncated cache from an interrupted first run,
and no writable cache folder at all. The counts are checked against the pair loop.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import posinterp.analysis._adjacency_kernel as kernel

VALUES = [0.3, 0.1, 0.3, 0.7, -0.2, 0.1, 0.5]

# The kernel module alone, loaded by path: no torch import, so each run is quick.
SCRIPT = f"""
import importlib.util, json, sys, numpy as np
spec = importlib.util.spec_from_file_location("adjacency_kernel", {str(Path(kernel.__file__))!r})
k = importlib.util.module_from_spec(spec)
sys.modules["adjacency_kernel"] = k  # numba's cache unpickles by module name
spec.loader.exec_module(k)
inv, tie = k.row_counts(np.array({VALUES!r}))
binv, btie = k.batch_counts(np.array([[{VALUES!r}] * {len(VALUES)}]), np.array([{len(VALUES)}]))
hits = sum(sum(d.stats.cache_hits.values()) for d in (k._pack_row, k._count_sorted_row,
           k._pack_batch, k._count_batch) if hasattr(d, "stats"))
print(json.dumps([int(inv), int(tie), int(binv[0, -1]), int(btie[0, -1]), hits]))
"""


def _pairs():
    """(inversions, ties) over i < j by the O(k^2) loop: the kernel's definition."""
    pairs = list(itertools.combinations(VALUES, 2))
    return sum(a > b for a, b in pairs), sum(a == b for a, b in pairs)


def _run(cache_dir, **env):
    full = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", **env}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    inv, tie, binv, btie, hits = json.loads(out.stdout.strip().splitlines()[-1])
    # the last row of the batch sees the row's first k-1 values
    last = VALUES[:-1]
    pairs = list(itertools.combinations(last, 2))
    assert (binv, btie) == (sum(a > b for a, b in pairs), sum(a == b for a, b in pairs))
    assert (inv, tie) == _pairs()
    return hits


def test_a_truncated_cache_is_compiled_over_and_rewritten(tmp_path):
    assert _run(tmp_path) == 0  # first run: compiled and written
    files = sorted(tmp_path.rglob("*.nb[ic]"))
    assert files and any(f.suffix == ".nbc" for f in files)
    for f in files:  # an interrupted run: data files cut short, index files empty
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3] if f.suffix == ".nbc" else b"")
    assert _run(tmp_path) == 0  # recompiled past the damage, not an UnpicklingError
    assert _run(tmp_path) > 0  # and the cache written over it is read again


def test_no_writable_cache_folder_compiles_in_memory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    # Only the user-provided folder may be used, and it cannot be created (even by root):
    # numba finds no cache locator, as with a read-only install and an unwritable HOME.
    _run(blocker / "cache", NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator")
    assert not (blocker.parent / "cache").exists()


def test_pair_counts_match_the_loop_in_process():
    assert kernel.row_counts(np.array(VALUES)) == _pairs()


def test_the_cache_is_never_written_inside_the_installed_package():
    """numba's default caches beside the source; pip leaves such files behind, and the
    folder they keep becomes an empty namespace package that hides a later install."""
    from posinterp.analysis import _rotary_kernel

    package = Path(kernel.__file__).resolve().parent.parent
    jitted = [f for m in (kernel, _rotary_kernel) for f in vars(m).values()
              if hasattr(f, "_cache") and hasattr(f, "py_func")]
    assert jitted
    for f in jitted:
        path = Path(f._cache.cache_path).resolve()
        assert not path.is_relative_to(package), (f.py_func.__name__, path)
