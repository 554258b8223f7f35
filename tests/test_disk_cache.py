"""posinterp._disk_cache: a stored result equals a fresh one bit for bit, is only reused
for its exact key, and a damaged, foreign or unwritable cache costs only recomputation."""

import os
import stat

import numpy as np
import pandas as pd
import pytest

from posinterp._disk_cache import CACHE_ENV, cache_root, cached_arrays


def _counting(arrays):
    calls = []

    def compute():
        calls.append(1)
        return {k: v.copy() for k, v in arrays.items()}
    return compute, calls


ARRAYS = {"b": np.array([0.1, 1 / 3, np.nextafter(1.0, 2.0)]), "a": np.arange(4, dtype=np.int32),
          "flag": np.array([True, False])}


def _same(got, want):
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes()


def test_second_call_reads_the_stored_arrays_bitwise(tmp_path):
    compute, calls = _counting(ARRAYS)
    args = {"d_model": 8, "std": 0.02, "k_e": None}
    first = cached_arrays("demo", 1, args, compute, root=tmp_path)
    second = cached_arrays("demo", 1, args, compute, root=tmp_path)
    assert len(calls) == 1 and len(list((tmp_path / "demo").glob("*.npz"))) == 1
    _same(first, ARRAYS)
    _same(second, ARRAYS)


@pytest.mark.parametrize("change", [{"version": 2}, {"args": {"d_model": 9}},
                                    {"args": {"d_model": 8, "std": 0.020000000000000004}}])
def test_another_version_or_argument_is_computed_again(tmp_path, change):
    compute, calls = _counting(ARRAYS)
    base = {"version": 1, "args": {"d_model": 8, "std": 0.02}}
    cached_arrays("demo", compute=compute, root=tmp_path, **base)
    cached_arrays("demo", compute=compute, root=tmp_path, **{**base, **change})
    assert len(calls) == 2 and len(list((tmp_path / "demo").glob("*.npz"))) == 2


def test_a_damaged_file_is_recomputed_and_rewritten(tmp_path):
    compute, calls = _counting(ARRAYS)
    cached_arrays("demo", 1, {"n": 1}, compute, root=tmp_path)
    (path,) = (tmp_path / "demo").glob("*.npz")
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])  # truncated
    with pytest.warns(UserWarning, match="is damaged"):
        _same(cached_arrays("demo", 1, {"n": 1}, compute, root=tmp_path), ARRAYS)
    _same(cached_arrays("demo", 1, {"n": 1}, compute, root=tmp_path), ARRAYS)
    assert len(calls) == 2


def test_a_file_holding_another_key_is_not_used(tmp_path):
    compute, calls = _counting(ARRAYS)
    cached_arrays("demo", 1, {"n": 1}, compute, root=tmp_path)
    (path,) = (tmp_path / "demo").glob("*.npz")
    other = {"x": np.zeros(3)}
    np.savez(path, __key__=np.array("{}"), __order__=np.array('["x"]'), **other)
    _same(cached_arrays("demo", 1, {"n": 1}, compute, root=tmp_path), ARRAYS)
    assert len(calls) == 2


def test_off_computes_every_time_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path))
    assert cache_root() is None
    compute, calls = _counting(ARRAYS)
    for _ in range(2):
        _same(cached_arrays("demo", 1, {"n": 1}, compute), ARRAYS)
    assert len(calls) == 2 and not any(tmp_path.rglob("*.npz"))


def test_the_default_root_follows_posinterp_home(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "cache"


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True,
                    reason="root writes into read-only folders")
def test_an_unwritable_cache_only_costs_recomputation(tmp_path):
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        compute, calls = _counting(ARRAYS)
        for _ in range(2):
            with pytest.warns(UserWarning, match="cannot write the posinterp cache"):
                _same(cached_arrays("demo", 1, {"n": 1}, compute, root=tmp_path), ARRAYS)
        assert len(calls) == 2
    finally:
        tmp_path.chmod(stat.S_IRWXU)


def test_an_unwritable_cache_file_path_only_costs_recomputation(tmp_path):
    (tmp_path / "demo").write_text("a file where the folder should be")
    compute, calls = _counting(ARRAYS)
    for _ in range(2):
        with pytest.warns(UserWarning, match="cannot write the posinterp cache"):
            _same(cached_arrays("demo", 1, {"n": 1}, compute, root=tmp_path), ARRAYS)
    assert len(calls) == 2


def test_the_nulls_read_from_disk_equal_fresh_draws(tmp_path, monkeypatch):
    """The Ginibre null and the |lambda| band, stored by one "process" (the in-process
    caches cleared) and read by the next, equal draws with the cache off, bit for bit."""
    from posinterp.analysis import kernels, spectral

    def fresh():
        spectral._ginibre_null.cache_clear()
        kernels._null_band.cache_clear()
        return (spectral._ginibre_null(16, 4, 40, 0.02, None, 1e-12, 3),
                kernels._null_band(16, 4, 30, (0.05, 0.95), 3))

    monkeypatch.setenv(CACHE_ENV, "off")
    want_null, want_band = fresh()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    fresh()  # drawn and stored
    assert len(list((tmp_path / "ginibre_null").glob("*.npz"))) == 1
    assert len(list((tmp_path / "null_band").glob("*.npz"))) == 1
    got_null, got_band = fresh()  # read back
    pd.testing.assert_frame_equal(got_null, want_null, check_exact=True)
    assert got_band == want_band
    spectral._ginibre_null.cache_clear()
    kernels._null_band.cache_clear()
