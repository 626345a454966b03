"""Per-sequence statistics of the policy's token distributions, for intrinsic rewards.

Rewards registered with ``needs_token_stats=True`` receive, as row fields aligned with the
completions, the mean over each completion's response tokens of

* ``self_certainty``: KL(U ‖ p_t) = −log V − (1/V) Σ_j log p_t(j)  (Kang et al. 2025, "Scalable
  Best-of-N Selection for Large Language Models via Self-Certainty"; used as a reward by Zhao et
  al. 2025, "Learning to Reason without External Rewards" — Intuitor);
* ``token_entropy``: H(p_t) = −Σ_j p_t(j) log p_t(j);
* ``mean_log_prob``: log p_t(y_t) of the sampled token,

where p_t is the policy's next-token distribution (temperature 1, the model's own distribution)
at response position t and V the vocabulary size. The trainer computes them with one no-grad
forward pass over the rollout, only when some reward asks for them (``trainer_fields``).
"""

from __future__ import annotations

import math

import torch

from anabranch.models.logprobs import position_ids_from_mask

TOKEN_STAT_FIELDS = ("self_certainty", "token_entropy", "mean_log_prob")


@torch.no_grad()
def sequence_token_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                         micro_batch_size: int = 8, chunk_rows: int = 4) -> dict[str, list[float]]:
    width = response_mask.shape[1]
    device = next(model.parameters()).device
    out: dict[str, list[float]] = {k: [] for k in TOKEN_STAT_FIELDS}
    for s in range(0, input_ids.shape[0], micro_batch_size):
        ids, mask = input_ids[s:s + micro_batch_size].to(device), attention_mask[s:s + micro_batch_size].to(device)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                       logits_to_keep=width + 1, use_cache=False).logits[:, :-1, :]
        targets = ids[:, -width:]
        rmask = response_mask[s:s + micro_batch_size].to(device).float()
        for c in range(0, logits.shape[0], chunk_rows):
            z = logits[c:c + chunk_rows].float()
            m = rmask[c:c + chunk_rows]
            lse = torch.logsumexp(z, dim=-1)
            logp = z - lse[..., None]
            vocab = z.shape[-1]
            sc = -math.log(vocab) - logp.mean(-1)
            ent = -(logp.exp() * logp).sum(-1)
            tok = logp.gather(-1, targets[c:c + chunk_rows, :, None]).squeeze(-1)
            denom = m.sum(-1).clamp(min=1.0)
            for key, val in (("self_certainty", sc), ("token_entropy", ent), ("mean_log_prob", tok)):
                out[key].extend(((val * m).sum(-1) / denom).tolist())
    return out


def trainer_fields(sources, model, rollout, micro_batch_size: int) -> dict[str, list]:
    """Fields the trainer adds for reward functions: token counts, and token statistics on demand."""
    fields: dict[str, list] = {"response_length": rollout.response_lengths.tolist()}
    if any(src.meta.get("needs_token_stats") for src in sources):
        was_training = model.training
        model.eval()
        try:
            fields.update(sequence_token_stats(model, rollout.input_ids, rollout.attention_mask,
                                               rollout.response_mask, micro_batch_size))
        finally:
            model.train(was_training)
    return fields
