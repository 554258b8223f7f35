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
