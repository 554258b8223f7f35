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


# On TransformerLens 4 the tests below exercise what posinterp does not yet support there;
# each skips with the reason (docs/tl4.md, "Status"). Everything else runs on both versions.
_TL3_ONLY = {
    "tests/analysis/test_spectral.py::test_raw_and_processed_loads_give_the_same_spectra":
    "processes weights with HookedTransformer.load_and_process_state_dict",
}


def pytest_collection_modifyitems(config, items):
    from posinterp.models.backend import TL_MAJOR

    if TL_MAJOR < 4:
        return
    for item in items:
        for prefix, reason in _TL3_ONLY.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.skip(reason=f"TransformerLens 4: {reason}"))
