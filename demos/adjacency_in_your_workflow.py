"""Drop posinterp into an existing TransformerLens workflow.

Any HookedTransformer and ActivationCache will do; here an absolute-PE toy model stands
in for yours. Runs offline in a few seconds: ``python demos/adjacency_in_your_workflow.py``.
"""

import torch

import posinterp as pi

torch.manual_seed(0)
model = pi.build_model(pi.preset("small", pe="absolute"))

# A left-padded batch, as model.to_tokens(..., padding_side="left") would give.
texts = ["rev(12345678)=", "rev(123)=", "wherex(1234,3)="]
tokens = model.to_tokens(texts, padding_side="left")
mask = (tokens != model.tokenizer.pad_token_id).long()

# 1. Your own cache, your own hook: the pure function takes the activation tensor.
_, cache = model.run_with_cache(tokens, attention_mask=mask)
sim = pi.cosine_self_similarity(cache["blocks.0.hook_resid_mid"], attention_mask=mask)
res = pi.adjacency_score(sim, lengths=mask.sum(-1))
print("after attention 0, per sequence:", [round(x, 3) for x in res.per_sequence.tolist()])

# 2. The whole residual stream at once, as a tidy DataFrame.
df = pi.adjacency_by_layer(model, tokens, attention_mask=mask)
print(df[["hook", "layer", "value"]].to_string(index=False))
