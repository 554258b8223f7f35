"""Self-contained HTML reports: inline PNG figures, tables, circuitsvis views, no network.

The circuitsvis bundle is inlined once per report in a classic ``<script>`` (so its
``CircuitsVis`` global is visible to every view's render call); figures are base64 PNGs.
Nothing in a report has a ``src`` or ``href`` that leaves the file.

Every string is escaped for where it lands: ``html.escape`` for text and attributes
(title, headings, paragraphs, captions, alt text), pandas' ``escape=True`` for tables,
and JSON with ``<``, ``>``, ``&`` as ``\\u00XX`` inside ``<script>`` (viz.circuits).
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..io import atomic_write_text
from .circuits import CircuitsView, script_safe_js

__all__ = ["Report", "fingerprint_summary", "integer_columns"]


def integer_columns(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with float columns that hold only whole numbers (and NA) as nullable integers.

    Counts, layers, heads, steps and k often arrive as floats (a NaN in a column makes
    pandas use float64), and would print as ``2.000``. A column of genuinely
    real-valued scores keeps its dtype unless every value is whole, in which case
    printing it without decimals loses nothing.
    """
    out = df.copy()
    for col in out.columns:
        s = out[col]
        if pd.api.types.is_float_dtype(s) and s.notna().any():
            v = s.dropna()
            if ((v % 1) == 0).all() and (v.abs() < 2**53).all():
                out[col] = s.astype("Int64")
    return out

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; }
.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: 0.5em 1em; }
img { max-width: 100%; }
"""


def fingerprint_summary(tests: pd.DataFrame) -> pd.DataFrame:
    """``fingerprint_test`` rows as a reader needs them: a ``reading`` column per k.

    ``separated`` alone next to an empty p reads like a result; the reading says which
    test ran and the smallest p the design can reach (1/C(n_R + n_O, n_R)).
    """
    out = tests.drop(columns=[c for c in ("note",) if c in tests.columns]).copy()

    def reading(r) -> str:
        floor = f"smallest reachable p = {r.min_possible_p:.3g}"
        if pd.isna(r.p_permutation):
            # an empty group has no floor: "p = nan" beside it would read like a number
            return (f"no permutation test (needs >= 2 models per group); Mann-Whitney p = "
                    f"{r.p_mannwhitney:.3g}, {floor}" if pd.notna(r.p_mannwhitney)
                    else "no test (a group is empty)")
        return f"permutation p = {r.p_permutation:.3g}, BH q = {r.q_bh:.3g}, {floor}"

    out["reading"] = [reading(r) for r in out.itertuples()]
    out["separated"] = out["separated"].map({True: "yes", False: "no"})
    return out


@dataclass
class Report:
    """An HTML report assembled section by section and written atomically."""

    title: str
    _parts: list[str] = field(default_factory=list)
    _bundle: str | None = None

    def heading(self, text: str, level: int = 2) -> Report:
        self._parts.append(f"<h{level}>{html.escape(text)}</h{level}>")
        return self

    def paragraph(self, text: str, note: bool = False) -> Report:
        cls = ' class="note"' if note else ""
        self._parts.append(f"<p{cls}>{html.escape(text)}</p>")
        return self

    def table(self, df: pd.DataFrame, float_format: str = "{:.3f}") -> Report:
        # escape=True (pandas' default, stated): cells and column names are text.
        df = integer_columns(df)
        self._parts.append(df.to_html(index=False, float_format=float_format.format,
                                      na_rep="", border=0, escape=True))
        return self

    def figure(self, fig, caption: str = "", save_as: str | Path | None = None) -> Report:
        """Embed a matplotlib figure as an inline PNG and close it.

        With ``save_as`` (a path without suffix) it is also written as PNG and SVG.
        """
        from .figures import _release

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110 if save_as is None else 150, bbox_inches="tight")
        if save_as is not None:
            from ..io import atomic_path
            from .figures import save_figure

            # Drawing is most of a figure's cost: the PNG drawn for the page is the file.
            with atomic_path(Path(f"{save_as}.png")) as tmp:
                Path(tmp).write_bytes(buf.getvalue())
            save_figure(fig, save_as, formats=("svg",), close=False)
        _release(fig)
        data = base64.b64encode(buf.getvalue()).decode("ascii")
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self._parts.append(f'<figure><img alt="{html.escape(caption)}" '
                           f'src="data:image/png;base64,{data}">{cap}</figure>')
        return self

    def circuits(self, view: CircuitsView, caption: str = "") -> Report:
        """Add a circuitsvis view; the first one brings the bundle, later ones reuse it."""
        if self._bundle is None:
            self._bundle = view.bundle
            self._parts.append(f"<script>\n{script_safe_js(view.bundle)}\n</script>")
        if caption:
            self._parts.append(f"<h4>{html.escape(caption)}</h4>")
        self._parts.append(view.html())
        return self

    def html(self) -> str:
        body = "\n".join(self._parts)
        return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
                f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head>\n"
                f"<body><h1>{html.escape(self.title)}</h1>\n{body}\n</body></html>\n")

    def _repr_html_(self) -> str:
        """The report inline in a notebook (viz.notebook: the same page as the file)."""
        from .notebook import notebook_html

        return notebook_html(self.html())

    def save(self, path: str | Path) -> Path:
        """Write the report atomically; returns the path."""
        return atomic_write_text(path, self.html())
