"""Drop posinterp into an existing TransformerLens workflow.

Any HookedTransformer and ActivationCache will do; here an absolute-PE toy model stands
in for yours. Runs offline in a few seconds: ``python demos/adjacency_in_your_workflow.py``.
"""

import torch

import posinterp as pi


def tokens_and_mask(tokenizer, texts: list[str], padding_side: str = "left"):
    """A padded batch ``[batch, pos]`` and the tokenizer's own attention mask (1 = real).

    Take the mask from the tokenizer, which knows which positions it padded. Never
    rebuild it by comparing the ids with the pad id: GPT-2 and Pythia tokenizers use one
    id for BOS, EOS and padding, so that drops the BOS (and any EOS) from the mask, and
    every real-token position after it moves. BOS is prepended where the tokenizer
    does not add one itself (GPT-2's does not), as ``model.to_tokens`` does.
    """
    if tokenizer("")["input_ids"][:1] != [tokenizer.bos_token_id]:
        texts = [tokenizer.bos_token + text for text in texts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side=padding_side)
    return enc["input_ids"], enc["attention_mask"]


def main():
    torch.manual_seed(0)
    model = pi.build_model(pi.preset("small", pe="absolute"))

    # A left-padded batch. A padded batch always needs its attention_mask, in every call.
    texts = ["rev(12345678)=", "rev(123)=", "wherex(1234,3)="]
    tokens, mask = tokens_and_mask(model.tokenizer, texts)

    # 1. Your own cache, your own hook: the pure function takes the activation tensor.
    _, cache = model.run_with_cache(tokens, attention_mask=mask)
    sim = pi.cosine_self_similarity(cache["blocks.0.hook_resid_mid"], attention_mask=mask)
    res = pi.adjacency_score(sim, lengths=mask.sum(-1))
    print("after attention 0, per sequence:", [round(x, 3) for x in res.per_sequence.tolist()])

    # 2. The whole residual stream at once, as a tidy DataFrame.
    df = pi.adjacency_by_layer(model, tokens, attention_mask=mask)
    print(df[["hook", "layer", "value"]].to_string(index=False))


if __name__ == "__main__":
    main()
