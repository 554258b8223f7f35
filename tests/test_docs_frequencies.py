"""docs/frequencies.md's generated part is benchmarks/frequencies.py's render of the committed
CSVs under docs/data/frequencies: no hand-typed figure. benchmarks/ is not a package, so
the script is loaded from its path."""

import importlib.util
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
_PATH = ROOT / "benchmarks" / "frequencies.py"


def _script():
    spec = importlib.util.spec_from_file_location("frequencies_benchmark", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_page_is_the_render_of_the_committed_data():
    mod = _script()
    page = (ROOT / "docs" / "frequencies.md").read_text()
    body = page.split(mod.BEGIN, 1)[1].split(mod.END, 1)[0]
    assert body == "\n" + mod.render(ROOT / "docs" / "data" / "frequencies")
    assert "### stories260K" in body and "### toy" in body


def test_committed_shares_are_shares():
    for folder in (ROOT / "docs" / "data" / "frequencies").iterdir():
        prof = pd.read_csv(folder / "profile.csv.gz")
        sums = prof.groupby(["layer", "head", "metric", "offset"], dropna=False).value.sum()
        assert ((sums - 1).abs() < 1e-4).all(), folder.name
