"""CURE's stage-1 rollouts (trainer/cure_rollouts.py): the critical-token choice from hand-computed
entropies, the branch rows (ids, masks, log-probs), the grouping, the stage switch, the config
refusals, and a 2-step run on the tiny model."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from anabranch.config import ConfigError, load_config
from anabranch.rollout.base import Rollout
from anabranch.trainer import collect, cure_rollouts
from anabranch.trainer.cure_rollouts import (
    combine, critical_positions, cure_or_plain, eligible_tokens, token_entropies,
)

EOS, PAD = 3, 3  # pad == EOS, as SmolLM2's: only the response mask tells them apart


# ----------------------------------------------------------------------------- the critical token

class TableModel(torch.nn.Module):
    """Logits of a 3-token vocabulary fixed per sequence position (no LM head: the plain forward)."""

    def __init__(self, table):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.table = torch.tensor(table, dtype=torch.float32)  # [T, 3]

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, **_):
        b, t = input_ids.shape
        logits = self.table[:t].expand(b, t, 3) + 0 * self.w
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def one_row(response, mask, prompt=(1, 2)):
    return Rollout(prompt_ids=torch.tensor([list(prompt)]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.long),
                   response_ids=torch.tensor([response]), response_mask=torch.tensor([mask]),
                   group_index=torch.zeros(1, dtype=torch.long), prompts=["q"], completions=["x"],
                   truncated=torch.zeros(1, dtype=torch.bool))


def test_entropies_and_the_critical_token_from_hand_computed_values():
    big = -1e4
    # positions 0..1 hold the prompt; position 1 predicts response token 0, position 2 token 1, ...
    table = [[0, 0, 0],          # (prompt token 0: not a prediction of the response)
             [5, big, big],      # → response 0: one choice, H = 0
             [0, 0, big],        # → response 1: two equal choices, H = ln 2
             [0, 0, 0],          # → response 2: uniform over 3, H = ln 3
             [0, math.log(2), big],  # → response 3: p = (1/3, 2/3), H = ln 3 − (2/3) ln 2
             [0, 0, 0],          # → response 4 (past the mask: zeroed)
             [0, 0, 0]]          # (the last token predicts nothing)
    roll = one_row([0, 1, 2, 1, 0], [1, 1, 1, 1, 0], prompt=(2, 1))
    ent = token_entropies(TableModel(table), roll, micro_batch_size=4, temperature=1.0)
    h3 = math.log(3) - 2 / 3 * math.log(2)
    assert ent[0].tolist() == pytest.approx([0.0, math.log(2), math.log(3), h3, 0.0], abs=1e-5)
    eligible = roll.response_mask.bool().clone()
    eligible[0, 0] = False
    # top-1: the ln 3 position; top-2: ln 3 (pos 2) and ln 3 − (2/3)ln 2 = 0.636 < ln 2 = 0.693 → pos 1
    assert critical_positions(ent, eligible, 1)[0].tolist() == [2]
    gen = torch.Generator().manual_seed(0)
    picks = {int(critical_positions(ent, eligible, 2, gen)[0]) for _ in range(40)}
    assert picks == {1, 2}  # uniform among the top-2, never the lower-entropy position 3
    # At the sampler's temperature τ = 2: logits (0, ln 2)/2, p ∝ (1, √2): H = ln(1 + √2) − √2/(1 + √2)·ln √2
    hot = token_entropies(TableModel(table), roll, 4, temperature=2.0)
    r2 = math.sqrt(2)
    assert hot[0, 3].item() == pytest.approx(math.log(1 + r2) - r2 / (1 + r2) * math.log(r2), abs=1e-5)
    assert hot[0, 2].item() == pytest.approx(math.log(3), abs=1e-5)


def uneven_rollout(vocab, seed=0):
    """6 rows (3 groups of 2) with prompts and responses of different real lengths."""
    g = torch.Generator().manual_seed(seed)
    p_len, r_len = [3, 5, 2, 5, 4, 1], [6, 2, 4, 1, 6, 3]
    pm = torch.tensor([[0] * (5 - p) + [1] * p for p in p_len])
    rm = torch.tensor([[1] * r + [0] * (6 - r) for r in r_len])
    return Rollout(prompt_ids=torch.randint(4, vocab, (6, 5), generator=g) * pm,
                   prompt_mask=pm, response_ids=torch.randint(4, vocab, (6, 6), generator=g) * rm, response_mask=rm,
                   group_index=torch.arange(3).repeat_interleave(2), prompts=["a", "b", "c"], completions=["x"] * 6,
                   truncated=torch.zeros(6, dtype=torch.bool))


def test_entropy_pass_follows_the_token_budget_and_halves_it_on_oom(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from anabranch.trainer import advantage_pass, microbatch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    roll = uneven_rollout(model.config.vocab_size)
    ref = token_entropies(model, roll, micro_batch_size=6, temperature=1.0, share_prefix=False)
    assert ref.abs().sum() > 0 and torch.equal(ref == 0, roll.response_mask == 0)
    seen, real = [], microbatch.forward_micro_batch

    def spy(model, mb, *a, **k):
        seen.append(mb)
        if oom[0] and len(mb.rows) > oom[0]:
            raise torch.cuda.OutOfMemoryError("test: too many rows")
        return real(model, mb, *a, **k)

    monkeypatch.setattr(microbatch, "forward_micro_batch", spy)
    monkeypatch.setattr(advantage_pass, "forward_micro_batch", spy)  # the pass is rollout_forward's
    oom = [0]
    got = token_entropies(model, roll, micro_batch_size=6, temperature=1.0, share_prefix=False, micro_batch_tokens=12)
    assert torch.allclose(got, ref, atol=1e-5)
    # packed by the budget as the update's passes, not by rows: several micro-batches, each of <= 12 computed
    # tokens unless a single row is longer
    assert len(seen) > 1 and all(mb.computed_tokens() <= 12 or len(mb.rows) == 1 for mb in seen)
    seen.clear()
    oom[0] = 2  # a micro-batch of more than 2 rows runs out of memory: the pass is re-planned smaller
    got = token_entropies(model, roll, micro_batch_size=6, temperature=1.0, share_prefix=False)
    assert torch.allclose(got, ref, atol=1e-5) and len(seen[0].rows) == 6 and len(seen) > 2
    oom[0] = -1  # every micro-batch fails, even single rows: the error is raised, not looped on
    with pytest.raises(torch.cuda.OutOfMemoryError):
        token_entropies(model, roll, micro_batch_size=6, temperature=1.0, share_prefix=False)


def test_entropy_pass_runs_in_eval_mode_and_restores_training_mode(tiny_model_dir, monkeypatch):
    """CURE's pass reads the distribution the policy samples from (no dropout); rollout_forward's default
    (every other no-grad pass) leaves the model's mode alone."""
    from transformers import AutoModelForCausalLM

    from anabranch.trainer import advantage_pass

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    roll = uneven_rollout(model.config.vocab_size)
    modes, real = [], advantage_pass.forward_micro_batch

    def spy(model, *a, **k):
        modes.append(model.training)
        return real(model, *a, **k)

    monkeypatch.setattr(advantage_pass, "forward_micro_batch", spy)
    token_entropies(model, roll, micro_batch_size=3, temperature=1.0, share_prefix=False)
    assert modes == [False, False] and model.training  # eval during both micro-batches, training mode after
    modes.clear()
    advantage_pass.rollout_forward(model, roll, 3, 1.0)
    assert modes == [True, True] and model.training


def test_position_zero_ineligible_and_fallback():
    scores = torch.tensor([[9.0, 1.0, 5.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
    eligible = torch.tensor([[True, True, False, True], [False, False, False, False]])
    pos, found = critical_positions(scores, eligible, 1)
    # the mask alone decides (eligible_tokens never marks position 0): position 2 scores above 3 but is out
    assert pos.tolist() == [0, 0] and found.tolist() == [True, False]
    pos, _ = critical_positions(scores, eligible & (torch.arange(4) > 0), 1)
    assert pos.tolist() == [3, 0]  # row 1 has no candidate: t = 0, a plain resample (the authors' fallback)


class Tok:
    all_special_ids = [EOS, 0]
    pad_token_id = PAD
    text = {4: "ab", 5: ".", 6: "  ", 7: "xyz", 8: "cd", EOS: "</s>"}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.text.get(int(i), f"<{int(i)}>") for i in ids
                       if not (skip_special_tokens and int(i) in self.all_special_ids))


def test_eligible_tokens_follow_the_authors_filter():
    ids = torch.tensor([[4, 4, 5, 6, 7, EOS], [8, 7, EOS, PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    got = eligible_tokens(ids, mask, Tok(), min_chars=2)
    # first position never; "." one character; "  " empty once stripped; EOS special; padding masked
    assert got.tolist() == [[False, True, False, False, True, False], [False, True, False, False, False, False]]
    assert eligible_tokens(ids, mask, Tok(), min_chars=1)[0, 2].item() is True


# ----------------------------------------------------------------------------- the branch rows

class ScriptedBackend:
    """generate: scripted originals; continue_ids: records the sequences and budgets, answers scripted rows."""

    eos_ids = [EOS]

    def __init__(self, originals, continuations, with_lp=False):
        self.originals, self.continuations, self.with_lp = originals, continuations, with_lp
        self.continued, self.generated = [], []

    def generate(self, prompts, n):
        self.generated.append((list(prompts), n))
        return self.originals(prompts, n)

    def continue_ids(self, sequences, max_new):
        self.continued.append((sequences, max_new))
        out = []
        for k, budget in enumerate(max_new):
            row = self.continuations[k % len(self.continuations)][:budget]
            out.append((row, [-0.5 - 0.1 * j for j in range(len(row))] if self.with_lp else None))
        return out


def two_originals(prompts=("q",), n=2):
    # one prompt [pad, 1, 2]; original 0: "ab ab xyz </s>" (4 tokens), original 1: "cd xyz </s>" (3 tokens)
    assert n == 2 and len(prompts) == 1
    return Rollout(prompt_ids=torch.tensor([[0, 1, 2], [0, 1, 2]]), prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1]]),
                   response_ids=torch.tensor([[4, 4, 7, EOS], [8, 7, EOS, PAD]]),
                   response_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
                   group_index=torch.zeros(2, dtype=torch.long),
                   prompts=list(prompts), completions=["ababxyz", "cdxyz"], truncated=torch.zeros(2, dtype=torch.bool),
                   sample_log_probs=torch.tensor([[-1.0, -1.1, -1.2, -1.3], [-2.0, -2.1, -2.2, 0.0]]))


def test_branch_rows_are_prompt_prefix_continuation_with_masks_and_log_probs():
    # continuation A ends with EOS; continuation B runs out of its budget (truncated)
    backend = ScriptedBackend(two_originals, [[8, EOS, PAD], [7, 7, 7, 7, 7, 7]], with_lp=True)
    first = two_originals()
    pos = torch.tensor([2, 1])  # original 0 branches at "xyz" (prefix "ab ab"), original 1 at "xyz" (prefix "cd")
    rows = cure_rollouts.branch_rows(backend, first, pos, n2=2, max_new_tokens=5)
    seqs, budgets = backend.continued[0]
    assert seqs == [[1, 2, 4, 4]] * 2 + [[1, 2, 8]] * 2  # prompt without padding ⊕ the policy's own prefix
    assert budgets == [3, 3, 4, 4]  # max_new_tokens − t: a branch is no longer than an original
    out = combine(first, rows, n1=2, n2=2, pad=PAD, tokenizer=Tok())
    # group order: the originals, then original 0's two branches, then original 1's
    assert out.response_ids.tolist() == [
        [4, 4, 7, EOS, PAD], [8, 7, EOS, PAD, PAD],
        [4, 4, 8, EOS, PAD], [4, 4, 7, 7, 7],       # B cut at its budget 3: truncated
        [8, 8, EOS, PAD, PAD], [8, 7, 7, 7, 7]]
    assert out.response_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1],
                                          [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    # the prefix is not trained again in the branch row: the loss covers the continuation only
    assert out.trained_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1],
                                         [0, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert out.truncated.tolist() == [False, False, False, True, False, True]
    # the recorded sampler log-probs are those of exactly the trained tokens (0 on the prefix)
    assert torch.equal(out.sample_log_probs[:2, :4], first.sample_log_probs)
    assert out.sample_log_probs[2].tolist() == pytest.approx([0, 0, -0.5, -0.6, 0])
    assert out.sample_log_probs[5].tolist() == pytest.approx([0, -0.5, -0.6, -0.7, -0.8])
    assert bool(((out.sample_log_probs != 0) <= out.trained_mask.bool()).all())
    # every row answers the group's prompt; the reward reads the whole re-concatenated response
    assert out.prompt_ids.tolist() == [[0, 1, 2]] * 6 and out.group_index.tolist() == [0] * 6
    assert out.completions[2] == "ababcd" and out.completions[4] == "cdcd"


def test_no_sampler_log_probs_stay_none():
    backend = ScriptedBackend(two_originals, [[8, EOS]])
    first = two_originals()
    first.sample_log_probs = None
    out = combine(first, cure_rollouts.branch_rows(backend, first, torch.tensor([1, 1]), 1, 5), 2, 1, PAD, Tok())
    assert out.sample_log_probs is None


def cure_cfg(*extra):
    return load_config(None, ["rollout.extra_rollouts=cure", "rollout.n=4", "rollout.cure_originals=2",
                              "rollout.cure_branches=1", "rollout.cure_steps=3", "rollout.max_new_tokens=5",
                              "rollout.prompts_per_step=2", *extra])


def two_prompt_originals(prompts, n):
    b = len(prompts) * n
    ids = torch.tensor([[4, 7, 8, EOS]] * b) + torch.arange(b)[:, None] * 0
    return Rollout(prompt_ids=torch.tensor([[1, 2]] * b) + torch.arange(len(prompts)).repeat_interleave(n)[:, None],
                   prompt_mask=torch.ones(b, 2, dtype=torch.long), response_ids=ids,
                   response_mask=torch.ones(b, 4, dtype=torch.long),
                   group_index=torch.arange(len(prompts)).repeat_interleave(n), prompts=list(prompts),
                   completions=["abxyzcd"] * b, truncated=torch.zeros(b, dtype=torch.bool))


def test_groups_hold_originals_and_their_branches():
    backend = ScriptedBackend(two_prompt_originals, [[8, EOS]])
    c = SimpleNamespace(backend=backend, tokenizer=Tok(), model=None)
    out = cure_or_plain(c, ["q0", "q1"], cure_cfg("rollout.cure_selection=random"), step=1)
    assert backend.generated == [(["q0", "q1"], 2)]  # n1 originals per prompt
    assert out.group_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # n1 + n1·n2 = rollout.n per group, contiguous
    assert out.prompt_ids[:, 1].tolist() == [2] * 4 + [3] * 4  # each branch answers its own group's prompt
    assert len(backend.continued[0][0]) == 4  # one branch per original
    assert out.metrics["cure/active"] == 1.0 and out.metrics["cure/branch_rows"] == 4.0
    # GRPO's statistics are over the whole group: rewards [1, 0, 1, 1] → mean 3/4 for every row
    from anabranch.algorithms.grpo import grpo_advantage
    from anabranch.algorithms.resolve import resolve_algorithm
    from anabranch.config import AlgorithmConfig

    algo = resolve_algorithm(AlgorithmConfig(name="grpo"))
    rewards = torch.tensor([1.0, 0, 1, 1, 0, 0, 0, 1])
    adv = grpo_advantage(rewards, out.group_index, out.response_mask, algo.cfg)[:, 0]
    std = math.sqrt(0.25)  # unbiased std of [1,0,1,1] = sqrt((3·(1/4)² + (3/4)²)/3) = 1/2
    assert adv[1].item() == pytest.approx(-0.75 / (std + algo.cfg.adv_epsilon), rel=1e-5)


def test_cure_generate_plans_the_entropy_pass_with_the_update_token_budget(monkeypatch):
    calls = []

    def spy(model, rollout, micro, temperature, share_prefix=True, micro_batch_tokens=0):
        calls.append((micro, temperature, share_prefix, micro_batch_tokens))
        return torch.rand(rollout.response_ids.shape)

    monkeypatch.setattr(cure_rollouts, "token_entropies", spy)
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(vocab_size=10)
    c = SimpleNamespace(backend=ScriptedBackend(two_prompt_originals, [[8, EOS]]), tokenizer=Tok(), model=model)
    cure_or_plain(c, ["q0", "q1"], cure_cfg("trainer.micro_batch_tokens=64", "trainer.micro_batch_size=3",
                                            "rollout.temperature=0.7"), step=1)
    assert calls == [(3, 0.7, True, 64)]
    calls.clear()  # auto (-1) on CPU: the CPU budget the update resolves, not rows
    cure_or_plain(c, ["q0", "q1"], cure_cfg("trainer.micro_batch_size=3"), step=1)
    from anabranch.trainer.microbatch import resolve_micro_batch_tokens

    assert calls[0][3] == resolve_micro_batch_tokens(-1, torch.device("cpu"), 10) > 0


def test_stage_two_is_plain_sampling_after_cure_steps():
    backend = ScriptedBackend(lambda p, n: two_prompt_originals(p, n), [[8, EOS]])
    c = SimpleNamespace(backend=backend, tokenizer=Tok(), model=None)
    cfg = cure_cfg("rollout.cure_selection=random")
    assert len(cure_or_plain(c, ["q0", "q1"], cfg, step=3).group_index) == 8  # step cure_steps: still stage 1
    assert len(backend.continued) == 1
    out = cure_or_plain(c, ["q0", "q1"], cfg, step=4)
    assert backend.generated[-1] == (["q0", "q1"], 4) and len(backend.continued) == 1  # rollout.n, no branches
    assert out.metrics["cure/active"] == 0.0 and out.loss_mask is None
    cure_or_plain(c, ["q0"] * 2, cfg, step=None)  # not a training step (no step): plain
    assert len(backend.continued) == 1


def test_default_config_never_enters_cure(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("CURE ran with rollout.extra_rollouts=none")

    monkeypatch.setattr(cure_rollouts, "cure_or_plain", boom)
    monkeypatch.setattr(collect, "score_detailed", lambda *a, **k: SimpleNamespace(
        total=[0.0] * 8, per_source={}, metrics={}))
    backend = ScriptedBackend(two_prompt_originals, [[EOS]])
    c = SimpleNamespace(backend=backend, train_prompts=["q0", "q1"], train_rows=[{}, {}], model=None, rewards=[])
    cfg = load_config(None, ["rollout.n=4", "rollout.prompts_per_step=2"])
    batch = collect.generate_scored(c, [0, 1], cfg, step=1)
    assert backend.generated == [(["q0", "q1"], 4)] and backend.continued == []
    assert not any(k.startswith("cure/") for k in batch.metrics)


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("overrides,key", [
    (["rollout.extra_rollouts=cure"], "rollout.n"),  # 4·(1 + 3) = 16 ≠ 4
    (["rollout.extra_rollouts=cure", "rollout.n=16", "rollout.backend=vllm"], "rollout.backend"),
    (["rollout.extra_rollouts=cure", "rollout.n=16", "rollout.tools=[calculator]"], "rollout.tools"),
    (["rollout.extra_rollouts=cure", "rollout.n=16", "rollout.min_new_tokens=2"], "rollout.min_new_tokens"),
    (["rollout.extra_rollouts=cure", "rollout.n=16", "rollout.cure_top_k=0"], "rollout.cure_top_k"),
    (["rollout.extra_rollouts=cure", "rollout.n=16", "rollout.cure_selection=max"], "rollout.cure_selection"),
    (["rollout.extra_rollouts=cure", "rollout.n=16", "rollout.cure_steps=0"], "rollout.cure_steps"),
    (["rollout.extra_rollouts=cure", "rollout.n=0", "rollout.cure_originals=0"], "rollout.n"),
    (["rollout.extra_rollouts=cure", "rollout.n=4", "rollout.cure_originals=4", "rollout.cure_branches=0"],
     "rollout.cure_branches"),
    # refused once, by rollout/retry_turns.py check_config (CURE's branches cannot start inside feedback turns)
    (["rollout.extra_rollouts=cure", "rollout.n=16", "rollout.retry_turns=2"],
     "rollout.retry_turns does not combine with rollout.extra_rollouts=cure"),
    (["rollout.cure_top_k=5"], "rollout.cure_top_k"),  # a CURE knob with CURE off
    (["rollout.cure_steps=10"], "rollout.cure_steps"),
])
def test_bad_configs_are_refused(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_good_config_and_sharded_refusal():
    from anabranch.trainer.distributed import Distributed

    cfg = load_config(None, ["rollout.extra_rollouts=cure", "rollout.n=16", "algorithm.name=dapo"])
    assert (cfg.rollout.cure_originals, cfg.rollout.cure_branches, cfg.rollout.cure_top_k) == (4, 3, 20)
    with pytest.raises(ConfigError, match="rollout.extra_rollouts=cure is not supported with a sharded policy"):
        Distributed.check_sharded(SimpleNamespace(sharded=True), SimpleNamespace(cfg=cfg))


@pytest.mark.parametrize("name", ["flowrl", "fdpg", "brain"])
def test_losses_matching_a_distribution_over_whole_responses_are_refused(name):
    # Branch rows are not draws from π_old(y|x): FlowRL's log Z(x), f-DPG's Ẑ(x) and BRAIn's α would be wrong.
    with pytest.raises(ConfigError, match=f"extra_rollouts=cure is not supported for algorithm.loss={name}"):
        load_config(None, [f"algorithm.name={name}", "rollout.extra_rollouts=cure", "rollout.n=16"])
    load_config(None, [f"algorithm.name={name}", "rollout.extra_rollouts=dars"])  # DARS's extra samples are plain draws


# ----------------------------------------------------------------------------- a short run

def test_two_steps_on_the_tiny_model(tiny_model_dir, write_jsonl, tmp_path, monkeypatch):
    from anabranch import train
    from anabranch.trainer import loop

    trained, real_update = [], loop.policy_update

    def spy_update(model, optimizer, rollout, *args, **kwargs):
        trained.append(rollout)
        return real_update(model, optimizer, rollout, *args, **kwargs)

    monkeypatch.setattr(loop, "policy_update", spy_update)
    data = write_jsonl([{"prompt": f"Q{i}: say seven", "answer": "7"} for i in range(8)])
    overrides = {
        "model.path": tiny_model_dir, "task.name": "file", "task.path": data, "task.eval_size": 0,
        "rollout.n": 4, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 6,
        "rollout.extra_rollouts": "cure", "rollout.cure_originals": 2, "rollout.cure_branches": 1,
        "rollout.cure_top_k": 3, "rollout.cure_min_token_chars": 1, "rollout.cure_steps": 1,
        "trainer.steps": 2, "trainer.output_dir": str(tmp_path), "trainer.run_name": "cure",
        "trainer.progress": False, "trainer.device": "cpu", "trainer.eval_before": False,
        "trainer.eval_after": False, "trainer.save_final": False,
    }
    result = train(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
    rows = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[0]["cure/active"] == 1.0 and steps[1]["cure/active"] == 0.0
    assert steps[0]["cure/branch_rows"] == 4.0 and math.isfinite(steps[0]["cure/critical_entropy"])
    assert steps[0]["cure/critical_entropy"] >= 0 and 0 <= steps[0]["cure/no_critical_frac"] <= 1
    first, second = trained
    assert first.group_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # branch rows (2, 3 of each group) start with their original's prefix, which is not trained again
    for g in (0, 4):
        for b, o in ((g + 2, g), (g + 3, g + 1)):
            start = int(first.loss_mask[b].argmax())  # where the continuation begins
            assert torch.equal(first.response_ids[b, :start], first.response_ids[o, :start])
            assert first.loss_mask[b, :start].sum() == 0
    assert any(int(first.loss_mask[b].argmax()) > 0 for b in (2, 3, 6, 7))  # some branch has a real prefix
    assert second.loss_mask is None  # stage 2: plain rollouts
