"""SPAE in the training step (algorithms/spae.py): step boundaries, the probe batch and its pass.

Each step, after the estimator's advantages, :meth:`SPAE.step`

1. decodes each response token by token (each distinct id of the batch once) and finds the step boundaries (``algorithm.spae_delimiter``), at
   most ``algorithm.spae_max_steps`` per response (evenly spaced, the last kept);
2. builds one probe per (row, boundary k): context = prompt ‖ response[: end of step k] ‖ the probe suffix
   (``algorithm.spae_probe``), all as token ids (the response's own tokens, not re-tokenized), and target =
   the row's gold answer (``row["answer"]``, tokenized alone, ``add_special_tokens=False``);
3. runs the current policy (π_old, before this step's update) once over all probes without gradient, in
   micro-batches of ``trainer.micro_batch_size`` rows or the update's token budget
   (advantage_pass.rollout_forward, the target read as a response; its full-vocabulary entropies come from
   the same pass), temperature 1; Acc and Conf of each probe from the target's log-probs and entropies;
4. returns the advantages with SPAE's term (algorithms/spae.py) and ``spae/*`` metrics; ``advantage/mean``
   and ``advantage/std`` are recomputed on the changed advantages (what the update trains on), the
   estimator's values kept as ``spae/base_mean`` and ``spae/base_std``.

Rows without a gold answer (or whose answer tokenizes to nothing) and rows without a boundary get no
term. Cost when on: Σ_rows (boundaries) extra no-grad sequences of prompt + response-prefix length; off,
nothing is built (the loop holds None). Refused: FSDP / DeepSpeed ZeRO-3 (the probe pass runs the
unsharded model outside the update; not tested here) and tasks whose training rows lack gold answers
(here); tools and rollout.retry_turns >= 2 (:func:`check_spae_run`, in config_checks.check_whole_config: at
config load and again first thing in train(), for a Config built in code); at config resolution
(algorithms/resolve.py), the losses that read a reward back from the advantages (flowrl, fdpg, rover, brain:
``advantage_is_reward``) and those that never read them (reasonmaxxer, pacs: ``ignores_advantages``).
"""

from __future__ import annotations

import dataclasses

import torch

from anabranch.algorithms.spae import (post_saturation, potential_deltas, select_steps, spae_advantages, spae_on,
                                       step_ends, step_potential, token_steps)
from anabranch.config import Config, ConfigError
from anabranch.rollout.base import Rollout, left_padded, pad_id, right_padded
from anabranch.trainer.advantage_pass import advantage_stats, rollout_forward


def check_spae_run(cfg: Config) -> None:
    """Whole-config combinations refused at config load and again before any model loads (both by
    config_checks.check_whole_config; train() runs it first thing, for a Config built in code)."""
    if not spae_on(cfg.algorithm):
        return
    if cfg.rollout.tools:
        raise ConfigError("algorithm.spae_coef > 0 with rollout.tools: tool outputs inside a response are not the "
                          "policy's steps, and a probe cut inside them would score the tool's text; set "
                          "algorithm.spae_coef=0 or rollout.tools=[]")
    if cfg.rollout.retry_turns >= 2:
        raise ConfigError(f"algorithm.spae_coef > 0 with rollout.retry_turns={cfg.rollout.retry_turns}: a response "
                          "holds several attempts and feedback turns, whose potentials are not one line of reasoning; "
                          "set rollout.retry_turns=0 or algorithm.spae_coef=0")


def response_boundaries(rollout: Rollout, tokenizer, delimiter: str, max_steps: int) -> list[list[int]]:
    """Per row, the inclusive end token of each probed step (response positions). Each distinct token id of
    the batch is decoded once, alone (one batch_decode over the batch's vocabulary, not B·T decodes), and
    every row reads its pieces from that table: the same pieces, so the same boundaries, as decoding each
    token of each row separately."""
    lengths = rollout.response_mask.sum(-1).tolist()
    rows = [rollout.response_ids[i, :int(n)].tolist() for i, n in enumerate(lengths)]
    vocab = sorted({t for ids in rows for t in ids})
    text = dict(zip(vocab, tokenizer.batch_decode([[t] for t in vocab], skip_special_tokens=False))) if vocab else {}
    return [select_steps(step_ends([text[t] for t in ids], delimiter), max_steps) for ids in rows]


def probe_items(rollout: Rollout, boundaries: list[list[int]], answers: list, tokenizer,
                probe: str) -> tuple[list[tuple[int, int]], list[list[int]], list[list[int]]]:
    """((row, step) of each probe, its context ids, its target ids). Rows with no usable answer: no probe."""
    suffix = tokenizer.encode(probe, add_special_tokens=False) if probe else []
    keys, contexts, targets = [], [], []
    for i, ends in enumerate(boundaries):
        answer = answers[i]
        gold = tokenizer.encode(str(answer), add_special_tokens=False) if answer not in (None, "") else []
        if not gold or not ends:
            continue
        prompt = rollout.prompt_tokens(i)
        response = rollout.response_ids[i].tolist()
        for k, e in enumerate(ends):
            keys.append((i, k))
            contexts.append(prompt + response[:e + 1] + suffix)
            targets.append(gold)
    return keys, contexts, targets


def probe_rollout(contexts: list[list[int]], targets: list[list[int]], pad: int) -> Rollout:
    """The probes as a Rollout: contexts left-padded as prompts, gold answers right-padded as responses."""
    ids, mask = left_padded(contexts, pad)
    resp, rmask = right_padded(targets, pad, min_width=0)
    return Rollout(prompt_ids=ids, prompt_mask=mask, response_ids=resp, response_mask=rmask,
                   group_index=torch.arange(len(targets)), prompts=[], completions=[],
                   truncated=torch.zeros(len(targets), dtype=torch.bool))


@torch.no_grad()
def probe_scores(model, contexts: list[list[int]], targets: list[list[int]], pad: int, micro_batch_size: int,
                 micro_batch_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] Acc (mean probability of the target's tokens) and [N] Conf (exp of minus their mean entropy)."""
    pr = probe_rollout(contexts, targets, pad)
    was_training = model.training
    model.eval()  # the probe reads the policy's distribution, without dropout
    try:
        out: dict = {}
        lp, _ = rollout_forward(model, pr, micro_batch_size, 1.0, micro_batch_tokens=micro_batch_tokens,
                                entropy_out=out)
    finally:
        model.train(was_training)
    m = pr.response_mask.float()
    n = m.sum(-1).clamp(min=1.0)
    acc = (lp.exp() * m).sum(-1) / n
    conf = torch.exp(-(out["entropy"] * m).sum(-1) / n)
    return acc, conf


@dataclasses.dataclass
class SPAEStep:
    phi: torch.Tensor        # [B, K] step potentials (0 on padding)
    valid: torch.Tensor      # [B, K] bool
    ends: torch.Tensor       # [B, K] inclusive end token of each step


class SPAE:
    """What the training loop holds for SPAE: the config and tokenizer; :meth:`step` runs each step."""

    def __init__(self, cfg: Config, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.pad = pad_id(tokenizer, tokenizer.eos_token_id)

    @classmethod
    def create(cls, cfg: Config, dist, c) -> "SPAE | None":
        """None unless ``algorithm.spae_coef > 0``; refuses what cannot work, before the first step."""
        if not spae_on(cfg.algorithm):
            return None
        if getattr(dist, "sharded", False):
            raise ConfigError("algorithm.spae_coef > 0 with FSDP or DeepSpeed ZeRO-3: SPAE's probe pass runs the "
                              "policy outside the update, which a sharded model does not support here; use DDP or "
                              "ZeRO-2, or set algorithm.spae_coef=0")
        rows = getattr(c, "train_rows", None) or []
        missing = sum(1 for r in rows if not isinstance(r, dict) or r.get("answer") in (None, ""))
        if missing:
            raise ConfigError(f"algorithm.spae_coef > 0 needs a gold answer in every training row (the probe scores it "
                              f"after each step), but {missing} of {len(rows)} rows of task {cfg.task.name!r} have "
                              "none; "
                              "use a task with reference answers or set algorithm.spae_coef=0")
        return cls(cfg, c.tokenizer)

    def probe(self, model, rollout: Rollout, answers: list, micro_batch_tokens: int = 0) -> SPAEStep:
        a = self.cfg.algorithm
        bounds = response_boundaries(rollout, self.tokenizer, a.spae_delimiter, a.spae_max_steps)
        keys, contexts, targets = probe_items(rollout, bounds, answers, self.tokenizer, a.spae_probe)
        b, k = rollout.response_ids.shape[0], max((len(e) for e in bounds), default=0)
        phi, valid, ends = torch.zeros(b, max(k, 1)), torch.zeros(b, max(k, 1), dtype=torch.bool), \
            torch.zeros(b, max(k, 1), dtype=torch.long)
        if keys:
            acc, conf = probe_scores(model, contexts, targets, self.pad, self.cfg.trainer.micro_batch_size,
                                     micro_batch_tokens)
            pot = step_potential(acc, conf)
            for (i, s), v in zip(keys, pot.tolist()):
                phi[i, s], valid[i, s], ends[i, s] = v, True, bounds[i][s]
        return SPAEStep(phi, valid, ends)

    def step(self, model, rollout: Rollout, rows: list, adv, micro_batch_tokens: int = 0):
        """``adv`` (advantage_pass.AdvantageBatch) with SPAE's term on its advantages and ``spae/*`` metrics."""
        a = self.cfg.algorithm
        answers = [r.get("answer") if isinstance(r, dict) else None for r in rows]
        st = self.probe(model, rollout, answers, micro_batch_tokens)
        mask = rollout.trained_mask.float()
        steps = token_steps(st.ends, st.valid, mask.shape[1])
        delta = potential_deltas(st.phi, st.valid)
        post = post_saturation(st.phi, st.valid, a.spae_saturation)
        base = {k: adv.metrics[k] for k in ("advantage/mean", "advantage/std") if k in adv.metrics}
        adv.advantages = spae_advantages(adv.advantages, mask, steps, delta, post, a.spae_coef,
                                         a.spae_saturation_penalty)
        # advantage/mean and advantage/std describe what the update trains on, so they are recomputed after
        # SPAE's term (advantage_pass's advantage_stats, same mask); the estimator's own values stay as spae/base_*.
        adv.metrics.update({f"spae/base_{k.split('/')[1]}": v for k, v in base.items()})
        adv.metrics.update(advantage_stats(adv.advantages, mask))
        n = st.valid.sum().clamp(min=1)
        post_tok = torch.gather(post.long(), 1, steps.clamp(min=0)) * (steps >= 0)
        adv.metrics.update({
            "spae/steps_per_response": st.valid.sum(-1).float().mean().item(),
            "spae/potential_mean": (st.phi.sum() / n).item(),
            "spae/delta_abs_mean": (delta.abs().sum() / n).item(),
            "spae/saturated_frac": ((st.phi >= a.spae_saturation) & st.valid).any(-1).float().mean().item(),
            "spae/post_saturation_token_frac": ((post_tok * mask).sum() / mask.sum().clamp(min=1)).item(),
        })
        return adv
