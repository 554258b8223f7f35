"""The pages' SVG/PNG download buttons, clicked in headless Chromium with the network blocked."""

import base64
import copy
import re
import subprocess
import xml.etree.ElementTree as ET

import pytest
import torch

from posinterp.dashboard.compare import compare_inspections
from posinterp.dashboard.compare_html import compare_page
from posinterp.dashboard.inspect import inspect_heads
from posinterp.dashboard.inspect_html import inspect_page
from tests.helpers import random_tokens, tiny_model
from tests.viz.test_browser import CHROMIUM, FLAGS

# Replaces the download step (an <a download> click a headless browser cannot keep) by
# writing each saved file into the page as a data: URL, then clicks the card's buttons.
CAPTURE = """<script>
window.POSINTERP_SAVE = (blob, name) => {
  const r = new FileReader();
  r.onload = () => { const p = document.createElement('pre'); p.className = 'saved';
                     p.setAttribute('data-name', name); p.textContent = r.result;
                     document.body.appendChild(p); };
  r.readAsDataURL(blob);
};
setTimeout(() => { document.querySelector('#card .export-svg').click();
                   document.querySelector('#card .export-png').click(); }, 200);
</script>"""


def _saved_files(page: str, tmp_path) -> dict[str, bytes]:
    tmp_path.mkdir()
    path = tmp_path / "page.html"
    path.write_text(page.replace("</body>", CAPTURE + "</body>"), encoding="utf-8")
    out = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--virtual-time-budget=10000", "--dump-dom", path.as_uri()],
                         capture_output=True, text=True, timeout=180)
    files = {}
    for name, url in re.findall(r'<pre class="saved" data-name="([^"]+)">([^<]*)</pre>', out.stdout):
        files[name] = base64.b64decode(url.split(",", 1)[1])
    assert files, out.stderr[-2000:]
    return files


def _check(files: dict[str, bytes], stem: str) -> None:
    assert set(files) == {f"{stem}.svg", f"{stem}.png"}
    root = ET.fromstring(files[f"{stem}.svg"])
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(root.findall("{http://www.w3.org/2000/svg}svg")) >= 3  # the card's plots
    png = files[f"{stem}.png"]
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(png[16:20], "big")
    assert width == 2 * int(float(root.get("width")))  # drawn at twice the SVG's size


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(apt-get install chromium); the browser check needs it")
def test_card_download_buttons_save_svg_and_png(tmp_path):
    model = tiny_model("rotary")
    tokens = random_tokens(model, 2, 8)
    a = inspect_heads(model, tokens, n_null=20)
    best = a.head_view().sort_values("previous_token_score", ascending=False).iloc[0]
    _check(_saved_files(inspect_page(a, "t"), tmp_path / "inspect"),
           f"posinterp-layer-{int(best.layer)}-head-{int(best['head'])}")
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.blocks[1].attn.W_Q[3] *= 3
    cmp = compare_inspections(a, inspect_heads(other, tokens, n_null=20))
    _check(_saved_files(compare_page(cmp, "t"), tmp_path / "compare"), "posinterp-layer-1-head-3")
