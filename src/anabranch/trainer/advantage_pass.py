"""From scored rollouts to advantages: the no-grad forward passes the algorithm declared, the KL
in the reward, and the estimator call.

Runs before the update, so that estimators that need per-token quantities of the rollout policy
(values for GAE, the KL of the sampled tokens for ``kl_in=reward``) get them, and the update
reuses the same old and reference log-probs instead of computing them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from anabranch.algorithms.advantages import token_level_rewards
from anabranch.algorithms.arpo import hard_attribution
from anabranch.algorithms.aggregation import masked_mean
from anabranch.algorithms.kl import kl_penalty
from anabranch.algorithms.ppl_position import ppl_position_on, ppl_position_shaping
from anabranch.algorithms.ppo_value import rollout_value_columns, rollout_values, split_rollout_values
from anabranch.algorithms.progrpo import answer_confidence, progrpo_advantages, progrpo_on, prompt_confidence
from anabranch.algorithms.ucas import head_stats, ucas_advantages, ucas_on
from anabranch.models.chunked_logprobs import supports_chunked_head
from anabranch.models.shared_prefix import supports_shared_prefix
from anabranch.rollout.base import Rollout
from anabranch.trainer.microbatch import forward_micro_batch, plan_micro_batches


@dataclass
class AdvantageBatch:
    advantages: torch.Tensor                             # [B, T]
    precomputed: dict = field(default_factory=dict)      # old_log_prob, ref_log_prob, values, returns
    metrics: dict = field(default_factory=dict)
    kl_coef: float = 0.0                                 # β of this step (before the controller's update)


@torch.no_grad()
def rollout_forward(model, rollout: Rollout, micro: int, temperature: float, modules: dict | None = None,
                    values: bool = False, share_prefix: bool = False, micro_batch_tokens: int = 0,
                    ucas_stats: dict | None = None, entropy_out: dict | None = None,
                    eval_mode: bool = False, oom_retry: bool = False):
    """log π(response) and, when asked, the value head's V for every response token.

    Micro-batches of ``micro`` rows, or packed by ``micro_batch_tokens`` when > 0 (as the update's);
    with ``share_prefix`` (and a model that supports it) each group's prompt runs once. A dict
    ``ucas_stats`` receives UCAS's per-token self-certainty and raw sampled-token logit [B, R]
    (algorithms/ucas.py), from the same pass's hidden states. A dict ``entropy_out`` receives ``entropy``
    [B, R], the full-vocabulary entropy at each response position (SRPO's teacher, trainer/srpo_step.py,
    CURE's critical tokens, trainer/cure_rollouts.py); without it nothing more is computed.
    ``eval_mode``: the pass runs with the model in eval mode (no dropout: the distribution it samples
    from), its training mode restored after (CURE's entropies; SPAE's probe may use it too).
    ``oom_retry``: on a CUDA out-of-memory error the whole pass runs again in micro-batches of half the
    largest one's computed tokens (as the update's ``oom_retry``), until none can be made smaller; then
    the error is raised. Both off by default: one plan, one pass, the model's mode untouched."""
    share = share_prefix and supports_shared_prefix(model)
    groups = rollout.group_index if share else None

    def plan(budget: int):
        return plan_micro_batches(rollout.prompt_mask, rollout.response_mask, micro, budget,
                                  group_index=groups, share_prefix=share)

    def run(mbs):
        return _forward_passes(model, rollout, mbs, temperature, modules, values, share, ucas_stats, entropy_out)

    was_training = eval_mode and model.training
    if eval_mode:
        model.eval()
    try:
        return _retry_smaller(run, plan, plan(micro_batch_tokens), rollout.group_index, share) if oom_retry \
            else run(plan(micro_batch_tokens))
    finally:
        if eval_mode:
            model.train(was_training)


def _retry_smaller(run, plan, mbs, group_index: torch.Tensor, share: bool):
    """``run(mbs)``, re-planned at half the largest micro-batch's computed tokens after each CUDA OOM."""
    def largest(plan_) -> int:
        return max(mb.computed_tokens(group_index, share) for mb in plan_)

    while True:
        try:
            return run(mbs)
        except torch.cuda.OutOfMemoryError:
            smaller = plan(max(largest(mbs) // 2, 1))
            if largest(smaller) >= largest(mbs):  # single rows (or whole shared groups): nothing to split
                raise
        # Outside the except block the failed attempt's tensors are released: free them, then retry.
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        mbs = smaller


def _forward_passes(model, rollout: Rollout, plan, temperature: float, modules, values: bool, share: bool,
                    ucas_stats: dict | None, entropy_out: dict | None):
    """:func:`rollout_forward`'s micro-batches of ``plan``; the dicts are filled only once all have run."""
    device = next(model.parameters()).device
    ids, mask = rollout.input_ids.to(device), rollout.attention_mask.to(device)
    width = rollout.response_ids.shape[1]
    lps = torch.zeros(ids.shape[0], width)
    vals = torch.zeros(ids.shape[0], width, *rollout_value_columns(modules)) if values else None
    want_stats = ucas_stats is not None
    ents = torch.zeros(ids.shape[0], width) if entropy_out is not None else None
    if want_stats:
        if not supports_chunked_head(model):
            raise RuntimeError("algorithm.ucas needs the LM head as a plain linear layer on the last hidden states "
                               "(not under FSDP, nor with logit scaling or soft-capping)")
        certainty, raw_logit = torch.zeros(ids.shape[0], width), torch.zeros(ids.shape[0], width)
        head, prompt_width = model.get_output_embeddings(), rollout.prompt_ids.shape[1]
    for mb in plan:
        fo = forward_micro_batch(model, mb, ids, mask, temperature, hidden=values or want_stats, share_prefix=share,
                                 entropy=ents is not None)
        lps[mb.rows] = fo.log_probs.float().cpu()
        if ents is not None:
            ents[mb.rows] = fo.entropy.float().cpu()
        if values:
            vals[mb.rows] = rollout_values(modules, fo.hidden, width).float().cpu()  # double critic: [b, R, 3]
        if want_stats:
            # Position P−1+t predicts response token t.
            h = fo.hidden[:, prompt_width - 1:prompt_width - 1 + width]
            s, z = head_stats(h, head, ids[mb.rows.to(device)][:, prompt_width:], temperature)
            certainty[mb.rows], raw_logit[mb.rows] = s.cpu(), z.cpu()
    if want_stats:
        ucas_stats.update(certainty=certainty, raw_logit=raw_logit)
    if ents is not None:
        entropy_out["entropy"] = ents
    return lps, vals


def compute_advantages(algo, model, rollout: Rollout, rewards: torch.Tensor, *, micro_batch_size: int,
                       temperature: float, ref_model=None, modules: dict | None = None,
                       kl_controller=None, share_prompt_prefix: bool = True,
                       micro_batch_tokens: int = 0, dist=None) -> AdvantageBatch:
    """``dist`` (data parallel): UCAS's token-logit min-max runs over the global batch."""
    cfg, needs = algo.cfg, algo.needs
    mask = rollout.trained_mask.float()  # tool outputs inside a response are not the policy's tokens
    pre: dict = {}
    # ROVER (algorithms/rover.py) reads mean_v log π_old(v|s_t) = −(UCAS's self-certainty) from the same pass.
    rover = "old_vocab_mean" in needs
    if rover and not supports_chunked_head(model):
        raise RuntimeError("loss=rover with ppo_epochs > 1 needs the LM head as a plain linear layer on the last "
                           "hidden states (not under FSDP, nor with logit scaling or soft-capping)")
    stats = {} if ucas_on(cfg) or rover else None
    if "old_log_prob" in needs or "values" in needs:
        old, values = rollout_forward(model, rollout, micro_batch_size, temperature, modules, "values" in needs,
                                      share_prompt_prefix, micro_batch_tokens, ucas_stats=stats)
        if "old_log_prob" in needs:
            pre["old_log_prob"] = old
        if rover:
            pre["old_vocab_mean"] = -stats["certainty"]
        if values is not None:  # the double critic's also "value_heads" (algorithms/double_critic.py)
            pre.update(split_rollout_values(values))
    if "ref_log_prob" in needs:
        if ref_model is None:
            raise RuntimeError("this algorithm needs reference log-probs but no reference model was loaded")
        # The reference's entropies from the same pass, when the objective reads them (registries.py).
        ref_ent = {} if "ref_entropy" in needs else None
        pre["ref_log_prob"], _ = rollout_forward(ref_model, rollout, micro_batch_size, temperature,
                                                 share_prefix=share_prompt_prefix,
                                                 micro_batch_tokens=micro_batch_tokens, entropy_out=ref_ent)
        if ref_ent is not None:
            pre["ref_entropy"] = ref_ent["entropy"]

    metrics: dict = {}
    token_rewards = token_level_rewards(rewards, mask)
    if rollout.process_rewards is not None:  # PRM-Clip/Delta's step rewards (reward.prm_shaping)
        token_rewards = token_rewards + rollout.process_rewards.to(token_rewards) * mask
    beta = kl_controller.value if kl_controller is not None else cfg.kl_coef
    if "old_log_prob" in pre and "ref_log_prob" in pre:
        kl = kl_penalty(pre["old_log_prob"], pre["ref_log_prob"], cfg.kl_estimator) * mask
        seq_kl = kl.sum(-1).mean().item()
        metrics.update({"kl/seq_kl": seq_kl, "kl/coef": beta})
        if cfg.kl_coef > 0 and cfg.kl_in == "reward":
            token_rewards = token_rewards - beta * kl
        if kl_controller is not None:
            kl_controller.update(seq_kl, mask.shape[0])
    # Estimator inputs the rollout does not hold (prompt pairing's q+/q− group_role for weighted_grpo).
    inputs = {key: fn(rollout) for key, fn in getattr(algo, "advantage_inputs", {}).items()}
    if cfg.advantage == "canon":  # CANON's entropy split reads π_old's sampled-token log-probs
        inputs["old_log_prob"] = pre.get("old_log_prob")
    out = algo.advantage(token_rewards.sum(-1), rollout.group_index, mask, cfg,
                         token_rewards=token_rewards, values=pre.get("values"), **inputs)
    advantages, extras = out if isinstance(out, tuple) else (out, {})
    pre.update(extras)
    if rollout.branch_segments is not None:  # ARPO's hard attribution over branched rows (algorithms/arpo.py)
        advantages, m = hard_attribution(advantages, rollout.branch_segments, rollout.group_index, mask)
        metrics.update(m)
    advantages = _confidence_shaping(cfg, model, rollout, rewards, advantages, mask, pre,
                                     stats if ucas_on(cfg) else None, metrics,
                                     micro_batch_size, temperature, dist)
    if ppl_position_on(cfg):  # Deng et al. 2025's PPL / position shaping (algorithms/ppl_position.py)
        advantages, m = ppl_position_shaping(cfg, advantages, mask, pre.get("old_log_prob"), rollout.group_index)
        metrics.update(m)
    metrics.update(advantage_stats(advantages, mask))
    return AdvantageBatch(advantages, pre, metrics, kl_coef=beta)


def advantage_stats(advantages: torch.Tensor, mask: torch.Tensor) -> dict:
    """``advantage/mean`` and ``advantage/std`` (population std) over the masked tokens: what the update
    trains on (SPAE recomputes them after its term, trainer/spae_step.py)."""
    mean = masked_mean(advantages, mask).item()
    return {"advantage/mean": mean, "advantage/std": masked_mean((advantages - mean) ** 2, mask).item() ** 0.5}


def _confidence_shaping(cfg, model, rollout, rewards, advantages, mask, pre, stats, metrics, micro, temperature,
                        dist=None):
    """UCAS and ProGRPO's ARM on the estimator's advantages (each only when its option is on; with
    both, UCAS's multiplicative stage runs first and ARM's shift is added to its result)."""
    if stats is not None:
        if "certainty" not in stats:
            raise RuntimeError("algorithm.ucas needs the rollout forward pass (old_log_prob in the algorithm's needs)")
        advantages, m = ucas_advantages(advantages, stats["certainty"], stats["raw_logit"], rollout.group_index,
                                        mask, beta_pos=cfg.ucas_beta_pos, beta_neg=cfg.ucas_beta_neg,
                                        token_coef=cfg.ucas_token_coef, norm_by_std=cfg.norm_adv_by_std,
                                        eps=cfg.adv_epsilon, dist=dist)
        metrics.update(m)
    if progrpo_on(cfg):
        if "old_log_prob" not in pre:
            raise RuntimeError("algorithm.progrpo_alpha needs old log-probs (old_log_prob in the algorithm's needs)")
        prompt_conf = prompt_confidence(model, rollout.prompt_ids, rollout.prompt_mask, rollout.group_index,
                                        micro, temperature)
        answer_conf = answer_confidence(pre["old_log_prob"], mask, cfg.progrpo_low_frac)
        advantages, m = progrpo_advantages(advantages, rewards, rollout.group_index, mask, prompt_conf, answer_conf,
                                           cfg.progrpo_alpha)
        metrics.update(m)
    return advantages
