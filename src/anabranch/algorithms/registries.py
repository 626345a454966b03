"""The algorithm registries and their fixed signatures.

- ``ADVANTAGES[name](rewards[B], group_index[B], response_mask[B,T], cfg, **extra) -> advantages[B,T]``
- ``OBJECTIVES[name](log_prob[B,T], old_log_prob[B,T], advantages[B,T], response_mask[B,T], ctx)
  -> (loss, metrics)``; registered with ``needs=(...)`` naming the extra inputs it reads from
  ``ctx`` (``ref_log_prob``, ``old_log_prob``, ``entropy``, ``hidden``), so the trainer computes
  only those.
  ``ref_entropy``: the reference model's token entropies from the rollout pass, stored as
  ``precomputed["ref_entropy"]`` (ReasonMaxxer's gate).
  ``precompute=fn(cfg, precomputed, response_mask[B,T], rewards[B], group_index[B], dist=None) -> dict``
  (optional): called once per update before the micro-batches, on every rank, with the mask of the tokens the
  update trains and ``policy_update``'s ``dist`` (None in one process; a hook may reduce over the ranks); the
  per-row tensors it returns reach the objective as ``ctx.extras``, sliced per micro-batch (batch-wide
  quantities, e.g. ReasonMaxxer's gate and labels, that must not depend on the micro-batch split).
  ``ignores_advantages=True``: the objective never reads its ``advantages`` argument (its labels come from
  the rewards: ReasonMaxxer, PACS), so options that only change the advantages (SPAE, TRLOO) are refused.
  Registered with ``group=True`` when it compares the samples of a prompt (needs rollout.n >= 2),
  ``needs=(...)``, ``modules={...}`` (extra heads) and ``aux_loss=fn`` (e.g. a critic loss).
- ``RECIPES[name] -> dict`` of :class:`~anabranch.config.AlgorithmConfig` defaults
  (``algorithm.name=dapo`` fills ``advantage``, ``loss``, clip ranges, ...).
"""

from anabranch.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")
OBJECTIVES: Registry = Registry("objective")
RECIPES: Registry = Registry("algorithm recipe")
