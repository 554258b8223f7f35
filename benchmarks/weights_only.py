"""Weights-only spectra at real attention shapes: peak memory and time against the floor.

Writes a synthetic Llama folder with a real model's attention shapes (``--shape 8b``:
Llama-3.1-8B's 32 layers, d_model 4096, 32 query heads over 8 KV heads, d_head 128;
``--shape 70b``: d_model 8192, 64 over 8 heads), bf16, in 4 safetensors shards with an
index. Only what a weights-only spectrum reads is written (q_proj, k_proj and the
attention norm per layer, plus config.json): the MLP and the vocabulary are not read, so
leaving them out changes nothing measured here and keeps the folder at q/k size.

Then, each in a fresh process with one thread:

* **floor**: read every layer's q/k with ``safetensors.safe_open``, form W_K^T W_Q per
  head in float64 and take its eigenvalues, for offsets 0 and -1 (what the spectrum
  table holds);
* **posinterp**: ``posinterp.experiments.spectrum.run_weights_only`` (``posinterp
  spectrum --weights-only``: spectrum.csv, heads.csv with the measures and their
  2,500-head Ginibre null percentiles, run.json).

Prints each one's wall time and peak RSS (the child's own ``VmHWM``: ``ru_maxrss`` would
count this parent's memory at fork, i.e. the folder's writing), the ratio, one head's eigenvalues checked
against numpy's on the same weights, and projections from the measured seconds per layer:
a whole Llama-70B and 154 Pythia-12B revisions on one machine and on 8 or 32 Ray workers.
With ``--layers 8,32,80`` it shows whether peak RSS is flat in depth (the folders are
written one after another and removed).

    OMP_NUM_THREADS=1 python benchmarks/weights_only.py --shape 8b
    OMP_NUM_THREADS=1 python benchmarks/weights_only.py --shape 70b --layers 8,16 --skip-floor

Needs about 1.4 GB of disk for 8b (32 layers), 150 MB per layer for 70b.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SHAPES = {"small": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                        num_hidden_layers=4),
          "8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     num_hidden_layers=32),
          "70b": dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      num_hidden_layers=80)}


def write_folder(folder: Path, shape: dict, n_layers: int, seed: int = 0) -> int:
    """The synthetic checkpoint; returns the bytes of q/k/norm tensors written."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    D, H, kv, dh = (shape[k] for k in ("hidden_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
              "num_attention_heads": H, "num_key_value_heads": kv, "head_dim": dh,
              "num_hidden_layers": n_layers, "intermediate_size": 256, "vocab_size": 256,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    shards = 4
    per = -(-n_layers // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for i in range(s * per, min(n_layers, (s + 1) * per)):
            p = f"model.layers.{i}."
            for part, rows in (("q_proj", H * dh), ("k_proj", kv * dh)):
                w = torch.randn(rows, D, generator=gen) * 0.02
                tensors[p + f"self_attn.{part}.weight"] = w.bfloat16()
            tensors[p + "input_layernorm.weight"] = (1 + 0.1 * torch.randn(D, generator=gen)).bfloat16()
        if tensors:
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({k: name for k in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


FLOOR = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import torch
    from safetensors import safe_open
    from posinterp._memory import peak_rss_mb
    torch.set_num_threads(1)
    folder = Path(sys.argv[1])
    cfg = json.loads((folder / "config.json").read_text())
    wm = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    H, kv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t0 = time.perf_counter()
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        with safe_open(str(folder / wm[p + "q_proj.weight"]), "pt") as f:
            q = f.get_tensor(p + "q_proj.weight").double().reshape(H, dh, -1).transpose(1, 2)
            k = f.get_tensor(p + "k_proj.weight").double().reshape(kv, dh, -1).transpose(1, 2)
        k = k.repeat_interleave(H // kv, dim=0)
        for _ in (0, -1):  # the two offsets of the spectrum table
            torch.linalg.eigvals(k.mT @ q)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds,
                      "peak_rss_mb": peak_rss_mb()}))
""")

OURS = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import torch
    from posinterp._memory import peak_rss_mb
    torch.set_num_threads(1)
    from posinterp.experiments.spectrum import run_weights_only
    from posinterp.models.qk_only import read_qk_weights
    t0 = time.perf_counter()
    run_weights_only([sys.argv[1]], sys.argv[2], progress=False)
    seconds = time.perf_counter() - t0
    # the run's peak, taken before the check below reads anything back
    rss = peak_rss_mb()
    # one head against numpy on the same weights (gain folded, as documented)
    import pandas as pd
    spec = pd.concat(c[(c.layer == 0) & (c["head"] == 3)] for c in pd.read_csv(
        sys.argv[2] + "/spectrum.csv", usecols=["layer", "head", "offset", "real", "imag"],
        chunksize=1 << 16))
    qk = read_qk_weights(sys.argv[1])
    q = qk.W_Q[0][3].numpy() * qk.gain[0].numpy()[:, None]
    k = qk.W_K[0][3].numpy() * qk.gain[0].numpy()[:, None]
    want = np.linalg.eigvals(k.T @ q)
    got = spec[(spec.layer == 0) & (spec["head"] == 3) & (spec.offset == 0)]
    got = got["real"].to_numpy() + 1j * got["imag"].to_numpy()
    err = max(np.abs(got - w).min() for w in want) / np.abs(want).max()
    print(json.dumps({"seconds": seconds, "peak_rss_mb": rss, "head_rel_error": float(err)}))
""")


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # a fixed threshold: RSS is live data
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# Pythia-12B's attention: 36 layers, d_model 5120, 40 heads of 128 (GPT-NeoX, no GQA), and
# the 154 checkpoints of its training series
PYTHIA_12B = dict(hidden_size=5120, num_attention_heads=40, head_dim=128, num_hidden_layers=36)
PYTHIA_REVISIONS = 154
RAY_WORKERS = (8, 32)


def _projections(shape: dict, n_layers: int, seconds: float) -> dict:
    """Projected, not measured: a layer's time taken as linear in n_heads x d_model (its
    products W_K^T W_Q, W_Q^T W_Q: the d_model-sized work; the eigenvalues, n_heads x
    d_head^3, are a few percent at these shapes), the null (drawn once per shape) and
    imports left out; N Ray workers split the revisions (one cell each) with no I/O limit."""
    per = seconds / n_layers / (shape["num_attention_heads"] * shape["hidden_size"])

    def model(s):
        return per * s["num_attention_heads"] * s["hidden_size"] * s["num_hidden_layers"]

    pythia = model(PYTHIA_12B) * PYTHIA_REVISIONS
    return {"projected_from": f"{n_layers} layers measured here",
            "llama70b_80_layers_s": round(model(SHAPES["70b"]), 0),
            "pythia12b_154_revisions_one_machine_h": round(pythia / 3600, 2),
            **{f"pythia12b_154_revisions_{w}_ray_workers_h": round(pythia / w / 3600, 3)
               for w in RAY_WORKERS}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--layers", default=None, help="comma-separated layer counts (default: the model's)")
    p.add_argument("--skip-floor", action="store_true")
    p.add_argument("--root", type=Path, default=None, help="where to write the folders (default: a temp dir)")
    args = p.parse_args()
    shape = SHAPES[args.shape]
    counts = [int(x) for x in args.layers.split(",")] if args.layers else [shape["num_hidden_layers"]]
    root = Path(tempfile.mkdtemp(dir=args.root))
    try:
        for n in counts:
            folder = root / f"{args.shape}-{n}"
            nbytes = write_folder(folder, shape, n)
            line = {"shape": args.shape, "layers": n, "qk_bytes_gb": round(nbytes / 1e9, 2)}
            if not args.skip_floor:
                floor = _run(FLOOR, str(folder))
                line.update(floor_s=round(floor["seconds"], 1), floor_rss_mb=round(floor["peak_rss_mb"]))
            ours = _run(OURS, str(folder), str(root / f"out-{n}"))
            line.update(ours_s=round(ours["seconds"], 1), ours_rss_mb=round(ours["peak_rss_mb"]),
                        head_rel_error=f"{ours['head_rel_error']:.1e}")
            if not args.skip_floor:
                line["ratio"] = round(ours["seconds"] / floor["seconds"], 2)
            print(json.dumps(line), flush=True)
            print(json.dumps(_projections(shape, n, ours["seconds"])), flush=True)
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
