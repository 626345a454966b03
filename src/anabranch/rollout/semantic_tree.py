"""ROSE's tree rollouts: semantic-divergence branching with ε root restarts (``rollout.semantic_tree.enabled``).

Zhao, Ren, Zou, Yang, Xu, Ge, Chen, Ma, Shi, Wang, Yin, Xin 2026, "Reinforced Efficient Reasoning via
Semantically Diverse Exploration" (ROSE; arXiv 2601.05053, ACL 2026); the advantage over these trees is
:mod:`anabranch.algorithms.rose`. A training step's rollout of each prompt q grows one tree of n leaves:

1. leaf 0 ~ π(· | q) (the backend's ``generate``);
2. each leaf's every response position t gets a branch score S_t (below), from one no-grad forward of the
   policy over q ⊕ leaf (a leaf's copied prefix scores as its parent's: same context, same weights);
3. n − 1 times: with probability ε = ``epsilon`` a new leaf starts from the root (q alone); otherwise the
   (leaf, t) of highest S_t over all the prompt's leaves so far (ties: the earlier leaf, then the earlier t)
   is the branch point, and the new leaf is that leaf's first t tokens ⊕ a fresh continuation
   (``backend.continue_ids``; the token at t is re-sampled), budget ``max_new_tokens − t``;
4. the rows: n per prompt, each leaf's whole root-to-leaf path as its response (every token trained, the
   shared prefix in every row that holds it, as in the authors' code), and ``Rollout.semantic_tree`` [B, 3]
   = (leaf slot, parent slot or −1, branch position) per row, from which the ROSE advantage finds the
   segments (spans between the branch nodes a path passes through; :func:`anabranch.algorithms.rose.Tree.cuts`).

Branch score (``score=cosine_entropy``, the authors' ``cosine-entropy`` branch metric): with p the policy's
next-token distribution at t (at ``rollout.temperature``), H_t = −Σ_v p_v log p_v, the k = ``top_k`` most
likely tokens v_1..v_k with probabilities p_i and unit input-embedding vectors e_i (the policy's own
embedding matrix),

    F_t = Σ_{i≠j} p_i p_j cos(e_i, e_j) = ‖Σ_i p_i e_i‖² − Σ_i p_i²,        S_t = −F_t · H_t

so a position scores high when the model is uncertain (H) *and* its likely tokens point in semantically
different (dissimilar, even opposite) directions; uncertainty among near-synonyms (high cos) scores low. The
candidates' meanings are compared through token embeddings, not by clustering sampled continuations: the
"semantic clusters" are soft, weighted by cos. ``score=entropy``: S_t = H_t, the generation-entropy branching
the paper improves on (an ablation).

Confirmed from the authors' released code (github.com/ZiqiZhao1/ROSE-rl, ``vllm_rollout_spmd``
``generate_sequences_loop_entropy``, as we read it): the iterative scheme above (one root sample, then one new
leaf per prompt per iteration, n iterations in all); ε per prompt per iteration, a restart starting from the
root; the argmax over every position of every existing leaf; the prefix excluding the branch token; F_t and
S_t = −F_t·H_t with top-k 20 candidates and the model's vocabulary embeddings; ε = 0.5 in their example
script. The paper's method text was not available beyond its abstract (a semantic-entropy-based branching
that "operates on already sampled reasoning rollouts to capture semantic uncertainty and select branching
points with high semantic divergence", and ε-exploration that "stochastically initiates reasoning rollouts from
the root"). Differs: their H_t is over the sampler's top-20 log-probs (vLLM returns no more), here over the
full vocabulary; the probabilities are π at ``rollout.temperature`` (theirs: as vLLM reports them).

Metrics: ``tree/restart_frac`` (root restarts among the n − 1 new leaves), ``tree/branch_depth_frac`` (branch
position over the parent's length), ``tree/branch_score`` (S_t at the chosen points), ``tree/leaves`` (n).
"""

from __future__ import annotations

import torch

from anabranch.config import ConfigError
from anabranch.rollout.base import Rollout, cut_at_eos, field_of_all, leaves_rollout, pad_id

SCORES = ("cosine_entropy", "entropy")


def branch_scores(logits: torch.Tensor, embeddings: torch.Tensor, top_k: int, score: str = "cosine_entropy",
                  temperature: float = 1.0) -> torch.Tensor:
    """[T] S_t from next-token ``logits`` [T, V] and the vocabulary's ``embeddings`` [V, H] (see the module)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return entropy if score == "entropy" else cosine_entropy(logp, entropy, embeddings, top_k)


def cosine_entropy(logp: torch.Tensor, entropy: torch.Tensor, embeddings: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T] S_t = −F_t·H_t from the next-token log-probs ``logp`` [T, V] and their entropies H_t (see the module)."""
    p = logp.exp()
    k = min(top_k, logp.shape[-1])
    probs, ids = p.topk(k, dim=-1)                                            # [T, k]
    e = torch.nn.functional.normalize(embeddings.float()[ids], dim=-1)        # [T, k, H]
    mean_dir = (probs.unsqueeze(-1) * e).sum(1)                               # Σ p_i e_i
    similarity = (mean_dir * mean_dir).sum(-1) - (probs * probs).sum(-1)      # F_t = Σ_{i≠j} p_i p_j cos_ij
    return -similarity * entropy


@torch.no_grad()
def leaves_scores(model, prompts: list[list[int]], leaves: list[list[int]], top_k: int, score: str,
                  temperature: float, pad: int = 0, batch: int = 8) -> list[torch.Tensor]:
    """[len(leaf)] S_t of each leaf's positions (leaf i after ``prompts[i]``): no-grad forwards of q ⊕ leaf in eval
    mode, ``batch`` leaves at a time, that project only the leaves' positions to the vocabulary (not the prompts';
    models/chunked_logprobs.suffix_entropies: S_t = H_t, or the cosine term on the same log-probs)."""
    from anabranch.models.chunked_logprobs import suffix_entropies

    emb = model.get_input_embeddings().weight
    extra = None if score == "entropy" else lambda logp, h: cosine_entropy(logp, h, emb, top_k)
    return suffix_entropies(model, prompts, leaves, temperature, pad, batch, extra)


def leaf_scores(model, prompt: list[int], leaf: list[int], top_k: int, score: str, temperature: float) -> torch.Tensor:
    """[len(leaf)] S_t of one leaf's positions (:func:`leaves_scores`)."""
    return leaves_scores(model, [prompt], [leaf], top_k, score, temperature)[0]


def choose(scores: list[torch.Tensor], epsilon: float, generator: torch.Generator | None = None) -> tuple[int, int]:
    """(parent slot, branch position) of the next leaf: (−1, 0) for a root restart (probability ε, or no
    position to branch at), else the argmax of S over every leaf's positions (ties: the first)."""
    restart = epsilon > 0 and float(torch.rand(1, generator=generator)) < epsilon
    if restart or not any(s.numel() for s in scores):
        return -1, 0
    flat = torch.cat([s.float() for s in scores])
    best = int(torch.argmax(flat))  # the first maximum: the earlier leaf, then the earlier position
    for slot, s in enumerate(scores):
        if best < s.numel():
            return slot, best
        best -= s.numel()
    raise AssertionError("unreachable")


def build_trees(backend, model, tokenizer, prompts: list[str], n: int, max_new_tokens: int, epsilon: float,
                top_k: int, score: str, temperature: float, generator: torch.Generator | None = None) -> Rollout:
    """n leaves per prompt grown as the module says; returns them as one rollout (n adjacent rows a prompt)."""
    first = backend.generate(prompts, 1)
    eos = set(backend.eos_ids)
    tops = [first.prompt_tokens(g) for g in range(len(prompts))]
    leaves = [[first.response_tokens(g)] for g in range(len(prompts))]
    ended = [[not bool(first.truncated[g])] for g in range(len(prompts))]
    meta = [[(-1, 0)] for _ in prompts]
    pad = pad_id(tokenizer, 0)
    scores = [[s] for s in leaves_scores(model, tops, [leaves[g][0] for g in range(len(prompts))], top_k, score,
                                         temperature, pad)]
    restarts, depth_fracs, chosen = 0, [], []
    for _ in range(n - 1):
        picks = [choose(scores[g], epsilon, generator) for g in range(len(prompts))]
        seqs, budgets = [], []
        for g, (parent, k) in enumerate(picks):
            prefix = leaves[g][parent][:k] if parent >= 0 else []
            seqs.append(tops[g] + prefix)
            budgets.append(max_new_tokens - k)
            if parent < 0:
                restarts += 1
            else:
                depth_fracs.append(k / max(len(leaves[g][parent]), 1))
                chosen.append(float(scores[g][parent][k]))
        outs = backend.continue_ids(seqs, budgets)
        for g, ((parent, k), (cont, _)) in enumerate(zip(picks, outs)):
            kept, done = cut_at_eos(list(cont), eos)
            prefix = leaves[g][parent][:k] if parent >= 0 else []
            leaves[g].append(prefix + kept)
            ended[g].append(done)
            meta[g].append((parent, k))
        # The copied prefix scores as in the parent (same context, same weights): only the rest is new, but one
        # forward over the whole path is what gives the new positions their context anyway. One batched pass.
        new_scores = leaves_scores(model, tops, [leaves[g][-1] for g in range(len(prompts))], top_k, score,
                                   temperature, pad)
        for g, s in enumerate(new_scores):
            scores[g].append(s)
    out = _as_rollout(first, leaves, ended, meta, tokenizer)
    new = max(len(prompts) * (n - 1), 1)
    out.metrics.update({
        "tree/restart_frac": restarts / new,
        "tree/branch_depth_frac": sum(depth_fracs) / len(depth_fracs) if depth_fracs else 0.0,
        "tree/branch_score": sum(chosen) / len(chosen) if chosen else 0.0,
        "tree/leaves": float(n),
    })
    return out


def _as_rollout(first: Rollout, leaves, ended, meta, tokenizer) -> Rollout:
    """The leaves in the backends' layout: prompt g's n rows adjacent, responses right-padded."""
    rows = [(g, s) for g in range(len(leaves)) for s in range(len(leaves[g]))]
    src = torch.tensor([g for g, _ in rows], dtype=torch.long)
    tree = torch.tensor([[s, meta[g][s][0], meta[g][s][1]] for g, s in rows], dtype=torch.long)
    return leaves_rollout(tokenizer, first.prompt_ids[src], first.prompt_mask[src], first.group_index[src],
                          [leaves[g][s] for g, s in rows], [ended[g][s] for g, s in rows], first.prompts,
                          semantic_tree=tree, metrics=dict(first.metrics))


def tree_round(c, prompts: list[str], cfg) -> Rollout:
    """The hook trainer/collect.generate_scored calls for a training round with ``rollout.semantic_tree.enabled``."""
    r, t = cfg.rollout, cfg.rollout.semantic_tree
    return build_trees(c.backend, c.model, c.tokenizer, prompts, r.n, r.max_new_tokens, t.epsilon, t.top_k,
                       t.score, r.temperature)


def concat_trees(rollouts: list[Rollout]) -> torch.Tensor | None:
    """The rounds' ``semantic_tree`` rows stacked (collect.concat_batches); None when no round has them. A mix
    is an error: the advantage would find rows without their tree."""
    trees = field_of_all([r.semantic_tree for r in rollouts],
                         "some rounds are tree rollouts (Rollout.semantic_tree) and others not")
    return None if trees is None else torch.cat(trees)


def check_config(cfg) -> None:
    """Key ranges and refused combinations of ``rollout.semantic_tree`` (config_checks, when enabled); the
    restrictions it shares with the other round builders come from trainer/round_builders.py."""
    t, r = cfg.rollout.semantic_tree, cfg.rollout
    if not t.enabled:
        return
    from anabranch.range_checks import first_failed_key
    from anabranch.trainer.method_sets import refuse_row_generators
    from anabranch.trainer.round_builders import branching_rollout_refusals

    checks = [
        (0.0 <= t.epsilon <= 1.0, "rollout.semantic_tree.epsilon", "must be in [0, 1] (the root-restart probability)"),
        (t.top_k >= 2, "rollout.semantic_tree.top_k", "must be >= 2 (candidate tokens compared by meaning)"),
        (t.score in SCORES, "rollout.semantic_tree.score", "must be cosine_entropy or entropy"),
        (r.n >= 2, "rollout.n", "must be >= 2 with rollout.semantic_tree.enabled (a tree of one leaf has no branch)"),
    ]
    error = first_failed_key(checks, cfg) or branching_rollout_refusals(
        cfg, "rollout.semantic_tree.enabled",
        "but a branched leaf keeps a prefix chosen from another leaf, so the leaves are not such draws",
        why={"backend": "the branch scores come from the training model's forward and the tree is implemented and "
             "tested with the hf sampler only",
             "retry_turns": "a retry episode is not a single response to branch",
             "temperature_schedule": "EAD's per-position temperatures on branched leaves are not tested"})
    if error is not None:
        raise ConfigError(error)
    # Agent-RLVR is not refused: its guided retries feed its own DPO term, the RL batch stays the tree's leaves.
    # SvS is, although its solve rounds pass n= and so never reach the builder: its rows join the step's batch
    # without Rollout.semantic_tree, and concat_trees refuses a batch that mixes tree and plain rounds (ARRoL refuses
    # SvS as well, for its own reason).
    refuse_row_generators(cfg, "rollout.semantic_tree.enabled", "the tree", allow=("algorithm.agent_rlvr.enabled",))
