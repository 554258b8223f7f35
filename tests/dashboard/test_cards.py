"""PNG/SVG of a head card from Python: valid files, built without pyplot."""

import copy
import xml.etree.ElementTree as ET

import pytest
import torch

from posinterp.dashboard.cards import comparison_card_figure, head_card_figure
from posinterp.dashboard.compare import compare_inspections
from posinterp.dashboard.inspect import inspect_heads
from posinterp.viz.figures import export_figure
from tests.helpers import random_tokens, tiny_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("rotary")
    tokens = random_tokens(model, 2, 8)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.blocks[1].attn.W_Q[0] *= 2
    return inspect_heads(model, tokens, n_null=20), inspect_heads(other, tokens, n_null=20)


def test_head_card_and_comparison_card_write_png_and_svg(pair, tmp_path):
    a, b = pair
    for name, fig in (("card", head_card_figure(a, 1, 0)),
                      ("cmp", comparison_card_figure(compare_inspections(a, b), 1, 0))):
        png = export_figure(fig, tmp_path / f"{name}.png")
        assert png.read_bytes()[:8] == PNG_MAGIC
        svg = export_figure(fig, tmp_path / f"{name}.svg")
        root = ET.fromstring(svg.read_bytes())
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        assert len(root.findall(".//{http://www.w3.org/2000/svg}path")) > 10  # something drawn


def test_bad_path_and_head_are_named(pair, tmp_path):
    a, _ = pair
    with pytest.raises(ValueError, match="layer"):
        head_card_figure(a, 2, 0)
    with pytest.raises(ValueError, match="head"):
        head_card_figure(a, 0, 4)
    with pytest.raises(ValueError, match="path must end"):
        export_figure(head_card_figure(a, 0, 0), tmp_path / "card.jpg")


def test_cards_are_standalone_figures(pair, monkeypatch):
    import matplotlib

    def refuse(*args, **kwargs):
        raise AssertionError("posinterp must never select the user's backend")
    monkeypatch.setattr(matplotlib, "use", refuse)
    a, b = pair
    for fig in (head_card_figure(a, 0, 1), comparison_card_figure(compare_inspections(a, b), 0, 1)):
        assert fig.canvas.manager is None  # pyplot's figures have a manager: these are in no registry
