"""The demo notebooks run headless on a real Jupyter kernel (nbclient), as a user runs them,
and the inspect notebook's output cell holds the dashboard, offline (issue 27)."""

import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from tests.viz.test_report import external_refs

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "docs" / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks_and_their_outputs_are_stripped():
    assert len(NOTEBOOKS) >= 4
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name


class _Frame(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.srcdoc = None

    def handle_starttag(self, tag, attrs):
        if tag == "iframe":
            self.srcdoc = dict(attrs).get("srcdoc")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Each notebook executed once on a python3 kernel (this interpreter's ipykernel)."""
    from nbclient import NotebookClient

    out = {}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        cwd = tmp_path_factory.mktemp(path.stem)
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(cwd)}}).execute()
        out[path.name] = nb
    return out


@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors_and_shows_results(executed, name):
    nb = executed[name]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert errors == [], errors
    # every notebook's last cell shows something (a table, a figure or a value)
    assert code[-1].outputs, f"{name}: the last cell shows nothing"


def test_inspect_notebook_displays_the_dashboard_offline(executed):
    nb = executed["02_inspect_a_loaded_model.ipynb"]
    html_outputs = [o.data["text/html"] for c in nb.cells if c.cell_type == "code"
                    for o in c.outputs if "data" in o and "text/html" in o.data]
    frames = []
    for markup in html_outputs:
        p = _Frame()
        p.feed(markup)
        if p.srcdoc is not None:
            frames.append(p.srcdoc)
    (page,) = [f for f in frames if 'id="inspect-data"' in f]
    assert "<title>posinterp inspect" in page
    assert external_refs(page) == []
    assert not re.search(r"<script[^>]*\bsrc\s*=", page)  # no script fetched from anywhere
