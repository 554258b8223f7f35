"""Inline notebook display: ``_repr_html_`` of reports, circuitsvis views and inspections
is the same self-contained page as the file, in an ``<iframe srcdoc>`` (issue 27)."""

import html
import re
from html.parser import HTMLParser

import pytest
import torch

from posinterp.dashboard import inspect_heads, inspect_page
from posinterp.viz import Report, attention_view
from posinterp.viz.notebook import notebook_html
from tests.helpers import random_tokens, tiny_model
from tests.viz.test_report import external_refs


class _Frames(HTMLParser):
    """The srcdoc of every iframe, as a browser decodes the attribute."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.srcdocs = []

    def handle_starttag(self, tag, attrs):
        if tag == "iframe":
            self.srcdocs.append(dict(attrs)["srcdoc"])


def frames(markup: str) -> list[str]:
    p = _Frames()
    p.feed(markup)
    return p.srcdocs


def test_srcdoc_decodes_to_the_page_exactly():
    page = '<!DOCTYPE html><p title="a&b">x</p><script>if (1 < 2 && "\'") {}</script>\n'
    out = notebook_html(page)
    assert frames(out) == [page]
    # the only markup outside the attribute is the frame itself: no script runs in the notebook
    assert re.sub(r'srcdoc="[^"]*"', "", out).count("<script") == 0


def test_height_is_checked():
    with pytest.raises(ValueError, match="height must be a positive integer"):
        notebook_html("<p>", height=0)


def test_report_and_view_display_their_own_page_offline():
    pattern = torch.softmax(torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0)), -1)
    view = attention_view(list("abcd"), pattern)
    rep = Report("t").circuits(view, caption="layer 0")
    assert frames(rep._repr_html_()) == [rep.html()]
    (doc,) = frames(view._repr_html_())
    assert doc.count("var CircuitsVis=") == 1 and view.render_call in doc
    assert external_refs(doc) == []


def test_inspection_displays_the_dashboard():
    model = tiny_model("rotary")
    res = inspect_heads(model, random_tokens(model, 2, 8), n_null=50)
    (doc,) = frames(res._repr_html_())
    title = html.unescape(re.search(r"<title>(.*?)</title>", doc).group(1))
    data = re.compile(r'<script type="application/json" id="inspect-data">(.*?)</script>', re.S)
    # the same dashboard as the file: same data, same script (circuitsvis's element ids
    # are random per render, so the pages are compared with them blanked)
    page = inspect_page(res, title)
    assert data.search(doc).group(1) == data.search(page).group(1)
    blank = re.compile(r"circuits-vis-[0-9a-f-]+")
    assert blank.sub("ID", doc) == blank.sub("ID", page)
    assert external_refs(doc) == []
