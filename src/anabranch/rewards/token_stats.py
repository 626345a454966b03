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


# Float logits of one chunk of response tokens at most this large: the whole micro-batch's logits
# would be rows × R × V (16 × 512 × 151,936 × 4 B = 5 GB for Qwen2.5 with 512-token completions).
STATS_CHUNK_BYTES = 256 * 2**20


def _stats_of_logits(z: torch.Tensor, targets: torch.Tensor, m: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token statistics × mask, summed over the tokens of each row, for float logits ``z`` [b, R, V]."""
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    sc = -math.log(z.shape[-1]) - logp.mean(-1)
    ent = -(logp.exp() * logp).sum(-1)
    tok = logp.gather(-1, targets[..., None]).squeeze(-1)
    return {"self_certainty": (sc * m).sum(-1), "token_entropy": (ent * m).sum(-1), "mean_log_prob": (tok * m).sum(-1)}


@torch.no_grad()
def sequence_token_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                         micro_batch_size: int = 8, chunk_rows: int = 4) -> dict[str, list[float]]:
    """Where the LM head is a plain linear map (models/chunked_logprobs.py), the backbone runs on
    ``micro_batch_size`` rows and only the response positions are projected to the vocabulary, as
    many rows at a time as fit :data:`STATS_CHUNK_BYTES`; otherwise the model's own logits are taken,
    ``chunk_rows`` rows at a time in float."""
    from anabranch.models.chunked_logprobs import backbone_hidden, supports_chunked_head

    width = response_mask.shape[1]
    device = next(model.parameters()).device
    head = model.get_output_embeddings() if supports_chunked_head(model) else None
    if head is not None:
        chunk_rows = max(1, STATS_CHUNK_BYTES // (4 * width * head.weight.shape[0]))
    sums: dict[str, list[torch.Tensor]] = {k: [] for k in TOKEN_STAT_FIELDS}
    for s in range(0, input_ids.shape[0], micro_batch_size):
        ids, mask = input_ids[s:s + micro_batch_size].to(device), attention_mask[s:s + micro_batch_size].to(device)
        pos = position_ids_from_mask(mask)
        if head is not None:  # the states that predict the response tokens
            states = backbone_hidden(model, ids, mask, pos)[:, -width - 1:-1]
        else:
            states = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=width + 1,
                           use_cache=False).logits[:, :-1, :]
        targets = ids[:, -width:]
        rmask = response_mask[s:s + micro_batch_size].to(device).float()
        for c in range(0, states.shape[0], chunk_rows):
            x = states[c:c + chunk_rows]
            z = (torch.nn.functional.linear(x, head.weight, head.bias) if head is not None else x).float()
            for key, val in _stats_of_logits(z, targets[c:c + chunk_rows], rmask[c:c + chunk_rows]).items():
                sums[key].append(val)
    denom = response_mask.float().sum(-1).clamp(min=1.0).to(device)
    return {k: (torch.cat(v) / denom).tolist() for k, v in sums.items()}


def trainer_fields(sources, model, rollout, micro_batch_size: int) -> dict[str, list]:
    """Fields the trainer adds for reward functions: token counts, and token statistics on demand."""
    fields: dict[str, list] = {"response_length": rollout.response_lengths.tolist()}
    if any(src.meta.get("needs_token_stats") for src in sources):
        was_training = model.training
        model.eval()
        try:
            fields.update(sequence_token_stats(model, rollout.input_ids, rollout.attention_mask,
                                               rollout.trained_mask, micro_batch_size))
        finally:
            model.train(was_training)
    return fields
