import pytest

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
