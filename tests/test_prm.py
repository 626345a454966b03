"""PRM-Clip / PRM-Delta (Gao et al. 2024): step splitting and step-end tokens (multi-byte characters and
space clean-up included), the PRM's step scores against a direct forward and its position limit, the
shaped step rewards on hand values, their place among the token-level rewards (the row slices that carry
them: test_prm_rows.py), the scoring calls without PRM fields, the config refusals, and short PPO / REINFORCE++ trainings with a tiny
random PRM whose step rewards are checked inside train()."""

import math
from types import SimpleNamespace

import pytest
import torch

from anabranch import load_config, train
from anabranch.algorithms.advantages import reinforce_pp_advantage
from anabranch.algorithms.prm_shaping import process_token_rewards, step_rewards
from anabranch.config import AlgorithmConfig, ConfigError
from anabranch.models.tiny import build_tiny_model, char_tokenizer
from anabranch.rewards.prm import prm_fields, prm_inputs, score_steps, split_steps, step_end_tokens
from anabranch.rollout.base import Rollout
from anabranch.trainer.advantage_pass import compute_advantages
from anabranch.trainer.collect import ScoredBatch, concat_batches, select_groups
from test_train_e2e import digit_task, tiny_overrides

PRM_PARAMS = {"step_tag": "#", "good_token": "+", "bad_token": "-", "step_delimiter": "\n\n", "batch_size": 2}


@pytest.fixture(scope="module")
def tiny_prm_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("prm") / "prm", seed=1))


def test_split_steps_and_step_end_tokens():
    text = "ab\n\n  \n\ncd  \n\nefg"
    spans = split_steps(text)
    assert [text[a:b] for a, b in spans] == ["ab", "cd", "efg"]  # whitespace-only piece dropped, tails cut
    assert spans == [(0, 2), (8, 10), (14, 17)]
    tok = char_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    # One character per token: a step ends on the token of its last character (EOS is not a step's end).
    assert step_end_tokens(decode, ids, spans) == [1, 9, 16]
    assert split_steps("one step only") == [(0, 13)]
    with pytest.raises(ValueError, match="step_delimiter"):
        split_steps("x", "")


def test_clip_and_delta_step_rewards_by_hand():
    s = [0.9, 0.3, 0.6, 0.8]
    assert step_rewards(s, "clip", 0.5) == pytest.approx([0.0, -0.2, 0.0, 0.0])  # min(s − η, 0), last included
    assert step_rewards(s, "delta") == pytest.approx([0.6, -0.3, -0.2, 0.0])     # s_k − s_{k+1}, last 0
    assert sum(step_rewards(s, "delta")) == pytest.approx(s[0] - s[-1])          # telescoping
    assert step_rewards(s, "clip_delta", 0.5) == pytest.approx([0.2, -0.2, 0.0, 0.0])
    assert step_rewards([0.7], "delta") == [0.0] and step_rewards([0.2], "clip", 0.5) == pytest.approx([-0.3])
    assert step_rewards([], "clip") == [] and step_rewards(s, "none") == [0.0] * 4
    # Repeating good steps cannot raise the return: Clip never rewards, Delta stays s_1 − s_K.
    many = [0.95] * 20
    assert sum(step_rewards(many, "clip", 0.5)) == 0.0 and sum(step_rewards(many, "delta")) == pytest.approx(0.0)


def test_process_token_rewards_placed_on_step_ends():
    out = process_token_rewards([[0.9, 0.3, 0.6], [0.2]], [[1, 4, 6], [2]], 8, "delta", coef=2.0)
    want = torch.zeros(2, 8)
    want[0, 1], want[0, 4] = 2 * 0.6, 2 * -0.3  # the last step's delta is 0
    assert torch.allclose(out, want)
    out = process_token_rewards([[0.2], [0.9, 0.1]], [[3], [0, 0]], 4, "clip", eta=0.5)
    assert out[0, 3].item() == pytest.approx(-0.3) and out[1, 0].item() == pytest.approx(-0.4)  # same token: added


def _rollout(response_mask):
    b, r = response_mask.shape
    return Rollout(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                   response_ids=torch.ones(b, r, dtype=torch.long), response_mask=response_mask,
                   group_index=torch.arange(b) // 2, prompts=["p"] * ((b + 1) // 2), completions=["c"] * b,
                   truncated=torch.zeros(b, dtype=torch.bool))


def test_advantage_pass_adds_step_rewards_to_the_outcome():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    rollout = _rollout(mask)
    process = torch.tensor([[0.5, 0.0, -0.25, 0.0, 0.0], [0.0, -0.5, 0.0, 0.0, 0.0]])
    seen = {}

    def capture(rewards, group_index, response_mask, cfg, token_rewards=None, **_):
        seen["token_rewards"], seen["rewards"] = token_rewards, rewards
        return reinforce_pp_advantage(rewards, group_index, response_mask, cfg, token_rewards=token_rewards)

    algo = SimpleNamespace(cfg=AlgorithmConfig(advantage="reinforce_pp", kl_coef=0.0, gamma=1.0), needs=frozenset(),
                           advantage=capture)
    outcome = torch.tensor([1.0, 0.0])
    plain = compute_advantages(algo, None, rollout, outcome, micro_batch_size=2, temperature=1.0)
    assert torch.equal(seen["token_rewards"], torch.tensor([[0, 0, 0, 1.0, 0], [0, 0, 0, 0, 0]]))
    rollout.process_rewards = process  # what trainer/collect.py attaches
    shaped = compute_advantages(algo, None, rollout, outcome, micro_batch_size=2, temperature=1.0)
    want = torch.tensor([[0.5, 0.0, -0.25, 1.0, 0.0], [0.0, -0.5, 0.0, 0.0, 0.0]])
    assert torch.allclose(seen["token_rewards"], want)
    # REINFORCE++ with γ = 1: G_t = Σ_{s≥t} r_s, whitened over the batch's tokens (computed by hand here).
    g = torch.tensor([[1.25, 0.75, 0.75, 1.0], [-0.5, -0.5, 0.0, 0.0]])
    vals = torch.cat([g[0], g[1, :3]])
    z = (vals - vals.mean()) / vals.std()
    assert torch.allclose(shaped.advantages[0, :4], z[:4], atol=1e-5)
    assert torch.allclose(shaped.advantages[1, :3], z[4:], atol=1e-5)
    assert not torch.allclose(plain.advantages, shaped.advantages)


def test_prm_scores_equal_a_direct_forward(tiny_prm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_prm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_prm_dir).eval()
    questions, steps = ["Q1: 2+3?", "Q2"], [["2+3=5", "so 5"], ["x"]]
    scores = score_steps(model, tok, questions, steps, "#", "+", "-", batch_size=2)  # padded together
    assert [len(s) for s in scores] == [2, 1]
    good, bad = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
    for q, st, got in zip(questions, steps, scores):
        text = q + "\n" + "".join(f"{s} #\n" for s in st)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        tags = (ids[0] == tok.convert_tokens_to_ids("#")).nonzero().flatten().tolist()
        want = [math.exp(logits[t, good]) / (math.exp(logits[t, good]) + math.exp(logits[t, bad])) for t in tags]
        assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="step_tag"):
        score_steps(model, tok, ["q"], [["a"]], "##", "+", "-")


def test_prm_fields_and_shaping_survive_dynamic_sampling(tiny_prm_dir):
    from anabranch.algorithms.prm_shaping import attach
    from anabranch.config import RewardConfig
    from anabranch.rewards.compose import RewardSource
    from anabranch.rewards.prm import prm_reward

    tok = char_tokenizer()
    texts = ["ab\n\ncd", "xyz", "p\n\nq\n\nr", ""]
    enc = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(len(e) for e in enc)
    resp = torch.full((4, width), tok.pad_token_id)
    mask = torch.zeros(4, width, dtype=torch.long)
    for i, e in enumerate(enc):
        resp[i, :len(e)], mask[i, :len(e)] = torch.tensor(e), 1
    rollout = _rollout(mask)
    rollout.response_ids = resp
    src = RewardSource("prm", 2.0, prm_reward, {"model_path": tiny_prm_dir, **PRM_PARAMS},
                       meta={"process_reward": True})
    fields = prm_fields([src], tok, rollout, [{"question": "Q"}] * 4)
    assert fields["prm_step_ends"] == [[1, 5], [2], [0, 3, 6], []]
    assert [len(s) for s in fields["prm_step_scores"]] == [2, 1, 3, 0]
    assert all(0 < x < 1 for s in fields["prm_step_scores"] for x in s)
    metrics = attach([src], RewardConfig(prm_shaping="delta"), rollout, fields)
    tr = rollout.process_rewards
    s0 = fields["prm_step_scores"][0]
    assert tr[0, 1].item() == pytest.approx(2.0 * (s0[0] - s0[1])) and tr[0, 5].item() == 0.0
    assert math.isfinite(metrics["prm/step_reward_sum_mean"])
    out = prm_reward(None, texts, **fields)
    assert out.values == [0.0] * 4 and out.metrics["steps_mean"] == pytest.approx(1.5)
    # select_groups / concat_batches (dynamic sampling) carry the rows' step rewards.
    batch = ScoredBatch(rollout, [{}] * 4, [0.0] * 4, {})
    second = select_groups(batch, [1])
    assert torch.equal(second.rollout.process_rewards, tr[2:])
    both = concat_batches([select_groups(batch, [0]), second])
    assert torch.equal(both.rollout.process_rewards, torch.cat([tr[:2], tr[2:]]))


def test_step_ends_with_a_multibyte_character_split_across_tokens():
    # Byte tokens: "é" is two tokens (0xC3 0xA9); a prefix ending between them decodes to U+FFFD.
    decode = lambda x: bytes(x).decode("utf-8", errors="replace")  # noqa: E731
    text = "é\n\nab€"
    ids = list(text.encode())  # é = 2 bytes (ids 0-1), "\n\n" (2-3), "ab" (4-5), € = 3 bytes (6-8)
    spans = split_steps(decode(ids))
    assert spans == [(0, 1), (3, 6)]
    # Step 1 ends on é's second byte (token 1), step 2 on €'s third byte (token 8), not on a partial byte.
    assert step_end_tokens(decode, ids, spans) == [1, 8]


def test_step_ends_when_a_prefix_decode_is_not_a_prefix():
    # clean_up_tokenization_spaces-like decoding: " ," becomes "," once the "," is decoded, so the prefix
    # "ab " is not a prefix of the full text "ab,\n\nc" though it has its length.
    vocab = ["ab", " ", ",", "\n\n", "c"]
    decode = lambda x: "".join(vocab[i] for i in x).replace(" ,", ",")  # noqa: E731
    ids = [0, 1, 2, 3, 4]
    text = decode(ids)
    spans = split_steps(text)
    assert [text[a:b] for a, b in spans] == ["ab,", "c"]
    assert step_end_tokens(decode, ids, spans) == [2, 4]  # the ",", not the space before it


def test_prm_inputs_cut_to_the_prm_position_limit():
    tok = char_tokenizer()
    tag = tok.convert_tokens_to_ids("#")
    ids, tags = prm_inputs(tok, "QQQQ", ["ab", "c"], tag)  # "QQQQ\n" + "ab #\n" + "c #\n": 5 + 5 + 4
    assert len(ids) == 14 and tags == [8, 12] and ids[8] == tag and ids[12] == tag
    ids, tags = prm_inputs(tok, "QQQQ", ["ab", "c"], tag, max_len=11)  # the question's start goes first
    assert tok.decode(ids) == "Q\nab #\nc #\n" and tags == [5, 9] and len(ids) == 11
    ids, tags = prm_inputs(tok, "QQQQ", ["ab", "c"], tag, max_len=6)  # steps alone too long: cut, last step unscored
    assert tok.decode(ids) == "ab #\nc" and tags == [3]
    ids, tags = prm_inputs(tok, "QQQQ", ["ab", "c"], tag, max_len=14)  # fits: unchanged
    assert len(ids) == 14 and tags == [8, 12]


def test_score_steps_respects_the_prm_position_limit(tiny_prm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_prm_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_prm_dir).eval()
    limit = model.config.max_position_embeddings
    steps = [["x" * (limit // 2 - 4)], ["y" * (limit // 2 - 4)], ["z"]]  # the third step's tag lies past the limit
    scores = score_steps(model, tok, ["q"], [[s[0] for s in steps]], "#", "+", "-")
    assert len(scores[0]) == 2 and all(0 < x < 1 for x in scores[0])


def test_scoring_without_prm_fields_is_no_failure_even_strict(tiny_prm_dir):
    from anabranch.rewards import REWARDS, score_detailed
    from anabranch.rewards.compose import GuardSettings, RewardSource
    from anabranch.rewards.math_answer import math_verify_reward
    from anabranch.rewards.prm import prm_reward

    strict = GuardSettings(10.0, "thread", strict=True)
    sources = [RewardSource("math_verify", 1.0, math_verify_reward, {}, guard=strict),
               RewardSource("prm", 2.0, prm_reward, {"model_path": tiny_prm_dir, **PRM_PARAMS},
                            meta=dict(REWARDS.meta("prm")), guard=strict)]
    # What AMPO's candidates, RL-PLUS's demonstrations, DPH's presampling and eval call: no PRM fields.
    out = score_detailed(sources, ["q", "q"], ["\\boxed{3}", "\\boxed{4}"], [{"answer": "3"}, {"answer": "3"}])
    assert out.total == [1.0, 0.0] and out.per_source["prm"] == [0.0, 0.0]
    assert out.metrics["reward/prm/failures"] == 0.0 and sources[1].failures.failures == 0


def _cfg(tiny_model_dir, write_jsonl, tmp_path, prm_dir=None, weight=1.0, **extra):
    prm_dir = str(tmp_path) if prm_dir is None else prm_dir  # an existing folder: load time checks only that
    prm = ("{name: prm, weight: %s, params: {model_path: %s, step_tag: '#', good_token: '+', bad_token: '-'}}"
           % (weight, prm_dir))
    over = {"reward.functions": f"[math_verify, {prm}]", "reward.prm_shaping": "delta", "algorithm.name": "ppo",
            "trainer.steps": 2, "trainer.eval_before": False, "trainer.eval_after": False, "rollout.n": 2,
            "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 8, "reward.isolation": "thread", **extra}
    return load_config(None, tiny_overrides(tiny_model_dir, digit_task(write_jsonl, n=8), tmp_path, **over))


@pytest.mark.parametrize("extra, match", [
    ({"algorithm.name": "grpo"}, "algorithm.advantage=grpo would only re-sum"),
    ({"algorithm.name": "rloo"}, "only the token-level estimators"),
    ({"reward.prm_shaping": "none"}, "reward.prm_shaping=none"),
    ({"reward.prm_shaping": "max"}, "'reward.prm_shaping' must be one of"),
    ({"reward.prm_eta": 0.3}, "'reward.prm_eta' has no effect unless reward.prm_shaping=clip"),
    ({"rollout.tools": "[calculator]"}, "cannot be used with rollout.tools"),
    ({"rollout.extra_rollouts": "cure"}, "cannot be used with rollout.extra_rollouts=cure"),
    ({"algorithm.ampo.enabled": True}, "cannot be used with algorithm.ampo.enabled"),  # teachers: no PRM scores
])
def test_refusals(tiny_model_dir, write_jsonl, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, **extra)


def test_refusals_of_the_prm_entry(tiny_model_dir, write_jsonl, tmp_path):
    with pytest.raises(ConfigError, match="needs exactly one 'prm' entry"):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, **{"reward.functions": "[math_verify]"})
    with pytest.raises(ConfigError, match="params.model_path is required"):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, prm_dir="''")
    with pytest.raises(ConfigError, match="params.model_path=.*no_such_prm.* is not an existing folder"):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, prm_dir=str(tmp_path / "no_such_prm"))
    with pytest.raises(ConfigError, match=r"reward.functions\[prm\].weight=0"):
        _cfg(tiny_model_dir, write_jsonl, tmp_path, weight=0.0)
    cfg = _cfg(tiny_model_dir, write_jsonl, tmp_path, **{"reward.prm_shaping": "clip", "reward.prm_eta": 0.3,
                                                          "algorithm.name": "reinforce_pp"})
    assert cfg.reward.prm_eta == 0.3 and cfg.algorithm.advantage == "reinforce_pp"
    # DARS's extra samples and the greedy filter's rollouts are PRM-scored (generate_scored): allowed.
    assert _cfg(tiny_model_dir, write_jsonl, tmp_path, **{"rollout.extra_rollouts": "dars"}).rollout.extra_rollouts == "dars"
    assert _cfg(tiny_model_dir, write_jsonl, tmp_path, **{"task.curation": "greedy_wrong"}).task.curation == "greedy_wrong"


@pytest.mark.parametrize("algo, shaping", [("ppo", "clip"), ("reinforce_pp", "delta")])
def test_two_step_training_puts_step_rewards_in_the_token_rewards(tiny_model_dir, tiny_prm_dir, write_jsonl,
                                                                  tmp_path, monkeypatch, algo, shaping):
    import dataclasses

    import anabranch.trainer.loop as loop
    from anabranch.algorithms.advantages import token_level_rewards

    seen = []
    real = loop.compute_advantages

    def spy(algo_, model, rollout, rewards, **kw):  # records what the estimator receives inside train()
        def capture(*a, token_rewards=None, **k):
            seen.append((rollout.process_rewards.clone(), rollout.trained_mask.clone(), rewards.clone(),
                         token_rewards.clone()))
            return algo_.advantage(*a, token_rewards=token_rewards, **k)
        return real(dataclasses.replace(algo_, advantage=capture), model, rollout, rewards, **kw)

    monkeypatch.setattr(loop, "compute_advantages", spy)
    # η = 0.9 for Clip: a random PRM's scores (≈ 0.5) all sit below it, so every step costs reward.
    extra = {"reward.prm_eta": 0.9} if shaping == "clip" else {}
    cfg = _cfg(tiny_model_dir, write_jsonl, tmp_path, prm_dir=tiny_prm_dir, weight=2.0,
               **{"algorithm.name": algo, "reward.prm_shaping": shaping, "algorithm.kl_coef": 0.0, **extra})
    result = train(cfg)
    assert len(result.history) == 2 and len(seen) == 2
    for m in result.history:
        assert m["reward/prm/failures"] == 0.0 and m["skipped_updates"] == 0
        assert math.isfinite(m["prm/step_reward_sum_mean"]) and m["reward/prm/steps_mean"] > 0
        if shaping == "clip":
            assert m["prm/step_reward_sum_mean"] < 0.0  # Clip never adds reward; here every step costs some
    for process, mask, rewards, token_rewards in seen:
        if shaping == "clip":  # Delta's last step gets 0, and a tiny model's 8 tokens rarely hold two steps
            assert (process * mask).abs().sum() > 0  # step rewards on trained tokens reached the estimator
        want = token_level_rewards(rewards, mask) + process * mask
        assert torch.allclose(token_rewards, want, atol=1e-6)
