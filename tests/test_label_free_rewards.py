import math

import pytest
import torch

from anabranch.rewards.intrinsic import neg_entropy_reward, self_certainty_reward
from anabranch.rewards.majority_vote import majority_vote_reward, vote
from anabranch.rewards.token_stats import sequence_token_stats


def test_vote_uses_math_equivalence():
    label, agree = vote(["1/2", "0.5", "3", None, "\\frac{1}{2}", "3"])
    assert label == "1/2" and agree == [True, True, False, False, True, False]
    assert vote([None, None]) == (None, [False, False])
    assert vote(["2", "3"])[0] == "2"  # tie: first seen


def test_majority_vote_reward_and_metrics():
    completions = ["\\boxed{4}", "Answer: 4", "5",          # prompt 0: majority 4, true 4
                   "7", "7", "Answer: 8"]                   # prompt 1: majority 7, true 8
    out = majority_vote_reward(None, completions, group_index=[0, 0, 0, 1, 1, 1], answer=["4"] * 3 + ["8"] * 3)
    assert out.values == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert out.metrics["label_accuracy"] == 0.5
    assert out.metrics["true_accuracy"] == pytest.approx(3 / 6)
    # pseudo-reward == true correctness: 1,1,1 for prompt 0; 0,0,0 for prompt 1 (7 rewarded, 8 not)
    assert out.metrics["reward_accuracy"] == pytest.approx(3 / 6)
    assert out.metrics["majority_ratio"] == pytest.approx(2 / 3)
    # No labels: reward only.
    out = majority_vote_reward(None, completions, group_index=[0, 0, 0, 1, 1, 1])
    assert out.values == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0] and "label_accuracy" not in out.metrics


class _FixedLogits(torch.nn.Module):
    """A 'model' whose next-token logits are given, to check the statistics by hand."""

    def __init__(self, logits):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.logits = logits

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep, use_cache):
        class Out:
            pass

        out = Out()
        out.logits = self.logits[:, -logits_to_keep:, :] + 0 * self.w
        return out


def test_token_stats_match_hand_computation():
    # Vocab 2, one prompt token, response of 2 tokens; the second response token is padding.
    # Position predicting response token 1 has p = (0.5, 0.5), the next has p = softmax(0, log 3) = (1/4, 3/4).
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)], [5.0, 5.0]]])
    model = _FixedLogits(logits)
    ids = torch.tensor([[0, 1, 1]])
    att = torch.tensor([[1, 1, 1]])
    both = sequence_token_stats(model, ids, att, torch.tensor([[1, 1]]))
    first = sequence_token_stats(model, ids, att, torch.tensor([[1, 0]]))
    # token 1: H = log 2, KL(U||p) = 0, log p(y=1) = log 0.5
    assert first["token_entropy"][0] == pytest.approx(math.log(2))
    assert first["self_certainty"][0] == pytest.approx(0.0, abs=1e-6)
    assert first["mean_log_prob"][0] == pytest.approx(math.log(0.5))
    # token 2: p = (1/4, 3/4): H = -(1/4 log 1/4 + 3/4 log 3/4); KL(U||p) = -log 2 - (log 1/4 + log 3/4)/2
    h2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    kl2 = -math.log(2) - 0.5 * (math.log(0.25) + math.log(0.75))
    assert both["token_entropy"][0] == pytest.approx((math.log(2) + h2) / 2)
    assert both["self_certainty"][0] == pytest.approx(kl2 / 2)
    assert both["mean_log_prob"][0] == pytest.approx((math.log(0.5) + math.log(0.75)) / 2)
    assert neg_entropy_reward(None, ["a"], token_entropy=[0.25]) == [-0.25]
    assert self_certainty_reward(None, ["a"], self_certainty=[0.3]) == [0.3]
    with pytest.raises(ValueError, match="only the trainer"):
        self_certainty_reward(None, ["a"])


class _LogitsOnly(torch.nn.Module):
    """A real model seen only through its logits (no separable LM head): the fallback path."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw)


def test_token_stats_from_hidden_states_equal_those_from_the_logits(tiny_model_dir, monkeypatch):
    # The LM head projects only the response positions, a few rows at a time (here one row per chunk);
    # the numbers are those of the model's full logits.
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model
    from anabranch.rewards import token_stats

    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=False)
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (5, 9))
    att = torch.ones_like(ids)
    att[1, :2] = 0  # left padding of a shorter prompt
    resp = torch.ones(5, 4, dtype=torch.long)
    resp[2, 3:] = 0
    resp[3, 1:] = 0
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(token_stats, "STATS_CHUNK_BYTES", 4 * 4 * vocab)  # one row of 4 tokens per chunk
    chunked = sequence_token_stats(model, ids, att, resp, micro_batch_size=3)
    full = sequence_token_stats(_LogitsOnly(model), ids, att, resp, micro_batch_size=3)
    for key in full:
        assert chunked[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key
    assert len(set(full["token_entropy"])) == 5  # five different rows, not one repeated
