"""A slow grid cell for the signal tests (tests/test_faults.py), kept free of heavy imports."""

import os
import time
from pathlib import Path


def slow_cell(i: int, marks: str, seconds: float = 4.0) -> dict:
    """Leave a marker ``<i>-<worker pid>`` as the cell starts, then take ``seconds``."""
    Path(marks, f"{i}-{os.getpid()}").write_text("")
    time.sleep(seconds)
    return {"i": i}
