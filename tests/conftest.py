import os
import socket

import pytest
import torch

# Two torch processes that each use every core slow each other down tens of times
# (docs/models.md); tests are small, one thread is plenty.
torch.set_num_threads(int(os.environ.get("POSINTERP_TEST_THREADS", "1")))


@pytest.fixture
def no_network(monkeypatch):
    """HF_HUB_OFFLINE=1 and every socket connection refused: a network call fails loudly."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="session")
def gguf_cache(request):
    """The converted folder lives in pytest's own cache (.pytest_cache, git-ignored): a
    conversion costs about a minute, so reruns and both TL lines share it; never $HOME."""
    return request.config.cache.mkdir("posinterp-gguf")


@pytest.fixture(scope="session")
def smol(gguf_cache):
    """SmolLM2-135M (the shared GGUF file) loaded once per session, for tests that only read
    it (tests/models/test_gguf.py, tests/analysis/test_induction.py); they skip without it."""
    from pathlib import Path

    from posinterp.models import load_model

    path = (Path(__file__).resolve().parents[1].parent / "shared" / "models"
            / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path.is_file():
        pytest.skip(f"{path} not present (the shared test models are only on the developers' machines)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POSINTERP_HOME", str(gguf_cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        model, info = load_model(path, device="cpu")
    return model, info


@pytest.fixture(scope="session", autouse=True)
def _disk_cache_in_tmp(tmp_path_factory):
    """The on-disk cache of random-head nulls (posinterp._disk_cache) in a fresh folder per
    session: never the user's, and each session computes before it reuses."""
    from posinterp._disk_cache import CACHE_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("posinterp-cache")))
        yield
