"""Which weight files of an HF folder posinterp reads: transformers' own precedence, for the
full load and the weights-only reader alike (issue 34, item 3)."""

import json
import shutil

import pytest
import torch
import transformers

from posinterp.models import load_model
from posinterp.models.checkpoint import checkpoint_files
from posinterp.models.qk_only import read_qk_weights
from tests.helpers import parity_cases, save_tiny_checkpoint


def _llama(folder, seed):
    arch, make, _ = parity_cases()["llama-gqa"]
    return save_tiny_checkpoint(arch, make(), folder, seed=seed)


def _hf_qk(folder):
    """q_proj/k_proj weights of HF's own from_pretrained on ``folder`` (the reference)."""
    hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), local_files_only=True)
    return [(layer.self_attn.q_proj.weight.detach().double(),
             layer.self_attn.k_proj.weight.detach().double()) for layer in hf.model.layers]


def _assert_weights_only_equal_hf(folder):
    qk, ref = read_qk_weights(folder), _hf_qk(folder)
    n, n_kv, dh = qk.n_heads, qk.n_kv_heads, qk.d_head
    for layer, (q, k) in enumerate(ref):
        # TL layout: W_Q[h, :, j] is row h * d_head + j of HF's [out, in] weight
        assert torch.equal(qk.W_Q[layer], q.reshape(n, dh, -1).transpose(1, 2))
        want_k = k.reshape(n_kv, dh, -1).transpose(1, 2).repeat_interleave(n // n_kv, dim=0)
        assert torch.equal(qk.W_K[layer], want_k)
    return qk


def _leftover_shards(folder, tmp_path, seed=1):
    """A different model's sharded index and shards, left beside ``folder``'s own file."""
    other = tmp_path / f"other-{seed}"
    _llama(other, seed).save_pretrained(other, max_shard_size="20KB")
    names = ["model.safetensors.index.json",
             *json.loads((other / "model.safetensors.index.json").read_text())["weight_map"].values()]
    for name in set(names):
        shutil.copyfile(other / name, folder / name)
    return other


def test_single_file_wins_over_a_leftover_sharded_index(tmp_path):
    folder = tmp_path / "llama"
    _llama(folder, seed=0)
    other = _leftover_shards(folder, tmp_path)
    assert (folder / "model.safetensors").is_file()
    assert (folder / "model.safetensors.index.json").is_file()
    qk = _assert_weights_only_equal_hf(folder)
    # the leftover shards hold other weights, so reading them would have shown
    assert not torch.equal(qk.W_Q[0], read_qk_weights(other).W_Q[0])
    assert qk.source["files"] == ["model.safetensors"] == checkpoint_files(folder)
    _, info = load_model(folder, device="cpu")
    assert info.weights["files"] == ["model.safetensors"]
    assert json.loads(json.dumps(info.to_dict()))["weights"]["files"] == ["model.safetensors"]


def test_shards_alone_are_read_through_their_index(tmp_path):
    folder = tmp_path / "llama"
    _llama(folder, seed=0).save_pretrained(folder, max_shard_size="20KB")
    (folder / "model.safetensors").unlink(missing_ok=True)
    qk = _assert_weights_only_equal_hf(folder)
    assert qk.source["files"][0] == "model.safetensors.index.json"
    assert qk.source["files"] == checkpoint_files(folder) and len(qk.source["files"]) > 2


def test_the_file_config_json_names_wins(tmp_path):
    """``transformers_weights`` in config.json: transformers reads that file first."""
    folder = tmp_path / "llama"
    _llama(folder, seed=0)
    _llama(tmp_path / "alt", seed=2)
    shutil.copyfile(tmp_path / "alt" / "model.safetensors", folder / "alt.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "transformers_weights": "alt.safetensors"}))
    qk = _assert_weights_only_equal_hf(folder)
    assert qk.source["files"] == ["alt.safetensors"]
    assert torch.equal(qk.W_Q[0], read_qk_weights(tmp_path / "alt").W_Q[0])
    _, info = load_model(folder, device="cpu")
    assert info.weights["files"] == ["alt.safetensors"]


def test_a_weights_only_read_of_bin_files_is_refused_by_name(tmp_path):
    folder = tmp_path / "llama"
    model = _llama(folder, seed=0)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*weights-only reading needs"):
        read_qk_weights(folder)


def test_a_distributed_checkpoint_is_refused_by_name(tmp_path):
    """transformers reads torch.distributed shards ahead of any other file: posinterp, which
    does not read them, refuses instead of reading model.safetensors."""
    folder = tmp_path / "llama"
    _llama(folder, seed=0)
    shutil.copyfile(folder / "model.safetensors", folder / "shard-00000-model-00000-of-00001.safetensors")
    with pytest.raises(ValueError, match="torch.distributed checkpoint"):
        checkpoint_files(folder)
    with pytest.raises(ValueError, match="torch.distributed checkpoint"):
        read_qk_weights(folder)
