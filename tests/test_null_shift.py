"""The fingerprint page's re-derived percentiles (experiments._null_shift): the
re-derivation itself is checked by running it against version 1's own draws, which must
give back the committed percentiles exactly."""

from pathlib import Path

import pandas as pd
import torch

from posinterp.analysis import spectral
from posinterp.experiments import _null_shift

DATA = Path(__file__).resolve().parents[1] / "docs" / "reproductions" / "data" / "fingerprints"


def _version1_null(d_model, d_head, n_heads=spectral.NULL_HEADS, std=0.02, seed=0):
    """The null as version 1 drew it (W_Q, W_K at d_model x d_head, 256 heads a block)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, n_heads, 256):
        n = min(256, n_heads - start)
        q = torch.randn(n, d_model, d_head, generator=gen, dtype=torch.float64) * std
        k = torch.randn(n, d_model, d_head, generator=gen, dtype=torch.float64) * std
        B = k.mT @ q
        m = spectral.rotational_measures(spectral.small_form_eigenvalues(B), None, 1e-8)
        m["antisymmetric_energy"] = spectral._antisymmetric_energy(q, k, B)
        out.append(pd.DataFrame({key: v.numpy() for key, v in m.items()}))
    return pd.concat(out, ignore_index=True)


def test_rederiving_against_version_1_gives_back_the_committed_numbers(monkeypatch):
    monkeypatch.setattr(_null_shift, "ginibre_null", _version1_null)
    for sub in ("families", "families-design2"):
        (row,) = _null_shift._families_rows(DATA / sub)
        assert row["max_shift"] == 0.0, sub
        for t in row["tests"]:
            assert t["p_v1"] == t["p_v2"] and t["mean_rope_v1"] == t["mean_rope_v2"], (sub, t)


def test_the_section_is_empty_once_every_run_used_the_current_null(tmp_path):
    import json
    import shutil

    for name in ("run.json", "heads.csv"):
        shutil.copy(DATA / name, tmp_path / name)
    assert _null_shift.null_shift_section(tmp_path)  # version 1 data: the section is shown
    run = json.loads((tmp_path / "run.json").read_text())
    run["null_version"] = spectral.GINIBRE_NULL_VERSION
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert _null_shift.null_shift_section(tmp_path) == []
