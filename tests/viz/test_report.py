import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pandas as pd
import pytest
import torch

from posinterp.viz import Report, attention_view, similarity_grid
from posinterp.viz.circuits import split_local_src


def external_refs(html: str) -> list[str]:
    """src/href attributes that point outside the file (the bundle's URL strings are fine)."""
    refs = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']+)["\']', html)
    return [r for r in refs if not r.startswith(("data:", "#"))]


def test_bundle_inlined_once_and_no_external_reference(tmp_path):
    gen = torch.Generator().manual_seed(0)
    rep = Report("t")
    for layer in range(3):
        pattern = torch.softmax(torch.randn(2, 4, 4, generator=gen), -1)
        rep.circuits(attention_view(list("abcd"), pattern), caption=f"layer {layer}")
    rep.figure(similarity_grid({"x": torch.eye(4)}), "fig")
    path = rep.save(tmp_path / "r.html")
    html = path.read_text()
    assert html.count("var CircuitsVis=") == 1
    assert html.count("CircuitsVis.render(") == 3
    assert external_refs(html) == []
    assert "<script crossorigin" not in html  # no module-scoped copy of the bundle


def test_external_reference_is_detected():
    assert external_refs('<img src="https://cdn.example/x.png">') == ["https://cdn.example/x.png"]
    assert external_refs('<img src="data:image/png;base64,AAA">') == []


def test_attention_view_shape_check():
    with pytest.raises(ValueError, match="pattern must have shape"):
        attention_view(list("abc"), torch.zeros(2, 4, 4))


def test_split_rejects_unknown_layout():
    with pytest.raises(RuntimeError, match="layout"):
        split_local_src("<div>nothing here</div>")


def test_long_sequences_are_cut_with_a_note():
    pattern = torch.softmax(torch.randn(2, 300, 300), -1)
    view = attention_view([str(i) for i in range(300)], pattern, max_tokens=50)
    assert "first 50 of 300" in view.html()
    assert view.render_call.count('"49"') == 1 and '"50"' not in view.render_call


def test_save_figure_png_and_svg(tmp_path):
    from posinterp.viz import save_figure

    paths = save_figure(similarity_grid({"x": torch.eye(3)}), tmp_path / "fig")
    assert [p.suffix for p in paths] == [".png", ".svg"]
    assert paths[0].read_bytes()[:4] == b"\x89PNG" and b"<svg" in paths[1].read_bytes()[:500]
    with pytest.raises(ValueError, match="format must be one of"):
        save_figure(similarity_grid({"x": torch.eye(3)}), tmp_path / "f", formats=("bmpx",))


HOSTILE = ["<bos>", "</script><h1>x</h1>", "a&amp;b<", "<!--", "<script>", "'\"`", "</SCRIPT >"]


class _Page(HTMLParser):
    """What a browser's tokenizer sees: tags, text outside scripts, and script bodies."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags, self.text, self.scripts, self._in_script = [], [], [], False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self._in_script = tag == "script"
        if tag == "img":
            self.text.append(dict(attrs).get("alt", ""))

    def handle_endtag(self, tag):
        self._in_script = False if tag == "script" else self._in_script

    def handle_data(self, data):
        (self.scripts if self._in_script else self.text).append(data)


def test_any_text_reaches_the_page_as_text(tmp_path):
    """Issue 11 case 10: a token `</script><h1>x</h1>` broke the view and became markup."""
    pattern = torch.softmax(torch.randn(2, len(HOSTILE), len(HOSTILE),
                                        generator=torch.Generator().manual_seed(0)), -1)
    markup = "<h1>m</h1> & </script>"
    rep = Report(f"title {markup}")
    rep.heading(f"heading {markup}").paragraph(f"para {markup}", note=True)
    rep.table(pd.DataFrame({f"col {markup}": [f"cell {markup}"], "model": ["<b>gpt</b>"]}))
    rep.figure(similarity_grid({"x": torch.eye(3)}), caption=f'cap {markup} "q"')
    rep.circuits(attention_view(HOSTILE, pattern), caption=f"view {markup}")
    page = _Page()
    page.feed(rep.save(tmp_path / "r.html").read_text())
    page.close()
    assert page.tags.count("h1") == 1 and "b" not in page.tags  # only the report's title
    text = "".join(page.text)
    for where in ("title", "heading", "para", "col", "cell", "cap", "view"):
        assert f"{where} {markup}" in text
    assert "<b>gpt</b>" in text
    # Bundle + one render call: no script was cut short by a token.
    assert page.tags.count("script") == 2
    render = page.scripts[-1]
    m = re.fullmatch(r'\s*CircuitsVis\.render\(\s*"([\w-]+)",\s*CircuitsVis\.(\w+),\s*(.*)\)\s*',
                     render, flags=re.S)
    assert m, render[:300]
    assert json.loads(m.group(3))["tokens"] == HOSTILE
    for bad in ("</script", "<!--", "<script"):
        assert bad not in render.lower()


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the JavaScript")
def test_javascript_sees_the_exact_tokens(tmp_path):
    """The escaped render call gives JavaScript the very same strings."""
    pattern = torch.softmax(torch.randn(1, len(HOSTILE), len(HOSTILE)), -1)
    view = attention_view(HOSTILE, pattern)
    script = tmp_path / "view.js"
    script.write_text("const CircuitsVis = {AttentionPatterns: 1, render: (id, c, props) => "
                      "console.log(JSON.stringify(props.tokens))};\n" + view.render_call)
    out = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout) == HOSTILE, out.stderr
    bundle = tmp_path / "bundle.js"
    bundle.write_text(view.bundle)
    assert subprocess.run(["node", "--check", str(bundle)], capture_output=True).returncode == 0
