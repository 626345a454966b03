"""HPT (Lv, Zuo et al. 2025, arXiv 2509.04419): the per-prompt switch between RL and SFT, the SFT NLL
against a hand computation on the tiny model, RL groups left exactly as a batch without the switched
ones, config and data errors, demonstrations from file rows, and a short run on a task the tiny model
cannot solve, where the demonstration's likelihood must rise."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.hpt import demonstration_text, group_accuracy, mix_coefficients, sft_nll, switch_to_sft
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, Config, ConfigError, HPTConfig, RewardConfig, RewardFunctionConfig
from anabranch.rewards import build_rewards
from anabranch.rewards.registry import REWARDS
from anabranch.rollout.base import Rollout
from anabranch.trainer.collect import ScoredBatch
from anabranch.trainer.hpt_step import HPT, build_sft_batch, combine_extra_losses, sft_extra_loss
from anabranch.trainer.step import policy_update
from test_dph import ToyLM  # noqa: F401  (logits(next) = W[current token]; test_rl_plus imports it from here)
from test_train_e2e import tiny_overrides

if "hpt_test_exact" not in REWARDS:
    @REWARDS.register("hpt_test_exact", correctness=True)
    def hpt_test_exact(prompts, completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]


# ---------------------------------------------------------------- the switch rule

def test_switch_rule_on_hand_made_groups():
    correct = torch.tensor([0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1])
    groups = torch.arange(3).repeat_interleave(4)
    acc = group_accuracy(correct, groups)
    assert acc == {0: 0.0, 1: 0.25, 2: 1.0}
    assert switch_to_sft(acc, 0.0) == [0]            # the paper's γ = 0: only the all-wrong prompt
    assert switch_to_sft(acc, 0.25) == [0, 1]        # P ≤ γ switches (1 of 4 right = 0.25)
    assert switch_to_sft(acc, 0.2) == [0]
    assert switch_to_sft(acc, 1.0) == [0, 1, 2]
    assert mix_coefficients(0.0, 0.0) == (0.0, 1.0) and mix_coefficients(0.25, 0.0) == (1.0, 0.0)


def test_demonstration_from_row_or_template():
    assert demonstration_text({"demonstration": "x = 3", "answer": "3"}, "<answer>{answer}</answer>") == "x = 3"
    assert demonstration_text({"answer": "3"}, "so: <answer>{answer}</answer>") == "so: <answer>3</answer>"
    assert demonstration_text({"answer": None}, "{answer}") is None
    assert demonstration_text({"answer": "  ", "demonstration": ""}, "{answer}") is None


# ---------------------------------------------------------------- SFT NLL on the tiny model

def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_sft_nll_matches_a_hand_computation(tiny_model_dir):
    model, tok = tiny(tiny_model_dir)
    prompts, demos = ["Q: 2+2?\n", "Q: say seven, please\n"], ["4", "<answer>7</answer>"]
    batch = build_sft_batch(tok, prompts, demos)
    coef = 0.7
    out = sft_extra_loss(model, batch, coef, temperature=1.0, micro_batch_size=1)()  # two micro-batches
    got_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    # By hand: each sequence alone, unpadded; −log softmax(logits)[next token] over the target tokens only.
    nll, n = 0.0, 0
    for p, d in zip(prompts, demos):
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        t_ids = tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([p_ids + t_ids])
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        for k, tgt in enumerate(t_ids):
            nll = nll - lp[len(p_ids) + k - 1, tgt]
            n += 1
    expected = nll / n
    assert out["hpt/sft_nll"] == pytest.approx(expected.item(), rel=1e-5)
    (coef * expected).backward()
    for g, p in zip(got_grad, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)
    # The prompt is context only: no prompt token is a target.
    assert int(batch.target_mask.sum()) == n


def test_sft_nll_token_mean_and_micro_batch_sums():
    lp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, s = sft_nll(lp, mask)
    assert loss.item() == pytest.approx(3.5 / 3) and s == pytest.approx(3.5)
    part, _ = sft_nll(lp[1:], mask[1:], total_tokens=3)
    assert part.item() == pytest.approx(0.5 / 3)
    # A per-sequence weight (RLTF-SD's w): −(3·(−1) + 3·(−2) − 1·(−0.5)) = 8.5 over N = 3 tokens (the tokens'
    # count, not the weights' sum 5).
    loss, s = sft_nll(lp, mask, weight=torch.tensor([3.0, -1.0]))
    assert loss.item() == pytest.approx(8.5 / 3) and s == pytest.approx(8.5)


# ---------------------------------------------------------------- the step on a toy model

def toy_rollout(groups: list[list[list[int]]]) -> Rollout:
    resp = [r for g in groups for r in g]
    width = max(len(r) for r in resp)
    ids = torch.zeros(len(resp), width, dtype=torch.long)
    mask = torch.zeros(len(resp), width, dtype=torch.long)
    for k, r in enumerate(resp):
        ids[k, :len(r)], mask[k, :len(r)] = torch.tensor(r), 1
    gi = torch.tensor([g for g, grp in enumerate(groups) for _ in grp])
    prompt_ids = torch.tensor([[4, g] for g in gi.tolist()])
    return Rollout(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), response_ids=ids,
                   response_mask=mask, group_index=gi, prompts=[f"p{g}" for g in range(len(groups))],
                   completions=["".join(map(str, r)) for r in resp], truncated=torch.zeros(len(resp), dtype=torch.bool))


def hpt_cfg(**h):
    cfg = Config()
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(
        cfg.algorithm, hpt=dataclasses.replace(cfg.algorithm.hpt, enabled=True, **h)))


class FakeTok:
    """Characters as token ids below the toy vocabulary; eos = pad = 0."""

    eos_token_id = pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(ch) % 7 for ch in text]}


def test_rl_groups_above_gamma_train_as_if_the_switched_ones_were_not_there():
    g0, g1 = [[1, 2], [3], [1, 1]], [[2, 2], [5, 6]]   # group 0: 1 of 3 right; group 1: none right
    both, alone = toy_rollout([g0, g1]), toy_rollout([g0])
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    rows = [{"question": "q0", "answer": "12"}] * 3 + [{"question": "q1", "answer": "2"}] * 2
    sources = build_rewards(RewardConfig(functions=[RewardFunctionConfig(name="hpt_test_exact")], isolation="none"))
    batch = ScoredBatch(both, rows, rewards.tolist(), {"hpt_test_exact": rewards.tolist()})
    decided = HPT(hpt_cfg(), FakeTok()).step(batch, both, sources)
    assert decided.sft_groups == [1] and decided.metrics["hpt/sft_groups"] == 0.5
    # group 1's demonstration: the template around its answer "2", after its prompt "p1"
    assert decided.sft_batch.target_mask.tolist() == [[1] * len("<answer>2</answer>") + [1]]
    assert decided.rollout.trained_mask[3:].sum() == 0 and torch.equal(decided.rollout.trained_mask[:3],
                                                                       both.trained_mask[:3])

    # GRPO advantages of group 0 (group 1's are 0 anyway; NGRPO-like estimators would not be), with
    # a KL-free but entropy-regularized loss so that the switched rows would move the weights if kept.
    algo = resolve_algorithm(AlgorithmConfig(name="grpo", entropy_coef=0.1))
    adv0 = torch.tensor([[1.1, 1.1], [-0.6, -0.6], [-0.6, -0.6]])
    adv = torch.cat([adv0, torch.full((2, 2), 0.3)])  # non-zero on the switched rows: the mask must win

    def update(rollout, advantages, r):
        model = ToyLM()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        out = policy_update(model, opt, rollout, advantages, r, algo, micro_batch_size=2, grad_clip=0.0,
                            temperature=1.0, max_response_len=2)
        return model.w.detach(), out

    w_hpt, m_hpt = update(decided.rollout, adv, rewards)
    w_alone, m_alone = update(alone, adv0, rewards[:3])
    assert torch.allclose(w_hpt, w_alone, atol=1e-6)
    assert m_hpt["loss"] == pytest.approx(m_alone["loss"], rel=1e-5)
    w_plain, _ = update(both, adv, rewards)  # without HPT the same batch moves the weights elsewhere
    assert not torch.allclose(w_plain, w_alone, atol=1e-4)


def test_combined_extra_losses_run_both_and_merge_metrics():
    calls = []
    f = combine_extra_losses(lambda: calls.append("a") or {"a": 1.0}, None, lambda: calls.append("b") or {"b": 2.0})
    assert f() == {"a": 1.0, "b": 2.0} and calls == ["a", "b"]
    assert combine_extra_losses(None, None) is None


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("key,value", [("gamma", -0.1), ("gamma", 1.5), ("sft_coef", 0.0),
                                       ("sft_coef", float("inf")), ("demonstration_template", "<answer></answer>"),
                                       ("max_demonstration_tokens", -1)])
def test_config_errors_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"algorithm.hpt.{key}"):
        resolve_algorithm(AlgorithmConfig(hpt=HPTConfig(**{"enabled": True, key: value})))


def test_dynamic_sampling_at_gamma_zero_is_refused():
    with pytest.raises(ConfigError, match="algorithm.hpt.gamma=0 with algorithm.dynamic_sampling"):
        resolve_algorithm(AlgorithmConfig(dynamic_sampling=True, hpt=HPTConfig(enabled=True)))
    resolve_algorithm(AlgorithmConfig(dynamic_sampling=True, hpt=HPTConfig(enabled=True, gamma=0.25)))


def test_rows_without_demonstration_or_answer_are_refused_and_several_processes_are_not():
    c = SimpleNamespace(train_rows=[{"question": "a", "answer": "1"}, {"question": "b", "answer": None}],
                        tokenizer=None)
    assert HPT.create(Config(), None, c) is None  # off by default
    with pytest.raises(ConfigError, match=r"row 2 .*task.demonstration_column='solution'.*task.answer_column"
                                          r".*algorithm.hpt.demonstration_template"):
        HPT.create(hpt_cfg(), None, c)
    c.train_rows[1]["demonstration"] = "it is 2"
    assert HPT.create(hpt_cfg(), None, c) is not None
    cfg = hpt_cfg()
    cfg = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, num_processes=2))
    # Data parallel (plain DDP) is supported; sharded training is refused at run time
    # (tests/test_extra_loss_distributed.py).
    assert HPT.create(cfg, None, c) is not None


def test_file_rows_carry_the_demonstration_column(write_jsonl):
    from anabranch.data.tasks import load_task

    path = write_jsonl([{"prompt": f"q{i}", "answer": str(i), **({"solution": f"s{i}"} if i % 2 else {})}
                        for i in range(6)])
    cfg = load_config(None, ["task.name=file", f"task.path={path}", "task.eval_size=2"]).task
    train_rows, _ = load_task(cfg)
    assert [r.get("demonstration") for r in train_rows] == [None, "s1", None, "s3"]
    cfg = dataclasses.replace(cfg, demonstration_column="answer")
    assert [r["demonstration"] for r in load_task(cfg)[0]] == ["0", "1", "2", "3"]


# ---------------------------------------------------------------- a short run on the tiny model

def unsolvable_run(tiny_model_dir, write_jsonl, tmp_path, steps: int, section: str):
    """A tiny-model run on "12345" in at most 3 new tokens (no sample is ever right), with
    ``algorithm.<section>`` on and the bare answer as the demonstration; shared by test_rl_plus."""
    data = write_jsonl([{"prompt": f"Q{i}: count", "answer": "12345"} for i in range(16)])
    return train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{
        "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
        "trainer.steps": steps, "rollout.n": 4, "rollout.max_new_tokens": 3, "trainer.micro_batch_size": 16,
        "reward.isolation": "none", "reward.functions": "[hpt_test_exact]", f"algorithm.{section}.enabled": True,
        f"algorithm.{section}.demonstration_template": "'{answer}'"})))  # quoted: YAML


def test_hpt_raises_the_demonstration_likelihood_where_rl_has_no_signal(tiny_model_dir, write_jsonl, tmp_path):
    # Exact answer "12345" in at most 3 new tokens: no sample can ever be right, so every group
    # switches to SFT, and plain GRPO would have no gradient at all.
    res = unsolvable_run(tiny_model_dir, write_jsonl, tmp_path, 6, "hpt")
    nll = [m["hpt/sft_nll"] for m in res.history]
    assert all(m["hpt/sft_groups"] == 1.0 for m in res.history)
    assert all(m["hpt/sft_tokens"] == 4 * 6.0 for m in res.history)  # 4 prompts × ("12345" + eos)
    assert nll[-1] < nll[0] - 1.0, nll  # −log-likelihood per demonstration token falls


def test_template_only_demonstrations_are_warned_about(capsys):
    # Measured on SmolLM2 (docs/benchmarks.md): bare-answer demonstrations lowered held-out accuracy.
    from anabranch.config import load_config
    from anabranch.trainer.hpt_step import check_demonstrations

    cfg = load_config(None, ["algorithm.hpt.enabled=true"])
    check_demonstrations([{"question": "1+1", "answer": "2"}], cfg, "hpt")
    assert "no training row has a worked solution" in capsys.readouterr().out
    check_demonstrations([{"question": "1+1", "answer": "2", "demonstration": "1 plus 1 is 2. <answer>2</answer>"},
                          {"question": "2+2", "answer": "4"}], cfg, "hpt")
    assert "warning" not in capsys.readouterr().out
    cfg = load_config(None, ["algorithm.rl_plus.enabled=true"])
    with pytest.raises(ConfigError, match=r"algorithm\.rl_plus\.enabled: training row 2 has no demonstration"):
        check_demonstrations([{"question": "a", "answer": "1"}, {"question": "b", "answer": None}], cfg, "rl_plus")
