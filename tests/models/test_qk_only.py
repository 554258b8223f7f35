"""Weights-only QK spectra (read_qk_weights): the same numbers as the fully loaded model."""

import numpy as np
import pandas as pd
import pytest
import torch

from posinterp.analysis import qk_spectrum, spectral_measures
from posinterp.models import load_model
from posinterp.models.qk_only import read_qk_weights
from tests.helpers import parity_cases, save_tiny_checkpoint

CASES = ("llama-gqa", "llama3-scaling", "qwen2")


def _checkpoint(name, folder, **save_kw):
    arch, make, _ = parity_cases()[name]
    model = save_tiny_checkpoint(arch, make(), folder)
    with torch.no_grad():  # non-trivial norm gains, so folding them matters
        gen = torch.Generator().manual_seed(1)
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(0.5 + torch.rand(layer.input_layernorm.weight.shape,
                                                                generator=gen))
    model.save_pretrained(folder, **save_kw)
    return model


def _same(a: pd.DataFrame, b: pd.DataFrame, key, cols, rtol=1e-6):
    assert len(a) == len(b) > 0
    m = a.merge(b, on=key, suffixes=("_full", "_weights"))
    assert len(m) == len(a)
    for c in cols:
        x, y = m[f"{c}_full"].to_numpy(float), m[f"{c}_weights"].to_numpy(float)
        assert np.allclose(x, y, rtol=rtol, atol=rtol * np.abs(x).max()), c


@pytest.mark.parametrize("name", CASES)
def test_weights_only_spectrum_equals_full_load(name, tmp_path):
    folder = tmp_path / name
    _checkpoint(name, folder)
    model, _ = load_model(folder, device="cpu")
    qk = read_qk_weights(folder)
    assert qk.source["tensors"] == 3 * model.cfg.n_layers
    key = ["layer", "head", "offset", "rank"]
    _same(qk_spectrum(model), qk_spectrum(qk), key, ["real", "imag", "abs"])
    _same(spectral_measures(model), spectral_measures(qk), ["layer", "head", "offset", "metric"],
          ["value"])


def test_sharded_checkpoint_is_read_through_its_index(tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    _checkpoint("llama-gqa", one)
    _checkpoint("llama-gqa", many, max_shard_size="20KB")
    # the first save's single file (unit gains) would win over the index, as in HF's loader
    (many / "model.safetensors").unlink()
    assert (many / "model.safetensors.index.json").is_file()
    a, b = qk_spectrum(read_qk_weights(one)), qk_spectrum(read_qk_weights(many))
    pd.testing.assert_frame_equal(a, b)


def test_other_architectures_are_refused_by_name(tmp_path):
    arch, make, _ = parity_cases()["gpt2"]
    save_tiny_checkpoint(arch, make(), tmp_path / "g")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        read_qk_weights(tmp_path / "g")
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        read_qk_weights(tmp_path / "absent")


def test_cli_weights_only_writes_the_same_spectrum(tmp_path, capsys):
    import json

    from posinterp.cli import main

    folder = tmp_path / "llama-gqa"
    _checkpoint("llama-gqa", folder)
    out = tmp_path / "out"
    assert main(["spectrum", str(folder), "--weights-only", "--out", str(out), "--no-progress"]) == 0
    got = pd.read_csv(out / "spectrum.csv")
    want = qk_spectrum(load_model(folder, device="cpu")[0])
    _same(want, got.astype({"offset": "Int64"}), ["layer", "head", "offset", "rank"], ["real", "imag"])
    heads = pd.read_csv(out / "heads.csv")
    assert {"rotational_mass", "rotational_mass_null_percentile"} <= set(heads.columns)
    assert "previous_token_score" not in heads.columns
    assert json.loads((out / "run.json").read_text())["weights_only"] is True
    assert main(["spectrum", str(folder), "--weights-only", "--dynamics", "--out",
                 str(tmp_path / "o2")]) == 2
    assert "--weights-only reads no activations" in capsys.readouterr().err


def test_weights_only_tables_equal_the_public_functions(tmp_path):
    """run_weights_only solves each head once for both tables: its spectrum and measures
    are exactly qk_spectrum's and spectral_measures' (offset 0 for RoPE)."""
    from posinterp.experiments.spectrum import run_weights_only

    folder = tmp_path / "llama-gqa"
    _checkpoint("llama-gqa", folder)
    qk = read_qk_weights(folder)
    heads = run_weights_only([str(folder)], tmp_path / "out", progress=False)
    spec = pd.read_csv(tmp_path / "out" / "spectrum.csv")
    want = qk_spectrum(qk)
    np.testing.assert_array_equal(spec[["real", "imag", "abs"]].to_numpy(),
                                  want[["real", "imag", "abs"]].to_numpy())
    meas = spectral_measures(qk, offset=0)
    for metric in ("rotational_mass", "phase", "antisymmetric_energy"):
        got = heads.sort_values(["layer", "head"])[metric].to_numpy()
        ref = meas[meas.metric == metric].sort_values(["layer", "head"])["value"].to_numpy()
        np.testing.assert_array_equal(got, ref)
