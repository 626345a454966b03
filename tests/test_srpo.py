"""SRPO (algorithms/srpo.py, trainer/srpo_step.py): the distillation term and entropy weights by hand,
routing, the self-teacher's context ids and its log-probs, the gradient's direction, refusals, and a
2-step run."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms.aggregation import aggregate, batch_scale
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.srpo import DEFAULT_TEMPLATE, distill_loss, entropy_weights, route_advantages
from anabranch.config import AlgorithmConfig, ConfigError, load_config
from anabranch.rollout.base import Rollout
from anabranch.trainer.srpo_step import SRPO, teacher_contexts

from test_train_e2e import digit_task, tiny_overrides


def _agg(mask):
    return partial(aggregate, mode="token-mean", scale=batch_scale(mask, mask.shape[1]))


def test_distill_term_by_hand_only_on_weighted_rows():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0], [-1.0, -2.0]])
    mask = torch.ones(2, 2)
    weight = torch.tensor([[0.0, 0.0], [2.0, 0.5]])  # row 0 correct (GRPO only), row 1 distilled
    loss, metrics = distill_loss(lp, teacher, mask, weight, _agg(mask))
    # Row 1: d = (0.5, −1); ½·d²·w = (0.25, 0.25); token-mean over the batch's 4 tokens.
    assert loss.item() == pytest.approx(0.5 / 4)
    assert metrics["srpo/teacher_gap"] == pytest.approx((-0.5 + 1.0) / 2)
    loss.backward()
    # ∂/∂lp = w·d / 4: the correct row gets nothing from this term.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0], [2.0 * 0.5 / 4, 0.5 * -1.0 / 4]]))


def test_entropy_weights_by_hand():
    h = torch.tensor([[0.0, math.log(2.0), 5.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # exp(−H) = (1, ½) on the two masked tokens, normalized to mean 1: (4/3, 2/3).
    torch.testing.assert_close(entropy_weights(h, mask, "softmax"), torch.tensor([[4 / 3, 2 / 3, 0.0], [0.0, 0.0, 0.0]]))
    assert entropy_weights(h, mask, "none").tolist() == mask.tolist()
    assert entropy_weights(h, torch.zeros(2, 3), "softmax").abs().sum() == 0
    # Large entropies (a shift keeps exp from underflowing): still mean 1, low entropy favoured.
    w = entropy_weights(torch.tensor([[900.0, 901.0]]), torch.ones(1, 2), "softmax")
    assert w[0].tolist() == pytest.approx([2 / (1 + math.exp(-1)), 2 * math.exp(-1) / (1 + math.exp(-1))])


def test_routing_zeroes_only_distilled_rows():
    adv = torch.tensor([[1.0, 1.0], [-0.5, -0.5], [0.25, 0.25]])
    out = route_advantages(adv, torch.tensor([False, True, False]))
    assert out.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.25, 0.25]]


def _tok():
    from anabranch.models.tiny import char_tokenizer

    return char_tokenizer()


def _rollout(tok, prompts, responses, groups):
    """Left-padded prompts and right-padded responses (each response ends with EOS)."""
    from anabranch.rollout.base import left_padded

    p_ids, p_mask = left_padded([tok.encode(p, add_special_tokens=False) for p in prompts], tok.pad_token_id or 0)
    resp = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in responses]
    width = max(len(r) for r in resp)
    r_ids = torch.full((len(resp), width), tok.pad_token_id or 0, dtype=torch.long)
    r_mask = torch.zeros(len(resp), width, dtype=torch.long)
    for i, r in enumerate(resp):
        r_ids[i, :len(r)], r_mask[i, :len(r)] = torch.tensor(r), 1
    return Rollout(p_ids, p_mask, r_ids, r_mask, torch.tensor(groups), prompts=list(prompts), completions=responses,
                   truncated=torch.zeros(len(resp), dtype=torch.bool))


def test_teacher_context_ids_sibling_answer_and_none():
    tok = _tok()
    prompts = ["Q0", "Q0", "Qq1", "Qq1", "Q22", "Q22"]
    # Group 0: one correct (row 0), one failed; group 1: all fail; group 2: all correct.
    ro = _rollout(tok, prompts, ["17", "3", "5", "6", "7", "7"], [0, 0, 1, 1, 2, 2])
    correct = torch.tensor([True, False, False, False, True, True])
    answers = ["7", "7", "42", None, "7", "7"]  # row 3: no reference answer
    rows, ctx, kinds = teacher_contexts(ro, correct, answers, tok, "<{solution}>", [tok.eos_token_id])
    enc = partial(tok.encode, add_special_tokens=False)
    assert rows == [1, 2] and kinds == ["sibling", "answer"]
    # Row 1: its prompt, unpadded, + "<" + the correct sibling's response without its EOS + ">".
    assert ctx[0] == enc("Q0") + enc("<") + enc("17") + enc(">")
    assert ctx[1] == enc("Qq1") + enc("<") + enc("42") + enc(">")  # no correct sibling: the reference answer


def test_sibling_loses_any_backend_stop_id_not_only_the_tokenizer_eos():
    """A chat model stops on <|im_end|> while tokenizer.eos_token_id is <|endoftext|>: the backend's eos_ids
    hold both, and the sibling's end-of-turn must not stay inside the teacher's context."""
    tok = _tok()
    enc = partial(tok.encode, add_special_tokens=False)
    im_end = enc("#")[0]  # stands for <|im_end|>: a stop id that is not tok.eos_token_id
    assert im_end != tok.eos_token_id
    ro = _rollout(tok, ["Q0", "Q0"], ["17", "3"], [0, 0])
    ro.response_ids[0, 2] = im_end  # row 0 ("17") ended on the other stop id
    correct, answers = torch.tensor([True, False]), ["7", "7"]
    _, ctx, _ = teacher_contexts(ro, correct, answers, tok, "<{solution}>", [tok.eos_token_id, im_end])
    assert ctx == [enc("Q0") + enc("<17>")]
    # SRPO takes the stop ids from the rollout backend (hf / vllm ``eos_ids``), with the tokenizer's EOS.
    cfg = load_config(None, ["algorithm.name=srpo"])
    srpo = SRPO.create(cfg, SimpleNamespace(sharded=False),
                       SimpleNamespace(tokenizer=tok, backend=SimpleNamespace(eos_ids=[im_end])))
    assert srpo.stop_ids == sorted({im_end, tok.eos_token_id})


class _Batch(SimpleNamespace):
    pass


def test_step_teacher_logprobs_are_the_policy_on_the_feedback_context(tiny_model_dir):
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model

    tok = _tok()
    model = load_model(ModelConfig(path=str(tiny_model_dir)), torch.device("cpu"), trainable=False)
    ro = _rollout(tok, ["Q0", "Q0", "Q11", "Q11"], ["17", "3x", "5", "7"], [0, 0, 1, 1])
    batch = _Batch(per_source={}, total=[1.0, 0.0, 1.0, 1.0], rows=[{"answer": "7"}] * 4)
    cfg = load_config(None, ["algorithm.name=srpo", "algorithm.srpo_coef=0.5", "algorithm.srpo_feedback_template=|{solution}|",
                             "trainer.micro_batch_size=2"])
    srpo = SRPO.create(cfg, SimpleNamespace(sharded=False), SimpleNamespace(tokenizer=tok))
    st = srpo.step(model, batch, ro, [])
    assert st.distilled.tolist() == [False, True, False, False]
    assert st.weight[[0, 2, 3]].abs().sum() == 0
    # Row 1 by hand: the model on prompt + "|" + "17" + "|" + response, log π of the response tokens.
    enc = partial(tok.encode, add_special_tokens=False)
    resp = enc("3x") + [tok.eos_token_id]
    ids = torch.tensor([enc("Q0") + enc("|17|") + resp])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / cfg.rollout.temperature
    logp = logits.log_softmax(-1)
    start = ids.shape[1] - len(resp)
    expect = torch.stack([logp[start - 1 + t, resp[t]] for t in range(len(resp))])
    assert st.teacher_log_prob[1, :len(resp)].tolist() == pytest.approx(expect.tolist(), abs=1e-4)
    ent = -(logp.exp() * logp).sum(-1)[start - 1:start - 1 + len(resp)]
    w = torch.exp(-ent) / torch.exp(-ent).mean()
    assert st.weight[1, :len(resp)].tolist() == pytest.approx((0.5 * w).tolist(), abs=1e-4)
    assert st.metrics["srpo/distilled_frac"] == 0.25 and st.metrics["srpo/sibling_feedback_frac"] == 0.25
    adv = torch.ones(4, ro.response_ids.shape[1])
    assert st.advantages(adv)[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert set(st.precomputed({"x": 1})) == {"x", "srpo_teacher_log_prob", "srpo_weight"}


def test_one_step_moves_failed_rows_toward_teacher():
    torch.manual_seed(0)
    z = torch.randn(2, 3, 5, requires_grad=True)  # [B, R, V] logits of a free "policy"
    tokens = torch.tensor([[1, 2, 3], [0, 4, 2]])
    teacher = torch.randn(2, 3, 5).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    mask = torch.ones(2, 3)
    weight = torch.tensor([[0.0] * 3, [1.0] * 3])  # row 1 failed
    lp0 = z.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    loss, _ = distill_loss(lp0, teacher, mask, weight, _agg(mask))
    loss.backward()
    with torch.no_grad():
        lp1 = (z - 0.5 * z.grad).log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    gap0, gap1 = (lp0.detach() - teacher).abs(), (lp1 - teacher).abs()
    assert (gap1[1] < gap0[1]).all()  # failed row: each token's log-prob closer to the teacher's
    assert torch.equal(lp1[0], lp0.detach()[0])  # correct row: untouched by this term


def test_refusals_name_the_keys():
    base = AlgorithmConfig(name="srpo")
    for change, match in (({"srpo_coef": -1.0}, "algorithm.srpo_coef must be"),
                          ({"srpo_entropy_weight": "max"}, "algorithm.srpo_entropy_weight must be one of"),
                          ({"srpo_feedback_template": "no slot"}, "algorithm.srpo_feedback_template must")):
        with pytest.raises(ConfigError, match=match):
            resolve_algorithm(dataclasses.replace(base, **change))
    with pytest.raises(ConfigError, match="'algorithm.srpo_entropy_weight' has no effect unless algorithm.srpo_coef"):
        resolve_algorithm(load_config(None, ["algorithm.srpo_entropy_weight=none"]).algorithm)
    with pytest.raises(ConfigError, match="algorithm.srpo_coef > 0 with loss='flowrl'"):
        resolve_algorithm(load_config(None, ["algorithm.name=flowrl", "algorithm.srpo_coef=1"]).algorithm)
    # Failed rows have Â = 0 but a distillation gradient: they must not be skipped as inert.
    assert resolve_algorithm(AlgorithmConfig(name="grpo")).inert_at_zero_advantage
    assert not resolve_algorithm(base).inert_at_zero_advantage
    cfg = load_config(None, ["algorithm.name=srpo"])
    assert cfg.algorithm.srpo_coef == 1.0 and cfg.algorithm.srpo_feedback_template == DEFAULT_TEMPLATE
    comps = SimpleNamespace(tokenizer=None)
    with pytest.raises(ConfigError, match="srpo_coef > 0 with FSDP or DeepSpeed ZeRO-3"):
        SRPO.create(cfg, SimpleNamespace(sharded=True), comps)
    tools = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, tools=["python"]))
    with pytest.raises(ConfigError, match="srpo_coef > 0 with rollout.tools"):
        SRPO.create(tools, SimpleNamespace(sharded=False), comps)
    assert SRPO.create(load_config(None, []), SimpleNamespace(sharded=True), comps) is None  # off: nothing refused


def test_two_step_train(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.loop import train

    data = digit_task(write_jsonl)
    res = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{
        "algorithm.name": "srpo", "trainer.steps": 2, "rollout.n": 4, "rollout.prompts_per_step": 2,
        "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
        "trainer.tensorboard": False, "trainer.log_samples": 0})))
    assert len(res.history) == 2
    for m in res.history:
        # The random model fails nearly everything: its failed rows get the reference answer as feedback.
        assert m["srpo/distilled_frac"] > 0 and math.isfinite(m["srpo/teacher_entropy"])
        assert math.isfinite(m["srpo/teacher_gap"]) and math.isfinite(m["loss"])


def test_policy_update_pulls_failed_row_toward_teacher(tiny_model_dir):
    """trainer/step.py adds the distillation on the update's forward: with every advantage 0, only that
    term moves the policy, and it raises the failed row's log-probs toward a teacher that rates them higher."""
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model
    from anabranch.trainer.step import no_grad_log_probs, policy_update

    tok = _tok()
    model = load_model(ModelConfig(path=str(tiny_model_dir)), torch.device("cpu"), trainable=True)
    ro = _rollout(tok, ["Q0", "Q0"], ["17", "35"], [0, 0])
    algo = resolve_algorithm(AlgorithmConfig(name="srpo", srpo_entropy_weight="none"))
    before = no_grad_log_probs(model, ro, 2, 1.0)
    mask = ro.response_mask.float()
    teacher = (before + 1.0) * mask  # the teacher rates every sampled token e times more likely
    weight = torch.tensor([[0.0], [1.0]]) * mask  # row 1 failed
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    policy_update(model, opt, ro, torch.zeros_like(mask), torch.tensor([1.0, 0.0]), algo, micro_batch_size=2,
                  grad_clip=0.0, temperature=1.0, max_response_len=mask.shape[1],
                  precomputed={"srpo_teacher_log_prob": teacher, "srpo_weight": weight})
    after = no_grad_log_probs(model, ro, 2, 1.0)
    gain = ((after - before) * mask).sum(-1) / mask.sum(-1)
    assert gain[1] > 1e-3, gain  # the failed row's tokens became more likely, toward the teacher


def test_weights_normalized_over_the_update_trained_tokens(tiny_model_dir):
    """ω has mean 1 over the tokens the update trains (train_rollout's mask), not over rollout's: a token
    or a row the overlong filter (or any loss mask) removed is neither weighted nor counted, nor distilled."""
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model

    tok = _tok()
    model = load_model(ModelConfig(path=str(tiny_model_dir)), torch.device("cpu"), trainable=False)
    ro = _rollout(tok, ["Q0", "Q0", "Q0"], ["17", "3x", "5y"], [0, 0, 0])  # widths: 3 tokens each
    batch = _Batch(per_source={}, total=[1.0, 0.0, 0.0], rows=[{"answer": "17"}] * 3)
    cfg = load_config(None, ["algorithm.name=srpo", "algorithm.srpo_coef=0.5"])
    srpo = SRPO.create(cfg, SimpleNamespace(sharded=False), SimpleNamespace(tokenizer=tok))
    trained = ro.trained_mask.clone()
    trained[1, 2] = 0  # row 1's last token is not trained
    trained[2] = 0  # row 2 left the loss (e.g. truncated, DAPO's overlong filter)
    st = srpo.step(model, batch, ro, [], trained_mask=trained)
    assert st.distilled.tolist() == [False, True, False]
    assert st.weight[1, 2] == 0 and st.weight[[0, 2]].abs().sum() == 0
    assert st.weight[1, :2].mean().item() == pytest.approx(0.5, abs=1e-5)  # β · mean-1 ω over 2 tokens
    # The untrained row keeps its (GRPO) advantage: it is not routed.
    assert st.advantages(torch.ones(3, 3))[:, 0].tolist() == [1.0, 0.0, 1.0]


def test_refused_combinations_name_the_keys():
    for extra, match in ((["algorithm.hpt.enabled=true"], "srpo_coef > 0 with algorithm.hpt.enabled"),
                         (["algorithm.guide.enabled=true"], "srpo_coef > 0 with algorithm.guide.enabled")):
        with pytest.raises(ConfigError, match=match):
            resolve_algorithm(load_config(None, ["algorithm.name=srpo", *extra]).algorithm)
        resolve_algorithm(load_config(None, ["algorithm.name=grpo", *extra]).algorithm)  # SRPO off: accepted
    # Hint scaffolding trains its groups in their hinted prompts, which the teacher context starts with.
    resolve_algorithm(load_config(None, ["algorithm.name=srpo", "algorithm.scaffold.enabled=true"]).algorithm)
    # SRPO with retry turns: refused once, at config load (rollout/retry_turns.py check_config).
    from anabranch.rollout.retry_turns import check_config as check_retry_turns

    with pytest.raises(ConfigError, match="rollout.retry_turns does not combine with algorithm.srpo_coef > 0"):
        load_config(None, ["algorithm.name=srpo", "rollout.retry_turns=2"])
    cfg = load_config(None, ["algorithm.name=srpo"])
    check_retry_turns(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, retry_turns=1)))
    off = load_config(None, [])
    check_retry_turns(dataclasses.replace(off, rollout=dataclasses.replace(off.rollout, retry_turns=2)))
