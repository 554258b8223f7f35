"""Print TransformerLens-vs-HF logit parity for tiny random checkpoints of each family.

Builds GPT-2 (absolute), GPT-NeoX (rotary_pct 0.25), Llama (grouped-query) and BLOOM
(ALiBi, 12 heads) checkpoints with ``save_pretrained``, loads each offline with
``posinterp.load_model`` (raw weights), and prints max |logit difference| on an unpadded
and a left-padded batch. Run: ``python benchmarks/parity.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from posinterp.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for tests.helpers
from tests.helpers import HF_VOCAB as VOCAB  # noqa: E402
from tests.helpers import tiny_hf_configs  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    toks = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    print(f"{'family':28s} {'unpadded':>10s} {'left-padded':>12s}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in tiny_hf_configs().items():
            hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            folder = Path(tmp) / name
            hf.save_pretrained(folder)
            model, _ = load_model(folder, fold_ln=False, center_writing_weights=False,
                                  center_unembed=False, fold_value_biases=False)
            kw = {} if name.startswith("bloom") else {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
            with torch.no_grad():
                plain = (model(toks) - hf(toks).logits).abs().max().item()
                padded = (model(toks, attention_mask=mask)
                          - hf(toks, attention_mask=mask, **kw).logits).abs()[mask.bool()].max().item()
            print(f"{name:28s} {plain:10.2e} {padded:12.2e}")


if __name__ == "__main__":
    main()
