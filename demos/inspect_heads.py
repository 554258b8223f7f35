"""Inspect individual heads of a loaded model: previous-token scores, QK spectra, patterns.

Offline. Uses the real stories260K llama2.c model when ../shared/models is present,
else a toy RoPE model. Writes ``demo-heads/report.html``.
Run: ``python demos/inspect_heads.py [SPEC]``.
"""

import sys
from pathlib import Path

import torch

import posinterp as pi
from posinterp.analysis.fingerprint import head_table
from posinterp.analysis.spectral import qk_spectrum
from posinterp.viz import Report, attention_view, eigenvalue_planes

torch.manual_seed(0)
stories = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.bin"
if len(sys.argv) > 1:
    model, info = pi.load_model(sys.argv[1])
elif stories.is_file():
    model, info = pi.load_model(stories)
else:
    model = pi.build_model(pi.preset("small", pe="rotary"))
    info = None
print("scheme:", info.pe if info else "rotary (toy)")

heads = head_table(model, n_sequences=8, n_tokens=48)
top = heads.sort_values("previous_token_score", ascending=False).head(5)
print(top[["layer", "head", "previous_token_score", "rotational_mass",
           "rotational_mass_null_percentile"]].to_string(index=False))

layer, head = int(top.layer.iloc[0]), int(top["head"].iloc[0])
spec = qk_spectrum(model, layers=[layer], heads=[head])
print(f"\nL{layer}H{head} eigenvalues (offset 0 and -1 for rotary):")
print(spec.groupby("offset", dropna=False).head(4).to_string(index=False))

toks = pi.random_tokens(model, 1, 32, seed=1, bos=info is None or info.source != "llama2c")
if info is not None and info.source == "llama2c":
    toks[0, 0] = 1  # llama2.c's BOS id
_, cache = model.run_with_cache(toks)
rep = Report("posinterp: inspecting heads")
rep.table(top)
rep.figure(eigenvalue_planes(qk_spectrum(model, offset=0 if model.cfg.positional_embedding_type
                                         == "rotary" else None), heads), "eigenvalue planes")
rep.circuits(attention_view([str(t) for t in toks[0].tolist()],
                            cache[f"blocks.{layer}.attn.hook_pattern"][0]), f"layer {layer}")
print("\nreport:", rep.save(Path("demo-heads") / "report.html").resolve())
