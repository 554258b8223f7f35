import re

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
