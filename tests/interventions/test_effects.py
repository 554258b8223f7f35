import numpy as np
import pytest
import torch

from posinterp.interventions import QKIntervention, ablation_effect, per_head_interventions
from tests.helpers import random_tokens, tiny_model, tiny_task


def test_identity_intervention_changes_nothing():
    model = tiny_model("rotary")
    toks = random_tokens(model, 3, 10)
    d_head = model.cfg.d_head
    df = ablation_effect(model, toks, QKIntervention("keep_top_k", 0, heads=(1,), k=d_head))
    assert set(df.metric) == {"loss", "adjacency_score", "previous_token_score"}
    assert df.value.abs().max() < 1e-6 and (df["head"] == 1).all()


def test_removing_every_channel_gives_uniform_previous_token_score():
    model = tiny_model("nope")
    n = 10
    df = ablation_effect(model, random_tokens(model, 2, n), QKIntervention("remove_all", 0))
    prev = df[df.metric == "previous_token_score"].iloc[0]
    uniform = sum(1 / (i + 1) for i in range(1, n)) / (n - 1)  # A[i, i-1] = 1/(i+1)
    assert prev.intervened == pytest.approx(uniform, abs=1e-6)
    assert prev["head"] is None or str(prev["head"]) == "<NA>"


def test_answer_metrics_and_sweep():
    model = tiny_model("alibi")
    data = tiny_task("reversal", n=20, max_digits=6)
    s = data.test
    ivs = per_head_interventions(model, ["remove_complex", "symmetric"], layers=[1])
    assert len(ivs) == 2 * model.cfg.n_heads
    df = ablation_effect(model, s.tokens[:8], ivs[:3], attention_mask=s.attention_mask[:8],
                         answer_mask=s.answer_mask[:8])
    assert set(df.metric) == {"loss", "answer_accuracy", "adjacency_score",
                              "previous_token_score"}
    assert len(df) == 3 * 4
    assert (df.value == df.intervened - df.clean).all()


def _pad(tokens, where: str, n: int = 4, pad_id: int = 0):
    """Insert ``n`` pads left, right or inside (after token 5) of every sequence."""
    batch, pos = tokens.shape
    cut = {"left": 0, "right": pos, "gap": 5}[where]
    pads = torch.full((batch, n), pad_id, dtype=tokens.dtype)
    toks = torch.cat([tokens[:, :cut], pads, tokens[:, cut:]], 1)
    mask = torch.cat([torch.ones(batch, cut), torch.zeros(batch, n),
                      torch.ones(batch, pos - cut)], 1).long()
    return toks, mask


@pytest.mark.parametrize("pe", ["nope", "absolute", "rotary", "alibi"])
@pytest.mark.parametrize("where", ["left", "right", "gap"])
def test_padding_changes_no_metric(pe, where):
    """Issue 11 case 8: loss over padding (was 4.5675 unpadded vs 4.6216 left-padded).

    These schemes take positions from the mask in TransformerLens, so every metric of a
    padded batch must equal the unpadded one.
    """
    model = tiny_model(pe)
    toks = random_tokens(model, 3, 12, seed=1)
    iv = QKIntervention("symmetric", 0)
    want = ablation_effect(model, toks, iv).set_index("metric")
    padded, mask = _pad(toks, where)
    got = ablation_effect(model, padded, iv, attention_mask=mask).set_index("metric")
    for col in ("clean", "intervened"):
        np.testing.assert_allclose(got[col].to_numpy(), want.loc[got.index, col].to_numpy(),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("where", ["left", "gap"])
def test_padding_changes_no_answer_metric(where):
    model = tiny_model("rotary")
    toks = random_tokens(model, 3, 12, seed=2)
    answer = torch.zeros_like(toks)
    answer[:, 0] = 1  # no predecessor: never a target, padded or not
    answer[:, 5:] = 1  # the gap goes right before token 5
    iv = QKIntervention("remove_complex", 1)
    want = ablation_effect(model, toks, iv, answer_mask=answer).set_index("metric")
    padded, mask = _pad(toks, where)
    padded_answer, _ = _pad(answer, where)
    got = ablation_effect(model, padded, iv, attention_mask=mask,
                          answer_mask=padded_answer).set_index("metric")
    for col in ("clean", "intervened"):
        np.testing.assert_allclose(got[col].to_numpy(), want.loc[got.index, col].to_numpy(),
                                   rtol=0, atol=1e-5)
