"""The main job: watch the adjacency pattern of a NoPE model at init and after training.

Builds the ``small`` NoPE model, scores adjacency by layer at init, trains it on
reversal until 90% exact match on held-out samples, scores again, and writes a
self-contained HTML report (Zuo et al. 2024, arXiv 2501.00073; docs/concepts.md,
"Run times on 2 CPU cores").
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch

from .._validate import derive
from ..analysis import adjacency_by_layer, similarity_by_layer
from ..devices import resolve_device
from ..io import atomic_path, atomic_write_json, check_out_dir, folder_lock, versions
from ..models import build_model, preset
from ..models.backend import run_cached
from ..tasks import CHAR_VOCAB, TaskConfig, make_task_data
from ..training import TrainConfig, _comparable, evaluate, latest_checkpoint, train
from ..viz import Report, adjacency_plot, attention_view, history_plot, similarity_grid

__all__ = ["DemoConfig", "DemoResult", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    """Settings of ``posinterp demo``.

    ``digits`` is the fixed length of the strings to reverse: docs/concepts.md measured
    6 digits at ~500 steps (``--quick``) and 8 digits at ~1,100 steps (default) for the
    4-layer, 192-wide NoPE model on 2 CPU cores.

    ``threads`` is the torch thread count for the whole run (default 1, restored
    afterwards). One thread degrades gracefully when other CPU-bound jobs share the
    cores; with every core, torch's threads wait on each other whenever one is
    descheduled, and a run next to one busy process took several times longer
    (docs/performance.md). Results depend on the thread count (summation order), and
    ``run.json`` records it.

    ``n_test`` is how many held-out samples give the final accuracy (the first ones of
    the split; default: all 20,000, or 5,000 with ``quick``: a standard error of about
    0.003 at 95% accuracy). Training and its stopping rule do not depend on it.
    """

    quick: bool = False
    digits: int | None = None
    preset: str = "small"
    seed: int = 0
    max_steps: int | None = None
    target_accuracy: float = 0.9
    n_analysis: int = 64
    init_seeds: int = 5
    threads: int = 1
    n_test: int | None = None

    def __post_init__(self) -> None:
        # Derived from quick; they follow it through dataclasses.replace unless set.
        derive(self, "digits", lambda: 6 if self.quick else 8)
        # The learning rate decays (cosine) over max_steps: a 600-step horizon decays it
        # while 6-digit reversal converges, which reached the target in 350 steps
        # instead of the 600 that a 1,500-step horizon took (seed 0; docs/performance.md).
        derive(self, "max_steps", lambda: 600 if self.quick else 3000)
        derive(self, "n_test", lambda: 5000 if self.quick else None)
        if not 5 <= self.digits <= 16:
            raise ValueError(f"digits must be in 5..16 (enough distinct strings), got {self.digits}")
        if self.n_analysis < 1 or self.init_seeds < 1:
            raise ValueError("n_analysis and init_seeds must be >= 1")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be >= 1 (an integer), got {self.threads!r}")
        if self.n_test is not None and (isinstance(self.n_test, bool)
                                        or not isinstance(self.n_test, int) or self.n_test < 1):
            raise ValueError(f"n_test must be >= 1 (an integer) or None for all, got {self.n_test!r}")


@dataclass(frozen=True)
class DemoResult:
    table: pd.DataFrame
    adjacency: pd.DataFrame
    report_path: Path
    accuracy: float
    steps: int
    reached_target: bool


def _random_tokens(n: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(4, CHAR_VOCAB.size, (n, length), generator=gen)
    toks[:, 0] = CHAR_VOCAB.bos_id
    return toks


def _adjacency(model, inputs: dict, state: str, seed: int) -> pd.DataFrame:
    frames = []
    for name, (toks, mask) in inputs.items():
        df = adjacency_by_layer(model, toks, attention_mask=mask)
        frames.append(df.assign(state=state, input=name, seed=seed))
    return pd.concat(frames, ignore_index=True)


def run_demo(config: DemoConfig = DemoConfig(), out_dir: str | Path = "posinterp-demo",
             progress: bool = True, device=None) -> DemoResult:
    """Run the demo and write ``report.html``, ``adjacency.csv``, ``history.csv`` to ``out_dir``.

    Models train and run on ``device`` (:func:`posinterp.devices.resolve_device`; None:
    CUDA when available, else CPU); ``run.json`` records it.

    Resumable: training checkpoints live in ``out_dir/checkpoints``; a rerun with the
    same config continues from the latest undamaged one (docs/faults.md). While it runs
    it holds a lock on ``out_dir``.

    Returns:
        :class:`DemoResult` with the per-layer table (init vs trained).

    Raises:
        ValueError: for invalid config values, an ``out_dir`` that is a file, or an
            ``out_dir`` holding a run with other settings (checked before any work; the
            message names the options that differ). Nothing is created on bad input.
        posinterp.io.FolderInUse: (a ValueError) if another run is writing ``out_dir``.
        OSError: if a file cannot be written (full disk, read-only folder), naming it.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with contextlib.ExitStack() as held:  # the folder's lock, once it is checked
            return _run_demo(config, out_dir, progress, device, held)
    finally:
        torch.set_num_threads(before)


def _run_demo(config: DemoConfig, out_dir: str | Path, progress: bool, device=None,
              held: contextlib.ExitStack | None = None) -> DemoResult:
    device = resolve_device(device)
    d = config.digits
    task_cfg = TaskConfig("reversal", min_digits=d, max_digits=d, seed=config.seed)
    model_cfg = preset(config.preset, pe="nope", seed=config.seed)
    train_cfg = TrainConfig(
        max_steps=config.max_steps, target_accuracy=config.target_accuracy,
        eval_every=50 if config.quick else 100, warmup_steps=50, seed=config.seed)
    _check_resumable(Path(out_dir), {"model": model_cfg.to_dict(), "task": task_cfg.to_dict(),
                                     "train": train_cfg.to_dict()}, config.threads)
    out = check_out_dir(out_dir, "out_dir")
    if held is not None:  # one run per folder: a second one is refused (io.FolderInUse)
        held.enter_context(folder_lock(out))
    # The thread count changes the numbers (summation order) but is not a training config:
    # record it before training, so a resume with another count is refused by name.
    atomic_write_json(out / "threads.json", {"threads": config.threads})
    t0 = time.time()
    data = make_task_data(task_cfg)

    test = data.test
    n = min(config.n_analysis, len(test))
    inputs = {
        "random tokens": (_random_tokens(n, data.max_len, seed=10_000 + config.seed), None),
        "task samples": (test.tokens[:n], test.attention_mask[:n]),
    }
    log = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    log(f"[posinterp] adjacency at init ({model_cfg.n_layers} layers, d_model "
        f"{model_cfg.d_model}, NoPE, N({model_cfg.init_mean}, {model_cfg.init_std}))")
    model = build_model(model_cfg, device=device)
    frames = [_adjacency(model, inputs, "init", config.seed)]
    # The embedding score depends on the tokens and W_E: average init seeds too (docs/concepts.md).
    for s in range(1, config.init_seeds):
        m = build_model(preset(config.preset, pe="nope", seed=config.seed + s), device=device,
                        tokenizer=model.tokenizer)  # building a tokenizer costs ~0.3 s
        frames.append(_adjacency(m, {"random tokens": inputs["random tokens"]}, "init",
                                 config.seed + s))
    sample_toks = test.tokens[:1, : int(test.attention_mask[0].sum())]
    init_sims = similarity_by_layer(model, sample_toks)

    log(f"[posinterp] training on {d}-digit reversal until {config.target_accuracy:.0%} "
        f"exact match (at most {config.max_steps} steps)")
    try:
        result = train(model_cfg, data, train_cfg, checkpoint_dir=out / "checkpoints",
                       progress=progress, model=model, threads=None)  # run_demo set them
    except ValueError as err:
        if "different" not in str(err):
            raise
        raise ValueError(f"{out} holds a demo run with other settings (e.g. --quick vs the "
                         "default); choose another --out folder or delete this one") from None
    model = result.model
    n_test = len(test) if config.n_test is None else min(config.n_test, len(test))
    final = evaluate(model, test, n_test)  # not the training-time subset
    frames.append(_adjacency(model, inputs, "trained", config.seed))
    adjacency = pd.concat(frames, ignore_index=True).assign(model=f"{config.preset}-nope")
    trained_sims = similarity_by_layer(model, sample_toks)

    table = _table(adjacency, config.seed)
    with atomic_path(out / "adjacency.csv") as tmp:
        adjacency.to_csv(tmp, index=False)
    with atomic_path(out / "history.csv") as tmp:
        result.history.to_csv(tmp, index=False)
    meta = {"demo": asdict(config), "model": model_cfg.to_dict(), "task": data.config.to_dict(),
            "train": train_cfg.to_dict(), "steps": result.steps,
            "reached_target": result.reached_target, "test_accuracy": final["test_accuracy"],
            "n_test": n_test, "threads": config.threads, "device": str(device),
            "cpu": cpu_name(), "versions": versions(),
            "seconds": round(time.time() - t0, 1)}
    atomic_write_json(out / "run.json", meta)

    report = _report(config, model_cfg, model, table, adjacency, result, final, sample_toks,
                     init_sims, trained_sims, n_test, len(test), out / "figures")
    path = report.save(out / "report.html")
    return DemoResult(table, adjacency, path, final["test_accuracy"], result.steps,
                      result.reached_target)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else :func:`platform.processor`).

    Training is deterministic per CPU, not across CPUs: one torch build's float32 kernels
    round differently on another x86 CPU, and training amplifies that into another step
    count and accuracy (docs/performance.md), so ``run.json`` names the CPU with the
    figures."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# Which command-line option sets a config field, to name it when a rerun differs.
_OPTION_OF = {("task", "min_digits"): "--digits", ("task", "max_digits"): "--digits",
              ("task", "seed"): "--seed", ("model", "seed"): "--seed", ("train", "seed"): "--seed",
              ("train", "max_steps"): "--max-steps", ("train", "eval_every"): "--quick"}


def _check_resumable(out: Path, configs: dict, threads: int) -> None:
    """Refuse at once (not after the init analysis) to resume a run made with other options
    (``threads`` included: it changes the numbers)."""
    try:
        last = latest_checkpoint(out / "checkpoints") if out.is_dir() else None
    except OSError:
        return
    if last is None:
        return
    try:
        saved = _comparable(json.loads((last / "config.json").read_text()))
    except (OSError, ValueError):
        return  # train() reports unreadable checkpoints by name
    now = _comparable(configs)
    diffs = {(_OPTION_OF.get((part, k), f"{part}.{k}"), saved.get(part, {}).get(k), v)
             for part in now for k, v in now[part].items() if saved.get(part, {}).get(k) != v}
    # --quick shows as its eval_every (50 vs 100): name the option, not the number
    diffs = {("--quick", "--quick" if old == 50 else "no --quick", "--quick" if new == 50
              else "no --quick") if opt == "--quick" else (opt, old, new)
             for opt, old, new in diffs}
    try:
        saved_threads = json.loads((out / "threads.json").read_text())["threads"]
    except (OSError, ValueError, KeyError):
        saved_threads = None  # older folders did not record it
    if saved_threads is not None and saved_threads != threads:
        diffs.add(("--threads", saved_threads, threads))
    diffs = sorted(diffs, key=str)
    if diffs:
        said = "; ".join(f"{opt}: the folder has {old!r}, this run {new!r}" for opt, old, new in diffs)
        raise ValueError(f"{out} holds a demo run with other settings ({said}); rerun with the "
                         "folder's settings to resume, or choose another --out folder")


def _table(adjacency: pd.DataFrame, seed: int) -> pd.DataFrame:
    """Wide view: one row per hook, columns per (state, input)."""
    a = adjacency[adjacency.metric == "adjacency_score"]
    main = a[a.seed == seed]
    wide = main.pivot_table(index=["hook", "layer"], columns=["state", "input"], values="value",
                            sort=False)
    wide.columns = [f"{s} / {i}" for s, i in wide.columns]
    seeds = a[(a.state == "init") & (a.input == "random tokens")]
    agg = seeds.groupby("hook", sort=False).value.agg(["mean", "std", "count"])
    wide["init / random, mean over seeds"] = agg["mean"].reindex(wide.index.get_level_values(0)).values
    wide["sd"] = agg["std"].reindex(wide.index.get_level_values(0)).values
    return wide.reset_index()


def _example(digits: int) -> str:
    s = "".join(str((i + 1) % 10) for i in range(digits))
    return f"rev({s})={s[::-1]}"


def _reading(table: pd.DataFrame) -> str:
    """What to look at in the table, said from its own numbers."""
    first = table[table.hook == "blocks.0.hook_resid_mid"]
    embed = table[table.layer == -1]
    parts = []
    if len(first) and {"init / random tokens", "trained / random tokens"} <= set(table.columns):
        a, b = float(first["init / random tokens"].iloc[0]), float(first["trained / random tokens"].iloc[0])
        trend = "falls" if b < a - 0.02 else "rises" if b > a + 0.02 else "stays about level"
        parts.append(
            f"What to look at: after the first attention layer (L0 resid_mid) the score on random "
            f"tokens is {a:.3f} at init and {b:.3f} trained, so it {trend} with training. The "
            "pattern is there before any training: the causal average alone makes nearby "
            "positions similar (Zuo et al.'s claim at random init). Training does not have to "
            "keep it: once the model solves the task with its own attention patterns, the "
            "residual stream may carry position in other ways, so a falling score here is a "
            "measured outcome, not a failure of the run.")
        attn = table[table.hook == "blocks.0.hook_attn_out"]
        if len(attn):
            c, d = (float(attn[f"{s} / random tokens"].iloc[0]) for s in ("init", "trained"))
            parts.append(
                f"At the first attention output alone (L0 attn_out, the paper's measurement "
                f"point) it is {c:.3f} at init and {d:.3f} trained; resid_mid adds the "
                "embedding, so its score also depends on the two norms' ratio "
                "(docs/concepts.md).")
    if len(embed) and {"init / random tokens", "init / task samples"} <= set(table.columns):
        r, t = float(embed["init / random tokens"].iloc[0]), float(embed["init / task samples"].iloc[0])
        parts.append(
            f"At the embedding (layer -1) the score is {r:.3f} on random tokens but {t:.3f} on "
            "task samples: every sample shares the template rev(...)=, which puts the same "
            "tokens at the same places, so the embedding score depends on the token string. "
            "The chance-level check (0.5) uses random tokens and the mean over init seeds.")
    return " ".join(parts)


def _report(config, model_cfg, model, table, adjacency, result, final, sample_toks,
            init_sims, trained_sims, n_test, n_split, figures: Path) -> Report:
    d = config.digits
    rep = Report("posinterp demo: the adjacency pattern of a NoPE transformer, at init and trained")
    rep.paragraph(
        "A causal transformer without positional encodings (NoPE) still knows position: "
        "after the first causal attention layer, nearby tokens' residual vectors are more "
        "cosine-similar than distant ones (Zuo, Guerzhoy & Guerzhoy 2024, arXiv 2501.00073). "
        "The adjacency score is the probability, over pairs i < j < k, that token k is more "
        "similar to the nearer token j than to i (ties count 1/2); 0.5 is chance.")
    rep.paragraph(
        f"Model: {model_cfg.n_layers} layers, d_model {model_cfg.d_model}, {model_cfg.n_heads} "
        f"heads, NoPE, init N({model_cfg.init_mean}, {model_cfg.init_std}), seed {config.seed}. "
        f"Task: reversal of fixed-length {d}-digit strings (e.g. {_example(d)}), "
        f"{f'--quick: {d} digits' if config.quick else f'{d} digits'}, as measured "
        "feasible on 2 CPU cores (docs/concepts.md). Adjacency is measured on "
        f"{config.n_analysis} random-token sequences and {config.n_analysis} held-out task "
        "samples.", note=True)
    status = "reached" if result.reached_target else "did NOT reach"
    rep.heading("Accuracy")
    rep.paragraph(
        f"Training {status} {config.target_accuracy:.0%} exact match (on a 1,000-sample "
        f"subset) after {result.steps} steps. Exact-match accuracy on "
        f"{'all ' if n_test == n_split else ''}{n_test:,} held-out samples"
        f"{'' if n_test == n_split else f' (of {n_split:,})'}: {final['test_accuracy']:.3f}.")
    rep.figure(history_plot(result.history, config.target_accuracy), "training curve",
               save_as=figures / "accuracy")
    rep.heading("Adjacency score by layer (init vs trained)")
    rep.paragraph(_reading(table), note=True)
    rep.table(table)
    rep.figure(adjacency_plot(adjacency[adjacency.seed == config.seed].assign(
        curve=lambda x: x.state + " / " + x.input), by="curve"), "adjacency by hook",
        save_as=figures / "adjacency_by_layer")
    labels = {h: h.replace("blocks.", "L").replace(".hook_", " ") for h in init_sims}
    for state, sims in (("init", init_sims), ("trained", trained_sims)):
        rep.heading(f"Cosine self-similarity on one test sample ({state})", level=3)
        rep.figure(similarity_grid({labels[h]: s[0] for h, s in sims.items()},
                                   title=state, tokens=model.to_str_tokens(sample_toks[0])),
                   f"similarity heatmaps, {state}",
                   save_as=figures / f"similarity_{state}")
    rep.heading("Attention patterns of every head (trained model, one test sample)")
    cache = run_cached(model, sample_toks, None, lambda n: n.endswith("hook_pattern"))
    str_tokens = model.to_str_tokens(sample_toks[0])
    for layer in range(model.cfg.n_layers):
        rep.circuits(attention_view(str_tokens, cache[f"blocks.{layer}.attn.hook_pattern"][0]),
                     caption=f"layer {layer}")
    return rep
