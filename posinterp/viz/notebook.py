"""Inline display in Jupyter, VS Code and Colab notebooks (``_repr_html_``).

A posinterp page (report, inspect dashboard, circuitsvis view) is a whole HTML document
with its own scripts and styles. Pasted into a notebook's output as is, its styles leak
into the notebook, its ``<html>``/``<body>`` are dropped, and scripts do not rerun when
the notebook is reopened. In an ``<iframe srcdoc>`` it is the same document as the file:
scripts run each time the output is shown, nothing is fetched (every script and image is
inline), and the notebook's own page is untouched.
"""

from __future__ import annotations

import html

__all__ = ["notebook_html"]

# Above this a notebook output slows the editor down; the page is still shown, with a
# note that saving it as a file keeps notebooks small.
LARGE_PAGE_BYTES = 8_000_000


def notebook_html(page: str, height: int = 720) -> str:
    """``page`` (a whole HTML document) as one notebook output cell's HTML.

    Args:
        page: the document, as written to the ``.html`` file.
        height: the frame's height in CSS pixels (the page scrolls inside it).

    Returns:
        ``<iframe srcdoc="...">`` markup; the attribute holds ``page`` escaped with
        ``html.escape`` (the browser unescapes it back to the same document).

    Raises:
        ValueError: for a non-positive ``height``.
    """
    if not isinstance(height, int) or height < 1:
        raise ValueError(f"height must be a positive integer (CSS pixels), got {height!r}")
    note = ""
    if len(page.encode("utf-8")) > LARGE_PAGE_BYTES:
        note = (f'<p style="color:#8a6d00">This view is {len(page) / 1e6:.1f} MB; saving it '
                "to a file (e.g. <code>save_inspect_page</code>) keeps the notebook small.</p>")
    return (f'{note}<iframe srcdoc="{html.escape(page, quote=True)}" '
            f'style="width: 100%; height: {height}px; border: 1px solid #ddd;"></iframe>')
