"""An independent llama2.c forward pass in numpy, written from the format description.

It mirrors run.c token by token (a KV cache, RoPE on adjacent pairs computed from
positions, grouped-query attention), sharing no code with posinterp's loader.
"""

from __future__ import annotations

import numpy as np


def read(path):
    raw = open(path, "rb").read()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = np.frombuffer(raw[:28], "<i4")
    hs = dim // n_heads
    off = 28
    W = {}

    def take(name, shape):
        nonlocal off
        n = int(np.prod(shape))
        W[name] = np.frombuffer(raw, "<f4", n, off).reshape(shape).astype(np.float64)
        off += 4 * n

    V = abs(vocab)
    take("emb", (V, dim))
    take("rms_att", (n_layers, dim))
    take("wq", (n_layers, dim, dim))
    take("wk", (n_layers, n_kv * hs, dim))
    take("wv", (n_layers, n_kv * hs, dim))
    take("wo", (n_layers, dim, dim))
    take("rms_ffn", (n_layers, dim))
    take("w1", (n_layers, hidden, dim))
    take("w2", (n_layers, dim, hidden))
    take("w3", (n_layers, hidden, dim))
    take("rms_final", (dim,))
    cfg = dict(dim=int(dim), n_layers=int(n_layers), n_heads=int(n_heads), n_kv=int(n_kv),
               hs=int(hs), vocab=int(V), seq_len=int(seq_len))
    return cfg, W


def rmsnorm(x, w, eps=1e-5):
    return w * x / np.sqrt(np.mean(x * x) + eps)


def forward_tokens(cfg, W, tokens, record=None):
    """Logits [len(tokens), vocab] computed one position at a time, as run.c does.

    With a dict ``record``: ``record["q"][layer]`` [pos, dim] and ``record["k"][layer]``
    [pos, n_kv * hs] after RoPE, ``record["scores"][layer][pos]`` [n_heads, pos + 1]
    (q·k / sqrt(hs), before the softmax)."""
    L, nh, nkv, hs, dim = cfg["n_layers"], cfg["n_heads"], cfg["n_kv"], cfg["hs"], cfg["dim"]
    kc = np.zeros((L, len(tokens), nkv * hs))
    vc = np.zeros((L, len(tokens), nkv * hs))
    out = []
    for pos, tok in enumerate(tokens):
        x = W["emb"][tok].copy()
        for layer in range(L):
            xb = rmsnorm(x, W["rms_att"][layer])
            q = W["wq"][layer] @ xb
            k = W["wk"][layer] @ xb
            v = W["wv"][layer] @ xb
            for i in range(0, dim, 2):
                freq = 1.0 / 10000.0 ** ((i % hs) / hs)
                c, s = np.cos(pos * freq), np.sin(pos * freq)
                q[i], q[i + 1] = q[i] * c - q[i + 1] * s, q[i] * s + q[i + 1] * c
                if i < nkv * hs:
                    k[i], k[i + 1] = k[i] * c - k[i + 1] * s, k[i] * s + k[i + 1] * c
            kc[layer, pos], vc[layer, pos] = k, v
            if record is not None:
                record.setdefault("q", {}).setdefault(layer, []).append(q.copy())
                record.setdefault("k", {}).setdefault(layer, []).append(k.copy())
                record.setdefault("scores", {}).setdefault(layer, []).append(np.zeros((nh, pos + 1)))
            att_out = np.zeros(dim)
            for h in range(nh):
                kvh = h // (nh // nkv)
                qh = q[h * hs:(h + 1) * hs]
                keys = kc[layer, : pos + 1, kvh * hs:(kvh + 1) * hs]
                scores = keys @ qh / np.sqrt(hs)
                if record is not None:
                    record["scores"][layer][pos][h] = scores
                a = np.exp(scores - scores.max())
                a /= a.sum()
                att_out[h * hs:(h + 1) * hs] = a @ vc[layer, : pos + 1, kvh * hs:(kvh + 1) * hs]
            x = x + W["wo"][layer] @ att_out
            xb = rmsnorm(x, W["rms_ffn"][layer])
            h1, h3 = W["w1"][layer] @ xb, W["w3"][layer] @ xb
            x = x + W["w2"][layer] @ ((h1 / (1 + np.exp(-h1))) * h3)
        out.append(W["emb"] @ rmsnorm(x, W["rms_final"]))
    return np.stack(out)


def greedy(cfg, W, n_new, bos=1):
    tokens = [bos]
    for _ in range(n_new):
        tokens.append(int(forward_tokens(cfg, W, tokens)[-1].argmax()))
    return tokens
