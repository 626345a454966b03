"""KDRL (algorithms/kdrl.py, trainer/kdrl_step.py): the KD term's numbers, its schedule and mask, the
teacher's refusals, and a short run where the student's KL to a different teacher falls."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms.aggregation import aggregate, batch_scale
from anabranch.algorithms.kdrl import check_kdrl, kd_coef, kd_loss, kd_row_mask
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError, KDRLConfig, load_config
from anabranch.trainer.kdrl_step import KDRL, check_same_vocabulary

from test_train_e2e import digit_task, tiny_overrides


def test_kd_term_by_hand_with_schedule_and_response_mask():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -2.2, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # Row 0 is correct (full credit), row 1 is not: mask=response keeps the KD term on row 1 only.
    keep = kd_row_mask("response", torch.tensor([True, False]), torch.tensor([0, 0]))
    assert keep.tolist() == [0.0, 1.0]
    k = KDRLConfig(teacher="t", coef=0.5, coef_final=0.1, schedule="linear", anneal_steps=5)
    beta = kd_coef(k, 3, total_steps=100)  # halfway through 5 steps: 0.5 + (0.1 − 0.5)·2/4
    assert beta == pytest.approx(0.3)
    agg = partial(aggregate, mode="token-mean", scale=batch_scale(mask, 3))
    loss, metrics = kd_loss(lp, teacher, mask, beta * keep, "k2", agg)
    # k2 = ½Δ²: row 0 (0.125, 0.5, 0), row 1 (0.02, 0.5); token mean over the batch's 5 tokens.
    assert loss.item() == pytest.approx(0.3 * (0.02 + 0.5) / 5)
    assert metrics["kdrl/kl"] == pytest.approx((0.125 + 0.5 + 0.0 + 0.02 + 0.5) / 5)
    loss.backward()
    # ∂/∂log π = β·w·Δ/5: nothing on the correct row or the padding, (log π − log π_T) elsewhere.
    expected = torch.tensor([[0.0, 0.0, 0.0], [0.3 * -0.2 / 5, 0.3 * 1.0 / 5, 0.0]])
    assert torch.allclose(lp.grad, expected, atol=1e-7)


def test_k1_and_k3_estimators_and_group_mask():
    lp, teacher, mask = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2)
    agg = partial(aggregate, mode="token-mean", scale=batch_scale(mask, 2))
    k1, _ = kd_loss(lp, teacher, mask, torch.ones(1), "k1", agg)
    assert k1.item() == pytest.approx((0.5 - 1.0) / 2)
    k3, _ = kd_loss(lp, teacher, mask, torch.ones(1), "k3", agg)
    assert k3.item() == pytest.approx(((math.exp(-0.5) - 1 + 0.5) + (math.exp(1.0) - 1 - 1.0)) / 2)
    # group: KD on every sample of a prompt with no correct sample (group 1), none on group 0's.
    keep = kd_row_mask("group", torch.tensor([True, False, False, False]), torch.tensor([0, 0, 1, 1]))
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert kd_row_mask("none", torch.tensor([True, False]), torch.tensor([0, 0])).tolist() == [1.0, 1.0]


def test_schedule_ends_at_coef_final_and_holds():
    k = KDRLConfig(teacher="t", coef=5e-3, coef_final=1e-3, schedule="linear")
    assert [kd_coef(k, s, 5) for s in (1, 5, 9)] == pytest.approx([5e-3, 1e-3, 1e-3])
    assert kd_coef(k, 3, 5) == pytest.approx(3e-3)
    assert kd_coef(dataclasses.replace(k, schedule="constant"), 5, 5) == 5e-3


def test_teacher_equal_to_student_gives_zero_loss_and_zero_gradient(tiny_model_dir):
    from anabranch.models.loading import load_model
    from anabranch.models.logprobs import response_forward
    from anabranch.config import ModelConfig

    model = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"))
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (3, 10))
    attn = torch.ones_like(ids)
    mask = torch.ones(3, 4)
    agg = partial(aggregate, mode="token-mean", scale=batch_scale(mask, 4))
    with torch.no_grad():
        teacher = response_forward(model, ids, attn, 4).log_probs
    for estimator in ("k2", "k3"):
        model.zero_grad(set_to_none=True)
        lp = response_forward(model, ids, attn, 4).log_probs
        loss, metrics = kd_loss(lp, teacher, mask, torch.full((3,), 10.0), estimator, agg)
        loss.backward()
        assert loss.item() == pytest.approx(0.0, abs=1e-10) and metrics["kdrl/kl"] == pytest.approx(0.0, abs=1e-10)
        grads = [p.grad.abs().max().item() for p in model.parameters() if p.grad is not None]
        assert grads and max(grads) < 1e-9, estimator


@pytest.mark.parametrize("key,value,match", [
    ("coef", 0.0, "algorithm.kdrl.coef"), ("coef", -1.0, "algorithm.kdrl.coef"),
    ("coef", float("nan"), "algorithm.kdrl.coef"), ("coef_final", -0.1, "algorithm.kdrl.coef_final"),
    ("estimator", "k4", "algorithm.kdrl.estimator"), ("mask", "correct", "algorithm.kdrl.mask"),
    ("schedule", "cosine", "algorithm.kdrl.schedule"), ("anneal_steps", -1, "algorithm.kdrl.anneal_steps"),
])
def test_bad_options_are_refused_naming_the_key(key, value, match):
    k = dataclasses.replace(KDRLConfig(teacher="some/teacher"), **{key: value})
    with pytest.raises(ConfigError, match=match):
        resolve_algorithm(AlgorithmConfig(kdrl=k))


def test_options_without_teacher_are_refused_and_defaults_are_off():
    assert check_kdrl(KDRLConfig()) is None
    with pytest.raises(ConfigError, match="algorithm.kdrl.coef is set but algorithm.kdrl.teacher is empty"):
        resolve_algorithm(AlgorithmConfig(kdrl=KDRLConfig(coef=0.1)))
    # The KD term has a gradient where Â = 0, so those rows may not be skipped (trainer/inert_rows.py).
    assert resolve_algorithm(AlgorithmConfig()).inert_at_zero_advantage
    assert not resolve_algorithm(AlgorithmConfig(kdrl=KDRLConfig(teacher="t"))).inert_at_zero_advantage


def test_vocabulary_checks():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    student = Tok({"a": 0, "b": 1, "c": 2})
    check_same_vocabulary(student, Tok({"c": 2, "a": 0, "b": 1}), 8, "t")  # same map, padded head: fine
    with pytest.raises(ConfigError, match="algorithm.kdrl.teacher='t'.*4 tokens, the student's 3"):
        check_same_vocabulary(student, Tok({"a": 0, "b": 1, "c": 2, "d": 3}), 8, "t")
    with pytest.raises(ConfigError, match="other ids.*'a': student 0, teacher 1"):
        check_same_vocabulary(student, Tok({"a": 1, "b": 0, "c": 2}), 8, "t")
    with pytest.raises(ConfigError, match="output layer has 2 rows"):
        check_same_vocabulary(student, Tok({"a": 0, "b": 1, "c": 2}), 2, "t")


def _kdrl_run(model_dir, data, out, **extra):
    from anabranch.trainer.loop import train

    base = {"trainer.steps": 6, "rollout.n": 4, "rollout.prompts_per_step": 4, "rollout.max_new_tokens": 6,
            "trainer.eval_before": False, "trainer.eval_after": False, "trainer.save_final": False,
            "trainer.tensorboard": False, "trainer.log_samples": 0}
    base.update(extra)
    return train(load_config(None, tiny_overrides(model_dir, data, out, **base)))


def test_missing_or_mismatched_teacher_is_refused(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.models.tiny import build_tiny_model, char_tokenizer

    data = digit_task(write_jsonl)
    with pytest.raises(ConfigError, match="algorithm.kdrl.teacher='./no/such/teacher': no such folder"):
        _kdrl_run(tiny_model_dir, data, tmp_path / "a", **{"algorithm.kdrl.teacher": "./no/such/teacher"})
    tok = char_tokenizer()
    tok.add_tokens(["<extra>"])  # one more token: another vocabulary
    other = build_tiny_model(tmp_path / "other", tokenizer=tok, seed=1)
    with pytest.raises(ConfigError, match="teacher's tokenizer has .* tokens"):
        _kdrl_run(tiny_model_dir, data, tmp_path / "b", **{"algorithm.kdrl.teacher": str(other)})


def test_sharded_policy_is_refused():
    cfg = load_config(None, ["algorithm.kdrl.teacher=some/teacher"])
    with pytest.raises(ConfigError, match="FSDP or DeepSpeed ZeRO-3"):
        KDRL.create(cfg, SimpleNamespace(sharded=True), SimpleNamespace(teacher=object()))


def _sevens_teacher(path, sft_steps: int = 4):
    """A different tiny model (seed 1), nudged by a few Adam steps toward the token "7" in every context:
    a teacher the student can reach in a few steps (a random teacher's per-context modes are not)."""
    from transformers import AutoModelForCausalLM

    from anabranch.models.tiny import build_tiny_model, char_tokenizer

    path = build_tiny_model(path, seed=1)
    seven = char_tokenizer().convert_tokens_to_ids("7")
    model = AutoModelForCausalLM.from_pretrained(str(path))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(sft_steps):
        loss = -model(torch.randint(3, 90, (16, 24), generator=gen)).logits.log_softmax(-1)[..., seven].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(path))
    return path


def _exact_reverse_kl(student_dir, teacher_dir) -> float:
    """Σ_v π_θ(v)·(log π_θ(v) − log π_T(v)), averaged over the positions of fixed random sequences."""
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model

    cpu = torch.device("cpu")
    s, t = (load_model(ModelConfig(path=str(p)), cpu, trainable=False) for p in (student_dir, teacher_dir))
    ids = torch.randint(3, 90, (32, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sl, tl = s(ids).logits.log_softmax(-1), t(ids).logits.log_softmax(-1)
    return (sl.exp() * (sl - tl)).sum(-1).mean().item()


def test_student_kl_to_a_different_teacher_falls(tiny_model_dir, write_jsonl, tmp_path):
    teacher = _sevens_teacher(tmp_path / "teacher")
    data = digit_task(write_jsonl)
    runs = {}
    for name, coef in (("kd", 10.0), ("control", 1e-6)):  # control: the same run with a negligible KD term
        runs[name] = _kdrl_run(tiny_model_dir, data, tmp_path / name, **{
            "trainer.steps": 8, "trainer.save_final": True, "algorithm.kdrl.teacher": str(teacher),
            "algorithm.kdrl.coef": coef, "algorithm.kdrl.schedule": "constant", "algorithm.kdrl.mask": "none"})
    history = runs["kd"].history
    assert all(m["kdrl/coef"] == 10.0 and m["kdrl/masked_frac"] == 0.0 for m in history)
    kl = [m["kdrl/kl"] for m in history]
    assert sum(kl[-2:]) < 0.6 * sum(kl[:2]), kl  # the logged teacher KL of the student's own samples falls
    before = _exact_reverse_kl(tiny_model_dir, teacher)
    after = {name: _exact_reverse_kl(r.final_model_dir, teacher) for name, r in runs.items()}
    # The KD term pulls the student to the teacher; without it the same training drifts away.
    assert after["kd"] < 0.5 * before and after["kd"] < 0.5 * after["control"], (before, after)


def test_recipe_loads_and_refuses_to_run_without_a_teacher():
    from pathlib import Path

    recipe = Path(__file__).parents[1] / "configs" / "kdrl.yaml"
    # Refused at load (config_checks.check_whole_config runs the algorithm's checks), before any model loads.
    with pytest.raises(ConfigError, match="algorithm.kdrl.anneal_steps is set but algorithm.kdrl.teacher is empty"):
        load_config(recipe)
    cfg = load_config(recipe, ["algorithm.kdrl.teacher=t"])
    k = cfg.algorithm.kdrl
    assert (k.coef, k.coef_final, k.estimator, k.mask, k.teacher) == (5e-3, 1e-3, "k2", "response", "t")
    with pytest.raises(ConfigError, match="algorithm.kdrl.anneal_steps is set but algorithm.kdrl.teacher is empty"):
        resolve_algorithm(dataclasses.replace(cfg.algorithm, kdrl=dataclasses.replace(k, teacher="")))
    assert resolve_algorithm(cfg.algorithm)


@pytest.mark.parametrize("other", [{"dynamic_sampling": True}, {"hpt": "enabled"}])
def test_group_mask_is_refused_where_its_groups_never_reach_the_loss(other):
    """mask=group distils prompts with no correct sample: dynamic sampling drops them, HPT takes them to SFT."""
    from anabranch.config import HPTConfig

    extra = {"dynamic_sampling": True} if "dynamic_sampling" in other else {"hpt": HPTConfig(enabled=True)}
    with pytest.raises(ConfigError, match="algorithm.kdrl.mask=group"):
        resolve_algorithm(AlgorithmConfig(kdrl=KDRLConfig(teacher="t", mask="group"), **extra))
    resolve_algorithm(AlgorithmConfig(kdrl=KDRLConfig(teacher="t", mask="response"), **extra))  # fine
