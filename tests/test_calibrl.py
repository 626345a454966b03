"""CalibRL (Huang et al. 2026, arXiv 2602.20197): the guided term |Â|·LeakyReLU_α(−sign(Â)(log π_θ − b)) against
hand computations on both sides of the LeakyReLU, the rareness weight from GRPO's advantages, the expert
baselines, the step's per-row baselines, the term inside policy_update (value and gradient), the refusals,
and a short run on the tiny model."""

import dataclasses

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.aggregation import aggregate, batch_scale
from anabranch.algorithms.calibrl import expert_baseline, guided_loss_mat
from anabranch.algorithms.registries import ADVANTAGES
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, Config, ConfigError, HPTConfig, RLPlusConfig
from anabranch.config_algorithm_options import CalibRLConfig
from anabranch.rewards.registry import REWARDS
from anabranch.trainer.calibrl_step import CalibRL
from anabranch.trainer.collect import ScoredBatch
from anabranch.trainer.hpt_step import build_sft_batch
from anabranch.trainer.rl_plus_step import demonstration_log_probs
from anabranch.trainer.step import no_grad_log_probs, policy_update
from test_hpt import FakeTok, ToyLM, toy_rollout  # also registers hpt_test_exact
from test_train_e2e import digit_task, tiny_overrides


# ---------------------------------------------------------------- the formulas by hand

def test_guided_term_by_hand_on_both_sides_of_the_leaky_relu():
    # row 0 correct (Â = +0.75), row 1 wrong (Â = −0.25), row 2 Â = 0; baseline −0.5 everywhere, α = 0.5
    lp = torch.tensor([[-1.0, -0.2], [-0.2, -2.0], [-0.3, -0.3]], requires_grad=True)
    adv = torch.tensor([[0.75, 0.75], [-0.25, -0.25], [0.0, 0.0]])
    mat = guided_loss_mat(lp, torch.full((3, 2), -0.5), adv, 0.5)
    # row 0: −(lp − b) = [0.5, −0.3] -> [0.5, 0.5·−0.3] × 0.75; row 1: +(lp − b) = [0.3, −1.5] -> [0.3, −0.75] × 0.25
    assert torch.allclose(mat, torch.tensor([[0.375, -0.1125], [0.075, -0.1875], [0.0, 0.0]]), atol=1e-6)
    mat.sum().backward()
    # d/d lp = −Â on the owed side (slope 1), −α·Â past the expert (moderated, same direction)
    assert torch.allclose(lp.grad, torch.tensor([[-0.75, -0.375], [0.25, 0.125], [0.0, 0.0]]), atol=1e-6)


def test_rareness_is_the_unnormalized_grpo_advantage():
    # One correct sample of four: it weighs 1 − p = 0.75, each wrong one p = 0.25 (authors' norm_adv_by_std=false).
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]), torch.tensor([0] * 4 + [1] * 4)
    cfg = AlgorithmConfig(norm_adv_by_std=False)
    adv = ADVANTAGES.get("grpo")(rewards, groups, torch.ones(8, 1), cfg)
    assert adv.abs()[:, 0].tolist() == pytest.approx([0.75, 0.25, 0.25, 0.25, 0, 0, 0, 0], abs=1e-6)
    assert torch.sign(adv[:4, 0]).tolist() == [1.0, -1.0, -1.0, -1.0]  # sign(Â) = correct / wrong


def test_expert_baselines_by_position_and_by_mean():
    lp, mask = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -9.0, -9.0]]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token: the expert's log-prob at the same position, 0 past its end (the authors' padded value)
    assert expert_baseline(lp, mask, 4, "token").tolist() == [[-1, -2, -3, 0], [-4, 0, 0, 0]]
    assert expert_baseline(lp, mask, 2, "token").tolist() == [[-1, -2], [-4, 0]]
    assert expert_baseline(lp, mask, 3, "mean").tolist() == [[-2, -2, -2], [-4, -4, -4]]


# ---------------------------------------------------------------- the step and the update

def calibrl_cfg(**k):
    cfg = Config()
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(
        cfg.algorithm, calibrl=dataclasses.replace(cfg.algorithm.calibrl, enabled=True, **k)))


def test_step_gives_each_row_its_groups_expert_log_probs():
    rollout = toy_rollout([[[1, 2], [3], [1, 1]], [[2, 2, 4], [5, 6]]])
    rows = [{"question": "q0", "answer": "12"}] * 3 + [{"question": "q1", "answer": "7", "demonstration": "89"}] * 2
    batch = ScoredBatch(rollout, rows, [1.0, 0, 0, 0, 1.0], {})
    model = ToyLM()
    step = CalibRL(calibrl_cfg(demonstration_template="{answer}"), FakeTok()).step(batch, rollout, model)
    b = step.precomputed({})["calibrl_baseline"]
    assert b.shape == (5, 3) and not b.requires_grad
    # the experts, scored directly: "12" + eos after "p0", the row's own "89" + eos after "p1"
    for g, (prompt, demo, rows_of) in enumerate([("p0", "12", [0, 1, 2]), ("p1", "89", [3, 4])]):
        want = demonstration_log_probs(model, build_sft_batch(FakeTok(), [prompt], [demo]), 1.0, 4)[0]
        for r in rows_of:
            assert torch.allclose(b[r], want[:3], atol=1e-6)
    assert step.metrics["calibrl/expert_tokens"] == 3.0


def test_policy_update_adds_exactly_lambda_times_the_aggregated_term():
    rollout = toy_rollout([[[1, 2], [3, 1], [1, 1]]])
    adv = torch.tensor([[0.8, 0.8], [-0.4, -0.4], [-0.4, -0.4]])
    rewards = torch.tensor([1.0, 0.0, 0.0])
    base = torch.tensor([[-2.0, -1.0]] * 3)
    algo = resolve_algorithm(AlgorithmConfig(calibrl=CalibRLConfig(enabled=True, coef=0.3, negative_slope=0.2)))

    def update(pre):
        model = ToyLM()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        out = policy_update(model, opt, rollout, adv, rewards, algo, micro_batch_size=2, grad_clip=0.0,
                            temperature=1.0, max_response_len=2, precomputed=pre)
        return model.w.detach(), out

    w_rl, _ = update(None)
    w_cal, out = update({"calibrl_baseline": base})
    # by hand: the same term on the initial model's log-probs, token-mean over the 6 trained tokens
    model = ToyLM()
    lp = no_grad_log_probs(model, rollout, 4, 1.0).requires_grad_(False)
    mask = rollout.trained_mask.float()
    want = 0.3 * aggregate(guided_loss_mat(lp, base, adv, 0.2), mask, "token-mean", batch_scale(mask, 2))
    assert out["calibrl/loss"] == pytest.approx(float(want), rel=1e-5)
    # its gradient: SGD(lr=1) moved the weights by exactly −∇(λ·agg(term)) more than the RL loss alone
    from anabranch.trainer.microbatch import forward_micro_batch, plan_micro_batches
    mb = plan_micro_batches(rollout.prompt_mask, rollout.response_mask, 4)[0]
    lp_g = forward_micro_batch(model, mb, rollout.input_ids, rollout.attention_mask, 1.0).log_probs
    term = 0.3 * aggregate(guided_loss_mat(lp_g, base, adv, 0.2), mask, "token-mean", batch_scale(mask, 2))
    term.backward()
    assert torch.allclose(w_cal - w_rl, -model.w.grad, atol=1e-5)
    assert (model.w.grad.abs() > 0).any()


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("key,value", [("coef", 0.0), ("coef", float("nan")), ("negative_slope", -0.1),
                                       ("negative_slope", 1.5), ("baseline", "expert"),
                                       ("demonstration_template", "<answer></answer>"),
                                       ("max_demonstration_tokens", -1)])
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.calibrl.{key}"):
        resolve_algorithm(AlgorithmConfig(calibrl=CalibRLConfig(**{"enabled": True, key: value})))


def test_combinations_that_cannot_work_are_refused_at_config_load():
    load_config(None, ["algorithm.calibrl.enabled=true"])  # GRPO: fine
    with pytest.raises(ConfigError, match="'algorithm.calibrl.coef' has no effect unless algorithm.calibrl.enabled"):
        load_config(None, ["algorithm.calibrl.coef=0.2"])
    with pytest.raises(ConfigError, match="rollout.n=1"):
        load_config(None, ["algorithm.calibrl.enabled=true", "rollout.n=1"])
    for name in ("flowrl", "rover"):
        with pytest.raises(ConfigError, match=f"algorithm.calibrl.enabled: .*loss='{name}'"):
            resolve_algorithm(AlgorithmConfig(name=name, calibrl=CalibRLConfig(enabled=True)))
    for other in (dict(hpt=HPTConfig(enabled=True)), dict(rl_plus=RLPlusConfig(enabled=True))):
        with pytest.raises(ConfigError, match=f"with algorithm.{next(iter(other))}.enabled"):
            resolve_algorithm(AlgorithmConfig(calibrl=CalibRLConfig(enabled=True), **other))


def test_rows_without_an_expert_are_refused_and_off_builds_nothing():
    from types import SimpleNamespace
    c = SimpleNamespace(train_rows=[{"question": "a", "answer": "1"}, {"question": "b", "answer": None}],
                        tokenizer=None)
    assert CalibRL.create(Config(), None, c) is None
    with pytest.raises(ConfigError, match=r"row 2 .*algorithm.calibrl.demonstration_template"):
        CalibRL.create(calibrl_cfg(), None, c)


# ---------------------------------------------------------------- a short run

if "calibrl_test_even" not in REWARDS:
    # Half the tiny model's characters are "right" as a first character: mixed groups from the first step,
    # so the guided term (|Â| > 0 only in mixed groups) acts at once, and a short run can learn.
    @REWARDS.register("calibrl_test_even", correctness=True)
    def calibrl_test_even(prompts, completions, answer, **_):
        return [float(bool(c) and ord(c[0]) % 2 == 0) for c in completions]


def test_short_run_trains_with_the_guided_term_and_learns(tiny_model_dir, write_jsonl, tmp_path):
    res = train(load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl), tmp_path, **{
        "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
        "trainer.steps": 8, "rollout.max_new_tokens": 2, "reward.isolation": "none",
        "reward.functions": "[calibrl_test_even]", "algorithm.norm_adv_by_std": False,
        "algorithm.calibrl.enabled": True, "algorithm.calibrl.demonstration_template": "'{answer}'"})))
    h = res.history
    assert all(m["calibrl/loss"] != 0.0 and "calibrl/expert_logprob" in m for m in h)
    assert all(0.0 < m["calibrl/moderated_frac"] < 1.0 for m in h[:2])  # both sides of the LeakyReLU in use
    rewards = [m["reward/mean"] for m in h]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
