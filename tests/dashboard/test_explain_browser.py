"""Explain one score in a real browser: open the written inspect page in headless Chromium,
click a cell of a head's pattern with a real mouse event (DevTools protocol over
``--remote-debugging-pipe``: no extra package) and read the parts the page displays."""

import json
import os
import select
import subprocess

import numpy as np
import pytest

import posinterp as pi
from posinterp.dashboard.inspect_html import save_inspect_page
from tests.viz.test_browser import CHROMIUM, FLAGS
from tests.viz.test_report import external_refs


class DevTools:
    """Chromium's DevTools protocol over the pipe pair (fd 3: commands in, fd 4: replies
    out), messages separated by NUL bytes."""

    def __init__(self, args):
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{cmd_r} 4>&{out_w} {cmd_r}<&- {out_w}>&-', CHROMIUM, *args],
            pass_fds=(cmd_r, out_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self.w, self.r, self.buf, self.n, self.events = cmd_w, out_r, b"", 0, []

    def call(self, method, session=None, **params):
        self.n += 1
        msg = {"id": self.n, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self.n:
                assert "error" not in reply, reply
                return reply["result"]
            if "method" in reply:
                self.events.append(reply["method"])

    def wait_event(self, method):
        while method not in self.events:
            reply = self._read()
            if "method" in reply:
                self.events.append(reply["method"])

    def _read(self):
        while b"\0" not in self.buf:
            ready, _, _ = select.select([self.r], [], [], 60)
            assert ready, "Chromium did not answer within 60 s"
            chunk = os.read(self.r, 1 << 16)
            assert chunk, "Chromium closed the DevTools pipe"
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def close(self):
        os.close(self.w)
        os.close(self.r)
        self.proc.kill()
        self.proc.wait(timeout=30)


def _eval(dt, session, expr):
    out = dt.call("Runtime.evaluate", session, expression=expr, returnByValue=True, awaitPromise=True)
    assert "exceptionDetails" not in out, out
    return out["result"].get("value")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(apt-get install chromium); the browser check needs it")
def test_clicking_a_pattern_cell_shows_its_score_parts(tmp_path):
    model = pi.build_model(pi.preset("tiny", pe="rotary", init_std=0.25))
    tokens = pi.random_tokens(model, batch=2, pos=12, seed=0)
    res = pi.inspect_heads(model, tokens, n_null=50)
    page = save_inspect_page(res, tmp_path / "inspect.html", "explain test")
    assert external_refs(page.read_text()) == []
    dt = DevTools([*FLAGS, "--remote-debugging-pipe", "--window-size=1400,1000",
                   f"--user-data-dir={tmp_path / 'profile'}", "about:blank"])
    try:
        target = dt.call("Target.createTarget", url="about:blank")["targetId"]
        session = dt.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        dt.call("Page.enable", session)
        dt.events.clear()
        dt.call("Page.navigate", session, url=page.as_uri())
        dt.wait_event("Page.loadEventFired")
        # the page opens the card of its best previous-token head, with its clickable pattern
        assert _eval(dt, session, """new Promise(done => { const t0 = Date.now();
            (function wait() { if (document.getElementById('explain-pattern')) done(true);
              else if (Date.now() - t0 > 30000) done(false); else setTimeout(wait, 50); })(); })""")
        layer, head = _eval(dt, session,
                            "document.querySelector('#card h2').textContent.match(/\\d+/g).map(Number)")
        query, key = 9, 4
        x, y = _eval(dt, session, f"""(() => {{
            const r = document.querySelector('rect.explain-cell[data-query="{query}"][data-key="{key}"]');
            r.scrollIntoView({{block: 'center'}});
            const b = r.getBoundingClientRect(); return [b.x + b.width / 2, b.y + b.height / 2]; }})()""")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            dt.call("Input.dispatchMouseEvent", session, type=kind, x=x, y=y, button="left", clickCount=1)
        shown = _eval(dt, session, """(() => {
            const cell = document.getElementById('explain-cell');
            const rows = id => Object.fromEntries([...document.querySelectorAll('#' + id + ' tr[data-part]')]
                .map(tr => [tr.dataset.part, tr.querySelector('.explain-value').textContent]));
            return {query: +cell.dataset.query, key: +cell.dataset.key, summary: rows('explain-summary'),
                    channels: rows('explain-channels'), pairs: rows('explain-pairs')}; })()""")
    finally:
        dt.close()
    assert (shown["query"], shown["key"]) == (query, key)
    df = res.score_parts
    cell = df[(df.layer == layer) & (df["head"] == head) & (df["query"] == query) & (df["key"] == key)]
    total = float(cell[cell.metric == "score_total"].value.iloc[0])
    assert abs(total) > 0.1  # a score worth explaining
    np.testing.assert_allclose(float(shown["summary"]["score_total"]), total, atol=1e-5)
    np.testing.assert_allclose(float(shown["summary"]["model_score"]),
                               float(cell[cell.metric == "model_score"].value.iloc[0]), atol=1e-5)
    for table, view in (("channels", "channel"), ("pairs", "rotary_pair")):
        parts = cell[(cell.metric == "score_part") & (cell.view == view)]
        want = {p if pd_na(pair) else f"{p}:{int(pair)}": v
                for p, pair, v in zip(parts.part, parts.pair, parts.value, strict=True)}
        got = {k: float(v) for k, v in shown[table].items() if k != "sum"}
        assert set(got) == set(want)
        for k, v in want.items():  # the page shows 5 decimals (or 5 significant digits)
            assert abs(got[k] - v) <= 1e-5 + 1e-4 * abs(v), (k, got[k], v)
        # what the reader sees adds up: the displayed parts sum to the displayed score
        assert abs(sum(got.values()) - total) < 1e-4
        assert abs(float(shown[table]["sum"]) - total) < 1e-5


def pd_na(x) -> bool:
    import pandas as pd

    return x is None or x is pd.NA or (isinstance(x, float) and np.isnan(x))
