"""Open a report in headless Debian Chromium and check that circuitsvis rendered offline."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from posinterp.viz import Report, attention_view

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags from this workplace's notes: without the background-networking ones Chromium
# tries (and fails) to reach Google's hosts at every start.
# Every host name resolves to nothing: if the page rendered, it needed no network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--host-resolver-rules=MAP * ~NOTFOUND"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(apt-get install chromium); the browser check needs it")
def test_report_renders_circuitsvis_offline_in_chromium(tmp_path):
    gen = torch.Generator().manual_seed(0)
    rep = Report("browser check")
    for layer in range(2):
        pattern = torch.softmax(torch.randn(3, 5, 5, generator=gen), -1).tril()
        rep.circuits(attention_view(list("abcde"), pattern), caption=f"layer {layer}")
    path = rep.save(tmp_path / "report.html")
    out = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=10000", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert "<html" in out.stdout, out.stderr[-2000:]
    # The bundle's own source holds these strings too: look only outside <script>s.
    dom = re.sub(r"<script.*?</script>", "", out.stdout, flags=re.S)
    # Text that only exists once React has rendered the AttentionPatterns component.
    assert dom.count("Head selector") == 2
    assert dom.count("Attention Patterns") == 2
    # A picture for humans: test-artifacts/browser-report.png (git-ignored).
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "browser-report.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile2'}",
                    "--virtual-time-budget=10000", "--window-size=1000,900",
                    f"--screenshot={shot}", path.as_uri()],
                   capture_output=True, text=True, timeout=120)
    assert shot.stat().st_size > 10_000
