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


ACC = {0: [1, 1], 1: [1, 0], 2: [0, 0], 3: [0, 1]}      # right/wrong of each prompt's two samples
SHAPING = {0: [0, -0.5], 1: [0, 0], 2: [0, -0.5], 3: [0, 0]}  # e.g. a length term


def score_with_shaping(sources, prompts, completions, rows, group_index=None, extra_fields=None):
    from anabranch.rewards.compose import Scored

    acc, shaping, seen = [], [], {}
    for row in rows:
        k = seen.get(row["id"], 0)
        seen[row["id"]] = k + 1
        acc.append(float(ACC[row["id"]][k]))
        shaping.append(float(SHAPING[row["id"]][k]))
    return Scored([a + b for a, b in zip(acc, shaping)], {"math_verify": acc, "shaping": shaping}, {})


@pytest.mark.parametrize("metric,with_verifier,expected_ids,rounds", [
    ("accuracy", True, [1, 3], 2),   # DAPO: all-correct (0) and all-wrong (2) groups dropped, shaping or not
    ("reward", True, [0, 1], 1),     # the total reward differs within group 0, so it stays
    ("accuracy", False, [0, 1], 1),  # no reward says right/wrong: the total reward decides
])
def test_dynamic_sampling_judges_groups_on_accuracy(monkeypatch, metric, with_verifier, expected_ids, rounds):
    from anabranch.rewards.compose import RewardSource
    from anabranch.rewards.registry import REWARDS

    monkeypatch.setattr(collect, "score_detailed", score_with_shaping)
    cfg = load_config(None, ["rollout.n=2", "rollout.prompts_per_step=2", "algorithm.dynamic_sampling=true",
                             f"algorithm.dynamic_sampling_metric={metric}"])
    c = components()
    if with_verifier:
        c.rewards = [RewardSource("math_verify", 1.0, REWARDS.get("math_verify"), {})]
    batch = collect.collect_batch(c, Sequential(), cfg)
    assert [row["id"] for row in batch.rows[::2]] == expected_ids
    assert batch.metrics["dynamic_sampling/rounds"] == rounds


def test_dynamic_sampling_metric_is_checked():
    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.config import ConfigError

    with pytest.raises(ConfigError, match="dynamic_sampling_metric"):
        resolve_algorithm(load_config(None, ["algorithm.dynamic_sampling_metric=acc"]).algorithm)


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


def test_overlong_filter_masks_the_loss_but_not_the_group_statistics(tiny_model_dir, write_jsonl, tmp_path,
                                                                     monkeypatch):
    """DAPO masks truncated samples out of the loss; their rewards still count in their group's mean
    and std. So the advantage pass sees every sample's mask and the update the filtered one."""
    from anabranch import train
    from anabranch.trainer import loop

    seen = {}
    real_advantages, real_update = loop.compute_advantages, loop.policy_update

    def spy_advantages(algo, model, rollout, rewards, **kw):
        seen["adv_mask"], seen["truncated"] = rollout.response_mask.clone(), rollout.truncated.clone()
        seen["rewards"], seen["groups"] = rewards.clone(), rollout.group_index.clone()
        out = real_advantages(algo, model, rollout, rewards, **kw)
        seen["advantages"] = out.advantages.clone()
        return out

    def spy_update(model, optimizer, rollout, advantages, *args, **kw):
        seen.setdefault("loss_mask", rollout.response_mask.clone())
        return real_update(model, optimizer, rollout, advantages, *args, **kw)

    from anabranch.rollout.hf_generate import HFGenerateBackend

    real_generate = HFGenerateBackend.generate

    def half_end_early(self, prompts, n, **kw):
        # The random tiny model never samples EOS: make every other sample end after one token.
        out = real_generate(self, prompts, n, **kw)
        out.response_mask[::2, 1:] = 0
        out.truncated[::2] = False
        return out

    monkeypatch.setattr(HFGenerateBackend, "generate", half_end_early)
    monkeypatch.setattr(loop, "compute_advantages", spy_advantages)
    monkeypatch.setattr(loop, "policy_update", spy_update)
    data = write_jsonl([{"prompt": f"Q{i}", "answer": "7"} for i in range(8)])
    # 3 new tokens with a 2-token buffer: the soft punishment is 0 for one token and −1 for three, so
    # every group has non-zero advantages.
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "task.name=file", f"task.path={data}",
                             "task.eval_size=0", "rollout.n=4", "rollout.prompts_per_step=2",
                             "rollout.max_new_tokens=3", "algorithm.name=dapo", "algorithm.dynamic_sampling=false",
                             "algorithm.overlong_buffer=2", "algorithm.overlong_filter=true",
                             "trainer.steps=1", f"trainer.output_dir={tmp_path}", "trainer.progress=false",
                             "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_final=false",
                             "trainer.device=cpu", "trainer.seed=3"])
    train(cfg)
    truncated = seen["truncated"]
    assert truncated.any() and (~truncated).any(), "the test needs both kinds of samples"
    lengths = seen["adv_mask"].sum(-1)
    assert bool((lengths[truncated] > 0).all())  # the advantage pass sees the truncated samples
    assert seen["loss_mask"][truncated].sum() == 0  # the loss does not
    assert torch.equal(seen["loss_mask"][~truncated], seen["adv_mask"][~truncated])
    # Every kept sample's advantage is its reward normalized by its whole group, truncated samples included.
    for g in seen["groups"].unique():
        rows = seen["groups"] == g
        r = seen["rewards"][rows]
        expected = (r - r.mean()) / (r.std() + 1e-6)
        got = seen["advantages"][rows].gather(1, (lengths[rows] - 1).clamp(min=0)[:, None]).squeeze(1)
        assert torch.allclose(got, expected, atol=1e-5), (g, got, expected)
