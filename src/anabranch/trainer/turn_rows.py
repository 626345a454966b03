"""WebAgent-R1's M-GRPO update over one training row per turn (``rollout.context_compression.enabled``).

Wei et al. 2025, "WebAgent-R1: Training Web Agents via End-to-End Multi-Turn Reinforcement Learning" (arXiv
2505.16421). With dynamic context compression (rollout/context_compression.py) turn j's action a_{i,j} of trajectory
τ_i was sampled from a context c_{i,j} that no later sequence holds (older observations are replaced as new ones
arrive), so the trajectory becomes T_i rows ``prompt · c_{i,j} · a_{i,j}``, loss mask 1 on a_{i,j}'s tokens only
(``Rollout.turn_contexts`` holds each c_{i,j}; a_{i,j} is the j-th run of trained tokens of the trajectory). The
objective (M-GRPO, as the lead's summary of the paper states it):

    L = −(1/G) Σ_i (1/T_i) Σ_j (1/|a_{i,j}|) Σ_t min(ρ_{i,j,t}·Â_i, clip(ρ_{i,j,t}, 1−ε, 1+ε)·Â_i)   (+ β·KL)
    Â_i = (R_i − mean(R_group)) / (std(R_group) + ε')            over the n TRAJECTORIES of the prompt

G: the trajectories of the step batch with a trained token (as ``seq-mean`` counts sequences). Â is computed by the
configured estimator (grpo, or rloo) on the trajectory batch, before any expansion, so the group statistics are over
trajectories, never over turn rows; each row then takes its action's tokens' advantages from its trajectory. The
update aggregates the R rows with ``loss_agg_mode=seq-mean-token-mean``, (1/R) Σ_r (1/|a_r|) Σ_t ℓ_{r,t}; since the
clipped surrogate is linear in a positive factor of Â (min(ρ·cA, clip(ρ)·cA) = c·min(ρA, clip(ρ)A), c > 0), row r of
trajectory i carries Â_i·c_r with

    c_r = R / (G·T_i)         so that  (1/R) Σ_r c_r (1/|a_r|) Σ_t ℓ = (1/G) Σ_i (1/T_i) Σ_j (1/|a_{i,j}|) Σ_t ℓ

exactly M-GRPO's weighting (R and G are global sums under DDP, as the update's own normalizer is). The KL term
(``kl_in=loss``) is not advantage-weighted: it is the mean over rows of each row's token mean (assumed; the paper's
"+KL" does not say how it is averaged). Rewards, advantages' statistics and every reward / accuracy / length metric
stay per trajectory (the loop's batch is untouched; only the update's rows are expanded). Under no compression this is
the same weighting as Flow-GRPO's ``advantage=turn_broadcast`` with ``turn_credit_turn_mean=true`` on one sequence,
aggregated with ``loss_agg_mode=seq-mean-token-sum`` (its per-token weights 1/(T_i·|a_{i,j}|) hold the turn means).

Confirmed (authors' released code, read): group-normalized trajectory rewards with std + 1e-4, binary task success.
Assumed: the loss above as summarized (the paper's method text was not available to read), the KL averaging, and the
per-turn rows themselves (the released code trains one compressed sequence per trajectory; see
rollout/context_compression.py). BC warm-up (the paper's SFT stage before RL) is not part of this update: start from
a behaviour-cloned checkpoint (``model.name``).
"""

from __future__ import annotations

import dataclasses

import torch

from anabranch.algorithms.turn_spans import turn_bounds, turn_index
from anabranch.rollout.base import Rollout, pad_id, right_padded, right_padded_values

# The per-token inputs the advantage pass would compute on the trajectory rows: under turn rows the update computes
# them itself, on the rows (the contexts differ), so the advantage pass skips them.
ROW_FORWARD_NEEDS = frozenset({"old_log_prob", "ref_log_prob", "values"})
ADVANTAGES = ("grpo", "rloo")  # trajectory-level group estimators: one Â_i per trajectory


class TurnRows:
    """The loop's part: ``advantage_algo`` (the algorithm without the per-token passes, for ``compute_advantages``
    on the trajectories) and :meth:`step` (trajectories -> turn rows for ``policy_update``)."""

    def __init__(self, algo, pad: int, dist=None):
        self.advantage_algo = dataclasses.replace(algo, needs=algo.needs - ROW_FORWARD_NEEDS)
        self.pad, self.dist = pad, dist

    @classmethod
    def create(cls, cfg, dist=None, c=None) -> "TurnRows | None":
        if not cfg.rollout.context_compression.enabled:
            return None
        return cls(c.algo, pad_id(c.tokenizer, c.tokenizer.eos_token_id) or 0,
                   None if dist is None else dist.active)

    def step(self, batch, rollout: Rollout, advantages: torch.Tensor, precomputed: dict,
             rewards: torch.Tensor) -> tuple[Rollout, torch.Tensor, dict, torch.Tensor]:
        """(row rollout, row advantages with M-GRPO's c_r, precomputed, per-row rewards); ``turn_rows/*`` metrics into
        ``batch.metrics``. The per-row rewards (each row its trajectory's R_i) only keep ``policy_update``'s row
        indexing aligned: batch means of them would weigh an episode by its turn count, so the update's readers of
        rewards (SAFE's controller, RLFR's flow, the reward-reading objectives) are refused by :func:`check_config`."""
        unknown = sorted(set(precomputed) - {"old_log_prob", "ref_log_prob", "values"})
        if unknown:  # config_checks refuses the methods that add them; a new one must be taught how to expand
            raise RuntimeError(f"rollout.context_compression: per-trajectory inputs {unknown} cannot follow turn rows")
        rows, row_adv, traj = expand_turn_rows(rollout, advantages, self.pad)
        weights = mgrpo_row_weights(traj, self.dist)
        lengths = rows.response_lengths.float()
        batch.metrics.update({"turn_rows/rows": float(len(traj)),
                              "turn_rows/rows_per_trajectory": len(traj) / max(len(set(traj)), 1),
                              "turn_rows/row_tokens_mean": lengths.mean().item() if traj else 0.0})
        return rows, row_adv * weights[:, None], {}, rewards[torch.tensor(traj, dtype=torch.long)]


def expand_turn_rows(ro: Rollout, advantages: torch.Tensor, pad: int) -> tuple[Rollout, torch.Tensor, list[int]]:
    """(the rows ``prompt · c_{i,j} · a_{i,j}``, their advantages [R, W] (trajectory i's at a_{i,j}'s tokens, 0 on the
    context), the trajectory of each row). Turn j's action is the j-th run of ``ro.trained_mask`` (a trajectory whose
    mask an overlong filter emptied gives no row); its context is ``ro.turn_contexts[i][j]``."""
    if ro.turn_contexts is None:
        raise RuntimeError("rollout.context_compression trains one row per turn from Rollout.turn_contexts, which this "
                           "batch lacks (it was not generated by an environment rollout with compression on)")
    bounds = turn_bounds(turn_index(ro.trained_mask))
    resp, loss, adv, lps, traj = [], [], [], [], []
    slp = ro.sample_log_probs
    for i, runs in enumerate(bounds):
        contexts = ro.turn_contexts[i]
        if len(runs) > len(contexts):
            raise RuntimeError(f"rollout.context_compression: response {i} has {len(runs)} runs of trained tokens but "
                               f"{len(contexts)} recorded turn contexts")
        for j, (first, last) in enumerate(runs):
            ctx, action = contexts[j], ro.response_ids[i, first:last + 1].tolist()
            resp.append(ctx + action)
            loss.append([0] * len(ctx) + [1] * len(action))
            adv.append([0.0] * len(ctx) + advantages[i, first:last + 1].float().tolist())
            if slp is not None:
                lps.append([0.0] * len(ctx) + slp[i, first:last + 1].tolist())
            traj.append(i)
    sel = torch.tensor(traj, dtype=torch.long)
    response_ids, response_mask = right_padded(resp, pad)
    width = response_ids.shape[1]
    rows = Rollout(prompt_ids=ro.prompt_ids[sel], prompt_mask=ro.prompt_mask[sel], response_ids=response_ids,
                   response_mask=response_mask, group_index=ro.group_index[sel], prompts=list(ro.prompts),
                   completions=[ro.completions[i] for i in traj], truncated=ro.truncated[sel],
                   sample_log_probs=right_padded_values(lps, width) if slp is not None else None,
                   loss_mask=right_padded(loss, 0)[0][:, :width], metrics=dict(ro.metrics))
    return rows, right_padded_values(adv, width), traj


def mgrpo_row_weights(traj: list[int], dist=None) -> torch.Tensor:
    """[R] c_r = R / (G·T_i): row r of trajectory i, T_i its rows, G the trajectories with a row; R and G summed over
    the ranks under DDP (the update's seq-mean normalizer is the global row count)."""
    counts: dict[int, int] = {}
    for i in traj:
        counts[i] = counts.get(i, 0) + 1
    totals = torch.tensor([float(len(traj)), float(len(counts))], dtype=torch.float64)
    if dist is not None and getattr(dist, "world_size", 1) > 1:
        totals = dist.all_reduce_sum(totals).cpu()
    r, g = float(totals[0]), max(float(totals[1]), 1.0)
    return torch.tensor([r / (g * counts[i]) for i in traj], dtype=torch.float32)


def check_config(cfg) -> str | None:
    """Whole-config refusals of ``rollout.context_compression`` (None when fine): what it needs and the methods that
    read one row per trajectory in the update, or the trajectory's own per-token tensors."""
    from anabranch.range_checks import first_failed, is_count

    r, a, cc = cfg.rollout, cfg.algorithm, cfg.rollout.context_compression
    if (error := first_failed([(is_count(cc.keep_last) and cc.keep_last >= 1, "keep_last", "must be an integer >= 1"),
                               (isinstance(cc.placeholder, str), "placeholder", "must be a string")],
                              "rollout.context_compression", cc)) is not None:
        return error
    if not r.environment:
        return ("rollout.context_compression compresses the observations of environment episodes: set "
                "rollout.environment=NAME (e.g. number_guess with task.name=number_guess)")
    if a.advantage not in ADVANTAGES:
        return (f"rollout.context_compression trains each turn as its own row with its trajectory's group-normalized "
                f"advantage (M-GRPO); algorithm.advantage={a.advantage} needs the whole trajectory in one row "
                "(turn-level estimators such as GiGPO, HiPER, ArCHer, turn_broadcast / turn_norm / spa, REFUEL's pairs, or a "
                "value/critic pass); set algorithm.advantage=grpo (or rloo)")
    if a.loss != "ppo_clip":
        return (f"rollout.context_compression folds M-GRPO's per-turn weights into the advantages of the clipped "
                f"surrogate; loss={a.loss!r} is not linear in them; set algorithm.loss=ppo_clip")
    if a.loss_agg_mode != "seq-mean-token-mean":
        return ("rollout.context_compression averages each turn row's tokens, then the rows (M-GRPO's 1/|a_ij| then "
                f"1/(G·T_i)); set algorithm.loss_agg_mode=seq-mean-token-mean (got {a.loss_agg_mode!r})")
    if a.overlong_filter:  # a rank whose trajectories were all cut would reach the update with no row (DDP: a hang)
        return ("algorithm.overlong_filter with rollout.context_compression: it empties the loss mask of truncated "
                "trajectories (episodes cut by rollout.max_env_turns or the token budget), which then give no turn "
                "row, so a step (under DDP, one rank while the others wait in the update's collectives) can reach the "
                "update with no rows at all; set algorithm.overlong_filter=false")
    from anabranch.trainer.replay import rebuilding_method

    if (key := rebuilding_method(cfg)) is not None:  # they read or rebuild the step's rows by batch position
        return (f"rollout.context_compression (one update row per turn) does not combine with {key}: that method "
                "rebuilds, re-weights or adds per-token inputs to the step's trajectory rows by their position in the "
                f"batch, which the turn rows replace; set {_off_setting(key)}")
    for on, what in ((a.kl_coef > 0 and (a.kl_in == "reward" or a.kl_target is not None),
                      "algorithm.kl_in=reward / kl_target (a KL of the trajectory's tokens; use kl_in=loss)"),
                     (bool(a.ucas) or a.progrpo_alpha > 0 or a.ppl_shaping_coef > 0,
                      "algorithm.ucas / progrpo_alpha / ppl_shaping_coef (they reshape from the trajectory's forward)"),
                     (a.rorecomp_fraction > 0, "algorithm.rorecomp_fraction (it replays trajectory rows)"),
                     (a.spear.enabled, "algorithm.spear.enabled (it replays trajectory rows)"),
                     # SAFE's controller reads the update's rewards and per-response entropies as batch means: over
                     # turn rows a T_i-turn episode would count T_i times in r_t and H_t
                     (a.safe.enabled, "algorithm.safe.enabled (its PID reads the batch's mean reward and mean "
                      "response entropy, which over turn rows would weigh each episode by its turn count)"),
                     # SIREN's H̄ and EPO's seq mode average per-response entropies: over turn rows a T_i-turn
                     # episode would count T_i times
                     (a.siren_coef > 0, "algorithm.siren_coef (its entropy is a mean over responses, which over turn "
                      "rows would weigh each episode by its turn count)"),
                     (a.epo_coef > 0 and a.epo_mode == "seq", "algorithm.epo_mode=seq (a mean over responses, which "
                      "over turn rows would weigh each episode by its turn count; epo_mode=token is per token)"),
                     (a.er_shaping_coef > 0, "algorithm.er_shaping_coef"), (a.rlfr.enabled, "algorithm.rlfr.enabled"),
                     # the one-step-off-policy loop's behaviour log-probs are per trajectory token (trainer/async_rollouts.py)
                     (getattr(getattr(cfg.trainer, "async_rollouts", None), "enabled", False),
                      "trainer.async_rollouts.enabled")):
        if on:
            return f"rollout.context_compression (one update row per turn) does not combine with {what}; leave it off"
    return None


def _off_setting(key: str) -> str:
    """The setting that turns off a method named as :func:`trainer.replay.rebuilding_method` names it
    ("algorithm.hpt.enabled", "algorithm.rltf_sd_coef > 0", "rollout.extra_rollouts=cure", "algorithm.kdrl.teacher")."""
    name = key.split(" ")[0].split("=")[0]
    if name.endswith(".enabled"):
        return f"{name}=false"
    if name == "rollout.extra_rollouts":
        return "rollout.extra_rollouts=none"
    if name == "algorithm.kdrl.teacher":
        return 'algorithm.kdrl.teacher="" (no teacher)'
    return f"{name}=0"
