"""Guide (Nath, Lau et al. 2025, arXiv 2506.13923): hints for all-fail prompts, trained for the hint-free
context with the ratio π_θ(o | q) / π_old(o | q, h). The ratio and clipped loss against hand values,
the guided batch on the tiny model (hint-free context tokens, hinted behaviour log-probs against a
manual forward, groups with a success untouched), the ratio reaching policy_update, config errors and
a short run with its metrics."""

import dataclasses
import math

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.guide import (all_fail_groups, behaviour_old_log_prob, check_run, hint_text, hinted_prompt,
                                        question_text)
from anabranch.algorithms.grpo import ppo_surrogate
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import Config, ConfigError
from anabranch.rewards.registry import REWARDS
from anabranch.trainer.guide_step import Guide, check_rows
from test_train_e2e import tiny_overrides

if "guide_test_reward" not in REWARDS:
    @REWARDS.register("guide_test_reward", correctness=True)
    def guide_test_reward(prompts, completions, answer, **_):
        # Rows answered "free" are always right; the others need the exact answer (never reached here).
        return [1.0 if a == "free" else float(c.strip() == a) for c, a in zip(completions, answer)]


# ---------------------------------------------------------------- pieces, by hand

def test_hint_text_prompt_and_failed_groups():
    assert hint_text({"answer": "7", "demonstration": "3+4"}, "Hint: {demonstration} = {answer}") == "Hint: 3+4 = 7"
    assert hint_text({"answer": " "}, "{answer}") is None and hint_text({}, "{solution}") is None
    assert question_text({"question": [{"role": "system", "content": "s"}, {"role": "user", "content": "Q?"}]}) == "Q?"
    p = "<user>Q: 2+2? Answer in tags.</user><assistant>"
    assert hinted_prompt(p, "Q: 2+2?", "Hint: 4") == "<user>Q: 2+2?\n\nHint: 4 Answer in tags.</user><assistant>"
    assert hinted_prompt(p, "Q: 3+3?", "x") is None
    correct = torch.tensor([0, 0, 0, 1, 0, 0, 1, 1, 0, 0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert all_fail_groups(correct, groups) == [0, 2, 4]


def test_guided_ratio_and_clipped_loss_against_hand_values():
    cfg = Config().algorithm  # clip_ratio_low = clip_ratio_high = 0.2
    lp = torch.log(torch.tensor([[0.5, 0.5], [0.2, 0.3], [0.6, 0.05]])).requires_grad_()
    old = lp.detach().clone()                                    # π_old in the hint-free context (ppo_epochs = 1)
    behaviour = torch.log(torch.tensor([[0.9, 0.9], [0.5, 0.2], [0.4, 0.1]]))  # π_old(o_t | q, h, o_<t)
    rows = torch.tensor([False, True, True])
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]])
    old_eff = behaviour_old_log_prob(old, behaviour, rows)
    assert torch.equal(old_eff[0], old[0]) and torch.allclose(old_eff[1:], behaviour[1:])
    loss_mat, clipped, _ = ppo_surrogate(lp, old_eff, adv, cfg)
    # Ratios: row 0 (not guided) 1, 1; row 1 0.2/0.5 = 0.4, 0.3/0.2 = 1.5; row 2 0.6/0.4 = 1.5, 0.05/0.1 = 0.5.
    # L = max(−Â·r, −Â·clip(r, 0.8, 1.2)): Â = +1: 0.4 -> −0.4 (kept), 1.5 -> −1.2 (clipped);
    # Â = −1: 1.5 -> 1.5 (kept), 0.5 -> 0.8 (clipped).
    expected = torch.tensor([[-1.0, -1.0], [-0.4, -1.2], [1.5, 0.8]])
    assert torch.allclose(loss_mat, expected, atol=1e-6)
    assert clipped.tolist() == [[False, False], [False, True], [False, True]]
    loss_mat.sum().backward()
    # d L / d log π_θ = −Â·r on kept tokens, 0 on clipped ones.
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -1.0], [-0.4, 0.0], [1.5, 0.0]]), atol=1e-6)
    # Off (no behaviour log-probs): the objective's own π_old.
    assert behaviour_old_log_prob(old, None, None) is old


# ---------------------------------------------------------------- the guided batch, tiny model

def components(tiny_model_dir, write_jsonl, tmp_path, **extra):
    from anabranch.trainer.components import build

    rows = [{"prompt": f"Q{i}: count", "answer": "free" if i % 2 else "12345"} for i in range(12)]
    cfg = load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 2, "rollout.n": 3, "rollout.max_new_tokens": 3, "reward.isolation": "none",
        "reward.functions": "[guide_test_reward]", "algorithm.guide.enabled": True,
        "algorithm.guide.hint_template": "'Hint: the answer is {answer}.'", **extra}))
    torch.manual_seed(0)
    c = build(cfg)
    fail = [i for i, r in enumerate(c.train_rows) if r["answer"] == "12345"]
    free = [i for i, r in enumerate(c.train_rows) if r["answer"] == "free"]
    return cfg, c, fail, free


def test_all_fail_groups_get_guided_samples_in_the_hint_free_context(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored

    cfg, c, fail, free = components(tiny_model_dir, write_jsonl, tmp_path, **{"algorithm.guide.num_samples": 2})
    idx = [fail[0], free[0], fail[1], free[1]]
    batch = generate_scored(c, idx, cfg, step=1)  # groups 0, 2 ("12345") fail; 1, 3 ("free") succeed
    seen = []
    generate = c.backend.generate
    c.backend.generate = lambda prompts, n, **kw: (seen.append((list(prompts), n)), generate(prompts, n, **kw))[1]
    guide = Guide.create(cfg, None, c)
    out = guide.step(c, batch, step=1)
    new, r = out.batch, out.batch.rollout

    # The hinted prompts went to the backend: the question, then the hint, in the user turn.
    assert len(seen) == 1 and seen[0][1] == 2
    assert seen[0][0] == [hinted_prompt(batch.rollout.prompts[g], c.train_rows[idx[g]]["question"],
                                        "Hint: the answer is 12345.") for g in (0, 2)]
    assert all("Hint: the answer is 12345." in p for p in seen[0][0])
    # Groups 0 and 2 are replaced by 2 guided samples each; groups 1 and 3 are the original rows.
    assert r.group_index.tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert out.guided_rows.tolist() == [True, True, False, False, False, True, True, False, False, False]
    assert out.metrics["guide/guided_groups_frac"] == 0.5 and out.metrics["guide/guided_success"] == 0.0
    # The policy's own accuracy, before the replacement: groups 1, 3 right (2 × 3 samples), 0, 2 wrong -> 6 / 12
    # (the replaced batch's would be 6 / 10).
    assert list(batch.total) == [0.0] * 3 + [1.0] * 3 + [0.0] * 3 + [1.0] * 3
    assert out.metrics["guide/pre_accuracy"] == pytest.approx(6 / 12)
    # Per trained row (num_samples=2 rows for a guided group): its prompt's own right/wrong, for the task mixture.
    assert out.pre_correct == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert r.prompts == batch.rollout.prompts  # hint-free prompt texts

    def tokens(ids, mask):
        return ids[mask.bool()].tolist()

    old = batch.rollout
    for i, g in enumerate(r.group_index.tolist()):
        # The training context is the hint-free prompt's tokens, for guided rows too.
        first = int((old.group_index == g).nonzero()[0])
        assert tokens(r.prompt_ids[i], r.prompt_mask[i]) == tokens(old.prompt_ids[first], old.prompt_mask[first])
    for i, j in ((2, 3), (3, 4), (4, 5), (7, 9), (8, 10), (9, 11)):  # rows of groups 1, 3: untouched
        assert tokens(r.response_ids[i], r.response_mask[i]) == tokens(old.response_ids[j], old.response_mask[j])
        assert new.total[i] == batch.total[j] == 1.0 and new.rows[i] is batch.rows[j]
    assert out.behaviour_log_prob[~out.guided_rows].abs().sum() == 0

    # Behaviour log-probs: log π(o_t | q, h, o_<t) by a manual forward of [hinted prompt | response].
    tok, model = c.tokenizer, c.model
    for i, g in ((0, 0), (1, 0), (5, 2), (6, 2)):
        hinted = tok(seen[0][0][0 if g == 0 else 1], add_special_tokens=False)["input_ids"]
        plain = tokens(r.prompt_ids[i], r.prompt_mask[i])
        resp = tokens(r.response_ids[i], r.response_mask[i])
        manual = []
        for ctx in (hinted, plain):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ctx + resp])).logits[0].float(), -1)
            manual.append(torch.stack([lp[len(ctx) + k - 1, t] for k, t in enumerate(resp)]))
        got = out.behaviour_log_prob[i, :len(resp)]
        assert torch.allclose(got, manual[0], atol=1e-4), (got, manual[0])
        assert not torch.allclose(got, manual[1], atol=1e-3)  # the hint-free context's differ: the test can tell


def test_the_update_uses_the_hinted_behaviour_log_probs(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored
    from anabranch.trainer.step import policy_update

    cfg, c, fail, _ = components(tiny_model_dir, write_jsonl, tmp_path)
    batch = generate_scored(c, fail[:2], cfg, step=1)  # both groups fail: all rows guided
    out = Guide.create(cfg, None, c).step(c, batch, step=1)
    # Advantages ±1 so every guided token has a gradient; lr 0 keeps the weights for the comparison.
    adv = torch.where(torch.arange(len(out.batch.rows)) % 2 == 0, 1.0, -1.0)[:, None] * out.batch.rollout.response_mask
    algo = resolve_algorithm(cfg.algorithm)
    opt = torch.optim.SGD(c.model.parameters(), lr=0.0)

    def update(pre):
        return policy_update(c.model, opt, out.batch.rollout, adv, out.batch.rewards, algo, micro_batch_size=4,
                             grad_clip=0.0, temperature=1.0, max_response_len=3, precomputed=pre)

    plain, guided = update({}), update(out.precomputed({}))
    assert plain["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # π_old = π_θ: ratio 1
    # approx_kl = mean_t −log r_t = mean_t (log π_old(o_t | q, h) − log π_θ(o_t | q)) over the guided tokens.
    m = out.batch.rollout.response_mask.bool()
    from anabranch.trainer.step import no_grad_log_probs
    lp = no_grad_log_probs(c.model, out.batch.rollout, 4, 1.0)
    expected = (out.behaviour_log_prob - lp)[m].mean().item()
    assert abs(expected) > 1e-3 and guided["approx_kl"] == pytest.approx(expected, abs=1e-4)


def test_groups_with_a_success_are_untouched_and_off_by_default(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored

    assert Config().algorithm.guide.enabled is False
    cfg, c, _, free = components(tiny_model_dir, write_jsonl, tmp_path)
    assert Guide.create(dataclasses.replace(cfg, algorithm=Config().algorithm), None, c) is None
    batch = generate_scored(c, free[:2], cfg, step=1)  # both "free": every sample right
    out = Guide.create(cfg, None, c).step(c, batch, step=1)
    assert out.batch is batch and out.guided_rows is None and out.precomputed({"x": 1}) == {"x": 1}
    assert out.metrics["guide/guided_groups_frac"] == 0.0
    assert out.metrics["guide/pre_accuracy"] == 1.0  # every sample of both groups right (6 / 6)


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("overrides,match", [
    (["algorithm.guide.hint_template=nofield"], "algorithm.guide.hint_template must be a text naming"),
    (["algorithm.guide.num_samples=-1"], "algorithm.guide.num_samples must be an integer >= 0"),
    (["algorithm.name=dapo"], "algorithm.guide.enabled with algorithm.dynamic_sampling"),
    (["algorithm.hpt.enabled=true"], "algorithm.guide.enabled with algorithm.hpt.enabled"),
    (["algorithm.name=flowrl"], r"loss='flowrl'"),
])
def test_resolution_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):  # refused at load now
        resolve_algorithm(load_config(None, ["algorithm.guide.enabled=true", *overrides]).algorithm)


def test_load_time_errors_name_the_key():
    resolve_algorithm(load_config(None, ["algorithm.guide.enabled=true"]).algorithm)  # the defaults resolve
    with pytest.raises(ConfigError, match=r"'algorithm.guide.num_samples' has no effect unless algorithm.guide"):
        load_config(None, ["algorithm.guide.num_samples=4"])
    with pytest.raises(ConfigError, match=r"algorithm.guide.enabled cannot be used with rollout.backend='vllm'"):
        load_config(None, ["algorithm.guide.enabled=true", "rollout.backend=vllm"])
    cfg = load_config(None, ["algorithm.guide.enabled=true"])
    for key, value, match in (("rollout", {"tools": ["python"]}, "rollout.tools"),
                              ("task", {"pairing": True}, "task.pairing")):
        bad = dataclasses.replace(cfg, **{key: dataclasses.replace(getattr(cfg, key), **value)})
        with pytest.raises(ConfigError, match=f"algorithm.guide.enabled cannot be used with {match}"):
            check_run(bad)
    # A mixture's curriculum would read the hinted groups' |advantage| as their source's (set on a loaded
    # config: TaskConfig refuses a curriculum without a mixture when it is built).
    curriculum = load_config(None, ["algorithm.guide.enabled=true"])
    curriculum.task.curriculum = "dump"
    with pytest.raises(ConfigError, match="algorithm.guide.enabled cannot be used with task.curriculum='dump'"):
        check_run(curriculum)


def test_rows_without_the_hint_fields_or_a_placeable_question_are_refused():
    cfg = load_config(None, ["algorithm.guide.enabled=true", "algorithm.guide.hint_template='Use {solution}'"])
    with pytest.raises(ConfigError, match=r"algorithm.guide.hint_template: training row 2 .*\['solution'\]"):
        check_rows([{"question": "a", "solution": "s"}, {"question": "b", "answer": "1"}], ["a\n", "b\n"], cfg)
    with pytest.raises(ConfigError, match=r"training row 1's question does not appear verbatim"):
        check_rows([{"question": "a & b", "solution": "s"}], ["a &amp; b\n"], cfg)
    check_rows([{"question": "a", "solution": "s"}], ["a\n"], cfg)


# ---------------------------------------------------------------- a short run

def test_short_run_logs_guide_metrics_with_finite_losses(tiny_model_dir, write_jsonl, tmp_path):
    rows = [{"prompt": f"Q{i}: count", "answer": "free" if i % 2 else "12345"} for i in range(12)]
    res = train(load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 2, "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
        "trainer.steps": 3, "rollout.n": 3, "rollout.max_new_tokens": 3, "trainer.micro_batch_size": 16,
        "reward.isolation": "none", "reward.functions": "[guide_test_reward]", "algorithm.guide.enabled": True})))
    assert len(res.history) == 3
    for m in res.history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert 0.0 <= m["guide/guided_groups_frac"] <= 1.0 and m["guide/guided_success"] == 0.0
    assert any(m["guide/guided_groups_frac"] > 0 for m in res.history)  # half the prompts always fail


def test_guide_is_refused_with_mssr():
    from anabranch.algorithms.guide import check_guide
    from anabranch.config import AlgorithmConfig, GuideConfig

    assert "advantage='mssr'" in check_guide(AlgorithmConfig(advantage="mssr", loss="ppo_clip", guide=GuideConfig(enabled=True)))
    assert check_guide(AlgorithmConfig(advantage="grpo", loss="ppo_clip", guide=GuideConfig(enabled=True))) is None


def test_hinted_samples_do_not_teach_stateful_rewards(tiny_model_dir, write_jsonl, tmp_path):
    """OLR / LASER-D record a training call's observations as pending; Guide's hinted call drops them."""
    from anabranch.trainer.collect import generate_scored

    cfg, c, fail, free = components(tiny_model_dir, write_jsonl, tmp_path)
    batch = generate_scored(c, [fail[0], free[0]], cfg, step=1)

    class State:  # a stateful reward's protocol (rewards/compose.py): pending observations until committed
        pending: list = []

        def take_pending(self):
            out, self.pending = self.pending, []
            return out

    c.rewards[0].state = State()
    c.rewards[0].state.pending = ["left by the hinted call"]
    out = Guide.create(cfg, None, c).step(c, batch, step=1)
    assert out.metrics["guide/guided_groups_frac"] == 0.5  # the failed group was guided
    assert c.rewards[0].state.pending == []


def test_own_flags_follow_the_trained_rows():
    from anabranch.trainer.guide_step import own_flags

    # Group 1 (all wrong) replaced by 3 hinted rows, groups 0 and 2 kept: each row gets its group's own flag.
    got = own_flags([1.0, 0.0, 0.0, 0.0, 1.0, 0.0], torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([0, 0, 1, 1, 1, 2, 2]))
    assert got == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
