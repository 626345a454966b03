"""AMPO (Yuan, Ding et al. 2025, arXiv 2510.02227): teachers' correct solutions replace samples of the groups
the policy fails entirely, the one(s) the student finds most likely first, trained with LUFFY's shaped term
−f(π_θ)·Â, f(p) = p / (p + γ). Hand values for the selection and the shaped loss, the injected batch on the
tiny model (scripted scores, ids/masks/log-probs, untouched groups), config refusals and a 2-step train()."""

import math

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.ampo import ampo_objective, candidate_texts, check_ampo, check_run, mean_log_prob, select_top
from anabranch.algorithms.off_policy_split import off_policy_loss_mat, shaped_prob
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import Config, ConfigError
from anabranch.config_checks import check_whole_config
from anabranch.config_algorithm_options import AMPOConfig
from anabranch.rewards.registry import REWARDS
from anabranch.trainer.ampo_step import AMPO, candidate_rollout, stop_token
from anabranch.trainer.step import LossContext
from test_train_e2e import tiny_overrides

if "ampo_test_reward" not in REWARDS:
    @REWARDS.register("ampo_test_reward", correctness=True)
    def ampo_test_reward(prompts, completions, answer, **_):
        # "free" rows are always right; the others need the exact answer, which the tiny model never writes.
        return [1.0 if a == "free" else float(c.strip() == a) for c, a in zip(completions, answer)]


# ---------------------------------------------------------------- pieces, by hand

def test_selection_and_candidates_by_hand():
    assert candidate_texts({"t": ["a", " ", None, "b"]}, "t") == ["a", "b"]
    assert candidate_texts({"t": "x"}, "t") == ["x"] and candidate_texts({}, "t") == []
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.1, 0.1]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.allclose(mean_log_prob(lp, mask), torch.tensor([(math.log(0.5) + math.log(0.25)) / 2, math.log(0.1)]))
    # The best ones, best first (the candidates are the correct ones already).
    assert select_top([-1.0, -0.2, -3.0, -0.5], 2) == [1, 3]
    assert select_top([-1.0, -1.0], 1) == [0]  # ties: column order
    assert select_top([-2.0], 2) == [0] and select_top([], 2) == []


def test_shaped_loss_and_gradient_against_hand_values():
    lp = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
    f = shaped_prob(lp, 0.1)
    assert torch.allclose(f, torch.tensor([[0.5 / 0.6, 0.2 / 0.3]]))
    off_policy_loss_mat(lp, torch.tensor([[2.0, 2.0]]), 0.1).sum().backward()
    # d(−A·f)/d log p = −A·p·γ/(p + γ)²: 0.5·0.1/0.36 and 0.2·0.1/0.09, times −2.
    assert torch.allclose(lp.grad, torch.tensor([[-2 * 0.05 / 0.36, -2 * 0.02 / 0.09]]), atol=1e-6)


def test_objective_on_policy_rows_and_shaped_term_on_injected_rows():
    algo = resolve_algorithm(Config().algorithm)  # GRPO: ppo_clip, token-mean
    lp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.2]])).requires_grad_()
    old = lp.detach().clone()
    adv = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    mask = torch.ones(2, 2)
    agg = lambda x, m: (x * m).sum() / 4  # noqa: E731  (four tokens in the batch)
    ctx = LossContext(cfg=algo.cfg, aggregate=agg)
    loss, metrics = ampo_objective(algo.objective, lp, old, adv, mask, ctx, torch.tensor([False, True]), 0.1, agg)
    # Row 0 (on-policy, r = 1): −Â per token; row 1 (injected): −2·f(p) = −2·(5/6), −2·(2/3).
    assert float(loss.detach()) == pytest.approx((-1 - 1 - 2 * 5 / 6 - 2 * 2 / 3) / 4, abs=1e-6)
    assert metrics["ampo/shaped_prob"] == pytest.approx((5 / 6 + 2 / 3) / 2)
    loss.backward()
    assert torch.allclose(lp.grad[1], torch.tensor([-2 * 0.05 / 0.36, -2 * 0.02 / 0.09]) / 4, atol=1e-6)
    assert torch.allclose(lp.grad[0], torch.tensor([-0.25, -0.25]), atol=1e-6)  # ∇ of −r·Â/4 at r = 1


# ---------------------------------------------------------------- the injected batch, tiny model

SOLUTIONS = ["99", "12345", "12345 ", "1234"]  # correct: 1 and 2 (the reward strips); 0 and 3 are wrong


def components(tiny_model_dir, write_jsonl, tmp_path, **extra):
    from anabranch.trainer.components import build

    rows = [{"prompt": f"Q{i}: count", "answer": "free" if i % 2 else "12345", "teacher_solutions": SOLUTIONS}
            for i in range(12)]
    cfg = load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 2, "rollout.n": 3, "rollout.max_new_tokens": 8, "reward.isolation": "none",
        "reward.functions": "[ampo_test_reward]", "algorithm.ampo.enabled": True, **extra}))
    torch.manual_seed(0)
    c = build(cfg)
    fail = [i for i, r in enumerate(c.train_rows) if r["answer"] == "12345"]
    free = [i for i, r in enumerate(c.train_rows) if r["answer"] == "free"]
    return cfg, c, fail, free


def tokens(ids, mask):
    return ids[mask.bool()].tolist()


def test_only_all_fail_groups_get_the_most_likely_correct_solution(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import anabranch.trainer.advantage_pass as ap
    from anabranch.trainer.collect import generate_scored

    cfg, c, fail, free = components(tiny_model_dir, write_jsonl, tmp_path, **{"algorithm.ampo.num_replace": 1})
    idx = [fail[0], free[0], fail[1], free[1]]
    batch = generate_scored(c, idx, cfg, step=1)  # groups 0, 2 fail; 1, 3 succeed
    real = ap.rollout_forward
    # Scripted student log-probs: candidate "12345 " (index 2 of each group's correct pair) is the more likely;
    # the wrong "99" would be the most likely of all, and must not be chosen.
    def scripted(model, rollout, micro, temperature, **kw):
        lp, values = real(model, rollout, micro, temperature, **kw)
        script = {"99": -0.1, "12345": -2.0, "12345 ": -1.0, "1234": -0.1}
        for i, text in enumerate(rollout.completions):
            lp[i] = script[text]
        return lp, values
    monkeypatch.setattr(ap, "rollout_forward", scripted)
    out = AMPO.create(cfg, None, c).step(c, batch)
    new, r = out.batch, out.batch.rollout
    assert r.group_index.tolist() == batch.rollout.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert out.injected.tolist() == [False, False, True] + [False] * 3 + [False, False, True] + [False] * 3
    assert [r.completions[i] for i in (2, 8)] == ["12345 ", "12345 "]
    assert new.total[2] == new.total[8] == 1.0 and new.total[:2] == batch.total[:2] == [0.0, 0.0]
    assert new.metrics["ampo/guided_groups"] == 2 and new.metrics["ampo/no_candidate_groups"] == 0
    assert new.metrics["ampo/selected_logprob"] == pytest.approx(-1.0)
    old = batch.rollout
    for i in range(12):  # every row's context is its group's own prompt tokens; other rows untouched
        first = int((old.group_index == r.group_index[i]).nonzero()[0])
        assert tokens(r.prompt_ids[i], r.prompt_mask[i]) == tokens(old.prompt_ids[first], old.prompt_mask[first])
        if i not in (2, 8):
            assert tokens(r.response_ids[i], r.response_mask[i]) == tokens(old.response_ids[i], old.response_mask[i])
            assert new.rows[i] is batch.rows[i]
    expect = c.tokenizer("12345 ", add_special_tokens=False)["input_ids"] + [c.tokenizer.eos_token_id]
    assert tokens(r.response_ids[2], r.response_mask[2]) == expect and not bool(r.truncated[2])

    # Two replaced per group with num_replace=2, best first: "12345 " then "12345".
    monkeypatch.setattr(cfg.algorithm.ampo, "num_replace", 2)
    out2 = AMPO(cfg).step(c, batch)
    assert out2.injected.tolist() == [False, True, True] + [False] * 3 + [False, True, True] + [False] * 3
    assert [out2.batch.rollout.completions[i] for i in (1, 2)] == ["12345 ", "12345"]
    assert out2.batch.metrics["ampo/selected_logprob"] == pytest.approx(-1.5)


def test_injected_rows_carry_the_students_log_probs_and_reach_the_update(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored

    cfg, c, fail, free = components(tiny_model_dir, write_jsonl, tmp_path)
    batch = generate_scored(c, [fail[0], free[0]], cfg, step=1)
    out = AMPO.create(cfg, None, c).step(c, batch)
    r = out.batch.rollout
    rows = out.injected.nonzero().flatten().tolist()
    assert len(rows) == 2
    picked = []
    for i in rows:  # the student's mean log-prob by a manual forward of [prompt | solution + eos]
        ctx, resp = tokens(r.prompt_ids[i], r.prompt_mask[i]), tokens(r.response_ids[i], r.response_mask[i])
        with torch.no_grad():
            lp = torch.log_softmax(c.model(torch.tensor([ctx + resp])).logits[0].float() / cfg.rollout.temperature, -1)
        manual = torch.stack([lp[len(ctx) + k - 1, t] for k, t in enumerate(resp)])
        if r.sample_log_probs is not None:
            assert torch.allclose(r.sample_log_probs[i, :len(resp)], manual, atol=1e-4)
        picked.append(float(manual.mean()))
    assert out.batch.metrics["ampo/selected_logprob"] == pytest.approx(sum(picked) / 2, abs=1e-4)
    assert picked[0] >= picked[1] - 1e-6  # best first
    assert out.precomputed({})["ampo_rows"] is out.injected
    # Nothing to guide (only groups with a success): the batch is the same object, no ampo_rows reach the update.
    plain = generate_scored(c, [free[0], free[1]], cfg, step=1)
    none = AMPO(cfg).step(c, plain)
    assert none.batch is plain and none.injected is None and none.precomputed({"x": 1}) == {"x": 1}
    assert none.batch.metrics["ampo/guided_groups"] == 0


def test_teacher_rows_end_with_the_chat_end_of_turn_not_the_tokenizers_eos():
    from anabranch.models.tiny import char_tokenizer

    tok = char_tokenizer()
    tok.eos_token = "<pad>"  # an EOS (id 0) other than the template's end-of-turn <|im_end|> (id 2)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (tok.eos_token_id, end) == (0, 2)
    # Both stop the sampler: under the chat template the policy ends a turn with <|im_end|>.
    assert stop_token(tok, [0, 2], chat=True) == 2
    assert stop_token(tok, [0, 2], chat=False) == 0          # plain prompts: the tokenizer's EOS
    assert stop_token(tok, [0], chat=True) == 0              # <|im_end|> would not stop the sampler
    assert stop_token(tok, [5, 7], chat=False) == 5          # EOS not a stop id: the first stop id
    r = candidate_rollout(tok, torch.tensor([0, 9]), torch.tensor([0, 1]), "p", ["ab", "abcdef"], 4, end)
    assert tokens(r.response_ids[0], r.response_mask[0]) == tok("ab", add_special_tokens=False)["input_ids"] + [2]
    assert r.truncated.tolist() == [False, True] and 2 not in tokens(r.response_ids[1], r.response_mask[1])


def test_candidates_get_the_overlong_penalty_and_pre_accuracy_is_the_policys(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored

    # L_max = 8, buffer 4: a length of 7 ("12345 " + end) costs (4 − 7)/4 = −0.75, of 6 ("12345" + end) −0.5.
    cfg, c, fail, free = components(tiny_model_dir, write_jsonl, tmp_path, **{
        "algorithm.overlong_buffer": 4, "algorithm.ampo.selection": "order"})
    batch = generate_scored(c, [fail[0], free[0]], cfg, step=1)
    # A chat model whose EOS is not its end-of-turn (both stop the sampler): the teacher rows end as a turn does.
    c.tokenizer.eos_token, c.backend.eos_ids = "<pad>", [0, 2]
    out = AMPO.create(cfg, None, c).step(c, batch)
    assert out.injected.tolist() == [False, True, True, False, False, False]
    r = out.batch.rollout
    assert [tokens(r.response_ids[i], r.response_mask[i])[-1] for i in (1, 2)] == [2, 2]
    new = out.batch
    # "order": the column's first correct ones, "12345" then "12345 ", in the group's last two rows.
    assert [new.rollout.completions[i] for i in (1, 2)] == ["12345", "12345 "]
    assert new.per_source["overlong"][1:3] == pytest.approx([-0.5, -0.75])
    assert new.total[1:3] == pytest.approx([0.5, 0.25])
    # The policy's own accuracy: group 0's three wrong samples and group 1's three "free" ones, before the injection.
    assert out.pre_correct == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert new.metrics["ampo/pre_accuracy"] == pytest.approx(0.5)


def test_selection_forward_runs_within_the_token_budget(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import anabranch.trainer.advantage_pass as ap
    from anabranch.trainer.collect import generate_scored

    cfg, c, fail, free = components(tiny_model_dir, write_jsonl, tmp_path)
    batch = generate_scored(c, [fail[0], free[0]], cfg, step=1)
    seen, real = [], ap.rollout_forward

    def spy(*args, **kw):
        seen.append(kw.get("micro_batch_tokens"))
        return real(*args, **kw)
    monkeypatch.setattr(ap, "rollout_forward", spy)
    AMPO.create(cfg, None, c).step(c, batch, micro_tokens=64)
    assert seen == [64]


# ---------------------------------------------------------------- config

def _algo(**kw):
    from anabranch.config import AlgorithmConfig

    return AlgorithmConfig(**{"advantage": "grpo", "loss": "ppo_clip", **kw})


def test_refusals_name_the_keys(tiny_model_dir, write_jsonl, tmp_path):
    assert check_ampo(_algo(ampo=AMPOConfig(enabled=True))) is None
    assert check_ampo(_algo()) is None  # off by default
    assert "algorithm.ampo.num_replace" in check_ampo(_algo(ampo=AMPOConfig(enabled=True, num_replace=0)))
    assert "algorithm.ampo.selection" in check_ampo(_algo(ampo=AMPOConfig(enabled=True, selection="ppl")))
    assert "algorithm.ampo.shaping_gamma" in check_ampo(_algo(ampo=AMPOConfig(enabled=True, shaping_gamma=0.0)))
    assert check_ampo(_algo(ampo=AMPOConfig(num_replace=3))) is None  # a knob while off: config_checks._GATED
    assert "loss='flowrl'" in check_ampo(_algo(loss="flowrl", ampo=AMPOConfig(enabled=True)))
    assert "dynamic_sampling" in check_ampo(_algo(dynamic_sampling=True, ampo=AMPOConfig(enabled=True)))
    from anabranch.config import GuideConfig

    assert "algorithm.guide.enabled" in check_ampo(_algo(guide=GuideConfig(enabled=True), ampo=AMPOConfig(enabled=True)))
    # SRPO would zero the failed rows' advantages; KDRL's mask=group would be off on exactly the guided prompts.
    assert "algorithm.srpo_coef > 0" in check_ampo(_algo(srpo_coef=0.5, ampo=AMPOConfig(enabled=True)))
    from anabranch.config_algorithm_options import KDRLConfig

    assert "algorithm.kdrl.mask=group" in check_ampo(_algo(kdrl=KDRLConfig(teacher="t", mask="group"),
                                                           ampo=AMPOConfig(enabled=True)))
    assert check_ampo(_algo(kdrl=KDRLConfig(teacher="t", mask="response"), ampo=AMPOConfig(enabled=True))) is None
    rows = [{"prompt": f"Q{i}", "answer": "1"} for i in range(6)]
    data = write_jsonl(rows)
    base = {"task.eval_size": 2, "algorithm.ampo.enabled": True}
    # At config load: a knob set while AMPO is off, a bad key, num_replace >= rollout.n (a guided group of
    # teacher rows only is all correct, Â = 0), the combinations that cannot work.
    load = lambda **kw: load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **kw))  # noqa: E731
    with pytest.raises(ConfigError, match="'algorithm.ampo.num_replace' has no effect unless algorithm.ampo.enabled"):
        load(**{"algorithm.ampo.num_replace": 3})
    with pytest.raises(ConfigError, match="algorithm.ampo.selection must be one of"):
        load(**base, **{"algorithm.ampo.selection": "ppl"})
    with pytest.raises(ConfigError, match="algorithm.ampo.num_replace=3 must be less than rollout.n=3"):
        load(**base, **{"rollout.n": 3, "algorithm.ampo.num_replace": 3})
    assert load(**base, **{"rollout.n": 3, "algorithm.ampo.num_replace": 2}).algorithm.ampo.num_replace == 2
    with pytest.raises(ConfigError, match="algorithm.ampo.enabled cannot be used with rollout.temperature_schedule"):
        load(**base, **{"rollout.temperature_schedule": "ead"})
    with pytest.raises(ConfigError, match="algorithm.ampo.enabled with algorithm.srpo_coef"):
        load(**base, **{"algorithm.srpo_coef": 0.5})
    curriculum = load(**base)
    curriculum.task.curriculum = "dump"  # (a mixture's curriculum; the whole-run check at load is check_run)
    with pytest.raises(ConfigError, match="algorithm.ampo.enabled cannot be used with task.curriculum='dump'"):
        check_run(curriculum)
    # A Config built in code (never loaded): train()'s check_whole_config refuses the same.
    off = Config()
    off.algorithm.ampo.num_replace = 3
    with pytest.raises(ConfigError, match="'algorithm.ampo.num_replace' has no effect"):
        check_whole_config(off)
    code = load(**base, **{"rollout.n": 3})
    code.algorithm.ampo.num_replace = 3
    with pytest.raises(ConfigError, match="must be less than rollout.n=3"):
        check_whole_config(code)
    with pytest.raises(ConfigError, match="algorithm.ampo.enabled cannot be used with rollout.backend='vllm'"):
        load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **base, **{"rollout.backend": "vllm"}))
    with pytest.raises(ConfigError, match="algorithm.ampo.enabled with algorithm.hpt.enabled"):
        resolve_algorithm(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **base,
                                                           **{"algorithm.hpt.enabled": True})).algorithm)
    from anabranch.trainer.components import build

    cfg = load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **base))
    with pytest.raises(ConfigError, match="algorithm.ampo.solutions_column='teacher_solutions'"):
        AMPO.create(cfg, None, build(cfg))


# ---------------------------------------------------------------- a short run

def test_two_step_run_trains_the_injected_solution(tiny_model_dir, write_jsonl, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [{"prompt": f"Q{i}: count", "answer": "free" if i % 2 else "12345", "teacher_solutions": ["12345", "9"]}
            for i in range(12)]
    res = train(load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 2, "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": True,
        "trainer.steps": 2, "rollout.n": 3, "rollout.max_new_tokens": 6, "trainer.micro_batch_size": 16,
        "reward.isolation": "none", "reward.functions": "[ampo_test_reward]", "algorithm.ampo.enabled": True})))
    assert len(res.history) == 2
    for m in res.history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["ampo/guided_groups"] >= 1  # half the prompts always fail, and "12345" is correct
        assert m["ampo/selected_logprob"] < 0
        assert 0 < m["ampo/shaped_prob"] < 1  # the injected rows reached policy_update's shaped term
        # The logged accuracy counts the teacher rows; ampo/pre_accuracy is the policy's own ("free" rows only).
        assert m["ampo/pre_accuracy"] < m["accuracy"]
    # The update raised the student's likelihood of the injected solution (Â > 0 on its rows).
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def solution_lp(model_dir):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        ctx = tok("Q0: count", add_special_tokens=False)["input_ids"]
        resp = tok("12345", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ctx + resp])).logits[0].float(), -1)
        return float(sum(lp[len(ctx) + k - 1, t] for k, t in enumerate(resp)))

    assert solution_lp(res.final_model_dir) > solution_lp(tiny_model_dir)
