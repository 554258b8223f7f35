"""The inspect page's own script, run in node (issue 39, item 5): tick labels are whole and
never overlap, the pattern views decode to the inspection's patterns, and the grid draws
the selected heads only. Text widths are bounded by 6 px a character, above the widths of
digits, signs and letters in a 10 px sans-serif font (about 5.6 px for a digit)."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess
from importlib.resources import files

import numpy as np
import pytest
import torch

from posinterp.dashboard.inspect import inspect_heads
from posinterp.dashboard.inspect_html import (
    decode_pattern,
    encode_pattern,
    inspect_data,
    inspect_page,
    pattern_data,
)
from tests.dashboard.test_compare_schemes import _js_function, _node, page_script_head
from tests.helpers import random_tokens, tiny_model

NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (apt-get install nodejs); "
                                "the page's drawing is checked by running its own script")
PX = 6.0  # an upper bound of one character's width at the page's 10 px SVG font

STUB = """
function node(tag) { return {tag, attrs: {}, children: [], textContent: '',
  setAttribute(a, v) { this.attrs[a] = String(v); },
  appendChild(c) { this.children.push(c); return c; }, append(...cs) { this.children.push(...cs); }}; }
const document = {createElement: node, createElementNS: (ns, tag) => node(tag)};
function texts(n, cls) { const out = [];
  (function walk(e) { if (e.tag === 'text' && e.attrs.class === cls)
    out.push([+e.attrs.x, e.textContent, e.attrs['text-anchor'] || 'start']);
    (e.children || []).forEach(walk); })(n);
  return out; }
"""


def _functions(*names) -> str:
    src = {n: files("posinterp.dashboard").joinpath(n).read_text(encoding="utf-8")
           for n in ("common.js", "inspect.js")}
    consts = "\n".join(line for line in src["inspect.js"].splitlines()
                       if line.startswith(("const CHAR_PX", "const textPx")))
    found = []
    for name in names:
        where = "common.js" if re.search(rf"^function {name}\(", src["common.js"], re.M) else "inspect.js"
        found.append(_js_function(src[where], name))
    return STUB + consts + "\n" + "\n".join(found)


def _spans(labels):
    """(left, right) of each label, from its x, text and anchor."""
    out = []
    for x, text, anchor in labels:
        w = PX * len(text)
        out.append((x - w, x) if anchor == "end" else (x - w / 2, x + w / 2) if anchor == "middle"
                   else (x, x + w))
    return out


@needs_node
@pytest.mark.parametrize("values", [[-108.596, -40.2, 3.5], [0.25, 0.5, 0.75], [-1.5e-5, 2e-5, 0.0]])
def test_kernel_axis_labels_are_whole_and_never_overlap(values):
    # the case: a score kernel from -108.596 up, whose minus sign was cut off
    lags = 128
    rows = [{"offset": -k, "value": values[k % 3] * (1 + k / lags), "ci_low": None, "ci_high": None}
            for k in range(lags)]
    code = (_functions("svg", "fmt", "linePlot")
            + f"\nconst s = linePlot('t', {json.dumps(rows)}, 'score');"
            "\nconsole.log(JSON.stringify([texts(s, 'ytick'), texts(s, 'xtick'), +s.attrs.width]));")
    yt, xt, width = json.loads(_node(code))
    lo = min(r["value"] for r in rows)
    assert any(t.startswith("-") for _, t, _ in yt) == (lo < 0)
    assert all(left >= 0 for left, _ in _spans(yt)), yt  # nothing left of the picture
    spans = sorted(_spans(xt))
    assert len(spans) >= 4 and spans[0][0] >= 0 and spans[-1][1] <= width
    assert all(a[1] + 2 <= b[0] for a, b in zip(spans, spans[1:], strict=False)), xt


@needs_node
@pytest.mark.parametrize("n", [4096, 8192])
def test_binned_kernel_axis_is_logarithmic_with_whole_labels(n):
    """A long input's kernel (every lag to 255, then log-spaced bins to n - 1) is drawn on
    a log(1 + |Δ|) axis: ticks 0, -1, -10, -100, -1000 in order, inside the picture and
    apart, and its points spread over the axis instead of crowding into the last 6 %."""
    from posinterp.analysis.kernels import DENSE_LAGS, kernel_bins

    rows = [{"offset": -lo, "value": 1 / (1 + lo), "ci_low": None, "ci_high": None}
            for lo, _ in kernel_bins(n)]
    code = (_functions("svg", "fmt", "linePlot")
            + f"\nconst s = linePlot('t', {json.dumps(rows)}, 'attention', {DENSE_LAGS});"
            "\nconst cx = s.children.filter(c => c.tag === 'circle').map(c => +c.attrs.cx);"
            "\nconsole.log(JSON.stringify([texts(s, 'xtick'), +s.attrs.width, cx]));")
    xt, width, cx = json.loads(_node(code))
    assert [t for _, t, _ in sorted(xt)] == ["-1000", "-100", "-10", "-1", "0"]
    spans = sorted(_spans(xt))
    assert spans[0][0] >= 0 and spans[-1][1] <= width
    assert all(a[1] + 2 <= b[0] for a, b in zip(spans, spans[1:], strict=False)), xt
    # Δ = -1 .. -10 take a visible share of the axis (linear: 10 of 8,192 lags)
    span = max(cx) - min(cx)
    near = [x for x, r in zip(cx, rows, strict=True) if -10 <= r["offset"] <= 0]
    assert (max(near) - min(near)) / span > 0.2


def _freq_rows(theta, unrotated: bool):
    rows = [{"metric": "rotary_frequency", "layer": 0, "head": None, "rank": p, "offset": None,
             "value": t} for p, t in enumerate(theta)]
    ranks = list(range(len(theta))) + ([None] if unrotated else [])
    rows += [{"metric": "frequency_share", "layer": 0, "head": 0, "rank": r, "offset": 0,
              "value": 1 / len(ranks)} for r in ranks]
    return rows


@needs_node
@pytest.mark.parametrize("base, pairs, unrotated", [(100000.0, 32, False), (100000.0, 32, True),
                                                    (10000.0, 4, False), (10000.0, 12, True),
                                                    (500000.0, 64, False)])
def test_frequency_labels_never_overlap(base, pairs, unrotated):
    d = 2 * pairs
    theta = [base ** (-2 * p / d) for p in range(pairs)]  # RoPE's θ_p, fastest first
    code = (_functions("svg", "fmt", "fmtPeriod", "frequencyPlot")
            + f"\nconst ROWS = {json.dumps(_freq_rows(theta, unrotated))};"
            "\nconst s = frequencyPlot(0, 0, 0);"
            "\nconsole.log(JSON.stringify([texts(s, 'xtick'), +s.attrs.width]));")
    labels, width = json.loads(_node(code))
    spans = sorted(_spans(labels))
    assert len(labels) >= min(3, pairs)
    assert spans[0][0] >= 0 and spans[-1][1] <= width
    assert all(a[1] + 2 <= b[0] for a, b in zip(spans, spans[1:], strict=False)), labels
    assert (labels[-1][1] == "unrot.") == unrotated  # the unrotated dims are always named
    # the first label is the fastest pair's period, 2π/θ_0 = 2π tokens
    assert float(labels[0][1]) == pytest.approx(2 * math.pi, rel=0.05)


def test_heads_table_headers_do_not_wrap():
    model = tiny_model("nope", n_layers=1)
    page = inspect_page(inspect_heads(model, random_tokens(model, 2, 6), n_null=20), "t")
    rule = re.search(r"#list th \{([^}]*)\}", page).group(1)
    assert "white-space: nowrap" in rule and "overflow-wrap" not in rule


@pytest.fixture(scope="module")
def selected():
    model = tiny_model("rotary")
    toks = random_tokens(model, 3, 10)
    return inspect_heads(model, toks, n_null=20, layers=[1], heads=[1, 3])


def test_pattern_encoding_is_lossless_to_its_levels():
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(9, 9, generator=gen, dtype=torch.float64).masked_fill(
        torch.ones(9, 9, dtype=torch.bool).triu(1), -math.inf).softmax(-1).numpy()
    back = decode_pattern(encode_pattern(s), 9)
    assert np.abs(back - s).max() <= 0.5 / 65535 + 1e-12
    assert (np.triu(back, 1) == 0).all()


@needs_node
def test_the_pages_views_decode_to_the_inspections_patterns(selected):
    res = selected
    data = pattern_data(res)
    assert [v["label"] for v in data["views"]] == ["sequence 0", "sequence 1", "sequence 2",
                                                   res.pattern_views[-1].label]
    assert all(set(v["heads"]) == {"1-1", "1-3"} for v in data["views"])
    code = (_functions("decodePattern")
            + f"\nconst V = {json.dumps(data['views'])};"
            "\nconsole.log(JSON.stringify(V.map(v => decodePattern(v.heads['1-3'], v.tokens.length))));")
    decoded = json.loads(_node(code))
    want = [res.patterns[1][1]] + [v.patterns[1][1] for v in res.pattern_views]
    for got, p in zip(decoded, want, strict=True):
        np.testing.assert_allclose(np.array(got), p.double().numpy(), atol=0.5 / 65535 + 1e-7)


@needs_node
def test_the_grid_lists_the_selected_layers_and_heads(selected):
    head = page_script_head()
    payload = inspect_data(selected)
    code = ("const document = {getElementById: () => ({textContent: " + json.dumps(json.dumps(payload))
            + "})};\n" + head
            + "\nconsole.log(JSON.stringify([LAYERS, HEAD_IDS, Object.keys(HEADS).sort()]));")
    layers, heads, ids = json.loads(_node(code))
    assert (layers, heads, ids) == ([1], [1, 3], ["1-1", "1-3"])
    # an inspection from before the selection existed (no lists in meta): every head
    old = {**payload, "meta": {k: v for k, v in payload["meta"].items() if k not in ("layers", "heads")}}
    code = ("const document = {getElementById: () => ({textContent: " + json.dumps(json.dumps(old))
            + "})};\n" + head + "\nconsole.log(JSON.stringify([LAYERS, HEAD_IDS]));")
    assert json.loads(_node(code)) == [[0, 1], [0, 1, 2, 3]]


def test_the_picker_offers_every_view_and_the_pattern_renders_in_chromium(selected, tmp_path):
    from tests.viz.test_browser import FLAGS

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    page = tmp_path / "inspect.html"
    page.write_text(inspect_page(selected, "t", "f"), encoding="utf-8")
    out = subprocess.run([chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    dom = re.sub(r"<script.*?</script>", "", out.stdout, flags=re.S)
    menu = re.search(r'<select id="seq-pick"[^>]*>(.*?)</select>', dom, re.S).group(1)
    labels = [html.unescape(x) for x in re.findall(r"<option[^>]*>(.*?)</option>", menu)]
    want = [v["label"] for v in pattern_data(selected)["views"]]
    assert [x.rsplit(" (", 1)[0] for x in labels] == want
    # circuitsvis drew into the holder (its own markup: not an empty div)
    holder = re.search(r'<div id="pattern-view-\d+">(.*?)</div>', dom, re.S)
    assert holder and len(holder.group(1)) > 100
    grid = re.search(r'<table id="grid">(.*?)</table>', dom, re.S).group(1)
    assert re.findall(r"<th>(L\d+|H\d+)</th>", grid) == ["H1", "H3", "L1"]
