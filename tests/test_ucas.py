"""UCAS (Xie et al. 2025): hand-computed shaped advantages, the statistics of the rollout pass, the
config keys and a short training run."""

import math

import pytest
import torch

from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.ucas import head_stats, ucas_advantages
from anabranch.config import AlgorithmConfig, ConfigError, load_config


def test_hand_computed_group_with_padding_and_a_singleton():
    # Group 0: three responses of 2 trained tokens (row 2 has a masked third token with huge values
    # that must count nowhere); group 1: one response.
    adv = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [-2.0, -2.0, 0.0], [0.5, 0.5, 0.0]])
    cert = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0], [3.0, 3.0, 100.0], [7.0, 9.0, 0.0]])
    raw = torch.tensor([[0.0, 4.0, 0.0], [2.0, 1.0, 0.0], [4.0, 3.0, 100.0], [1.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    out, metrics = ucas_advantages(adv, cert, raw, torch.tensor([0, 0, 0, 1]), mask, beta_pos=0.25,
                                   beta_neg=0.35, token_coef=0.1, eps=0.0)
    # Sums 2, 4, 6: mean 4, unbiased std 2, z = −1, 0, 1; the singleton's z is 0.
    # Raw logits over the trained tokens span [0, 4]: ℓ = x / 4.
    e = [[1 * math.exp(0.25) - 0.1 * 0.0, 1 * math.exp(0.25) - 0.1 * 1.0, 0.0],
         [1.0 - 0.1 * 0.5, 1.0 - 0.1 * 0.25, 0.0],
         [-2 * math.exp(0.35) - 0.1 * 1.0, -2 * math.exp(0.35) - 0.1 * 0.75, 0.0],
         [0.5 - 0.1 * 0.25, 0.5 - 0.1 * 0.5, 0.0]]
    assert torch.allclose(out, torch.tensor(e), atol=1e-5)
    assert metrics["ucas/factor_neg_mean"] == pytest.approx(math.exp(0.35), rel=1e-5)


def test_positive_advantage_is_clamped_at_zero_and_negative_is_not():
    adv = torch.tensor([[0.01, 0.01], [-0.01, -0.01]])
    raw = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    out, _ = ucas_advantages(adv, torch.zeros(2, 2), raw, torch.tensor([0, 1]), torch.ones(2, 2),
                             beta_pos=0.25, beta_neg=0.35, token_coef=1.0)
    assert torch.allclose(out, torch.tensor([[0.0, 0.01], [-1.01, -0.01]]), atol=1e-6)


def test_uncertain_correct_grows_and_confident_error_shrinks():
    # Same advantages, different self-confidence; no token term.
    adv = torch.tensor([[1.0], [1.0], [-1.0], [-1.0]])
    cert = torch.tensor([[1.0], [5.0], [1.0], [5.0]])
    out, _ = ucas_advantages(adv, cert, torch.zeros(4, 1), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1),
                             beta_pos=0.25, beta_neg=0.35, token_coef=0.0)
    assert out[0, 0] > 1.0 > out[1, 0] > 0  # the less confident correct response is pushed up more
    assert out[3, 0] < -1.0 < out[2, 0] < 0  # the more confident error is pushed down harder


def test_head_stats_are_the_self_certainty_and_the_raw_logit():
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=False)
    hidden, targets = torch.randn(5, 3, 6), torch.randint(0, 11, (5, 3))
    cert, raw = head_stats(hidden, head, targets, temperature=0.7, chunk_rows=2)
    with torch.no_grad():
        z = head(hidden)
        expected_cert = -torch.log_softmax(z / 0.7, -1).mean(-1)  # KL(U‖p) + log V
        expected_raw = torch.stack([z[i, t, targets[i, t]] for i in range(5) for t in range(3)]).view(5, 3)
    assert torch.allclose(cert, expected_cert, atol=1e-5)
    assert torch.allclose(raw, expected_raw, atol=1e-6)


def two_group_rollout():
    """Two prompts (the second left-padded) × 3 samples with ragged responses; shared by test_rover."""
    from anabranch.rollout.base import Rollout

    torch.manual_seed(0)
    b, p, r = 6, 4, 5
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[3:, 0] = 0  # the second prompt is one token shorter (left padding)
    response_mask = torch.ones(b, r, dtype=torch.long)
    response_mask[1, 3:] = 0
    response_mask[4, 2:] = 0
    prompt_ids = torch.randint(3, 60, (2, p)).repeat_interleave(3, 0)
    return Rollout(prompt_ids=prompt_ids * prompt_mask, prompt_mask=prompt_mask,
                   response_ids=torch.randint(3, 60, (b, r)) * response_mask, response_mask=response_mask,
                   group_index=torch.tensor([0, 0, 0, 1, 1, 1]), prompts=["a", "b"],
                   completions=[""] * b, truncated=torch.zeros(b, dtype=torch.bool))


@pytest.mark.parametrize("share, tokens", [(True, 0), (False, 0), (False, 20)])
def test_rollout_pass_statistics_match_full_logits(tiny_model_dir, share, tokens):
    from anabranch.algorithms.grpo import grpo_advantage
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model
    from anabranch.models.logprobs import position_ids_from_mask
    from anabranch.trainer.advantage_pass import compute_advantages

    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=True)
    ro = two_group_rollout()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    algo = resolve_algorithm(AlgorithmConfig(ucas=True))
    out = compute_advantages(algo, model, ro, rewards, micro_batch_size=4, temperature=0.8,
                             share_prompt_prefix=share, micro_batch_tokens=tokens)
    with torch.no_grad():
        ids, att = ro.input_ids, ro.attention_mask
        logits = model(input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att)).logits
        z = logits[:, ro.prompt_ids.shape[1] - 1:-1].float()
    raw = z.gather(-1, ro.response_ids[..., None]).squeeze(-1)
    cert = -torch.log_softmax(z / 0.8, -1).mean(-1)
    mask = ro.response_mask.float()
    base = grpo_advantage(rewards, ro.group_index, mask, algo.cfg)
    expected, _ = ucas_advantages(base, cert, raw, ro.group_index, mask, beta_pos=0.25, beta_neg=0.35,
                                  token_coef=0.05)
    assert torch.allclose(out.advantages, expected, atol=1e-4)
    assert not torch.allclose(out.advantages, base, atol=1e-3)
    assert "ucas/confidence_mean" in out.metrics


def test_off_is_bit_identical_and_needs_nothing_more(tiny_model_dir):
    from anabranch.algorithms.grpo import grpo_advantage
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model
    from anabranch.trainer.advantage_pass import compute_advantages

    off = resolve_algorithm(AlgorithmConfig())
    assert "old_log_prob" not in off.needs
    assert "old_log_prob" in resolve_algorithm(AlgorithmConfig(ucas=True)).needs
    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=True)
    ro = two_group_rollout()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    out = compute_advantages(off, model, ro, rewards, micro_batch_size=4, temperature=1.0)
    assert torch.equal(out.advantages, grpo_advantage(rewards, ro.group_index, ro.response_mask.float(), off.cfg))
    assert not any(k.startswith("ucas/") for k in out.metrics)


@pytest.mark.parametrize("override, key", [
    ("algorithm.ucas_beta_pos=-0.1", "ucas_beta_pos"),
    ("algorithm.ucas_beta_neg=nan", "ucas_beta_neg"),
    ("algorithm.ucas_token_coef=inf", "ucas_token_coef"),
])
def test_bad_keys_are_refused(override, key):
    with pytest.raises(ConfigError, match=f"algorithm.{key}"):
        resolve_algorithm(load_config(None, ["algorithm.ucas=true", override]).algorithm)


def test_reward_reading_objective_is_refused():
    with pytest.raises(ConfigError, match="algorithm.ucas"):
        resolve_algorithm(load_config(None, ["algorithm.name=flowrl", "algorithm.ucas=true"]).algorithm)


def test_short_training_run_with_ucas(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch import train

    from test_train_e2e import digit_task, tiny_overrides

    overrides = tiny_overrides(tiny_model_dir, digit_task(write_jsonl, n=8), tmp_path, **{
        "task.eval_size": 2, "rollout.n": 4, "rollout.prompts_per_step": 2, "trainer.steps": 2,
        "trainer.run_name": "ucas", "trainer.micro_batch_size": 16, "algorithm.ucas": "true"})
    result = train(load_config(None, overrides))
    assert len(result.history) == 2
    for row in result.history:
        assert math.isfinite(row["loss"]) and math.isfinite(row["ucas/factor_pos_mean"])
        assert math.isfinite(row["advantage/mean"])


class _TwoRanks:
    """A stand-in for trainer.distributed.Distributed with a second rank whose logits span [lo, hi]."""

    world_size = 2

    def __init__(self, other_lo, other_hi):
        self.other = (other_lo, other_hi)

    def all_reduce_extrema(self, lo, hi):
        return torch.minimum(lo, torch.tensor(self.other[0])), torch.maximum(hi, torch.tensor(self.other[1]))


def test_token_minmax_is_over_every_ranks_tokens_under_data_parallelism():
    from anabranch.algorithms.ucas import minmax_normalize

    x = torch.tensor([[2.0, 4.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # this rank's trained logits: 2 and 4
    # One process: (x − 2) / (4 − 2).
    assert torch.allclose(minmax_normalize(x, mask, eps=0.0), torch.tensor([[0.0, 1.0, 0.0]]))
    # The other rank's logits reach 0 and 10: (x − 0) / (10 − 0) for the global batch.
    got = minmax_normalize(x, mask, eps=0.0, dist=_TwoRanks(0.0, 10.0))
    assert torch.allclose(got, torch.tensor([[0.2, 0.4, 0.0]]))
    # A rank with no trained token still joins the reduction and returns zeros.
    calls = []
    dist = _TwoRanks(0.0, 10.0)
    dist.all_reduce_extrema = lambda lo, hi: calls.append((float(lo), float(hi))) or (torch.tensor(0.0), torch.tensor(10.0))
    assert torch.equal(minmax_normalize(x, torch.zeros_like(mask), dist=dist), torch.zeros_like(x))
    assert calls == [(float("inf"), float("-inf"))]
