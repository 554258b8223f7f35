"""The pass in query blocks through the model's KV cache (backend.chunked_pass) against
the whole pass: a layer's pattern and scores reduced from the rows each block fires equal
the reduction of the whole tensor, residual activations joined from the blocks equal the
whole pass's; padded either side and with gaps, sliding windows; both TL lines (CI).
Where the pass cannot be exact it is refused by name."""

import pytest
import torch

from posinterp.analysis._attention_blocks import AttentionReduction
from posinterp.models import backend
from tests.dashboard.test_hook_time import N
from tests.dashboard.test_hook_time import _masks as _mask  # left, right padding and a gap
from tests.helpers import parity_cases, save_tiny_checkpoint, tiny_model


def _reducers(model, mask):
    out = []
    for layer in range(model.cfg.n_layers):
        h = model.cfg.n_heads
        out.append((f"blocks.{layer}.attn.hook_pattern",
                    AttentionReduction(3, h, N, mask, scores=True, views={0: 2})))
        try:
            out.append((backend.scores_hook(model, layer), AttentionReduction(3, h, N, mask)))
        except backend.MissingFeatureError:
            pass
        out.append((f"blocks.{layer}.hook_resid_post", lambda x: x.clone()))
    return out


def _compare(model, tokens, mask, query_block):
    whole = backend.run_reduced(model, tokens, mask, _reducers(model, mask))
    blocks = backend.run_reduced(model, tokens, mask, _reducers(model, mask), query_block=query_block)
    real = mask.bool()
    for w, b in zip(whole, blocks, strict=True):
        if isinstance(w, torch.Tensor):  # residual stream: the real positions
            torch.testing.assert_close(b[real], w[real], rtol=1e-5, atol=1e-5)
            continue
        # scores: float32 q.k of the same vectors summed in another order (a block's matmul
        # has fewer keys), ~1e-7 relative to the largest score; patterns to 1e-6
        tol = dict(rtol=1e-5, atol=1e-6) if w.prev is not None else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.kernel(), w.kernel(), equal_nan=True, **tol)
        if w.prev is not None:
            for k, v in w.scores().items():
                torch.testing.assert_close(b.scores()[k], v, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(b.views[0], w.views[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["qwen2", "mistral-sliding-16", "gpt2", "gptneo-local"])
def test_blocks_equal_the_whole_pass_on_loaded_hf_models(tmp_path, name):
    from posinterp.models import load_model

    arch, make, _ = parity_cases()[name]
    save_tiny_checkpoint(arch, make(), tmp_path / name)
    model, _ = load_model(str(tmp_path / name), device="cpu")
    try:
        backend.check_chunked_pass(model)
    except backend.MissingFeatureError as err:
        # refused by name, never run with other numbers
        assert "query-block pass" in str(err)
        pytest.skip(f"refused: {err}")
    tokens = torch.randint(4, 12, (3, N), generator=torch.Generator().manual_seed(0))
    for query_block in (1, 4, 5):
        _compare(model, tokens, _mask(3), query_block)


@pytest.mark.parametrize("pe", ["rotary", "alibi", "absolute"])
def test_blocks_on_toys_equal_the_whole_pass_or_are_refused(pe):
    """TL 3.9's HookedTransformer runs TransformerLens's own KV cache; TL 4's native toy
    has none and is refused by name."""
    model = tiny_model(pe)
    tokens = torch.randint(0, 6, (3, N), generator=torch.Generator().manual_seed(1))
    if backend.is_bridge(model):
        with pytest.raises(backend.MissingFeatureError, match="query-block pass"):
            backend.run_reduced(model, tokens, _mask(3), _reducers(model, _mask(3)), query_block=4)
        return
    _compare(model, tokens, _mask(3), 4)


def test_llama_blocks_ask_for_row_reducers(tmp_path):
    from posinterp.models import load_model

    arch, make, _ = parity_cases()["qwen2"]
    save_tiny_checkpoint(arch, make(), tmp_path / "q")
    model, _ = load_model(str(tmp_path / "q"), device="cpu")
    tokens = torch.randint(4, 12, (1, N), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="row_start"):
        backend.run_reduced(model, tokens, None, [("blocks.0.attn.hook_pattern", lambda p: p)],
                            query_block=4)
    with pytest.raises(ValueError, match="query_block must be a positive integer"):
        backend.chunked_pass(model, tokens, None, 0)


def test_bidirectional_models_are_refused(tmp_path):
    from posinterp.models import load_model

    arch, make, _ = parity_cases()["bert"]
    save_tiny_checkpoint(arch, make(), tmp_path / "bert")
    model, _ = load_model(str(tmp_path / "bert"), device="cpu")
    with pytest.raises(backend.MissingFeatureError, match="bidirectional"):
        backend.check_chunked_pass(model)
