"""SCOPE (Ren et al. 2026, arXiv 2602.24110): a PRM locates the first wrong step of a failed sample, a rectifier
model rewrites the response from there, and a correct rewrite replaces the failed sample (its prefix trained
on-policy, the rectifier's tokens with LUFFY's shaped term −f(π_θ)·Â). Hand values for the location, the
selection and the loss; the rewritten batch on the tiny model (stub PRM and rectifier); refusals; a 2-step run."""

import copy
import dataclasses
import math

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.scope import check_run, check_scope, first_wrong_step, prefix_length, scope_objective
from anabranch.config import Config, ConfigError
from anabranch.config_checks import check_whole_config
from anabranch.config_algorithm_options import ScopeConfig
from anabranch.rewards.registry import REWARDS
from anabranch.rollout.base import Rollout, right_padded
from anabranch.trainer.scope_rollouts import Scope, choose
from anabranch.trainer.step import LossContext
from test_train_e2e import tiny_overrides

if "scope_test_reward" not in REWARDS:
    @REWARDS.register("scope_test_reward", correctness=True)
    def scope_test_reward(prompts, completions, answer, **_):
        # "free": always right; "even": right when the completion has an even length; else the digits must match.
        def ok(c, a):
            if a == "free":
                return True
            if a == "even":
                return len(c) % 2 == 0
            return "".join(c.split()) == a
        return [float(ok(c, a)) for c, a in zip(completions, answer)]


# ---------------------------------------------------------------- pieces, by hand

def test_first_wrong_step_and_kept_prefix_by_hand():
    assert first_wrong_step([0.9, 0.8, 0.3, 0.1], 0.5) == 2
    assert first_wrong_step([0.9, 0.5, 0.7], 0.5) is None      # a score at τ is not wrong
    assert first_wrong_step([0.2, 0.9], 0.5) == 0
    assert first_wrong_step([], 0.5) is None
    ends = [3, 7, 12, 15]                                       # each step's last response column
    assert prefix_length(ends, 2) == 8                          # through step 1's last token (column 7)
    assert prefix_length(ends, 1) == 4
    assert prefix_length(ends, 0) is None                       # first step wrong: nothing to keep
    assert prefix_length(ends, None) is None                    # no wrong step located
    # Per group, the largest kept share first (ties: the earlier row), at most max_per_group; row order out.
    cands = [(0, 0, 2, 10), (1, 0, 6, 10), (2, 0, 3, 6), (4, 1, 1, 4)]
    assert choose(cands, 1) == [(1, 6), (4, 1)]
    assert choose(cands, 2) == [(1, 6), (2, 3), (4, 1)]
    assert choose([(3, 0, 2, 4), (1, 0, 1, 2)], 1) == [(1, 1)]


def test_loss_on_prefix_and_rectifier_tokens_against_hand_values():
    algo = resolve_algorithm(Config().algorithm)  # GRPO: ppo_clip, token-mean
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.5, 0.2]])).requires_grad_()
    old = lp.detach().clone()
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    agg = lambda x, m: (x * m).sum() / 5  # noqa: E731  (five trained tokens)
    ctx = LossContext(cfg=algo.cfg, aggregate=agg)
    # Row 1 is a rewrite: its first token is the policy's prefix, the last two the rectifier's.
    off = torch.tensor([[False, False, False], [False, True, True]])
    loss, metrics = scope_objective(algo.objective, lp, old, adv, mask, ctx, off, 0.1, agg)
    # On-policy tokens at r = 1: −Â each (−1, −1, −2); rectifier's: −2·f(p), f = 0.5/0.6 and 0.2/0.3.
    assert float(loss.detach()) == pytest.approx((-1 - 1 - 2 - 2 * 5 / 6 - 2 * 2 / 3) / 5, abs=1e-6)
    assert metrics["scope/shaped_prob"] == pytest.approx((5 / 6 + 2 / 3) / 2)
    loss.backward()
    # ∂(−Â·r)/∂log p = −Â at r = 1; ∂(−Â·f)/∂log p = −Â·p·γ/(p + γ)².
    expect = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -2 * 0.05 / 0.36, -2 * 0.02 / 0.09]]) / 5
    assert torch.allclose(lp.grad, expect, atol=1e-6)
    # No rectifier token: exactly the run's objective (and the metric key still there, 0).
    lp2 = lp.detach().clone().requires_grad_()
    plain, _ = algo.objective(lp2, old, adv, mask, ctx)
    same, m2 = scope_objective(algo.objective, lp2, old, adv, mask, ctx, torch.zeros_like(off), 0.1, agg)
    assert float(same.detach()) == pytest.approx(float(plain.detach())) and m2["scope/shaped_prob"] == 0.0


@pytest.mark.parametrize("mode, row_weight", [
    ("token-mean", 4 / 8),                 # Σ over the row's 4 tokens of 1/(8 tokens in the batch)
    ("seq-mean-token-sum", 4 / 2),         # 4 tokens of 1/(B = 2)
    ("seq-mean-token-mean", 1 / 2),        # the row's mean: 4 tokens of 1/(4·B)
    ("seq-mean-token-sum-norm", 4 / (2 * 5)),  # 4 tokens of 1/(B·T_max), T_max = 5
])
def test_a_salvaged_row_weighs_one_row_in_every_aggregation_mode(mode, row_weight):
    """Row 0 plain, row 1 salvaged (two prefix tokens, two rectifier tokens), both 4 tokens long. Each token's
    aggregation weight is its gradient over ∂L_t/∂log p (−Â at r = 1 for the objective, −Â·pγ/(p + γ)² for the
    shaped term): both rows' weights must sum to one row's. (Aggregating the parts apart under
    seq-mean-token-mean gave the salvaged row 2·(1/2): twice a plain row.)"""
    from functools import partial

    from anabranch.algorithms.aggregation import aggregate, batch_scale
    from anabranch.algorithms.ampo import ampo_objective

    algo = resolve_algorithm(_algo(loss_agg_mode=mode))
    mask = torch.ones(2, 4)
    agg = partial(aggregate, mode=mode, scale=batch_scale(mask, 5))
    ctx = LossContext(cfg=algo.cfg, aggregate=agg)
    p, gamma = 0.5, 0.1
    adv = torch.ones(2, 4)
    off = torch.tensor([[False] * 4, [False, False, True, True]])
    per_token = torch.where(off, torch.tensor(p * gamma / (p + gamma) ** 2), torch.tensor(1.0))  # ∂L_t/∂log p / −Â

    def weights(loss_fn, unit):
        lp = torch.full((2, 4), math.log(p)).requires_grad_()
        loss, _ = loss_fn(lp, lp.detach().clone())
        loss.backward()
        return lp.grad / (-adv * unit)
    w = weights(lambda lp, old: scope_objective(algo.objective, lp, old, adv, mask, ctx, off, gamma, agg), per_token)
    assert float(w[0].sum()) == pytest.approx(row_weight) and float(w[1].sum()) == pytest.approx(row_weight)
    assert torch.allclose(w[1], w[0])  # token by token too: a salvaged token weighs as a plain row's token
    # AMPO's whole injected rows (the same split, algorithms/off_policy_split.py): row 1 all shaped, one row too.
    unit = torch.tensor([[1.0] * 4, [p * gamma / (p + gamma) ** 2] * 4])
    wa = weights(lambda lp, old: ampo_objective(algo.objective, lp, old, adv, mask, ctx, torch.tensor([False, True]),
                                                gamma, agg), unit)
    assert float(wa[0].sum()) == pytest.approx(row_weight) and float(wa[1].sum()) == pytest.approx(row_weight)


# ---------------------------------------------------------------- the rewritten batch, tiny model

class StubRectifier:
    """continue_ids with scripted continuations, keyed by the kept prefix's text."""

    def __init__(self, tok, script):
        self.tok, self.script, self.seen = tok, script, []
        self.eos_ids = [tok.eos_token_id]

    def continue_ids(self, sequences, budgets):
        out = []
        for seq, budget in zip(sequences, budgets):
            text = self.tok.decode(seq, skip_special_tokens=True)
            prefix = next(p for p in sorted(self.script, key=len, reverse=True) if text.endswith(p))
            self.seen.append((prefix, budget))
            ids = self.tok(self.script[prefix], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id, 5, 5]
            out.append((ids[:budget], None))
        return out


def components(tiny_model_dir, write_jsonl, tmp_path, **extra):
    from anabranch.trainer.components import build

    rows = [{"prompt": f"Q{i}: count", "answer": "12345"} for i in range(6)]
    cfg = load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 2, "rollout.n": 3, "rollout.max_new_tokens": 12, "reward.isolation": "none",
        "reward.functions": "[scope_test_reward]", "algorithm.scope.enabled": True,
        "algorithm.scope.prm_path": tiny_model_dir, "algorithm.scope.rectifier": tiny_model_dir, **extra}))
    torch.manual_seed(0)
    return cfg, build(cfg)


def hand_batch(c, cfg, texts):
    """Two groups of three responses ``texts`` (each + EOS) to the first two training prompts, scored."""
    from anabranch.trainer.collect import score_rollout

    tok = c.tokenizer
    prompts = [c.train_prompts[0], c.train_prompts[1]]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    resp, rmask = right_padded([tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts],
                               tok.pad_token_id)
    r = Rollout(prompt_ids=enc["input_ids"].repeat_interleave(3, 0), prompt_mask=enc["attention_mask"].repeat_interleave(3, 0),
                response_ids=resp, response_mask=rmask, group_index=torch.tensor([0, 0, 0, 1, 1, 1]), prompts=prompts,
                completions=list(texts), truncated=torch.zeros(6, dtype=torch.bool))
    return score_rollout(c, r, [c.train_rows[0]] * 3 + [c.train_rows[1]] * 3, cfg, step=1)


def test_rewritten_rows_layout_and_what_is_replaced(tiny_model_dir, write_jsonl, tmp_path):
    cfg, c = components(tiny_model_dir, write_jsonl, tmp_path)
    tok = c.tokenizer
    texts = ["12\n\n34\n\n99", "12345", "7\n\n8", "1\n\n2\n\n3", "12\n\n3\n\n4", "12345"]
    batch = hand_batch(c, cfg, texts)
    assert batch.total == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    scripted = {"12\n\n34\n\n99": [0.9, 0.9, 0.1],   # step 3 wrong: keep "12\n\n34" (6 tokens)
                "7\n\n8": [0.2, 0.9],                # first step wrong: nothing to keep
                "1\n\n2\n\n3": [0.9, 0.6, 0.7],      # no step below τ = 0.5: no error located
                "12\n\n3\n\n4": [0.9, 0.4, 0.9]}     # step 2 wrong: keep "12" (2 tokens)
    seen = []

    def scorer(questions, steps):
        seen.append((questions, steps))
        return [scripted["\n\n".join(s)] for s in steps]
    rect = StubRectifier(tok, {"12\n\n34": "5", "12": "9"})  # the second rewrite stays wrong
    out = Scope(cfg, rect, scorer).step(c, batch)
    # The PRM saw the failed rows only, cut at the delimiter, with each row's question.
    assert seen[0][1] == [["12", "34", "99"], ["7", "8"], ["1", "2", "3"], ["12", "3", "4"]]
    assert seen[0][0] == [str(c.train_rows[0]["question"])] * 2 + [str(c.train_rows[1]["question"])] * 2
    # Each continuation's budget is max_new_tokens − kept tokens (a rewrite is no longer than a sample).
    assert rect.seen == [("12\n\n34", 12 - 6), ("12", 12 - 2)]
    new, r = out.batch, out.batch.rollout
    m = new.metrics
    assert (m["scope/failed"], m["scope/located"], m["scope/first_step_wrong"], m["scope/no_wrong_step"],
            m["scope/rewritten"], m["scope/salvaged"]) == (4, 2, 1, 1, 2, 1)
    assert m["scope/prefix_frac"] == pytest.approx(6 / 11)  # 6 kept of the original's 10 chars + EOS
    assert m["scope/pre_accuracy"] == pytest.approx(2 / 6) and out.pre_correct == batch.total
    # Row 0 is now prefix ⊕ "5" ⊕ EOS (the tokens after EOS cut), right and trained; the rest untouched.
    assert r.completions[0] == "12\n\n345" and new.total == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    row0 = r.response_ids[0][r.response_mask[0].bool()].tolist()
    assert row0 == tok("12\n\n345", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row0[:6] == batch.rollout.response_ids[0, :6].tolist() and not bool(r.truncated[0])
    assert r.loss_mask is None  # every token trained: the prefix on-policy, once (its failed row is gone)
    assert out.off_tokens.shape == r.response_ids.shape
    assert out.off_tokens[0].nonzero().flatten().tolist() == [6, 7]  # "5" and EOS: the rectifier's
    assert not bool(out.off_tokens[1:].any())
    assert r.group_index.tolist() == [0, 0, 0, 1, 1, 1] and r.prompts == batch.rollout.prompts
    for i in range(1, 6):
        n = int(batch.rollout.response_mask[i].sum())
        assert r.response_ids[i, :n].tolist() == batch.rollout.response_ids[i, :n].tolist()
        assert new.rows[i] is batch.rows[i] and r.completions[i] == texts[i]
    assert torch.equal(r.prompt_ids, batch.rollout.prompt_ids)
    assert out.precomputed({"x": 1})["scope_off_tokens"] is out.off_tokens

    # max_per_group=1 with both failures of a group located: the one keeping more of its response.
    cfg.algorithm.scope.max_per_group = 1
    texts2 = ["12\n\n3\n\n4", "12\n\n34\n\n99", "12345", "12345", "12345", "12345"]
    rect2 = StubRectifier(tok, {"12\n\n34": "5", "12": "345"})
    out2 = Scope(cfg, rect2, scorer).step(c, hand_batch(c, cfg, texts2))
    assert [p for p, _ in rect2.seen] == ["12\n\n34"] and out2.off_tokens[1].nonzero().flatten().tolist() == [6, 7]
    # Nothing salvaged (the rewrite stays wrong): the same batch object, no key for the update.
    rect3 = StubRectifier(tok, {"12\n\n34": "0", "12": "0"})
    b3 = hand_batch(c, cfg, texts)
    none = Scope(cfg, rect3, scorer).step(c, b3)
    assert none.batch is b3 and none.off_tokens is None and none.precomputed({"x": 1}) == {"x": 1}
    assert none.batch.metrics["scope/rewritten"] == 2 and none.batch.metrics["scope/salvaged"] == 0


def test_update_raises_the_salvaged_rewrites_tokens(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.advantage_pass import compute_advantages
    from anabranch.trainer.step import policy_update

    cfg, c = components(tiny_model_dir, write_jsonl, tmp_path)
    tok = c.tokenizer
    batch = hand_batch(c, cfg, ["12\n\n34\n\n99", "7", "8", "12345", "0", "1"])
    out = Scope(cfg, StubRectifier(tok, {"12\n\n34": "5"}), lambda q, steps: [[0.9, 0.9, 0.1][:len(x)] for x in steps]).step(c, batch)
    r = out.batch.rollout
    assert out.off_tokens[0].nonzero().flatten().tolist() == [6, 7]

    def row0_log_probs(model):
        ctx = r.prompt_ids[0][r.prompt_mask[0].bool()].tolist()
        resp = r.response_ids[0][r.response_mask[0].bool()].tolist()
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ctx + resp])).logits[0].float() / cfg.rollout.temperature, -1)
        return torch.stack([lp[len(ctx) + k - 1, t] for k, t in enumerate(resp)])
    before = row0_log_probs(c.model)
    adv = compute_advantages(c.algo, c.model, r, out.batch.rewards, micro_batch_size=8,
                             temperature=cfg.rollout.temperature)
    assert float(adv.advantages[0].max()) > 0  # the salvaged row is the group's only success

    def update(rollout, precomputed):  # one step of a fresh copy of the policy and a fresh optimizer
        model = copy.deepcopy(c.model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        metrics = policy_update(model, opt, rollout, adv.advantages, out.batch.rewards, c.algo, micro_batch_size=8,
                                grad_clip=1.0, temperature=cfg.rollout.temperature, max_response_len=12,
                                precomputed=precomputed)
        return row0_log_probs(model) - before, metrics
    rise, metrics = update(r, out.precomputed(adv.precomputed))
    assert 0 < metrics["scope/shaped_prob"] < 1
    # Control: the same update with the rectifier's tokens left out of the loss.
    masked = dataclasses.replace(r, loss_mask=(r.response_mask.bool() & ~out.off_tokens).long())
    rise0, _ = update(masked, adv.precomputed)
    # Â > 0 on the salvaged row: its prefix rises, and the shaped term raises the rectifier's "5" ⊕ EOS more
    # than the control does.
    assert float(rise[:6].sum()) > 0 and float(rise[6:].sum()) > float(rise0[6:].sum())


# ---------------------------------------------------------------- config

def _algo(**kw):
    from anabranch.config import AlgorithmConfig

    return AlgorithmConfig(**{"advantage": "grpo", "loss": "ppo_clip", **kw})


def test_refusals_name_the_keys(tiny_model_dir, write_jsonl, tmp_path):
    on = dict(enabled=True, prm_path="p", rectifier="r")
    assert check_scope(_algo(scope=ScopeConfig(**on))) is None
    assert check_scope(_algo()) is None  # off by default
    assert "algorithm.scope.step_threshold" in check_scope(_algo(scope=ScopeConfig(**on, step_threshold=0.0)))
    assert "algorithm.scope.max_per_group" in check_scope(_algo(scope=ScopeConfig(**on, max_per_group=0)))
    assert "algorithm.scope.shaping_gamma" in check_scope(_algo(scope=ScopeConfig(**on, shaping_gamma=-1.0)))
    assert check_scope(_algo(scope=ScopeConfig(max_per_group=1))) is None  # a knob while off: config_checks._GATED
    assert "needs algorithm.scope.prm_path" in check_scope(_algo(scope=ScopeConfig(enabled=True, rectifier="r")))
    assert "loss='gspo'" in check_scope(_algo(loss="gspo", scope=ScopeConfig(**on)))
    from anabranch.config_algorithm_options import AMPOConfig

    assert "algorithm.ampo.enabled" in check_scope(_algo(ampo=AMPOConfig(enabled=True), scope=ScopeConfig(**on)))
    # Dynamic sampling would drop the all-fail groups, SCOPE's main target, before it sees them.
    assert "with algorithm.dynamic_sampling: dynamic sampling drops the groups whose samples are all wrong" in \
        check_scope(_algo(dynamic_sampling=True, scope=ScopeConfig(**on)))
    rows = [{"prompt": f"Q{i}", "answer": "1"} for i in range(6)]
    data = write_jsonl(rows)
    base = {"task.eval_size": 2, "algorithm.scope.enabled": True, "algorithm.scope.prm_path": tiny_model_dir,
            "algorithm.scope.rectifier": tiny_model_dir}
    load = lambda **kw: load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **kw))  # noqa: E731
    with pytest.raises(ConfigError, match="'algorithm.scope.step_threshold' has no effect unless"):
        load(**{"algorithm.scope.step_threshold": 0.3})
    with pytest.raises(ConfigError, match="algorithm.scope.max_per_group=3 must be less than rollout.n=3"):
        load(**base, **{"rollout.n": 3, "algorithm.scope.max_per_group": 3})
    assert load(**base, **{"rollout.n": 3}).algorithm.scope.enabled
    for key, value, match in [("rollout.backend", "vllm", "rollout.backend='vllm'"),
                              ("rollout.temperature_schedule", "ead", "rollout.temperature_schedule='ead'"),
                              ("rollout.extra_rollouts", "cure", "rollout.extra_rollouts=cure")]:
        with pytest.raises(ConfigError, match=f"algorithm.scope.enabled cannot be used with {match}"):
            load(**base, **{key: value, **({"rollout.n": 16} if value == "cure" else {})})
    with pytest.raises(ConfigError, match="algorithm.scope.enabled with algorithm.dynamic_sampling"):
        load(**base, **{"algorithm.dynamic_sampling": True})
    with pytest.raises(ConfigError, match="algorithm.scope.rectifier='/no/such/model' is not an existing folder"):
        load(**{**base, "algorithm.scope.rectifier": "/no/such/model"})
    shaped = load(**base)
    shaped.reward.prm_shaping = "clip"
    with pytest.raises(ConfigError, match="cannot be used with reward.prm_shaping=clip"):
        check_run(shaped)
    # A Config built in code (never loaded): train()'s check_whole_config refuses the same.
    off = Config()
    off.algorithm.scope.max_per_group = 1
    with pytest.raises(ConfigError, match="'algorithm.scope.max_per_group' has no effect"):
        check_whole_config(off)
    code = load(**base, **{"rollout.n": 3})
    code.algorithm.scope.max_per_group = 3
    with pytest.raises(ConfigError, match="must be less than rollout.n=3"):
        check_whole_config(code)


def test_rectifier_errors_name_the_scope_key(tiny_model_dir):
    """The loader's and the vocabulary check's errors name algorithm.scope.rectifier, not KDRL's key."""
    from anabranch.trainer.scope_rollouts import load_rectifier

    class OtherTok:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    cfg = Config()
    cfg.algorithm.scope.rectifier = tiny_model_dir
    with pytest.raises(ConfigError, match=r"^algorithm\.scope\.rectifier='.*': the teacher's tokenizer has \d+ tokens, "
                                          r"the student's 2") as err:
        load_rectifier(cfg, OtherTok(), torch.device("cpu"))
    assert "kdrl" not in str(err.value)
    cfg.algorithm.scope.rectifier = "not a folder"
    with pytest.raises(ConfigError, match="^algorithm.scope.rectifier='not a folder' could not be loaded"):
        load_rectifier(cfg, OtherTok(), torch.device("cpu"))


# ---------------------------------------------------------------- a short run

def test_two_step_run_trains_the_rectifier_tokens(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    import anabranch.rewards.prm as prm
    import anabranch.trainer.scope_rollouts as sr

    # Stub PRM: each token a step (the char model writes no "\n\n"), the third step the first wrong one.
    monkeypatch.setattr(prm, "response_steps", lambda decode, ids, delim: ([decode([t]) for t in ids], list(range(len(ids)))))
    monkeypatch.setattr(sr, "prm_scorer", lambda path, device: (
        lambda questions, steps: [[0.9, 0.9] + [0.1] * (len(s) - 2) for s in steps]))
    rows = [{"prompt": f"Q{i}: count", "answer": "even"} for i in range(12)]
    res = train(load_config(None, tiny_overrides(tiny_model_dir, write_jsonl(rows), tmp_path, **{
        "task.eval_size": 2, "trainer.eval_before": False, "trainer.eval_after": False,
        "trainer.steps": 2, "rollout.n": 4, "rollout.max_new_tokens": 8, "trainer.micro_batch_size": 16,
        "reward.isolation": "none", "reward.functions": "[scope_test_reward]", "algorithm.scope.enabled": True,
        "algorithm.scope.prm_path": tiny_model_dir, "algorithm.scope.rectifier": tiny_model_dir})))
    assert len(res.history) == 2
    for m in res.history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["scope/failed"] >= 1 and m["scope/rewritten"] >= 1
        assert m["scope/salvaged"] <= m["scope/rewritten"] <= m["scope/located"] <= m["scope/failed"]
        if m["scope/salvaged"] > 0:  # the rectifier's tokens reached policy_update's shaped term
            assert 0 < m["scope/shaped_prob"] < 1 and m["accuracy"] > m["scope/pre_accuracy"]
    assert sum(m["scope/salvaged"] for m in res.history) >= 1
