"""A real language model offline: SmolLM2-135M's previous-token and induction heads.

Loads SmolLM2-135M-Instruct from its GGUF file (dequantized Q4_1 weights: an
approximation of the released float weights, so every number below is about the
dequantized model), finds its strongest previous-token head on a natural passage and its
strongest induction head on the same passage repeated, prints their positional kernels
and QK spectra, and ablates each head to show what it does to the loss.

Needs the gguf extra (``pip install "posinterp[gguf]"``) and the file, from
``../shared/models`` or given on the command line. The first load converts the file
into a cached HF folder (about a minute); later loads take 10-40 s.
Run: ``python demos/real_model.py [PATH.gguf]``.
"""

import sys
from pathlib import Path

import torch

import posinterp as pi
from posinterp.analysis.kernels import attention_kernel

PASSAGE = (
    "The lighthouse keeper woke before dawn, as he had every morning for thirty years. "
    "He climbed the spiral stairs, wiped the salt from the great lens, and lit the lamp. "
    "Far below, the fishing boats were already leaving the harbour, their small lights "
    "moving slowly across the dark water toward the open sea."
)


def induction_scores(pattern: torch.Tensor, half: int) -> torch.Tensor:
    """[batch, head, pos, pos] pattern of a sequence repeated once -> [head] mean attention
    from each token i of the second copy to the token after its first occurrence, i - half + 1
    (Olsson et al. 2022, "In-context learning and induction heads", §2)."""
    i = torch.arange(half, 2 * half)
    return pattern[:, :, i, i - half + 1].mean((0, -1))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, start: int = 0) -> float:
    """Mean cross-entropy (nats) of predicting tokens[t + 1] for t >= start."""
    logp = logits[0, start:-1].double().log_softmax(-1)
    return float(-logp.gather(-1, tokens[0, start + 1:, None]).mean())


def zero_head(head: int):
    def hook(z, hook):  # z: [batch, pos, head, d_head]
        z = z.clone()
        z[:, :, head] = 0.0
        return z
    return hook


def main():
    torch.manual_seed(0)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else (
        Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path.is_file():
        sys.exit(f"no model file at {path}; pass a .gguf path (see ../shared/models/README.md)")
    model, info = pi.load_model(path, device="cpu")
    print(f"{path.name}: {model.cfg.n_layers} layers x {model.cfg.n_heads} heads, "
          f"{info.weights.get('file_type')} weights dequantized to float32")

    natural, _ = pi.tokenize_texts(model, [PASSAGE])  # as `posinterp inspect --text` does
    half = natural.shape[1]
    repeated = torch.cat([natural, natural], 1)
    print(f"natural passage: {half} tokens; repeated: {2 * half} tokens")

    # Previous-token heads on the natural passage; induction heads on the repeated one.
    prev = pi.previous_token_scores(model, natural)
    p = prev.loc[prev.value.idxmax()]
    with torch.no_grad():
        _, cache = model.run_with_cache(repeated, names_filter=lambda n: n.endswith("hook_pattern"))
    ind = torch.stack([induction_scores(cache[f"blocks.{layer}.attn.hook_pattern"], half)
                       for layer in range(model.cfg.n_layers)])  # [layer, head]
    flat = int(ind.argmax())
    heads = {"previous-token": (int(p.layer), int(p["head"])),
             "induction": (flat // model.cfg.n_heads, flat % model.cfg.n_heads)}
    print(f"strongest previous-token head L{heads['previous-token'][0]}H{heads['previous-token'][1]}: "
          f"score {p.value:.3f} (mean over heads {prev.value.mean():.3f})")
    print(f"strongest induction head L{heads['induction'][0]}H{heads['induction'][1]}: "
          f"score {ind.max():.3f} (mean over heads {ind.mean():.3f})")

    # Positional kernels: mean attention by key offset Δ = j - i, on each input.
    print("\npositional kernel, mean attention at Δ = 0, -1, ..., -4:")
    for name, (layer, head) in heads.items():
        for label, toks in (("natural", natural), ("repeated", repeated)):
            with torch.no_grad():
                _, c = model.run_with_cache(toks, names_filter=f"blocks.{layer}.attn.hook_pattern")
            k = attention_kernel(c[f"blocks.{layer}.attn.hook_pattern"][:, head:head + 1])[0, 0, :5]
            print(f"  {name:15s} L{layer}H{head} on {label:8s}: "
                  + "  ".join(f"{v:.3f}" for v in k.tolist()))

    # QK spectra (effective weights, RoPE offsets 0 and -1): rotational mass and top eigenvalues.
    print("\nQK spectrum (B = W_K^T W_Q, norm gain folded):")
    for name, (layer, head) in heads.items():
        meas = pi.spectral_measures(model, layers=[layer], heads=[head])
        eig = pi.qk_spectrum(model, layers=[layer], heads=[head], offset=0)
        rm = meas[meas.metric == "rotational_mass"].set_index("offset").value
        top = ", ".join(f"{complex(r, i):.2f}" for r, i in zip(eig.real[:3], eig.imag[:3], strict=True))
        print(f"  {name:15s} L{layer}H{head}: rotational mass {rm.loc[0]:.3f} at Δ=0, "
              f"{rm.loc[-1]:.3f} at Δ=-1; largest eigenvalues {top}")

    # One causal ablation per head: zero its output (hook_z) and compare the loss on the
    # second copy of the repeated passage, where induction can predict every token.
    with torch.no_grad():
        clean = next_token_loss(model(repeated), repeated, start=half)
        print(f"\nloss on the repeated copy (nats/token): clean {clean:.3f}")
        for name, (layer, head) in heads.items():
            hooks = [(f"blocks.{layer}.attn.hook_z", zero_head(head))]
            after = next_token_loss(model.run_with_hooks(repeated, fwd_hooks=hooks), repeated, half)
            print(f"  {name:15s} L{layer}H{head} zeroed: {after:.3f} (change {after - clean:+.3f})")


if __name__ == "__main__":
    main()
