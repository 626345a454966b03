"""Sparse selection: where, along the trained model's own completions, its most likely next token
differs from the base model's, and how the base model ranks the trained model's choice there.

After Akgül, Kannan, Neiswanger & Prasanna 2026, "Rethinking RL for LLM Reasoning: It's Sparse
Policy Selection, Not Capability Learning" (arXiv 2605.06241), who report that RL changes the
top token at only 1–3% of positions, that the promoted token always lies in the base model's
top-5, and that the changed positions sit where the base model's entropy is high.

For a trained completion y (prompt x) and each response position t, with the context
c_t = (x, y_<t) fed to both models (teacher forcing) and π_T, π_B the trained and base
next-token distributions at temperature 1:

- a_T = argmax_v π_T(v | c_t),  a_B = argmax_v π_B(v | c_t);  the position is *changed* when a_T ≠ a_B.
- changed_fraction = #changed / #positions.
- rank_B(a_T) = 1 + #{v : π_B(v | c_t) > π_B(a_T | c_t)}  (1 = the base's own top token; a tie
  counts in a_T's favour). ``changed_in_base_top_k[k]`` = fraction of changed positions with
  rank_B(a_T) ≤ k, for k in 1..5 and 10; ``changed_beyond_base_top_10`` = the rest.
- KL(π_T ‖ π_B) = Σ_v π_T(v) (ln π_T(v) − ln π_B(v)), averaged over all positions (nats).
- H_B = −Σ_v π_B(v) ln π_B(v), averaged over all positions and over the changed ones (the paper's
  changed positions sit at several times the average base entropy).

Assumptions (the excerpts of the paper available to us do not say): the completions are the
eval's sampled ones (at ``--temperature`` / ``--top-p``), not greedy ones; ``positions`` are the
tokens the trained model sampled (tool outputs inserted by multi-turn rollouts are context, not
counted); the distributions compared are the raw temperature-1 ones (argmax and ranks do not
depend on the temperature; the KL and entropies do). A base top-token tie with a_T gives rank 1.

Cost: at most ``max_tokens`` response positions per trained model (``--sparse-tokens``), spread
over the problems (first sample of every problem, then the second, ...); two forward passes over
those sequences, no gradient. Only the response positions are projected to the vocabulary, and
at most ``rows`` positions of float logits exist at once.
"""

from __future__ import annotations

import dataclasses

import torch

from anabranch.models.chunked_logprobs import backbone_hidden, supports_chunked_head
from anabranch.models.logprobs import position_ids_from_mask

TOP_KS = (1, 2, 3, 4, 5, 10)


@dataclasses.dataclass
class Sequence:
    """One trained completion, unpadded, on the CPU."""
    problem: int
    sample: int
    prompt: torch.Tensor     # [P] prompt ids (no padding)
    response: torch.Tensor   # [R] response ids
    attend: torch.Tensor     # [R] attention mask of the response (1 up to and including EOS)
    counted: torch.Tensor    # [R] 1 where the trained model sampled the token


def sequences_of(ro, first_problem: int) -> list[Sequence]:
    """The rows of a Rollout (``ro.group_index`` numbered from ``first_problem``) as Sequences."""
    out, seen = [], {}
    counted = ro.trained_mask
    for b, g in enumerate(ro.group_index.tolist()):
        j = seen.get(g, 0)
        seen[g] = j + 1
        keep = ro.prompt_mask[b].bool()
        out.append(Sequence(first_problem + g, j, ro.prompt_ids[b][keep].cpu(), ro.response_ids[b].cpu(),
                            ro.response_mask[b].long().cpu(), counted[b].long().cpu()))
    return out


def pick(sequences: list[Sequence], max_tokens: int) -> tuple[list[Sequence], bool]:
    """Sequences holding at most ``max_tokens`` counted positions, taken round-robin over problems
    (so a cap spreads over the problems instead of using up the first ones); the last one is cut
    short at the cap (positions before t do not depend on what follows). Returns (kept, capped)."""
    kept, total = [], 0
    for s in sorted(sequences, key=lambda s: (s.sample, s.problem)):
        n = int(s.counted.sum())
        if n == 0:
            continue
        if total + n > max_tokens:
            room = max_tokens - total
            if room > 0:  # keep the positions up to the room-th counted one
                end = int(torch.nonzero(s.counted.cumsum(0) == room)[0]) + 1
                kept.append(dataclasses.replace(s, response=s.response[:end], attend=s.attend[:end],
                                                counted=s.counted[:end]))
            return kept, True
        kept.append(s)
        total += n
    return kept, False


def position_stats(trained_logits: torch.Tensor, base_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position ([N, V] logits of each model at the same N positions): ``changed`` (a_T ≠ a_B),
    ``rank`` (rank_B(a_T), 1-based), ``kl`` (KL(π_T ‖ π_B)) and ``base_entropy`` (H_B)."""
    t, b = trained_logits.float(), base_logits.float()
    a_t, a_b = t.argmax(-1), b.argmax(-1)
    rank = (b > b.gather(-1, a_t[:, None])).sum(-1) + 1
    lt, lb = t.log_softmax(-1), b.log_softmax(-1)
    pt, pb = lt.exp(), lb.exp()
    # 0·ln 0 = 0: a masked (−inf) logit would otherwise give NaN; p_T > 0 with p_B = 0 stays +inf.
    kl = torch.where(pt > 0, pt * (lt - lb), torch.zeros_like(pt)).sum(-1)
    ent = -torch.where(pb > 0, pb * lb, torch.zeros_like(pb)).sum(-1)
    return {"changed": a_t != a_b, "rank": rank, "kl": kl, "base_entropy": ent}


def summarize(stats: dict[str, torch.Tensor], sequences: int) -> dict:
    """The JSON entry from the concatenated per-position statistics."""
    changed, rank = stats["changed"].bool(), stats["rank"]
    n, c = int(changed.numel()), int(changed.sum())
    r = rank[changed]
    ent = stats["base_entropy"]
    return {
        "sequences": sequences,
        "positions": n,
        "changed_positions": c,
        "changed_fraction": c / n if n else None,
        "changed_in_base_top_k": {str(k): (int((r <= k).sum()) / c if c else None) for k in TOP_KS},
        "changed_beyond_base_top_10": int((r > 10).sum()) / c if c else None,
        "changed_base_rank_median": float(r.float().median()) if c else None,
        "kl_trained_base_mean": float(stats["kl"].mean()) if n else None,
        "base_entropy_mean": float(ent.mean()) if n else None,
        "base_entropy_changed_mean": float(ent[changed].mean()) if c else None,
    }


def pad_batch(seqs: list[Sequence], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """[prompts left-padded | responses right-padded]: ids, attention mask, counted mask [B, R], R."""
    p = max(len(s.prompt) for s in seqs)
    r = max(len(s.response) for s in seqs)
    ids = torch.zeros((len(seqs), p + r), dtype=torch.long)
    mask = torch.zeros_like(ids)
    counted = torch.zeros((len(seqs), r), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, p - len(s.prompt):p] = s.prompt
        mask[i, p - len(s.prompt):p] = 1
        ids[i, p:p + len(s.response)] = s.response
        mask[i, p:p + len(s.response)] = s.attend
        counted[i, :len(s.response)] = s.counted.bool()
    return ids.to(device), mask.to(device), counted.to(device), r


def _position_logits(model, ids, mask, r, counted):
    """A function ``rows(slice) -> [n, V] logits`` at the counted response positions. With a plain
    linear head only the backbone runs over the batch and the head projects one slice at a time."""
    pos = position_ids_from_mask(mask)
    if supports_chunked_head(model):
        h = backbone_hidden(model, ids, mask, pos)[:, -r - 1:-1][counted]  # position t-1 predicts token t
        head = model.get_output_embeddings()
        return lambda sl: head(h[sl])
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=r + 1,
                   use_cache=False).logits[:, :-1][counted]
    return lambda sl: logits[sl]


@torch.no_grad()
def measure(trained, base, sequences: list[Sequence], chunk: int = 4, rows: int = 128) -> dict[str, torch.Tensor]:
    """Concatenated :func:`position_stats` of every counted position of ``sequences``, ``chunk``
    sequences per forward pass and ``rows`` positions per vocabulary projection."""
    device = next(trained.parameters()).device
    parts: list[dict] = []
    for start in range(0, len(sequences), chunk):
        ids, mask, counted, r = pad_batch(sequences[start:start + chunk], device)
        t_rows = _position_logits(trained, ids, mask, r, counted)
        b_rows = _position_logits(base, ids, mask, r, counted)
        n = int(counted.sum())
        for i in range(0, n, rows):
            sl = slice(i, min(i + rows, n))
            parts.append({k: v.cpu() for k, v in position_stats(t_rows(sl), b_rows(sl)).items()})
    if not parts:
        return {"changed": torch.zeros(0, dtype=torch.bool), "rank": torch.zeros(0, dtype=torch.long),
                "kl": torch.zeros(0), "base_entropy": torch.zeros(0)}
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def against_base(base_label: str, base, trained, sequences: list[Sequence], max_tokens: int) -> dict:
    """The JSON entry comparing the (loaded) ``trained`` and ``base`` models on the trained model's
    completions, at most ``max_tokens`` positions. Loading the base beside it and checking that the
    two can be compared is :func:`anabranch.eval.beside_base.load_comparable_base`'s job."""
    kept, capped = pick(sequences, max_tokens)
    return {"base": base_label, "max_tokens": max_tokens, "capped": capped,
            **summarize(measure(trained, base, kept), len(kept))}


def summary_line(label: str, sel: dict) -> str:
    if "error" in sel:
        return f"sparse selection of {label} vs {sel['base']}: not measured ({sel['error']})"
    if not sel.get("positions"):
        return f"sparse selection of {label} vs {sel['base']}: no response positions to compare"
    top5 = sel["changed_in_base_top_k"]["5"]
    return (f"sparse selection of {label} vs {sel['base']}: top token changed at {sel['changed_fraction']:.2%} of "
            f"{sel['positions']} positions; " + (f"{top5:.1%} of those in the base's top-5" if top5 is not None
                                                 else "none changed") + f", KL {sel['kl_trained_base_mean']:.4f} nats")
