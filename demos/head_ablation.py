"""A causal ablation in a TransformerLens workflow: zero-ablate a previous-token head.

Train (briefly) a toy RoPE model on reversal, find its strongest previous-token head,
zero its output through ``hook_z`` with ``run_with_hooks``, and compare loss, exact
match and adjacency with the unablated model. Offline, about a minute on 2 cores.
Run: ``python demos/head_ablation.py``.
"""

import torch

import posinterp as pi
from posinterp.training import answer_loss, exact_match

torch.manual_seed(0)
data = pi.make_task_data(pi.TaskConfig("reversal", min_digits=5, max_digits=5,
                                       n_train=2000, n_test=500))
cfg = pi.preset("small", pe="rotary", n_layers=2)
res = pi.train(cfg, data, pi.TrainConfig(max_steps=300, eval_every=100, target_accuracy=None),
               progress=False)
model = res.model
print(f"trained 300 steps: held-out exact match {res.final_accuracy:.3f}")

toks, attn, ans = data.test.tokens[:200], data.test.attention_mask[:200], data.test.answer_mask[:200]
prev = pi.previous_token_scores(model, pi.random_tokens(model, 8, 24, seed=0))
best = prev.loc[prev.value.idxmax()]
layer, head = int(best.layer), int(best["head"])
print(f"strongest previous-token head: L{layer}H{head} (score {best.value:.3f})")


def zero_head(z, hook):  # z: [batch, pos, head, d_head]
    z[:, :, head] = 0.0
    return z


hooks = [(f"blocks.{layer}.attn.hook_z", zero_head)]
with torch.no_grad():
    clean = model(toks, attention_mask=attn)
    ablated = model.run_with_hooks(toks, attention_mask=attn, fwd_hooks=hooks)
for name, logits in (("clean", clean), ("ablated", ablated)):
    print(f"{name:8s} loss {answer_loss(logits, toks, ans).item():.3f}  "
          f"exact match {exact_match(logits, toks, ans).mean().item():.3f}")

adj = pi.adjacency_by_layer(model, toks[:32], attention_mask=attn[:32])
print("\nadjacency after each block (clean model):")
print(adj[adj.hook.str.endswith("resid_post")][["hook", "value"]].to_string(index=False))
