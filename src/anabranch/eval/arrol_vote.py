"""``anabranch eval --arrol-vote``: ARRoL's quality head weighing the answers of a majority vote (test-time scaling).

Xu et al. 2026, "Prune as You Generate: Online Rollout Pruning for Faster and Better RLVR" (arXiv 2603.24840):
"the learned quality head can further weigh candidates to improve inference accuracy during test-time scaling"
(the abstract; confirmed). Here each of a problem's n samples votes for its extracted answer with weight
p_i = σ(q_φ(h_ℓ(x ⊕ y_{i,<L_p}))), the head's predicted success at the training run's pruning point L_p
(``rollout.arrol.prune_at``, layer ℓ = ``rollout.arrol.layer``, read from the checkpoint's run config):

    â = argmax_a Σ_{i: ans_i = a} p_i          (plain majority: all p_i = 1)

and the problem counts as its fraction of samples with answer â marked correct (ties: the mean over the top
answers): eval/passk.majority_correct with ``weights``, the rule maj@k scores with. **Assumed** (the paper's
method text was not readable): the weight is the head's probability itself (not a thresholded or tempered one),
read at the pruning point (the head was trained on prefixes of that length; reading it on the full response would
be out of its training distribution), summed per answer. The head comes from a checkpoint folder's
``trainer_state.pt`` (``stateful`` "arrol": the trainer saves it there; a run directory's ``final/`` model holds
no head), one extra no-grad forward of the policy over prompt ⊕ the first L_p tokens of each sample
(trainer/arrol_rollouts.prefix_features).

The entry's ``arrol_vote``: ``majority`` (plain vote over all n: the entry's maj@n), ``weighted`` (the head's
vote), ``prune_at``, ``mean_weight``; a model without a head gets a ``note`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from anabranch.config import ConfigError

NO_HEAD = ("--arrol-vote reads ARRoL's quality head from a checkpoint's trainer_state.pt (stateful \"arrol\"): name "
           "a checkpoint folder RUN/checkpoints/step-NNNNNN of a run trained with rollout.arrol.enabled=true "
           "(a run directory's final/ model holds no head)")


@dataclass
class VoteHead:
    head: torch.nn.Module
    layer: int
    prune_at: int

    @torch.no_grad()
    def scores(self, model, rollout, micro_batch_size: int) -> list[float]:
        """p_i of each row of ``rollout`` (row order): the head on the prefix state at the pruning point."""
        from anabranch.trainer.arrol_rollouts import prefix_features

        h = prefix_features(model, rollout, self.prune_at, self.layer, micro_batch_size)
        device = next(self.head.parameters()).device
        with torch.autocast(device_type=device.type, enabled=False):
            return torch.sigmoid(self.head(h.to(device).float())).cpu().tolist()


def state_file(spec) -> Path | None:
    """The checkpoint's trainer_state.pt when ``spec`` names a checkpoint folder (its ``model/``), else None."""
    from anabranch.trainer.checkpoint import STATE_FILE

    p = Path(spec.path)
    return p.parent / STATE_FILE if p.name == "model" and (p.parent / STATE_FILE).is_file() else None


def check_models(specs) -> None:
    """Before any model loads: at least one model is a checkpoint folder (where a head can be)."""
    if not any(state_file(s) is not None for s in specs):
        raise ConfigError(NO_HEAD)


def load_head(spec, cfg, device) -> VoteHead | None:
    """The checkpoint's quality head (shape from its saved weights; layer and pruning point from its run's config,
    else ``cfg``), or None when ``spec`` is no checkpoint of an ARRoL run."""
    from anabranch.algorithms.arrol import QualityHead
    from anabranch.trainer.arrol_rollouts import prune_length

    path = state_file(spec)
    if path is None:
        return None
    saved = (torch.load(path, map_location="cpu", weights_only=False).get("stateful") or {}).get("arrol")
    if saved is None:
        return None
    run_cfg = cfg
    if spec.config_file is not None:
        from anabranch.eval.run_config import load_run_config

        run_cfg = load_run_config(str(spec.config_file), [])
    sd = saved["head"]
    hidden = sd["net.0.weight"].shape[0] if "net.0.weight" in sd else 0
    head = QualityHead((sd["net.0.weight"] if hidden else sd["net.weight"]).shape[1], hidden)
    head.load_state_dict(sd)
    return VoteHead(head.to(device).eval(), run_cfg.rollout.arrol.layer, prune_length(run_cfg))


def vote_entry(answers: list[list], correct: list[list], weights: list[list[float]], prune_at: int,
               majority: float | None = None) -> dict:
    """The mean over problems of the plain and the head-weighted majority vote's correctness. ``majority``: the
    plain vote over all n, the entry's maj@n (eval/passk.sample_metrics) when ``--k`` asked for k = n; computed
    here only when it did not."""
    from anabranch.eval.passk import majority_correct

    m = len(answers)
    if m == 0:
        raise ValueError("no problems to vote on")
    if majority is None:
        majority = sum(majority_correct(a, c) for a, c in zip(answers, correct)) / m
    flat = [w for ws in weights for w in ws]
    return {"majority": majority,
            "weighted": sum(majority_correct(a, c, w) for a, c, w in zip(answers, correct, weights)) / m,
            "prune_at": prune_at, "mean_weight": sum(flat) / max(len(flat), 1)}


NOT_ARROL = {"note": "no ARRoL head: not a checkpoint folder of a run with rollout.arrol.enabled=true"}


def summary_line(label: str, vote: dict) -> str:
    if "weighted" not in vote:
        return f"{label}: ARRoL vote: {vote['note']}"
    return (f"{label}: ARRoL head-weighted vote {vote['weighted']:.3f} vs majority {vote['majority']:.3f} "
            f"(head read at {vote['prune_at']} response tokens)")
