"""Hub names through a Hugging Face cache written here (no network): resolved into a
snapshot folder and loaded exactly like a local folder, on both TransformerLens lines."""

import pytest
import torch
import transformers

from posinterp.models import load_model
from posinterp.models.pretrained import distinct_revisions, weights_sha256
from tests.helpers import HF_VOCAB, parity_cases, save_sharded, save_tiny_checkpoint, write_hub_cache


@pytest.fixture
def cache(tmp_path, monkeypatch, no_network):
    root = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def _gpt2(folder, seed):
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=HF_VOCAB)
    return save_tiny_checkpoint("GPT2LMHeadModel", cfg, folder, seed=seed)


def _same_model(a, b):
    toks = torch.randint(0, HF_VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.equal(a(toks), b(toks))


def test_a_cached_name_and_revision_load_like_their_folders(tmp_path, cache):
    _gpt2(tmp_path / "final", seed=0)
    _gpt2(tmp_path / "early", seed=1)
    main = write_hub_cache(cache, "org/tiny-gpt2", tmp_path / "final")
    early = write_hub_cache(cache, "org/tiny-gpt2", tmp_path / "early", ref="step1000")
    model, info = load_model("org/tiny-gpt2")
    assert (info.spec, info.source) == ("org/tiny-gpt2", "hub")
    assert info.weights["commit"] == main.name and info.weights["revision"] == "main"
    assert info.weights["files"] == ["model.safetensors"] and info.hf_check
    local, _ = load_model(tmp_path / "final")
    assert _same_model(model, local)
    model_e, info_e = load_model("org/tiny-gpt2", revision="step1000")
    assert info_e.weights["commit"] == early.name and info_e.weights["revision"] == "step1000"
    assert _same_model(model_e, load_model(tmp_path / "early")[0])
    assert not _same_model(model_e, model)
    # a commit hash is a revision too
    assert load_model("org/tiny-gpt2", revision=early.name)[1].weights["commit"] == early.name


def test_a_cached_alibi_model_gets_the_same_exact_slopes(tmp_path, cache):
    arch, make, _ = parity_cases()["bloom-6-heads"]
    save_tiny_checkpoint(arch, make(), tmp_path / "bloom")
    write_hub_cache(cache, "bigscience/tiny-bloom", tmp_path / "bloom")
    model, info = load_model("bigscience/tiny-bloom")
    local, local_info = load_model(tmp_path / "bloom")
    assert info.alibi_slopes == local_info.alibi_slopes and _same_model(model, local)


def test_hub_names_get_the_same_refusals_as_folders(tmp_path, cache):
    from posinterp.models.hf_config import UnsupportedConfigError

    arch, make, refusal = parity_cases()["llama-attention-bias"]
    save_tiny_checkpoint(arch, make(), tmp_path / "llama")
    write_hub_cache(cache, "org/biased-llama", tmp_path / "llama")
    with pytest.raises(UnsupportedConfigError, match=refusal):
        load_model("org/biased-llama")


def test_a_name_neither_cached_nor_reachable_says_where_to_put_it(tmp_path, cache):
    _gpt2(tmp_path / "m", seed=0)
    write_hub_cache(cache, "org/tiny-gpt2", tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="no such folder or file: org/absent") as err:
        load_model("org/absent")
    assert str(cache) in str(err.value) and "hf download org/absent" in str(err.value)
    with pytest.raises(FileNotFoundError, match="--revision step9"):
        load_model("org/tiny-gpt2", revision="step9")
    with pytest.raises(ValueError, match="revision='main' applies to hub names only"):
        load_model(tmp_path / "m", revision="main")


def test_an_unreachable_hub_is_named_without_offline_mode(tmp_path, cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def unreachable(*args, **kwargs):  # what snapshot_download raises on a connection error
        calls.append(kwargs)
        raise LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(FileNotFoundError, match=r"hub cannot be reached \(LocalEntryNotFoundError\)"):
        load_model("org/absent")
    assert calls[0]["local_files_only"] is False and calls[0]["cache_dir"] == cache


def test_weight_digests_ignore_storage_and_refuse_duplicate_revisions(tmp_path, cache):
    hf = _gpt2(tmp_path / "a", seed=0)
    save_sharded(hf, tmp_path / "a-bin-shards", "bin", shard_size="5KB")
    _gpt2(tmp_path / "b", seed=1)
    digest = weights_sha256(tmp_path / "a")
    assert weights_sha256(tmp_path / "a-bin-shards") == digest != weights_sha256(tmp_path / "b")
    write_hub_cache(cache, "org/pythia-tiny", tmp_path / "a", ref="main")
    write_hub_cache(cache, "org/pythia-tiny", tmp_path / "b", ref="step1000")
    write_hub_cache(cache, "org/pythia-tiny", tmp_path / "a-bin-shards", ref="step2000")
    digests = distinct_revisions("org/pythia-tiny", ["step1000", "main"])
    assert list(digests) == ["step1000", "main"] and digests["main"] == digest
    with pytest.raises(ValueError, match="'main' and 'step2000' hold identical weights"):
        distinct_revisions("org/pythia-tiny", ["step1000", "main", "step2000"])


def test_hf_parity_of_a_hub_name_compares_with_the_revision_loaded(tmp_path, cache):
    from posinterp.models.parity import hf_parity

    _gpt2(tmp_path / "final", seed=0)
    _gpt2(tmp_path / "early", seed=1)
    write_hub_cache(cache, "org/tiny-gpt2", tmp_path / "final")
    write_hub_cache(cache, "org/tiny-gpt2", tmp_path / "early", ref="step1000")
    table = hf_parity("org/tiny-gpt2", revision="step1000", lengths=(8,), paddings=("none", "left"))
    assert table.value.max() <= 1e-5


def test_only_the_weight_files_transformers_reads_are_downloaded(tmp_path, cache, monkeypatch):
    """A stand-in hub serving a repo with sharded safetensors, a consolidated copy (as
    Mistral's repos have), .bin files and a Flax file: only config, index and shards come."""
    import fnmatch
    import shutil

    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    remote = tmp_path / "remote"
    hf = _gpt2(tmp_path / "a", seed=0)
    save_sharded(hf, remote, "safetensors", shard_size="5KB")
    for extra in ("consolidated.safetensors", "pytorch_model.bin", "flax_model.msgpack"):
        shutil.copyfile(tmp_path / "a" / "model.safetensors", remote / extra)
    snap = cache / "models--org--big" / "snapshots" / ("0" * 40)
    asked = []

    def hub(name, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None):
        assert not local_files_only and name == "org/big"
        asked.append(allow_patterns)
        snap.mkdir(parents=True, exist_ok=True)
        for f in remote.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copyfile(f, snap / f.name)
        return str(snap)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    model, info = load_model("org/big")
    fetched = sorted(p.name for p in snap.iterdir())
    shards = sorted(p.name for p in remote.glob("model-*.safetensors"))
    assert fetched == sorted(["config.json", "generation_config.json",
                              "model.safetensors.index.json", *shards])
    assert info.weights["files"] == ["model.safetensors.index.json", *shards]
    assert _same_model(model, load_model(tmp_path / "a")[0])


def test_transformerlens_aliases_name_their_repository(tmp_path, cache):
    from posinterp.models.backend import hub_repo_for

    assert hub_repo_for("pythia-70m") == "EleutherAI/pythia-70m"
    assert hub_repo_for("org/not-an-alias") == "org/not-an-alias"
    _gpt2(tmp_path / "m", seed=0)
    write_hub_cache(cache, "EleutherAI/pythia-70m", tmp_path / "m")  # any weights will do
    _, info = load_model("pythia-70m")
    assert info.weights["hub"] == "EleutherAI/pythia-70m" and info.spec == "pythia-70m"
