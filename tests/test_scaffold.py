"""Hint scaffolding, GHPO (Liu, Gong et al. 2025, arXiv 2507.10628): all-fail prompts re-sampled with the
first ω of their reference solution, ω raised per retry stage, trained on-policy in the hinted context.
The prefix against hand-cut texts, the stages on the tiny model (which groups are hinted, at which ω),
the trained rows' hinted prompt tokens and old log-probs against a manual forward, refusals, and a
2-step run with its metrics."""

import dataclasses
import math

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.guide import hinted_prompt
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.scaffold import check_run, scaffold_hint, solution_prefix
from anabranch.config import Config, ConfigError
from anabranch.rewards.registry import REWARDS
from anabranch.trainer.scaffold_step import Scaffold, check_rows
from test_train_e2e import tiny_overrides

if "scaffold_test_reward" not in REWARDS:
    @REWARDS.register("scaffold_test_reward", correctness=True)
    def scaffold_test_reward(prompts, completions, answer, **_):
        # "free" rows are always right; the others are right exactly when the prompt shows the word KEY, i.e.
        # once the hint's solution prefix is long enough to reach it (the completion does not matter).
        return [1.0 if a == "free" else float("KEY" in p) for p, a in zip(prompts, answer)]


# ---------------------------------------------------------------- the hint, by hand

def test_solution_prefix_cuts_at_the_ceiling_of_omega_times_the_words():
    sol = "  Let x = 2.\nThen 2x = 4, so the answer is 4."  # 13 words
    assert solution_prefix(sol, 0.25) == "Let x = 2."                        # ⌈3.25⌉ = 4 words
    assert solution_prefix(sol, 0.5) == "Let x = 2.\nThen 2x ="              # ⌈6.5⌉ = 7 words, spacing kept
    assert solution_prefix(sol, 0.75) == "Let x = 2.\nThen 2x = 4, so the"   # ⌈9.75⌉ = 10 words
    assert solution_prefix(sol, 1.0) == sol.strip()
    assert solution_prefix(sol, 0.01) == "Let"                               # at least one word
    words = [f"w{i}" for i in range(25)]
    assert solution_prefix(" ".join(words), 0.28) == " ".join(words[:7])  # 0.28·25 = 7.000000000000001 is 7 words
    assert solution_prefix("", 0.5) == "" and solution_prefix("one", 0.25) == "one"
    assert scaffold_hint({"demonstration": "a b c d"}, 0.5, "Start: {prefix}") == "Start: a b"
    assert scaffold_hint({"answer": "4"}, 0.5, "{prefix}") is None
    assert scaffold_hint({"demonstration": " "}, 1.0, "{prefix}") is None


# ---------------------------------------------------------------- the stages, tiny model

def components(tiny_model_dir, write_jsonl, tmp_path, **extra):
    from anabranch.trainer.components import build

    # free: always right; at4: KEY is the 4th of 8 words (reached at ω = 0.5); never: no KEY (fails every stage).
    sols = {"free": "p q r s t u v w", "at4": "a b c KEY e f g h", "never": "a b c d e f g h"}
    rows = [{"prompt": f"Q{i}: count", "answer": kind, "solution": sols[kind]}
            for i, kind in enumerate(["free", "at4", "never"] * 4)]
    cfg = load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 2, "rollout.n": 3, "rollout.max_new_tokens": 3, "reward.isolation": "none",
        "reward.functions": "[scaffold_test_reward]", "algorithm.scaffold.enabled": True,
        "algorithm.scaffold.hint_template": "'Start: {prefix}'", **extra}))
    torch.manual_seed(0)
    c = build(cfg)
    kinds = {k: [i for i, r in enumerate(c.train_rows) if r["answer"] == k] for k in sols}
    return cfg, c, kinds


def _tokens(ids, mask):
    return ids[mask.bool()].tolist()


def test_only_all_fail_groups_are_hinted_with_omega_raised_per_stage(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored
    from anabranch.trainer.step import no_grad_log_probs

    cfg, c, kinds = components(tiny_model_dir, write_jsonl, tmp_path)
    idx = [kinds["free"][0], kinds["at4"][0], kinds["never"][0]]
    batch = generate_scored(c, idx, cfg, step=1)
    assert list(batch.total) == [1.0] * 3 + [0.0] * 6  # group 0 right; groups 1 and 2 fail without a hint
    seen = []
    generate = c.backend.generate
    c.backend.generate = lambda prompts, n, **kw: (seen.append(list(prompts)), generate(prompts, n, **kw))[1]
    res = Scaffold.create(cfg, None, c).step(c, batch, step=1)
    out = res.batch

    def hinted(g, prefix):
        return hinted_prompt(batch.rollout.prompts[g], c.train_rows[idx[g]]["question"], f"Start: {prefix}")

    # Stage 1 (ω = 0.25: 2 of 8 words) hints both failed groups; stage 2 (0.5: 4 words) both again (no KEY yet);
    # stage 3 (0.75: 6 words) only group 2, since group 1 found KEY at stage 2. Group 0 is never sent.
    assert seen == [[hinted(1, "a b"), hinted(2, "a b")], [hinted(1, "a b c KEY"), hinted(2, "a b c d")],
                    [hinted(2, "a b c d e f")]]
    new, r = out, out.rollout
    assert r.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert r.prompts == [batch.rollout.prompts[0], hinted(1, "a b c KEY"), hinted(2, "a b c d e f")]
    assert new.total == [1.0] * 3 + [1.0] * 3 + [0.0] * 3  # group 1 trained with its solved stage-2 samples
    assert all(new.rows[i] is batch.rows[i] for i in range(3))  # group 0: the original rows, untouched
    old = batch.rollout
    for i in range(3):
        assert _tokens(r.prompt_ids[i], r.prompt_mask[i]) == _tokens(old.prompt_ids[i], old.prompt_mask[i])
        assert _tokens(r.response_ids[i], r.response_mask[i]) == _tokens(old.response_ids[i], old.response_mask[i])
    # Metrics: 2 of 3 groups hinted, trained at ω 0.5 and 0.75; the policy's own accuracy before: 3 of 9.
    assert out.metrics["scaffold/hinted_groups"] == pytest.approx(2 / 3)
    assert out.metrics["scaffold/hint_ratio"] == pytest.approx(0.625)
    assert out.metrics["scaffold/pre_accuracy"] == pytest.approx(3 / 9)
    # The task mixture's accuracy reads each trained row's own-sample right/wrong, not group 1's hinted successes.
    assert res.pre_correct == [1.0] * 3 + [0.0] * 6

    # The trained rows' context is the hinted prompt's tokens, and their old log-probs (the update's π_old
    # forward of the rollout) are log π(o_t | q̃, o_<t), checked against a manual forward.
    tok, model = c.tokenizer, c.model
    old_lp = no_grad_log_probs(model, r, 4, 1.0)
    for i, g in ((3, 1), (5, 1), (6, 2), (8, 2)):
        ctx = tok(r.prompts[g], add_special_tokens=False)["input_ids"]
        assert _tokens(r.prompt_ids[i], r.prompt_mask[i]) == ctx
        plain = _tokens(old.prompt_ids[3 * g], old.prompt_mask[3 * g])  # the hint-free prompt of group g
        assert len(ctx) > len(plain)
        resp = _tokens(r.response_ids[i], r.response_mask[i])
        manual = []
        for context in (ctx, plain):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([context + resp])).logits[0].float(), -1)
            manual.append(torch.stack([lp[len(context) + k - 1, t] for k, t in enumerate(resp)]))
        got = old_lp[i, :len(resp)]
        assert torch.allclose(got, manual[0], atol=1e-4), (got, manual[0])
        assert not torch.allclose(got, manual[1], atol=1e-3)  # the hint-free context's differ: the test can tell


def test_groups_with_a_success_are_untouched_and_off_by_default(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored

    assert Config().algorithm.scaffold.enabled is False
    cfg, c, kinds = components(tiny_model_dir, write_jsonl, tmp_path, **{"algorithm.scaffold.ratios": "[0.5]"})
    assert Scaffold.create(dataclasses.replace(cfg, algorithm=Config().algorithm), None, c) is None
    batch = generate_scored(c, kinds["free"][:2], cfg, step=1)
    out = Scaffold.create(cfg, None, c).step(c, batch, step=1).batch
    assert out is batch and out.metrics["scaffold/hinted_groups"] == 0.0 and out.metrics["scaffold/hint_ratio"] == 0.0
    # One stage at ω = 0.5: a failed group is hinted once and kept even though it still fails.
    batch = generate_scored(c, [kinds["never"][0]], cfg, step=1)
    out = Scaffold.create(cfg, None, c).step(c, batch, step=1).batch
    assert "Start: a b c d" in out.rollout.prompts[0] and out.metrics["scaffold/hint_ratio"] == 0.5


def test_hinted_groups_are_plain_samples_in_cure_stage_one(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.collect import generate_scored

    cfg, c, kinds = components(tiny_model_dir, write_jsonl, tmp_path, **{
        "algorithm.scaffold.ratios": "[0.5]", "rollout.n": 4, "rollout.extra_rollouts": "cure",
        "rollout.cure_originals": 2, "rollout.cure_branches": 1, "rollout.cure_steps": 5,
        "rollout.cure_selection": "random", "rollout.cure_min_token_chars": 0})
    batch = generate_scored(c, [kinds["free"][0], kinds["never"][0]], cfg, step=1)
    assert batch.metrics["cure/active"] == 1.0 and batch.rollout.loss_mask is not None  # the step's own: CURE's
    branched = []
    cont = c.backend.continue_ids
    c.backend.continue_ids = lambda seqs, *a, **kw: (branched.append(len(seqs)), cont(seqs, *a, **kw))[1]
    out = Scaffold.create(cfg, None, c).step(c, batch, step=1).batch
    assert branched == []  # the hinted prompt was sampled plainly, not originals + critical-token branches
    r = out.rollout
    hinted = (r.group_index == 1).nonzero().flatten()
    assert len(hinted) == 4 and "Start: a b c d" in r.prompts[1]  # rollout.n samples: the group keeps its size
    assert torch.equal(r.trained_mask[hinted], r.response_mask[hinted])  # every sampled token trained (no prefix)
    own = (r.group_index == 0).nonzero().flatten()
    assert torch.equal(r.loss_mask[own], batch.rollout.loss_mask[:4, :r.loss_mask.shape[1]])  # group 0 as it was


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("overrides,match", [
    (["algorithm.scaffold.ratios=[]"], "algorithm.scaffold.ratios must be a non-empty, strictly increasing"),
    (["algorithm.scaffold.ratios=[0.5,0.25]"], "algorithm.scaffold.ratios must be"),
    (["algorithm.scaffold.ratios=[0,0.5]"], "algorithm.scaffold.ratios must be"),
    (["algorithm.scaffold.ratios=[0.5,1.5]"], "algorithm.scaffold.ratios must be"),
    (["algorithm.scaffold.hint_template=noslot"], "algorithm.scaffold.hint_template must be a text containing"),
    (["algorithm.guide.enabled=true"], "algorithm.scaffold.enabled with algorithm.guide.enabled"),
    (["algorithm.name=dapo"], "algorithm.scaffold.enabled with algorithm.dynamic_sampling"),
    (["algorithm.hpt.enabled=true"], "algorithm.scaffold.enabled with algorithm.hpt.enabled"),
    (["algorithm.name=mssr"], "algorithm.scaffold.enabled with algorithm.advantage='mssr'"),
])
def test_resolution_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):  # refused at load now
        resolve_algorithm(load_config(None, ["algorithm.scaffold.enabled=true", *overrides]).algorithm)


def test_inactive_knobs_and_whole_config_combinations_are_refused():
    resolve_algorithm(load_config(None, ["algorithm.scaffold.enabled=true"]).algorithm)  # the defaults resolve
    resolve_algorithm(load_config(None, ["algorithm.scaffold.enabled=true", "algorithm.name=flowrl"]).algorithm)
    for key, value in (("ratios", "[0.5]"), ("hint_template", "'x {prefix}'")):
        with pytest.raises(ConfigError, match=rf"'algorithm.scaffold.{key}' has no effect unless algorithm.scaffold"):
            resolve_algorithm(load_config(None, [f"algorithm.scaffold.{key}={value}"]).algorithm)
    # At config load, as Guide's (config_checks; the same shared refusals, named by scaffold's key).
    with pytest.raises(ConfigError, match=r"algorithm.scaffold.enabled cannot be used with rollout.backend='vllm'.*"
                                          r"or set algorithm.scaffold.enabled=false"):
        load_config(None, ["algorithm.scaffold.enabled=true", "rollout.backend=vllm"])
    cfg = load_config(None, ["algorithm.scaffold.enabled=true"])
    check_run(cfg)
    for key, value, match in (("rollout", {"backend": "vllm"}, "rollout.backend='vllm'"),
                              ("rollout", {"tools": ["python"]}, "rollout.tools"),
                              ("task", {"pairing": True}, "task.pairing")):
        bad = dataclasses.replace(cfg, **{key: dataclasses.replace(getattr(cfg, key), **value)})
        with pytest.raises(ConfigError, match=f"algorithm.scaffold.enabled cannot be used with {match}"):
            check_run(bad)
    # A mixture's curriculum would read the hinted groups' |advantage| as their source's (set on a loaded
    # config: TaskConfig refuses a curriculum without a mixture when it is built).
    curriculum = load_config(None, ["algorithm.scaffold.enabled=true"])
    curriculum.task.curriculum = "dump"
    with pytest.raises(ConfigError, match="algorithm.scaffold.enabled cannot be used with task.curriculum='dump'"):
        check_run(curriculum)
    with pytest.raises(ConfigError, match="algorithm.scaffold.enabled cannot be used with rollout.backend"):
        train(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend="vllm")))  # before any load


def test_rows_without_a_solution_or_a_placeable_question_are_refused():
    cfg = load_config(None, ["algorithm.scaffold.enabled=true", "task.demonstration_column=worked"])
    with pytest.raises(ConfigError, match=r"training row 2 has no reference solution in "
                                          r"task.demonstration_column='worked'"):
        check_rows([{"question": "a", "demonstration": "s t"}, {"question": "b", "answer": "1"}], ["a\n", "b\n"], cfg)
    with pytest.raises(ConfigError, match=r"training row 1's question does not appear verbatim"):
        check_rows([{"question": "a & b", "demonstration": "s"}], ["a &amp; b\n"], cfg)
    check_rows([{"question": "a", "demonstration": "s"}], ["a\n"], cfg)


# ---------------------------------------------------------------- a short run

def test_two_step_run_logs_scaffold_metrics_with_finite_losses(tiny_model_dir, write_jsonl, tmp_path):
    sols = {"free": "p q r s", "at4": "a b c KEY e f g h"}
    rows = [{"prompt": f"Q{i}: count", "answer": k, "solution": sols[k]} for i, k in enumerate(["free", "at4"] * 6)]
    res = train(load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 2, "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
        "trainer.steps": 2, "rollout.n": 3, "rollout.max_new_tokens": 3, "trainer.micro_batch_size": 16,
        "reward.isolation": "none", "reward.functions": "[scaffold_test_reward]",
        "algorithm.scaffold.enabled": True})))
    assert len(res.history) == 2
    for m in res.history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        # Every hinted group reached KEY at ω = 0.5 (stage 2), so the trained batch is all right.
        assert m["scaffold/hint_ratio"] == (0.5 if m["scaffold/hinted_groups"] > 0 else 0.0)
        assert m["accuracy"] == 1.0
    # Before the hints, only the "free" prompts were right: some step drew an "at4" prompt and hinted it.
    assert any(m["scaffold/hinted_groups"] > 0 and m["scaffold/pre_accuracy"] < 1.0 for m in res.history)


def test_a_task_mixture_counts_the_policys_own_accuracy_not_the_hinted_one(tiny_model_dir, write_jsonl, tmp_path):
    # "free" prompts are always right; "at4" prompts only once the hint shows KEY (stage 2), so their hinted
    # groups are all right while the policy's own samples never are: task/at4/accuracy must stay 0.
    free = write_jsonl([{"prompt": f"F{i}: count", "answer": "free", "solution": "p q r s"} for i in range(6)],
                       "free.jsonl")
    at4 = write_jsonl([{"prompt": f"K{i}: count", "answer": "at4", "solution": "a b c KEY e f g h"} for i in range(6)],
                      "at4.jsonl")
    res = train(load_config(None, tiny_overrides(tiny_model_dir, "unused", tmp_path, **{
        "task.mixture": f"[{{name: file, path: {free}, label: free}}, {{name: file, path: {at4}, label: at4}}]",
        "task.eval_size": 1, "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
        "trainer.steps": 2, "rollout.n": 3, "rollout.max_new_tokens": 3, "rollout.prompts_per_step": 4,
        "trainer.micro_batch_size": 16, "reward.isolation": "none", "reward.functions": "[scaffold_test_reward]",
        "algorithm.scaffold.enabled": True})))
    seen = False
    for m in res.history:
        assert m["accuracy"] == 1.0  # the trained batch: every hinted group solved at ω = 0.5
        if "task/at4/accuracy" in m:
            seen = True
            assert m["task/at4/accuracy"] == 0.0 and m["scaffold/hinted_groups"] > 0
        if "task/free/accuracy" in m:
            assert m["task/free/accuracy"] == 1.0
    assert seen  # some step drew an at4 prompt
