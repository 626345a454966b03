"""SPAE (algorithms/spae.py, trainer/spae_step.py): step segmentation, potentials → step terms → token
advantages by hand (a drop and post-saturation steps included), the probe contexts' ids, the probe's
Acc/Conf against a direct forward, refusals, and a 2-step run."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.algorithms.spae import (post_saturation, potential_deltas, select_steps, spae_advantages, step_ends,
                                       step_potential, token_steps)
from anabranch.config import ConfigError, load_config
from anabranch.rollout.base import Rollout, left_padded
from anabranch.trainer.spae_step import SPAE, check_spae_run, probe_items, response_boundaries

from test_train_e2e import tiny_overrides


def _tok():
    from anabranch.models.tiny import char_tokenizer

    return char_tokenizer()


def _rollout(tok, prompts, responses):
    p_ids, p_mask = left_padded([tok.encode(p, add_special_tokens=False) for p in prompts], tok.pad_token_id or 0)
    resp = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in responses]
    width = max(len(r) for r in resp)
    r_ids = torch.full((len(resp), width), tok.pad_token_id or 0, dtype=torch.long)
    r_mask = torch.zeros(len(resp), width, dtype=torch.long)
    for i, r in enumerate(resp):
        r_ids[i, :len(r)], r_mask[i, :len(r)] = torch.tensor(r), 1
    return Rollout(p_ids, p_mask, r_ids, r_mask, torch.arange(len(resp)), prompts=list(prompts),
                   completions=list(responses), truncated=torch.zeros(len(resp), dtype=torch.bool))


def test_step_ends_on_token_pieces():
    # ".\n\n" in one token; "\n" + "\n" across two tokens (ends at the second); two occurrences in one token: one step
    pieces = ["a", ".\n\n", "b", "\n", "\n", "c", "\n\n\n\n", "d", "\n"]
    assert step_ends(pieces, "\n\n") == [1, 4, 6]
    assert step_ends(["x\n", "\ny", "z"], "\n\n") == [1]
    assert step_ends(["abc"], "\n\n") == []
    assert select_steps([1, 4, 6, 9, 12], 3) == [1, 6, 12]
    assert select_steps([1, 4, 6, 9, 12], 1) == [12]
    assert select_steps([1, 4], 8) == [1, 4]


def test_potential_formula_by_hand():
    acc, conf = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0])
    # right & sure → 1; wrong & sure (false confidence) → −1; 1.5·.25 + .25 − .5;
    # right & unsure → .5; nothing → 0
    assert step_potential(acc, conf).tolist() == pytest.approx([1.0, -1.0, 0.125, 0.5, 0.0])


def test_potentials_to_token_advantages_by_hand():
    # Two rows with the same potentials; Φ drops at step 4 after saturating (τ = 0.9) at step 3.
    phi = torch.tensor([[0.2, 0.5, 0.95, 0.3, 0.92], [0.2, 0.5, 0.95, 0.3, 0.92]])
    valid = torch.ones(2, 5, dtype=torch.bool)
    delta = potential_deltas(phi, valid)
    assert delta[0].tolist() == pytest.approx([0.0, 0.3, 0.45, -0.65, 0.62])
    post = post_saturation(phi, valid, 0.9)
    assert post[0].tolist() == [False, False, False, True, True]  # after the saturating step, not it
    ends = torch.tensor([[1, 3, 4, 6, 7], [1, 3, 4, 6, 7]])
    steps = token_steps(ends, valid, 10)
    assert steps[0].tolist() == [0, 0, 1, 1, 2, 3, 3, 4, -1, -1]  # tokens 8, 9 after the last boundary
    adv = torch.tensor([[1.0] * 10, [-1.0] * 9 + [0.0]])
    mask = torch.tensor([[1.0] * 10, [1.0] * 9 + [0.0]])
    out = spae_advantages(adv, mask, steps, delta, post, coef=0.5, penalty=0.5)
    # Â − 0.5·|Â|·post + 0.5·ΔΦ: a correct row loses credit after saturation, a wrong row is penalised more.
    assert out[0].tolist() == pytest.approx([1, 1, 1.15, 1.15, 1.225, 0.175, 0.175, 0.81, 1, 1])
    assert out[1].tolist() == pytest.approx([-1, -1, -0.85, -0.85, -0.775, -1.825, -1.825, -1.19, -1, 0])
    # Padding steps (invalid) neither count as boundaries nor add a term.
    valid2 = torch.tensor([[True, True, False, False, False]] * 2)
    steps2 = token_steps(ends, valid2, 10)
    assert steps2[0].tolist() == [0, 0, 1, 1, -1, -1, -1, -1, -1, -1]
    assert potential_deltas(phi, valid2)[0, 2:].abs().sum() == 0


def test_probe_contexts_ids():
    tok = _tok()
    ro = _rollout(tok, ["Q1", "Q22"], ["ab\n\ncd\n\n7", "xy"])
    bounds = response_boundaries(ro, tok, "\n\n", 8)
    assert bounds == [[3, 7], []]  # response tokens a b \n \n c d \n \n 7 <eos>
    keys, contexts, targets = probe_items(ro, bounds, ["17", "3"], tok, "|")
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert keys == [(0, 0), (0, 1)]  # row 1 has no boundary: no probe
    assert contexts == [enc("Q1") + enc("ab\n\n|"), enc("Q1") + enc("ab\n\ncd\n\n|")]
    assert targets == [enc("17"), enc("17")]
    assert probe_items(ro, bounds, [None, "3"], tok, "|")[0] == []  # no gold answer: no probe
    assert response_boundaries(ro, tok, "\n\n", 1) == [[7], []]


def test_boundaries_decode_each_distinct_token_once():
    tok = _tok()
    ro = _rollout(tok, ["Q1", "Q22"], ["ab\n\ncd\n\n7\n\nab\n\n", "xy\n\nxy"])
    calls = []

    class Counting:
        def batch_decode(self, seqs, **kw):
            calls.append(len(seqs))
            return tok.batch_decode(seqs, **kw)

    got = response_boundaries(ro, Counting(), "\n\n", 8)
    distinct = {t for i, n in enumerate(ro.response_mask.sum(-1).tolist()) for t in ro.response_ids[i, :n].tolist()}
    assert calls == [len(distinct)]  # one call over the batch's distinct ids, not one decode per token
    # The same boundaries as decoding every token of every row on its own (the previous implementation).
    ref = []
    for i, n in enumerate(ro.response_mask.sum(-1).tolist()):
        pieces = [tok.decode([t], skip_special_tokens=False) for t in ro.response_ids[i, :n].tolist()]
        ref.append(select_steps(step_ends(pieces, "\n\n"), 8))
    assert got == ref == [[3, 7, 10, 14], [3]]


def test_probe_scores_match_a_direct_forward(tiny_model_dir):
    from anabranch.config import ModelConfig
    from anabranch.models.loading import load_model

    tok = _tok()
    model = load_model(ModelConfig(path=str(tiny_model_dir)), torch.device("cpu"), trainable=False)
    ro = _rollout(tok, ["Q1", "Q22"], ["ab\n\ncd\n\n7", "x\n\ny"])
    cfg = load_config(None, ["algorithm.spae_coef=0.5", "algorithm.spae_probe=Ans=", "trainer.micro_batch_size=2"])
    spae = SPAE.create(cfg, SimpleNamespace(sharded=False), SimpleNamespace(tokenizer=tok, train_rows=[]))
    st = spae.probe(model, ro, ["17", "17"])
    assert st.valid.tolist() == [[True, True], [True, False]] and st.ends[0].tolist() == [3, 7]
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    gold = enc("17")
    for (i, k), ctx in (((0, 0), "Q1ab\n\nAns="), ((0, 1), "Q1ab\n\ncd\n\nAns="), ((1, 0), "Q22x\n\nAns=")):
        ids = torch.tensor([enc(ctx) + gold])
        with torch.no_grad():
            logp = model(ids).logits[0].float().log_softmax(-1)
        start = ids.shape[1] - len(gold)
        pos = [start - 1 + m for m in range(len(gold))]
        acc = sum(logp[p, g].exp().item() for p, g in zip(pos, gold)) / len(gold)
        ent = [-(logp[p].exp() * logp[p]).sum().item() for p in pos]
        conf = math.exp(-sum(ent) / len(ent))
        assert st.phi[i, k].item() == pytest.approx(1.5 * acc * conf + 0.5 * acc - conf, abs=1e-5)
    # The whole step on the advantages: AdvantageBatch-like object, metrics present.
    # The estimator's advantage/* (all zeros) are what the loop logged before SPAE's term.
    adv = SimpleNamespace(advantages=torch.zeros(2, ro.response_ids.shape[1]),
                          metrics={"advantage/mean": 0.0, "advantage/std": 0.0})
    out = spae.step(model, ro, [{"answer": "17"}, {"answer": "17"}], adv)
    d = (st.phi[0, 1] - st.phi[0, 0]).item()
    # Row 0: step 1 (tokens 0..3) has ΔΦ = 0, step 2 (tokens 4..7) ΔΦ = Φ_2 − Φ_1, the answer tail nothing.
    expect = [0.0] * 4 + [0.5 * d] * 4 + [0.0, 0.0]
    assert out.advantages[0].tolist() == pytest.approx(expect, abs=1e-5)
    assert out.metrics["spae/steps_per_response"] == 1.5
    # advantage/* describe the changed advantages: row 0 has 10 tokens (4 at 0.5·d), row 1 "x\n\ny<eos>" 5 tokens
    # at 0 (one step: ΔΦ_1 = 0; nothing saturates here unless Φ ≥ 0.9), so mean = 2·d/15 over 15 tokens.
    assert not st.phi.ge(0.9).any()
    vals = [0.5 * d] * 4 + [0.0] * 11
    mean = sum(vals) / 15
    assert out.metrics["advantage/mean"] == pytest.approx(mean, abs=1e-6) and d != 0
    assert out.metrics["advantage/std"] == pytest.approx((sum((v - mean) ** 2 for v in vals) / 15) ** 0.5, abs=1e-6)
    assert out.metrics["spae/base_mean"] == 0.0 and out.metrics["spae/base_std"] == 0.0


def test_refusals_name_the_keys():
    for extra, match in ((["algorithm.spae_coef=-1"], "spae_coef must be"),
                         (["algorithm.spae_coef=1", "algorithm.spae_saturation_penalty=1.5"],
                          "spae_saturation_penalty"),
                         (["algorithm.spae_coef=1", "algorithm.spae_saturation=2"], "spae_saturation must"),
                         (["algorithm.spae_coef=1", "algorithm.spae_max_steps=0"], "spae_max_steps"),
                         (["algorithm.spae_coef=1", "algorithm.spae_delimiter="], "spae_delimiter"),
                         (["algorithm.name=flowrl", "algorithm.spae_coef=1"], "spae_coef > 0 with loss='flowrl'")):
        with pytest.raises(ConfigError, match=match):
            resolve_algorithm(load_config(None, extra).algorithm)
    with pytest.raises(ConfigError, match="'algorithm.spae_probe' has no effect unless algorithm.spae_coef > 0"):
        load_config(None, ["algorithm.spae_probe=Ans="])
    cfg = load_config(None, ["algorithm.spae_coef=1"])
    resolve_algorithm(cfg.algorithm)  # defaults accepted
    rows = [{"answer": "7"}, {"answer": None}]
    with pytest.raises(ConfigError, match="spae_coef > 0 with FSDP or DeepSpeed ZeRO-3"):
        SPAE.create(cfg, SimpleNamespace(sharded=True), SimpleNamespace(tokenizer=_tok(), train_rows=rows))
    with pytest.raises(ConfigError, match="needs a gold answer in every training row.*1 of 2"):
        SPAE.create(cfg, SimpleNamespace(sharded=False), SimpleNamespace(tokenizer=_tok(), train_rows=rows))
    tools = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, tools=["python"]))
    with pytest.raises(ConfigError, match="spae_coef > 0 with rollout.tools"):
        check_spae_run(tools)
    retry = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, retry_turns=2))
    with pytest.raises(ConfigError, match="spae_coef > 0 with rollout.retry_turns=2"):
        check_spae_run(retry)
    off = load_config(None, [])
    assert SPAE.create(off, SimpleNamespace(sharded=True), SimpleNamespace(tokenizer=None, train_rows=rows)) is None
    check_spae_run(dataclasses.replace(off, rollout=dataclasses.replace(off.rollout, tools=["python"])))


@pytest.mark.parametrize("name", ["flowrl", "fdpg", "rover", "brain", "reasonmaxxer", "pacs"])
def test_refused_with_losses_that_read_a_reward_from_the_advantages_or_never_read_them(name):
    # flowrl, fdpg, rover, brain: advantage_is_reward; reasonmaxxer, pacs: ignores_advantages (the probe pass
    # would run every step for nothing).
    with pytest.raises(ConfigError, match=f"algorithm.spae_coef > 0 with loss='{name}'"):  # refused at load now
        resolve_algorithm(load_config(None, [f"algorithm.name={name}", "algorithm.spae_coef=0.5"]).algorithm)
    resolve_algorithm(load_config(None, [f"algorithm.name={name}"]).algorithm)  # the loss itself is fine


def test_tools_and_retry_turns_are_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="spae_coef > 0 with rollout.tools"):
        load_config(None, ["algorithm.spae_coef=0.5", "rollout.tools=[python]"])
    with pytest.raises(ConfigError, match="spae_coef > 0 with rollout.retry_turns=2"):
        load_config(None, ["algorithm.spae_coef=0.5", "rollout.retry_turns=2"])
    load_config(None, ["rollout.tools=[python]"])  # SPAE off: nothing refused


def test_two_step_train(tiny_model_dir, write_jsonl, tmp_path):
    from anabranch.trainer.loop import train

    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(16)])
    # The random tiny model rarely writes "\n\n": a frequent one-character delimiter gives it steps to probe.
    res = train(load_config(None, tiny_overrides(tiny_model_dir, data, tmp_path, **{
        "algorithm.name": "grpo", "algorithm.spae_coef": 0.5, "algorithm.spae_delimiter": DELIM,
        "algorithm.spae_max_steps": 3, "trainer.steps": 2, "rollout.n": 4, "rollout.prompts_per_step": 2,
        "rollout.max_new_tokens": 12, "trainer.eval_before": False, "trainer.eval_after": False,
        "trainer.save_final": False, "trainer.tensorboard": False, "trainer.log_samples": 0})))
    assert len(res.history) == 2
    for m in res.history:
        assert 0 < m["spae/steps_per_response"] <= 3
        assert -1 <= m["spae/potential_mean"] <= 1 and math.isfinite(m["loss"])


DELIM = "e"
