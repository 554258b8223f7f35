"""Long inputs: time and peak RSS of ``posinterp inspect`` (no ablations) and
``adjacency_by_layer`` against one plain forward pass of the same tokens.

Model: SmolLM2-135M-Instruct (GGUF, ../shared/models; 30 layers x 9 heads, n_ctx 8192).
Text: one paragraph of real English, the GPL-3, Apache-2.0 and GFDL-1.3 texts of Debian's
``/usr/share/common-licenses`` joined with single spaces (about 14,000 tokens), cut to the
first n tokens of its tokenization and written back as text (the CLI's tokenization of
that file gives n tokens, give or take a few at the cut; the real count is printed).

For each n (``--tokens``, default 512,2048,4096,8192), each in a fresh process with one
thread:

* ``forward``: load the model, then time one ``model(tokens, return_type=None)`` under
  ``torch.no_grad()`` (the pass every analysis needs at least once);
* ``forward_blocks``: the same pass in blocks of 512 positions through the model's KV
  cache (``backend.chunked_pass``, what ``query_block="auto"`` runs past 2,048 tokens);
* ``inspect``: ``posinterp inspect MODEL --text FILE --out DIR`` (the CLI, in process:
  its time includes loading the model and writing the page; the ratio to the forward
  pass is conservative by the load time, printed beside it); heads scored in heads.csv;
* ``adjacency``: load, then time ``adjacency_by_layer(model, tokens)`` (every residual
  hook).

Peak RSS is the process's own (``VmHWM``, :func:`posinterp._memory.peak_rss_mb`; the
loaded model is about 2.6 GB of it). One
JSON line per (n, job) goes to ``--out/results.jsonl``; a rerun skips what is there
(8,192 tokens take most of an hour on one core).

    OMP_NUM_THREADS=1 python benchmarks/long_context.py --out /tmp/long-context
    OMP_NUM_THREADS=1 python benchmarks/long_context.py --out /tmp/long-context --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LICENCES = [Path("/usr/share/common-licenses") / f for f in ("GPL-3", "Apache-2.0", "GFDL-1.3")]

COMMON = textwrap.dedent("""
    import json, sys, time
    import torch
    from posinterp._memory import peak_rss_mb as rss
    torch.set_num_threads(1)
    model_path, text_file = sys.argv[1], sys.argv[2]
    def load():
        import posinterp as pi
        from posinterp.experiments.inspect import text_batch
        t0 = time.perf_counter()
        model, _ = pi.load_model(model_path, device="cpu")
        load_s = time.perf_counter() - t0
        tokens, mask = text_batch(model, open(text_file, encoding="utf-8").read())[:2]
        return model, tokens, mask, load_s
""")

JOBS = {
    "forward": COMMON + textwrap.dedent("""
        model, tokens, mask, load_s = load()
        loaded = rss()
        with torch.no_grad():
            t0 = time.perf_counter()
            model(tokens, attention_mask=mask, return_type=None)
            s = time.perf_counter() - t0
        print(json.dumps({"seconds": s, "load_s": load_s, "tokens": int(tokens.shape[1]),
                          "loaded_rss_mb": loaded, "peak_rss_mb": rss()}))
    """),
    "forward_blocks": COMMON + textwrap.dedent("""
        from posinterp.models.backend import chunked_pass
        model, tokens, mask, load_s = load()
        loaded = rss()
        chunked_pass(model, tokens[:, :8], mask[:, :8], 3)  # verified here, not timed
        t0 = time.perf_counter()
        chunked_pass(model, tokens, mask, 512)
        s = time.perf_counter() - t0
        print(json.dumps({"seconds": s, "load_s": load_s, "tokens": int(tokens.shape[1]),
                          "loaded_rss_mb": loaded, "peak_rss_mb": rss()}))
    """),
    "inspect": COMMON + textwrap.dedent("""
        import csv
        from posinterp.cli import main
        out = sys.argv[3]
        t0 = time.perf_counter()
        code = main(["inspect", model_path, "--text", text_file, "--out", out])
        s = time.perf_counter() - t0
        scored = {(r["layer"], r["head"]) for r in csv.DictReader(open(out + "/heads.csv"))
                  if r["metric"] == "previous_token_score" and r["value"] not in ("", "nan")}
        scored = len(scored)
        meta = json.load(open(out + "/inspection.json"))["meta"]
        print(json.dumps({"seconds": s, "exit": code, "heads_scored": scored,
                          "tokens": meta["lengths"][0], "peak_rss_mb": rss()}))
    """),
    "adjacency": COMMON + textwrap.dedent("""
        import posinterp as pi
        model, tokens, mask, load_s = load()
        t0 = time.perf_counter()
        df = pi.adjacency_by_layer(model, tokens, mask)
        s = time.perf_counter() - t0
        print(json.dumps({"seconds": s, "hooks": int(df.hook.nunique()), "peak_rss_mb": rss()}))
    """),
}


def write_text(n: int, path: Path) -> None:
    """The first ``n`` tokens of the licences' text, as text."""
    from transformers import AutoTokenizer

    missing = [str(f) for f in LICENCES if not f.exists()]
    if missing:
        raise SystemExit(f"the benchmark's text is Debian's licence files; missing {missing}")
    text = " ".join(" ".join(f.read_text().split()) for f in LICENCES)
    tok = AutoTokenizer.from_pretrained(str(MODEL.parent), gguf_file=MODEL.name)
    ids = tok(text, add_special_tokens=False)["input_ids"][:n]
    path.write_text(tok.decode(ids), encoding="utf-8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", default="512,2048,4096,8192")
    p.add_argument("--jobs", default="forward,forward_blocks,inspect,adjacency")
    a = p.parse_args()
    if not MODEL.exists():
        raise SystemExit(f"needs {MODEL}")
    a.out.mkdir(parents=True, exist_ok=True)
    results = a.out / "results.jsonl"
    done = {(r["n"], r["job"]) for r in map(json.loads, results.read_text().splitlines())} \
        if results.exists() else set()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for n in [int(x) for x in a.tokens.split(",")]:
        text = a.out / f"text-{n}.txt"
        if not text.exists():
            write_text(n, text)
        for job in a.jobs.split(","):
            if (n, job) in done:
                continue
            out_dir = a.out / f"inspect-{n}"
            if job == "inspect" and out_dir.exists():
                import shutil

                shutil.rmtree(out_dir)  # a run cut short: start again
            proc = subprocess.run([sys.executable, "-c", JOBS[job], str(MODEL), str(text), str(out_dir)],
                                  capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(json.dumps({"n": n, "job": job, "failed": proc.returncode,
                                  "stderr": proc.stderr[-2000:]}), flush=True)
                continue
            line = {"n": n, "job": job, **json.loads(proc.stdout.strip().splitlines()[-1])}
            with open(results, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    by = {(r["n"], r["job"]): r for r in rows}
    for n in sorted({r["n"] for r in rows}):
        fwd = by.get((n, "forward"))
        for job in ("inspect", "adjacency"):
            r = by.get((n, job))
            if fwd and r:
                print(json.dumps({
                    "n": n, "job": job, "ratio_to_forward": round(r["seconds"] / fwd["seconds"], 2),
                    "seconds": round(r["seconds"], 1), "forward_s": round(fwd["seconds"], 1),
                    "load_s": round(fwd["load_s"], 1), "peak_rss_gb": round(r["peak_rss_mb"] / 1024, 2),
                    "forward_peak_rss_gb": round(fwd["peak_rss_mb"] / 1024, 2)}))

if __name__ == "__main__":
    main()
