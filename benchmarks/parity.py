"""Print the HF parity table: every registered architecture x settings x masks x lengths.

Builds each tiny checkpoint of ``tests/helpers.parity_cases`` (default and non-default
RoPE/ALiBi/head settings, q/k weights x20 so attention is sharp) with ``save_pretrained``,
loads it offline with ``posinterp.load_model`` (default weight processing) and prints the
max |log-prob difference| against HF (BERT: last hidden state) for unpadded, left- and
right-padded and interior-gap masks at 8, 64 and 512 tokens; BLOOM also past its n_ctx.
Refused settings print their error. Run: ``python benchmarks/parity.py [--markdown]``.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings
from pathlib import Path

import pandas as pd

from posinterp.models.hf_config import UnsupportedConfigError
from posinterp.models.parity import hf_parity

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.helpers
from tests.helpers import parity_cases, save_tiny_checkpoint  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    rows, refused = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (architecture, make_config, _) in parity_cases().items():
            folder = Path(tmp) / name
            save_tiny_checkpoint(architecture, make_config(), folder)
            try:
                table = hf_parity(folder, lengths=(8, 64, 512))
                if architecture == "BloomForCausalLM":
                    table = pd.concat([table, hf_parity(folder, lengths=(2100,),
                                                        paddings=("none", "gap"))])
            except UnsupportedConfigError as err:
                refused.append((name, str(err)))
                continue
            rows.append(table.assign(case=name))
    table = pd.concat(rows).pivot_table(index=["case", "architecture"], columns=["padding", "length"],
                                        values="value", aggfunc="max")
    print("max |log-prob difference| vs HF (BERT: |hidden state| difference)\n")
    if "--markdown" in sys.argv:
        print(_markdown(table))
    else:
        print(table.to_string(float_format=lambda v: f"{v:.1e}", na_rep="-"))
    print(f"\nworst: {table.max().max():.2e}\n\nrefused by name:")
    for name, why in refused:
        print(f"  {name}: {why}")


def _markdown(table: pd.DataFrame) -> str:
    """A Markdown table without pandas' optional tabulate dependency."""
    cols = [f"{pad} {n}" for pad, n in table.columns]
    lines = ["| case | architecture | " + " | ".join(cols) + " |",
             "|" + "---|" * (2 + len(cols))]
    for (case, arch), row in table.iterrows():
        cells = ["-" if pd.isna(v) else f"{v:.1e}" for v in row]
        lines.append(f"| {case} | {arch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
