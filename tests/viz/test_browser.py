"""Open a report in headless Debian Chromium and check that circuitsvis rendered offline."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from posinterp.experiments import DemoConfig, run_demo
from tests.viz.test_report import external_refs

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
def test_demo_report_renders_circuitsvis_offline_in_chromium(tmp_path):
    # The demo's own report, from a tiny run: 2 layers, so 2 circuitsvis views.
    cfg = DemoConfig(preset="tiny", digits=5, max_steps=2, n_analysis=3, init_seeds=1)
    path = run_demo(cfg, tmp_path / "demo", progress=False).report_path
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
    assert external_refs(out.stdout) == []  # nothing the scripts added points outside either
    # A picture for humans: test-artifacts/browser-report.png (git-ignored).
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "browser-report.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile2'}",
                    "--virtual-time-budget=10000", "--window-size=1000,900",
                    f"--screenshot={shot}", path.as_uri()],
                   capture_output=True, text=True, timeout=120)
    assert shot.stat().st_size > 10_000
