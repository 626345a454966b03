"""WebAgent-R1 (rollout/context_compression.py, trainer/turn_rows.py): dynamic context compression of environment
episodes, one update row per turn under the context it was sampled from, M-GRPO's per-trajectory / per-turn /
per-token weights, group statistics over trajectories, the refusals, and a short number_guess run."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from anabranch.algorithms.aggregation import aggregate, batch_scale
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import ConfigError, ContextCompressionConfig, RolloutConfig
from anabranch.models.tiny import char_tokenizer
from anabranch.rollout.base import Rollout
from anabranch.rollout.environments import EnvironmentBackend
from anabranch.rollout.retry_turns import feedback_ids
from anabranch.trainer.advantage_pass import compute_advantages
from anabranch.trainer.step import LossContext
from anabranch.trainer.turn_rows import TurnRows, expand_turn_rows, mgrpo_row_weights
from env_configs import ENV_BASE, Scripted, load_with, number_guess_overrides, scripted_guesses

TOK = char_tokenizer()
ROWS = {"A\n": {"lo": 1, "hi": 16, "target": 11}}
GUESSES = ["1<|im_end|>", "14<|im_end|>", "12<|im_end|>", "11<|im_end|>"]  # Higher, Lower, Lower, Correct
PH = "(old)"


class Recording(Scripted):
    """Scripted, recording every sequence a turn was sampled from."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seqs = []

    def continue_ids(self, seqs, max_new, stop=(), greedy=False, seed=None):
        self.seqs.append([list(s) for s in seqs])
        return super().continue_ids(seqs, max_new, stop, greedy, seed)


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def obs(text):  # an observation after an action: the user turn (its leading <|im_end|> is the action's EOS)
    return ids(f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def play(keep_last=1, enabled=True, env_class=None, script=GUESSES, turns=4, n=1):
    inner = Recording({"A\n": script})
    cc = ContextCompressionConfig(enabled=enabled, keep_last=keep_last, placeholder=PH)
    rc = RolloutConfig(environment="number_guess", max_new_tokens=400, max_env_turns=turns, context_compression=cc)
    be = EnvironmentBackend(inner, TOK, rc, ROWS, env_class=env_class)
    return inner, be.generate(["A\n"], n)


def test_four_turn_context_compressed_exactly_as_new_observations_arrive():
    """keep_last=1: turn j is sampled from prompt · a_1 · õ · ... · a_{j−1} · o_{j−1}, the older observations replaced
    by the placeholder's user turn; keep_last=2 keeps two. Exact tokens of every context the backend got, of the
    recorded turn contexts and of the final transcript (its loss mask still exactly on the actions)."""
    a = [ids(g) for g in GUESSES]
    o = [obs("Higher."), obs("Lower."), obs("Lower.")]
    p = obs(PH)
    inner, ro = play(keep_last=1)
    want = [[], a[0] + o[0], a[0] + p + a[1] + o[1], a[0] + p + a[1] + p + a[2] + o[2]]
    assert [s[0] for s in inner.seqs] == [ids("A\n") + w for w in want]  # what each action was sampled from
    assert ro.turn_contexts == [want]
    final = a[0] + p + a[1] + p + a[2] + o[2] + a[3]
    n = int(ro.response_mask[0].sum())
    assert ro.response_ids[0, :n].tolist() == final
    assert ro.loss_mask[0, :n].tolist() == ([1] * len(a[0]) + [0] * len(p) + [1] * len(a[1]) + [0] * len(p)
                                            + [1] * len(a[2]) + [0] * len(o[2]) + [1] * len(a[3]))
    assert ro.env_turns[0][-1][1] == 1.0 and not bool(ro.truncated[0])  # solved, as without compression
    assert ro.metrics["env/obs_token_frac"] == pytest.approx((2 * len(p) + len(o[2])) / len(final))
    # The episode's action spans (ep.spans, what REFUEL-like callers copy) moved with the compressions.
    inner = Recording({"A\n": GUESSES})
    rc = RolloutConfig(environment="number_guess", max_new_tokens=400, max_env_turns=4,
                       context_compression=ContextCompressionConfig(enabled=True, placeholder=PH))
    be = EnvironmentBackend(inner, TOK, rc, ROWS)
    enc, st, ep = be.start_episodes(["A\n"], 1, 400)
    be.play(st, ep, [0], 400)
    assert [st.resp[0][b:e] for b, e in ep.spans[0]] == a and st.resp[0] == final
    inner, ro = play(keep_last=2)
    assert ro.turn_contexts[0][3] == a[0] + p + a[1] + o[1] + a[2] + o[2]
    assert ro.turn_contexts[0][2] == a[0] + o[0] + a[1] + o[1]


class PageEnv:
    """An environment with a first observation (reset) and a page per step; done after three actions."""

    def __init__(self, row):
        self.k, self.solved = 0, False

    def reset(self):
        return "PAGE0"

    def state_key(self):
        return self.k

    def step(self, action):
        self.k += 1
        self.solved = self.k == 3
        return f"PAGE{self.k}", float(self.solved), self.solved


def test_first_observation_is_compressed_whole_and_off_is_unchanged():
    inner, ro = play(env_class=PageEnv, script=["x<|im_end|>"], turns=5)
    first, first_p = feedback_ids(TOK, True, "PAGE0"), feedback_ids(TOK, True, PH)
    x, p = ids("x<|im_end|>"), obs(PH)
    # PAGE1 arriving pushes PAGE0 (rendered whole, as reset()'s observation is) out of the last keep_last=1
    assert ro.turn_contexts[0] == [first, first_p + x + obs("PAGE1"), first_p + x + p + x + obs("PAGE2")]
    # Off: no contexts recorded, the layout as before; compression that never triggers gives the same tokens.
    _, off = play(enabled=False, env_class=PageEnv, script=["x<|im_end|>"], turns=5)
    _, wide = play(keep_last=9, env_class=PageEnv, script=["x<|im_end|>"], turns=5)
    assert off.turn_contexts is None and torch.equal(off.response_ids, wide.response_ids)
    assert torch.equal(off.loss_mask, wide.loss_mask) and off.completions == wide.completions
    assert off.response_ids[0, :int(off.response_mask[0].sum())].tolist() == (first + x + obs("PAGE1") + x
                                                                             + obs("PAGE2") + x)


def test_rows_are_each_action_under_its_own_sampling_context():
    inner, ro = play(keep_last=1)
    adv = ro.trained_mask.float() * 0.5
    rows, row_adv, traj = expand_turn_rows(ro, adv, pad=0)
    assert traj == [0, 0, 0, 0] and rows.group_index.tolist() == [0, 0, 0, 0]
    for j in range(4):
        n = int(rows.response_mask[j].sum())
        seq = inner.seqs[j][0][len(ids("A\n")):]  # the context this action was sampled from
        action = ids(GUESSES[j])
        assert rows.response_ids[j, :n].tolist() == seq + action
        assert rows.loss_mask[j, :n].tolist() == [0] * len(seq) + [1] * len(action)
        assert rows.sample_log_probs[j, :n].tolist() == [0.0] * len(seq) + [-0.5] * len(action)
        assert row_adv[j, :n].tolist() == [0.0] * len(seq) + [0.5] * len(action)
        assert rows.prompt_tokens(j) == ids("A\n")
    # A trajectory whose loss mask an overlong filter emptied gives no row.
    ro.loss_mask[0] = 0
    assert expand_turn_rows(ro, adv, pad=0)[2] == []


def _trajectories(turns_per_row, lengths, groups):
    """A synthetic trajectory batch: row i has turns_per_row[i] actions of lengths[k] tokens, each observation 2
    tokens; its turn contexts are distinct token lists of 3 + j tokens."""
    resp, loss, ctxs = [], [], []
    for t in turns_per_row:
        r, m = [], []
        for k in range(t):
            r += [20 + k] * lengths[k] + ([9, 9] if k < t - 1 else [])
            m += [1] * lengths[k] + ([0, 0] if k < t - 1 else [])
        resp.append(r)
        loss.append(m)
        ctxs.append([[30 + j] * (3 + j) for j in range(t)])
    w = max(len(r) for r in resp)
    pad = lambda x: torch.tensor([v + [0] * (w - len(v)) for v in x])  # noqa: E731
    mask = pad([[1] * len(r) for r in resp])
    b = len(resp)
    return Rollout(prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
                   response_ids=pad(resp), response_mask=mask, group_index=torch.tensor(groups), prompts=["p", "q"],
                   completions=[str(i) for i in range(b)], truncated=torch.zeros(b, dtype=torch.bool),
                   loss_mask=pad(loss), turn_contexts=ctxs)


def _algo(**over):
    cfg = load_with(**{**ENV_BASE, "rollout.context_compression.enabled": True, "algorithm.advantage": "grpo",
                       "algorithm.loss": "ppo_clip", "algorithm.loss_agg_mode": "seq-mean-token-mean", **over})
    return resolve_algorithm(cfg.algorithm)


def test_mgrpo_weights_against_a_hand_computation():
    """Two trajectories of 2 and 3 turns (action lengths 1, 2, 3): the update's loss over the 5 rows has gradient
    ∂L/∂log π(a_{i,j,t}) = −Â_i / (G·T_i·|a_{i,j}|) at ρ = 1, M-GRPO's (1/G)(1/T_i)(1/|a_ij|) weighting."""
    ro = _trajectories([2, 3], [1, 2, 3], [0, 0])
    adv_traj = torch.tensor([0.8, -0.3])
    rows, row_adv, traj = expand_turn_rows(ro, adv_traj[:, None] * ro.trained_mask.float(), pad=0)
    w = mgrpo_row_weights(traj)
    assert w.tolist() == pytest.approx([5 / (2 * 2)] * 2 + [5 / (2 * 3)] * 3)  # R / (G·T_i), R = 5, G = 2
    algo = _algo()
    mask = rows.trained_mask.float()
    lp = torch.zeros(mask.shape, requires_grad=True)
    ctx = LossContext(cfg=algo.cfg, aggregate=partial(aggregate, mode="seq-mean-token-mean",
                                                      scale=batch_scale(mask, 64)))
    loss, _ = algo.objective(lp, lp.detach(), row_adv * w[:, None], mask, ctx)
    loss.backward()
    hand = torch.zeros_like(mask)
    sizes = [1, 2, 1, 2, 3]  # |a_{i,j}| of the rows in order
    for r, (i, size) in enumerate(zip(traj, sizes)):
        t_i = [2, 3][i]
        hand[r, mask[r] > 0] = -float(adv_traj[i]) / (2 * t_i * size)
    assert torch.allclose(lp.grad, hand, atol=1e-6)


class OtherRank:
    """A fake two-rank ``dist``: ``all_reduce_sum`` adds the other rank's (R, G) totals to this rank's."""
    world_size = 2

    def __init__(self, other_rows, other_trajectories):
        self.other, self.seen = torch.tensor([other_rows, other_trajectories], dtype=torch.float64), []

    def all_reduce_sum(self, t):
        self.seen.append(t.clone())
        return t + self.other


def test_mgrpo_weights_use_the_all_reduced_row_and_trajectory_counts():
    """Under DDP c_r = R / (G·T_i) with R and G the GLOBAL row and trajectory counts (the update's seq-mean divides by
    the global row count). Rank A holds trajectories of 2 and 1 turns (R_A = 3, G_A = 2), rank B of 2 and 3 turns
    (R_B = 5, G_B = 2): R = 8, G = 4, so A's rows weigh 8/(4·2) = 1, 1 and 8/(4·1) = 2 (per rank it would be 0.75,
    0.75, 1.5), and every trajectory of the global batch carries Σ_j c_r / R = 1/G = 1/4 of the loss."""
    dist_a, dist_b = OtherRank(5.0, 2.0), OtherRank(3.0, 2.0)
    w_a = mgrpo_row_weights([0, 0, 1], dist_a)
    w_b = mgrpo_row_weights([0, 0, 1, 1, 1], dist_b)
    assert w_a.tolist() == pytest.approx([1.0, 1.0, 2.0])
    assert w_b.tolist() == pytest.approx([1.0, 1.0, 2 / 3, 2 / 3, 2 / 3])
    assert dist_a.seen[0].tolist() == [3.0, 2.0] and dist_b.seen[0].tolist() == [5.0, 2.0]  # this rank's (R, G)
    share = [w_a[:2].sum(), w_a[2:].sum(), w_b[:2].sum(), w_b[2:].sum()]
    assert [float(x) / 8 for x in share] == pytest.approx([0.25] * 4)  # M-GRPO: each trajectory 1/G of the loss
    # One process (world_size 1 or no dist): no collective, the local counts.
    one = SimpleNamespace(world_size=1, all_reduce_sum=None)
    assert mgrpo_row_weights([0, 0, 1], one).tolist() == pytest.approx([0.75, 0.75, 1.5])


def test_group_advantages_are_over_trajectories_not_rows():
    """One group: a solved 1-turn trajectory and a failed 3-turn one. GRPO over the two trajectories gives ±1/√2
    (mean 0.5); over the 4 turn rows it would be mean 0.25. The loop's path (advantages on the trajectories, then
    TurnRows.step) gives each row its trajectory's value times c_r, and the per-row rewards are the trajectory's."""
    ro = _trajectories([1, 3], [2, 1, 1], [0, 0])
    rewards = torch.tensor([1.0, 0.0])
    algo = _algo()
    tr = TurnRows(algo, pad=0)
    adv = compute_advantages(tr.advantage_algo, None, ro, rewards, micro_batch_size=4, temperature=1.0)
    batch = SimpleNamespace(metrics={})
    rows, row_adv, pre, row_rewards = tr.step(batch, ro, adv.advantages, adv.precomputed, rewards)
    a = 0.5 / (torch.tensor([1.0, 0.0]).std().item() + algo.cfg.adv_epsilon)
    c = [4 / (2 * 1), 4 / (2 * 3), 4 / (2 * 3), 4 / (2 * 3)]
    per_row = [row_adv[r][rows.trained_mask[r] > 0].unique().tolist() for r in range(4)]
    assert per_row == [[pytest.approx(a * c[0])]] + [[pytest.approx(-a * c[r])] for r in range(1, 4)]
    assert row_rewards.tolist() == [1.0, 0.0, 0.0, 0.0] and pre == {}
    assert batch.metrics["turn_rows/rows"] == 4 and batch.metrics["turn_rows/rows_per_trajectory"] == 2
    # The per-token passes are left to the update (on the rows): none ran here on the trajectories.
    algo_kl = _algo(**{"algorithm.kl_coef": 0.1, "algorithm.ppo_epochs": 2})
    assert {"ref_log_prob", "old_log_prob"} <= algo_kl.needs
    assert not {"ref_log_prob", "old_log_prob"} & TurnRows(algo_kl, pad=0).advantage_algo.needs


@pytest.mark.parametrize("over, match", [
    ({"rollout.environment": "", "reward.functions": [{"name": "math_verify"}], "task.name": "gsm8k"},
     "set rollout.environment"),
    ({"algorithm.advantage": "gigpo"}, "set algorithm.advantage=grpo"),
    ({"algorithm.advantage": "turn_broadcast", "algorithm.loss_agg_mode": "seq-mean-token-sum"},
     "set algorithm.advantage=grpo"),
    ({"algorithm.loss": "gspo"}, "set algorithm.loss=ppo_clip"),
    ({"algorithm.loss_agg_mode": "token-mean"}, "seq-mean-token-mean"),
    ({"algorithm.kl_coef": 0.1, "algorithm.kl_in": "reward"}, "kl_in=reward"),
    ({"algorithm.spear.enabled": True}, "algorithm.spear.enabled"),
    # SAFE's PID reads the update's mean reward: over turn rows an episode would count once per turn
    ({"algorithm.safe.enabled": True, "algorithm.kl_coef": 0.0},
     r"algorithm.safe.enabled \(its PID reads the batch.s mean reward"),
    # SIREN's and EPO's seq-mode entropies are means over responses: an episode would count once per turn row
    ({"algorithm.siren_coef": 0.005}, r"algorithm.siren_coef \(its entropy is a mean over responses"),
    ({"algorithm.epo_coef": 0.1, "algorithm.epo_mode": "seq"}, r"algorithm.epo_mode=seq \(a mean over responses"),
    ({"rollout.context_compression.keep_last": 0}, "keep_last"),
    # truncated episodes give no turn row: a rank with only cut episodes would reach the update empty (DDP: a hang)
    ({"algorithm.overlong_filter": True}, r"algorithm.overlong_filter with rollout.context_compression.*give no turn "
                                          r"row.*set algorithm.overlong_filter=false"),
    # trainer/replay.rebuilding_method's set, each naming the method and what turns it off
    ({"algorithm.hpt.enabled": True}, r"with algorithm.hpt.enabled: .*set algorithm.hpt.enabled=false"),
    ({"algorithm.dsdr_local_coef": 0.1}, r"with algorithm.dsdr_local_coef > 0: .*set algorithm.dsdr_local_coef=0"),
    ({"rollout.extra_rollouts": "dars"}, r"with rollout.extra_rollouts=dars: .*set rollout.extra_rollouts=none"),
    ({"trainer.async_rollouts.enabled": True}, r"does not combine with trainer.async_rollouts.enabled"),
])
def test_refusals_at_load(over, match):
    base = {**ENV_BASE, "rollout.context_compression.enabled": True, "algorithm.advantage": "grpo",
            "algorithm.loss": "ppo_clip", "algorithm.loss_agg_mode": "seq-mean-token-mean"}
    with pytest.raises(ConfigError, match=match):
        load_with(**{**base, **over})


def test_epo_per_token_entropy_still_combines_with_turn_rows():
    base = {**ENV_BASE, "rollout.context_compression.enabled": True, "algorithm.advantage": "grpo",
            "algorithm.loss": "ppo_clip", "algorithm.loss_agg_mode": "seq-mean-token-mean"}
    assert load_with(**{**base, "algorithm.epo_coef": 0.1, "algorithm.epo_mode": "token"}).algorithm.epo_mode == "token"


def test_options_without_compression_are_refused_and_a_good_config_loads():
    with pytest.raises(ConfigError, match="rollout.context_compression.enabled=true"):
        load_with(**{"rollout.context_compression.keep_last": 2})
    cfg = load_with(**{**ENV_BASE, "rollout.context_compression.enabled": True, "algorithm.advantage": "grpo",
                       "algorithm.loss": "ppo_clip", "algorithm.loss_agg_mode": "seq-mean-token-mean"})
    assert cfg.rollout.context_compression.keep_last == 1


def test_short_number_guess_run_trains_turn_rows(tiny_model_dir, tmp_path, monkeypatch):
    """One step on number_guess with compression (8 episodes of up to 3 turns): the update trains exactly one row per
    action of the step's trajectories (rows = Σ_i T_i, each row's trained tokens that action's guess + EOS), the
    reward / accuracy metrics stay per trajectory, the update is finite."""
    from anabranch import load_config
    from anabranch.trainer import turn_rows
    from anabranch.trainer.loop import train
    from test_train_e2e import tiny_overrides

    scripted_guesses(monkeypatch)
    seen = []
    step = turn_rows.TurnRows.step

    def recording(self, batch, rollout, *a):
        out = step(self, batch, rollout, *a)
        seen.append((rollout, out[0]))
        return out

    monkeypatch.setattr(turn_rows.TurnRows, "step", recording)
    over = number_guess_overrides(**{"rollout.context_compression.enabled": "true", "algorithm.advantage": "grpo",
                                     "trainer.steps": 1,
                                     "algorithm.loss": "ppo_clip", "algorithm.loss_agg_mode": "seq-mean-token-mean",
                                     "algorithm.kl_coef": 0.05})
    result = train(load_config(None, tiny_overrides(tiny_model_dir, "", tmp_path, **over)))
    assert len(seen) == len(result.history) == 1
    (traj, rows), m = seen[0], result.history[0]
    turns = [len(t) for t in traj.env_turns]
    assert len(turns) == 8 and rows.response_ids.shape[0] == sum(turns) == m["turn_rows/rows"]
    assert sum(turns) > len(turns)  # this run has multi-turn episodes (fixed seed): the rows are not the trajectories
    assert rows.trained_mask.sum(-1).tolist() == [2] * sum(turns)  # each row trains one action: guess + EOS
    assert m["env/turns_mean"] == pytest.approx(sum(turns) / 8)
    assert m["accuracy"] == pytest.approx(m["env/solved_frac"])  # per trajectory, not per row
    assert m["reward/mean"] == pytest.approx(m["env/return_mean"])
    assert torch.isfinite(torch.tensor(m["loss"])) and m["skipped_updates"] == 0 and "kl_ref" in m
