r"""circuitsvis attention views for offline HTML reports.

``circuitsvis``'s ``RenderedHTML.local_src`` embeds its whole 1.3 MB JavaScript bundle in
every view, and ``str()`` of a view is a CDN page that renders nothing offline. We split
``local_src`` into the bundle and the render call, so a report inlines the bundle once
and then holds one small render call per view (docs/models.md).

Any text can reach a view (code-model vocabularies hold tokens like ``</script>``), so
nothing is pasted into a ``<script>`` as is: the view's props are re-serialized as JSON
with ``<``, ``>`` and ``&`` written as ``\u003c``, ``\u003e``, ``\u0026`` (the same
string to JavaScript, never markup to the HTML tokenizer), and the bundle's own
``</script``, ``<script`` and ``<!--`` get their ``<`` written as ``\x3C``.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass

import torch
from jaxtyping import Float

from ..io import dumps_json

__all__ = ["CircuitsView", "attention_view"]

_RENDER = "CircuitsVis.render("
_CALL = re.compile(r'CircuitsVis\.render\(\s*"([\w-]+)",\s*CircuitsVis\.(\w+),\s*(.*)\)', re.S)
# Sequences that end a <script> early or switch its tokenizer into the escaped states.
_SCRIPT_BREAKERS = re.compile(r"<(?=!--|/?script)", re.I)


def script_json(obj) -> str:
    r"""``obj`` as JSON that is safe inside an inline ``<script>`` (HTML's script data).

    Strict JSON (:func:`posinterp.io.dumps_json`: NaN and ±inf are ``null``, which
    ``JSON.parse`` accepts), ASCII only (so U+2028/U+2029 are escaped too), with ``<``,
    ``>`` and ``&`` as ``\u003c``, ``\u003e``, ``\u0026``: they only occur inside JSON strings,
    where these escapes denote the same characters.
    """
    text = dumps_json(obj, ensure_ascii=True)  # strict: NaN and ±inf are null
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def script_safe_js(source: str) -> str:
    r"""JavaScript ``source`` with ``</script``, ``<script`` and ``<!--`` made inert.

    The ``<`` becomes ``\x3C``, which is the same character in strings, template
    literals and regular expressions, the only places a bundle holds these sequences.
    """
    return _SCRIPT_BREAKERS.sub(r"\\x3C", source)


@dataclass(frozen=True)
class CircuitsView:
    """One circuitsvis view: the shared ``bundle`` JS and this view's ``div`` + render call."""

    bundle: str
    element_id: str
    render_call: str
    note: str = ""

    def html(self) -> str:
        """The view's markup, to be placed after the bundle's ``<script>`` in a page."""
        note = f'<p class="note">{html.escape(self.note)}</p>\n' if self.note else ""
        return (f'{note}<div id="{html.escape(self.element_id)}" style="margin: 15px 0;"></div>\n'
                f"<script>\n{self.render_call}\n</script>")

    def _repr_html_(self) -> str:
        """The view inline in a notebook: its own page with the bundle inlined once, in a
        frame (viz.notebook), instead of the bundle pasted into the notebook as text."""
        from .notebook import notebook_html

        page = (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'></head><body>\n"
                f"<script>\n{script_safe_js(self.bundle)}\n</script>\n{self.html()}\n</body></html>\n")
        return notebook_html(page, height=560)


def split_local_src(local_src: str) -> CircuitsView:
    """Split circuitsvis's ``local_src`` into bundle, element id and render call.

    The render call is rebuilt from its parsed props with :func:`script_json`, and the
    bundle passed through :func:`script_safe_js`, so any token text stays text.

    Raises:
        RuntimeError: if circuitsvis's output no longer has the expected layout.
    """
    m_id = re.search(r'<div id="([^"]+)"', local_src)
    open_tag = re.search(r"<script[^>]*>", local_src)
    cut = local_src.rfind(_RENDER)
    close = local_src.rfind("</script>")
    call = _CALL.fullmatch(local_src[cut:close].strip()) if cut >= 0 and close > cut else None
    if not (m_id and open_tag and call and cut > open_tag.end()):
        raise RuntimeError("unexpected circuitsvis local_src layout; cannot inline its bundle")
    try:
        props = json.loads(call.group(3))
    except json.JSONDecodeError as err:
        raise RuntimeError("unexpected circuitsvis local_src layout: props are not JSON") from err
    element_id, component = call.group(1), call.group(2)
    return CircuitsView(
        bundle=script_safe_js(local_src[open_tag.end():cut].strip()),
        element_id=element_id,
        render_call=(f'CircuitsVis.render(\n  "{element_id}",\n  CircuitsVis.{component},\n  '
                     f"{script_json(props)}\n)"),
    )


def attention_view(
    str_tokens: list[str], pattern: Float[torch.Tensor, "n_heads query key"],
    max_tokens: int = 128,
) -> CircuitsView:
    """circuitsvis ``attention_patterns`` view of one layer's heads on one sequence.

    Args:
        str_tokens: the ``pos`` token strings (e.g. ``model.to_str_tokens(tokens)``).
        pattern: ``cache["blocks.{l}.attn.hook_pattern"][b]``, probabilities in [0, 1].
        max_tokens: longer sequences are cut to their first ``max_tokens`` positions
            (a causal pattern's top-left block is exact) with a visible note, since a
            browser freezes on very large views.

    Raises:
        ValueError: if the pattern is not ``[n_heads, pos, pos]`` with ``pos = len(str_tokens)``.
    """
    import circuitsvis as cv

    n = len(str_tokens)
    if pattern.ndim != 3 or tuple(pattern.shape[1:]) != (n, n):
        raise ValueError(
            f"pattern must have shape [n_heads, {n}, {n}] for {n} tokens, got {tuple(pattern.shape)}")
    note = ""
    if n > max_tokens:
        note = f"Showing the first {max_tokens} of {n} positions (cut for the browser)."
        str_tokens, pattern = str_tokens[:max_tokens], pattern[:, :max_tokens, :max_tokens]
    rendered = cv.attention.attention_patterns(
        tokens=list(str_tokens), attention=pattern.detach().float().cpu())
    view = split_local_src(rendered.local_src)
    return CircuitsView(view.bundle, view.element_id, view.render_call, note)
