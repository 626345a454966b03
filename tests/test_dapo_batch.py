"""DAPO's overlong shaping and filtering and dynamic sampling, with a fake backend and scorer;
the KL-in-reward advantage pass on the tiny model."""

from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms.overlong import filter_overlong, overlong_penalty
from anabranch.config import load_config
from anabranch.rollout.base import Rollout
from anabranch.trainer import collect


def test_soft_overlong_punishment():
    pen = overlong_penalty(torch.tensor([5, 6, 8, 10, 11]), max_len=10, buffer=4, factor=0.5)
    # free up to 10 − 4 = 6 tokens, then linear to −1 at 10, −1 beyond
    assert pen.tolist() == [0.0, 0.0, -0.25, -0.5, -0.5]
    assert overlong_penalty(torch.tensor([10]), 10, 0).tolist() == [0.0]


def fake_rollout(n_prompts, n, prompt_width, resp_width, truncated=None):
    b = n_prompts * n
    return Rollout(prompt_ids=torch.ones(b, prompt_width, dtype=torch.long),
                   prompt_mask=torch.ones(b, prompt_width, dtype=torch.long),
                   response_ids=torch.full((b, resp_width), 2, dtype=torch.long),
                   response_mask=torch.ones(b, resp_width, dtype=torch.long),
                   group_index=torch.arange(n_prompts).repeat_interleave(n),
                   prompts=[f"p{i}" for i in range(n_prompts)], completions=[f"c{i}" for i in range(b)],
                   truncated=torch.zeros(b, dtype=torch.bool) if truncated is None else truncated)


def test_overlong_filter_empties_truncated_rows():
    r = fake_rollout(1, 2, 2, 3, truncated=torch.tensor([True, False]))
    f = filter_overlong(r, True)
    assert f.response_mask.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert r.response_mask.sum() == 6  # the original (for metrics) is untouched
    assert filter_overlong(r, False) is r


class FakeBackend:
    """Prompt widths differ per call, so that batches of several rounds must be re-padded."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, n):
        self.calls += 1
        r = fake_rollout(len(prompts), n, prompt_width=self.calls + 1, resp_width=4 - self.calls)
        r.prompts = list(prompts)
        return r


class Sequential:
    def __init__(self):
        self.pos = 0

    def next(self, k):
        self.pos += k
        return list(range(self.pos - k, self.pos))


# Rewards per prompt index for its two samples: all-equal groups give no signal.
REWARDS = {0: [1, 1], 1: [0, 0], 2: [1, 0], 3: [0, 0], 4: [0, 1], 5: [1, 0]}


def fake_score(sources, prompts, completions, rows, group_index=None, extra_fields=None):
    from anabranch.rewards.compose import Scored

    total = []
    seen = {}
    for row in rows:
        k = seen.get(row["id"], 0)
        seen[row["id"]] = k + 1
        total.append(float(REWARDS[row["id"]][k]))
    return Scored(total, {"fake": list(total)}, {})


def components():
    rows = [{"id": i} for i in range(6)]
    return SimpleNamespace(backend=FakeBackend(), train_prompts=[f"q{i}" for i in range(6)], train_rows=rows,
                           rewards=[], model=None)


@pytest.mark.parametrize("cap,expected_ids,rounds", [(10, [2, 4], 3), (2, [2], 2)])
def test_dynamic_sampling_fills_the_batch_up_to_a_cap(monkeypatch, cap, expected_ids, rounds):
    monkeypatch.setattr(collect, "score_detailed", fake_score)
    cfg = load_config(None, ["rollout.n=2", "rollout.prompts_per_step=2", "algorithm.dynamic_sampling=true",
                             f"algorithm.max_sample_batches={cap}"])
    batch = collect.collect_batch(components(), Sequential(), cfg)
    assert [row["id"] for row in batch.rows[::2]] == expected_ids
    assert batch.rollout.group_index.tolist() == [g for g in range(len(expected_ids)) for _ in range(2)]
    assert batch.total == [x for i in expected_ids for x in map(float, REWARDS[i])]
    assert batch.metrics["dynamic_sampling/rounds"] == rounds
    r = batch.rollout
    # rounds 2 and 3 had prompt widths 3 and 4, response widths 2 and 1: left/right re-padded
    assert r.prompt_ids.shape[0] == r.response_ids.shape[0] == 2 * len(expected_ids)
    if len(expected_ids) == 2:
        assert r.prompt_mask[0].tolist() == [0, 1, 1, 1] and r.prompt_mask[2].tolist() == [1, 1, 1, 1]
        assert r.response_mask[0].tolist() == [1, 1] and r.response_mask[2].tolist() == [1, 0]


def test_dynamic_sampling_off_takes_one_round(monkeypatch):
    monkeypatch.setattr(collect, "score_detailed", fake_score)
    cfg = load_config(None, ["rollout.n=2", "rollout.prompts_per_step=2", "algorithm.overlong_buffer=2",
                             "rollout.max_new_tokens=3"])
    batch = collect.collect_batch(components(), Sequential(), cfg)
    assert [row["id"] for row in batch.rows] == [0, 0, 1, 1]
    # responses of 3 tokens with L_max=3, buffer 2: penalty (1 − 3)/2 = −1 on top of the score
    assert batch.total == [0.0, 0.0, -1.0, -1.0]
    assert batch.per_source["overlong"] == [-1.0] * 4


def test_kl_in_reward_reaches_the_estimator(tiny_model_dir):
    from anabranch.algorithms.advantages import reinforce_pp_advantage, token_level_rewards
    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.config import AlgorithmConfig, ModelConfig
    from anabranch.models.loading import load_model
    from anabranch.trainer.advantage_pass import compute_advantages
    from anabranch.trainer.step import no_grad_log_probs

    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=True)
    ref = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.manual_seed(0)
    r = fake_rollout(2, 2, 3, 4)
    r.prompt_ids = torch.randint(3, 60, r.prompt_ids.shape)
    r.response_ids = torch.randint(3, 60, r.response_ids.shape)
    r.response_mask[1, 2:] = 0
    algo = resolve_algorithm(AlgorithmConfig(name="reinforce_pp", kl_coef=0.5))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    out = compute_advantages(algo, model, r, rewards, micro_batch_size=3, temperature=1.0, ref_model=ref)
    old = no_grad_log_probs(model, r, 4, 1.0)
    ref_lp = no_grad_log_probs(ref, r, 4, 1.0)
    assert torch.allclose(out.precomputed["old_log_prob"], old, atol=1e-5)
    mask = r.response_mask.float()
    token_rewards = token_level_rewards(rewards, mask) - 0.5 * (old - ref_lp) * mask  # k1 in the reward
    expected = reinforce_pp_advantage(None, None, mask, algo.cfg, token_rewards=token_rewards)
    assert torch.allclose(out.advantages, expected, atol=1e-4)
    assert out.metrics["kl/seq_kl"] == pytest.approx(((old - ref_lp) * mask).sum(-1).mean().item(), abs=1e-5)
