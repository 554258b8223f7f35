import json

import pandas as pd
import pytest
import torch

from posinterp.experiments.zoo import ZooConfig, list_zoo, load_zoo_model, train_zoo
from posinterp.models import build_model, load_model
from posinterp.tasks.corpus import stdlib_corpus
from posinterp.tasks.tokenizer import build_byte_tokenizer

TINY = ZooConfig(n_layers=1, d_model=16, n_heads=2, n_ctx=16, batch_size=4, max_steps=6,
                 eval_every=3, n_val_windows=4, n_snapshots=3, schemes=("rotary", "absolute"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lib")
    for i in range(30):
        (root / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # module {i}\n" * 20)
    (root / "test").mkdir()
    (root / "test" / "skipped.py").write_text("never read\n")
    return stdlib_corpus(root)


def test_corpus_split_is_by_file_and_fingerprinted(corpus, tmp_path):
    assert corpus.info["n_files"] == 30 and 0 < corpus.info["n_val_files"] < 30
    assert b"never read" not in bytes(corpus.train.numpy())
    again = stdlib_corpus(corpus.info["root"])
    assert again.fingerprint == corpus.fingerprint and torch.equal(again.val, corpus.val)
    w = corpus.windows("train", torch.tensor([0, 5]), 8)
    assert w.shape == (2, 8) and w.dtype == torch.long
    assert bytes(w[0].tolist()) == bytes(corpus.train[:8].tolist())


def test_byte_tokenizer_round_trip():
    tok = build_byte_tokenizer()
    text = "déf f(x):\n\treturn x  # € ✓"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode()) and tok.decode(ids) == text


def test_schemes_share_every_other_weight_at_init():
    models = {pe: build_model(TINY.model_config(pe, seed=3)) for pe in TINY.schemes + ("nope",)}
    ref = dict(models["rotary"].named_parameters())
    for pe, m in models.items():
        for name, p in m.named_parameters():
            if name in ref:
                assert torch.equal(p, ref[name]), (pe, name)


def test_train_list_load_and_skip(tmp_path, corpus):
    df = train_zoo(TINY, seeds=1, home=tmp_path, progress=False, corpus=corpus)
    assert list(df.pe) == ["rotary", "absolute"] and (df.steps == 6).all()
    listed = list_zoo(tmp_path)
    assert set(listed.status) == {"done"} and len(listed) == 2
    card = json.loads((tmp_path / "rotary-seed0" / "card.json").read_text())
    assert card["corpus"]["fingerprint"] == corpus.fingerprint
    assert card["snapshot_steps"] == [0, 1, 2, 6]
    assert set(card["previous_token_heads"]) >= {"random_tokens", "natural_text"}
    # Finished cells are skipped: a second call trains nothing and returns the same.
    again = train_zoo(TINY, seeds=1, home=tmp_path, progress=False, corpus=corpus)
    assert again.equals(df)
    model, card2 = load_zoo_model("zoo:rotary", home=tmp_path)
    init, _ = load_zoo_model("zoo:rotary:0@0", home=tmp_path)
    fresh = build_model(TINY.model_config("rotary", 0))
    torch.testing.assert_close(init.W_Q, fresh.W_Q)
    assert not torch.equal(model.W_Q, fresh.W_Q)


def test_load_model_zoo_spec(tmp_path, corpus, monkeypatch):
    train_zoo(ZooConfig(**{**TINY.__dict__, "schemes": ("alibi",)}), home=tmp_path / "zoo",
              progress=False, corpus=corpus)
    monkeypatch.setenv("POSINTERP_HOME", str(tmp_path))
    model, info = load_model("zoo:alibi")
    assert info.source == "zoo" and info.pe == "alibi" and len(info.alibi_slopes) == 2


@pytest.mark.parametrize("spec, err", [("zoo:sinusoidal", ValueError), ("zoo:rotary:x", ValueError),
                                       ("zoo:rotary:7", FileNotFoundError)])
def test_bad_zoo_specs(tmp_path, spec, err):
    with pytest.raises(err):
        load_zoo_model(spec, home=tmp_path)


def test_first_seed_selects_the_seed_range(tmp_path, corpus):
    cfg = ZooConfig(**{**TINY.__dict__, "schemes": ("nope",), "max_steps": 2})
    df = train_zoo(cfg, seeds=2, first_seed=3, home=tmp_path, progress=False, corpus=corpus)
    assert df.seed.tolist() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nope-seed3", "nope-seed4"]
    with pytest.raises(ValueError, match="first_seed"):
        train_zoo(cfg, first_seed=-1, home=tmp_path, corpus=corpus)


def test_a_process_pool_trains_the_same_models(tmp_path, corpus):
    from posinterp.executors import ProcessExecutor

    cfg = ZooConfig(**{**TINY.__dict__, "max_steps": 2})
    local = train_zoo(cfg, home=tmp_path / "local", progress=False, corpus=corpus)
    pool = train_zoo(cfg, home=tmp_path / "pool", progress=False, corpus=corpus,
                     executor=ProcessExecutor(2))
    pd.testing.assert_frame_equal(local, pool)
    for pe in cfg.schemes:
        a, b = (load_zoo_model(f"zoo:{pe}", home=tmp_path / h)[0] for h in ("local", "pool"))
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.equal(x, y), (pe, name)


def test_family_configs_validate_and_derive_their_fields():
    from posinterp.cli import FAMILY_NAMES
    from posinterp.experiments.zoo import FAMILIES, ZooFamily, zoo_family

    assert set(FAMILY_NAMES) == set(FAMILIES)  # the CLI names them without importing torch
    seeds = [f.seed for f in FAMILIES.values()]
    assert len(set(seeds)) == len(seeds)  # no two families share an initialization
    assert len(FAMILIES) >= 4
    for fam in FAMILIES.values():
        cfg = fam.config
        assert {"rotary", "absolute", "alibi", "nope"} == set(cfg.schemes)
        assert cfg.d_head * cfg.n_heads == cfg.d_model
        mc = cfg.model_config("rotary", fam.seed)
        assert mc.d_head == cfg.d_head and mc.d_vocab == 256 and mc.n_ctx == cfg.n_ctx
        tc = cfg.train_config(fam.seed)
        assert (tc.lr, tc.weight_decay, tc.batch_size) == (cfg.lr, cfg.weight_decay, cfg.batch_size)
        again = ZooConfig(**{**cfg.to_dict(), "schemes": cfg.schemes})  # the recorded dict rebuilds it
        assert again == cfg
    # families that differ only in data/optimizer differ in what they record
    assert len({json.dumps(f.config.to_dict(), sort_keys=True) for f in FAMILIES.values()}) \
        == len(FAMILIES)
    assert zoo_family("heads8").config.d_head == 8
    with pytest.raises(ValueError, match="family must be one of"):
        zoo_family("nope")
    with pytest.raises(ValueError, match="family name"):
        ZooFamily("a/b", TINY, 0, "x")
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ZooConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="data_part"):
        ZooConfig(data_part=(2, 2))
    with pytest.raises(ValueError, match="weight_decay"):
        ZooConfig(weight_decay=-1.0)


def test_design2_is_design1_with_only_the_steps_tripled():
    from dataclasses import asdict

    from posinterp.cli import FAMILY_SETS as CLI_SETS
    from posinterp.experiments.zoo import FAMILY_SETS, family_set, zoo_family

    assert CLI_SETS == {n: s.folder for n, s in FAMILY_SETS.items()}  # --help needs no torch
    d1, d2 = family_set("design1"), family_set("design2")
    assert d1.folder != d2.folder  # design 1's models and tables are never overwritten
    assert list(d1.families) == list(d2.families)
    for name, f1 in d1.families.items():
        f2 = zoo_family(name, "design2")
        assert (f2.name, f2.seed, f2.differs_in) == (f1.name, f1.seed, f1.differs_in)
        a, b = asdict(f1.config), asdict(f2.config)
        assert {k for k in a if a[k] != b[k]} == {"max_steps"}, name
        assert f2.config.max_steps == 3 * f1.config.max_steps
        # the recorded dict (cards, checkpoints) differs in max_steps alone, so design-2
        # folders resume only under design 2
        r1, r2 = f1.config.to_dict(), f2.config.to_dict()
        assert {k for k in r1.keys() | r2.keys() if r1.get(k) != r2.get(k)} == {"max_steps"}
    with pytest.raises(ValueError, match="family_set must be one of.*design1.*design2"):
        family_set("design3")
    with pytest.raises(ValueError, match="family_set must be one of"):
        zoo_family("base", "design3")


def test_zoo_train_family_set_trains_that_design_s_configs(tmp_path, corpus, monkeypatch):
    from dataclasses import replace

    from posinterp.cli import main
    from posinterp.experiments import zoo
    from posinterp.experiments.zoo import FamilySet, ZooFamily

    cfg = ZooConfig(**{**TINY.__dict__, "max_steps": 2, "n_snapshots": 2,
                       "schemes": ("absolute",)})
    fams = {"fa": ZooFamily("fa", replace(cfg, max_steps=3), 5, "x")}
    monkeypatch.setitem(zoo.FAMILY_SETS, "design2", FamilySet("design2", fams, "d2", "y"))
    monkeypatch.setattr(ZooConfig, "corpus", lambda self: corpus)  # the CLI reads config.corpus()
    assert main(["zoo", "train", "--family-set", "design2", "--home", str(tmp_path),
                 "--no-progress"]) == 0  # no --family: every family of the set
    card = json.loads((tmp_path / "fa" / "absolute-seed5" / "card.json").read_text())
    assert ZooConfig(**card["zoo"]) == fams["fa"].config and card["steps"] == 3
    _, loaded = load_zoo_model("zoo:absolute:5", home=tmp_path / "fa")
    assert loaded["zoo"]["max_steps"] == 3


def test_default_zoo_records_the_config_it_recorded_before_families():
    # models trained before weight_decay/data_part existed must still resume
    assert set(ZooConfig().to_dict()) == {"n_layers", "d_model", "n_heads", "n_ctx", "batch_size",
                                          "max_steps", "lr", "warmup_steps", "eval_every",
                                          "n_val_windows", "n_snapshots", "schemes"}


def test_corpus_parts_are_disjoint_and_cover_the_library(corpus):
    root = corpus.info["root"]
    parts = [stdlib_corpus(root, part=(i, 2)) for i in range(2)]
    assert sum(p.info["n_files"] for p in parts) == corpus.info["n_files"]
    assert sum(len(p.train) + len(p.val) for p in parts) == len(corpus.train) + len(corpus.val)
    assert parts[0].fingerprint != parts[1].fingerprint
    with pytest.raises(ValueError, match="part"):
        stdlib_corpus(root, part=(1, 1))


def test_train_zoo_only_trains_the_schemes_asked(tmp_path, corpus):
    cfg = ZooConfig(**{**TINY.__dict__, "max_steps": 2})
    df = train_zoo(cfg, home=tmp_path, progress=False, corpus=corpus, only=("absolute",))
    assert list(df.pe) == ["absolute"]
    with pytest.raises(ValueError, match="only"):
        train_zoo(cfg, home=tmp_path, progress=False, corpus=corpus, only=("alibi",))
