"""Option groups of the rollout methods, nested in ``rollout``: ARRoL's online pruning (``rollout.arrol.*``), ARPO's
entropy-based branching of tool rollouts with AEPO's budget (``rollout.arpo.*``), ROSE's semantic tree
(``rollout.semantic_tree.*``) and DeepSearch's MCTS (``rollout.mcts.*``): their keys, defaults and why.

Split out of config.py to keep that file small; config.py imports them, so ``from anabranch.config import
ARPOConfig`` and the YAML/override loader see them as before. Imports nothing from the other config modules, so no
import cycle (``Optional`` is imported here because the loader resolves the string annotations in this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ARRoLConfig:
    """ARRoL's online rollout pruning (``rollout.arrol``; Xu et al. 2026, "Prune as You Generate", arXiv 2603.24840;
    trainer/arrol_rollouts.py, algorithms/arrol.py): n' = round(n·(1 + oversample)) samples per prompt generate
    prune_at tokens, a quality head on the policy's hidden state predicts each prefix's success, and the n kept
    are the ⌊ρn + ½⌋ most and the rest least likely correct; the survivors finish. Defaults assumed (see there)."""

    enabled: bool = False
    prune_at: int = 0           # the pruning point in response tokens (0: rollout.max_new_tokens // 4)
    oversample: float = 1.0     # phase 1 samples n·(1 + oversample) per prompt (1.0: 2n)
    target_ratio: float = 0.5   # ρ: the survivors' target fraction of correct ones (the paper's "usually 0.5")
    layer: int = -1             # the head reads hidden_states[layer] (0: embeddings, −1: the last layer)
    head_hidden: int = 0        # 0: a linear head; else one ReLU hidden layer of this width
    head_lr: float = 1e-3       # the head's own Adam
    head_updates: int = 1       # Adam steps on each round's survivors
    warmup_steps: int = 5       # head updates (on plain, unpruned rounds) before pruning starts
    # The probe (trainer/arrol_probe.py): this fraction of each group's pruned prefixes, drawn uniformly (seeded),
    # also finish, for the head's BCE only (importance-weighted by 1/P(finished)); never trained or rewarded. 0: off.
    head_probe: float = 0.0


@dataclass
class ARPOConfig:
    """ARPO's entropy-based adaptive branching of tool rollouts (``rollout.arpo``; Dong et al. 2025, "Agentic
    Reinforced Policy Optimization", arXiv 2507.19849; rollout/arpo_branching.py, algorithms/arpo.py): M global
    samples per prompt; after a tool result, when the policy's entropy over the next k tokens rose from the first
    turn's, the row branches Z re-samples of its continuation, up to rollout.n rows per prompt. Defaults: the
    authors' released training script (16 rows, 8 initial, beam 2, branch probability 0.5, entropy weight 0.2)."""

    enabled: bool = False
    initial_samples: int = 0    # M global samples per prompt (0: rollout.n // 2, the authors' 8 of 16)
    branch_factor: int = 1      # Z re-samples per branching (the authors' beam_size 2: one copy beside the row)
    entropy_tokens: int = 20    # k: the window of tokens after a tool result whose entropy is measured
    alpha: float = 0.5          # α: the base branch probability
    beta: float = 0.2           # β: the weight of the entropy rise ΔH
    # τ: branch when α + β·ΔH > τ (the paper's rule); None: with probability clip(α + β·ΔH, 0, 1) (the code's).
    threshold: Optional[float] = None
    attribution: str = "soft"   # "soft": GRPO over the n rows (the authors' default); "hard": shared-prefix mean
    # AEPO's dynamic entropy-balanced rollout (Dong et al. 2025, arXiv 2510.14545; rollout/aepo_rollout.py).
    # "fixed": M = initial_samples; "aepo": M per prompt = min(n, ⌊n·σ(budget_beta·(H_root − H̄_tool))⌋ + 1),
    # from one pre-rollout per prompt.
    budget_mode: str = "fixed"
    budget_beta: float = 0.5    # β of the budget split (the authors' code: 0.5)
    # λ: a row that branched at its last l tool steps has its draw scaled by 1 − λ·l (0: off; the authors' 0.05)
    branch_penalty: float = 0.0


@dataclass
class SemanticTreeConfig:
    """ROSE's tree rollouts (``rollout.semantic_tree``; Zhao et al. 2026, arXiv 2601.05053; rollout/semantic_tree.py,
    advantage in algorithms/rose.py): one root sample per prompt, then n − 1 leaves each branched at the position of
    highest S_t = −(Σ_{i≠j} p_i p_j cos(e_i, e_j))·H_t over the prompt's leaves, or restarted at the root with
    probability epsilon. Defaults: the authors' released code (ε 0.5 in their script, top-k 20, cosine-entropy)."""

    enabled: bool = False
    epsilon: float = 0.5            # ε: probability that a new leaf starts from the root instead of branching
    top_k: int = 20                 # candidate next tokens compared by their embeddings' cosine
    score: str = "cosine_entropy"   # "cosine_entropy" (ROSE's S_t) or "entropy" (H_t alone, the ablation)


@dataclass
class MCTSConfig:
    """DeepSearch's Monte Carlo tree search in training rounds (``rollout.mcts``; Wu et al. 2025, arXiv 2509.25454;
    rollout/mcts_search.py, advantage and solution cache in algorithms/deepsearch.py): steps of
    max_new_tokens/max_depth tokens, width children per expansion, UCT inside a subtree, the global frontier
    λ1·tanh(Q(parent)) + λ2·H + λ3·sqrt(depth/max_depth) after a terminal, n kept leaves per prompt. Defaults: the
    authors' released code (c 2, γ_min 0.1, λ 0.4/off/0.01, width n), max_depth sized for the CPU recipe."""

    enabled: bool = False
    max_depth: int = 4              # steps per path: a step is rollout.max_new_tokens / max_depth tokens
    width: int = 0                  # children per expansion (0: rollout.n, the authors' default)
    puct_c: float = 2.0             # c of the UCT child choice
    gamma_min: float = 0.1          # γ_min of the backup weight max((d+1)/(L+1), γ_min)
    parent_q_weight: float = 0.4    # λ1: the frontier's tanh(Q(parent)) term
    entropy_weight: float = 0.0     # λ2: the frontier's step-entropy term (the authors' default: off)
    depth_weight: float = 0.01      # λ3: the frontier's sqrt(depth/max_depth) term
    q_temperature: float = 1.0      # τ of the rows' tanh(W/τ) node values (0: raw W)
    cache: bool = True              # solved problems skip later searches and reuse their cached solutions
    cache_max_accuracy: float = 0.25  # δ: cache a problem when 0 < its share of correct kept leaves <= δ (authors')


@dataclass
class SelfSearchConfig:
    """SSRL's self-search rollouts (``rollout.self_search``; Fan et al. 2025, "SSRL: Self-Search Reinforcement Learning",
    arXiv 2508.10874; rollout/self_search.py): one single-turn response in the Search-R1 format whose
    ``<information>`` blocks the policy writes itself; with mask_information those blocks' tokens leave the loss (the
    authors' example script: enable_information_loss_mask=True). sim2real: evaluation (the trainer's held-out eval and
    ``anabranch eval``) stops at each ``</search>`` and inserts the BM25 passages of rollout.search_corpus as the
    ``<information>`` block instead; training rollouts stay self-search."""

    enabled: bool = False
    mask_information: bool = True   # loss_mask 0 on the <information>...</information> spans (tags included)
    sim2real: bool = False          # evaluation with the real search tool (rollout.search_corpus, search_top_k)


@dataclass
class ContextCompressionConfig:
    """WebAgent-R1's dynamic context compression (``rollout.context_compression``; Wei et al. 2025, "WebAgent-R1:
    Training Web Agents via End-to-End Multi-Turn Reinforcement Learning", arXiv 2505.16421;
    rollout/context_compression.py, trainer/turn_rows.py): in an environment episode (``rollout.environment``) every
    observation but the last ``keep_last`` is replaced by ``placeholder`` as a new one arrives (the actions are kept),
    so the context stays bounded; each turn then trains as its own row under the context it was sampled from
    (M-GRPO's per-trajectory, per-turn, per-token mean)."""

    enabled: bool = False
    keep_last: int = 1   # observations kept in full (the authors' code keeps only the current page)
    # The text an older observation becomes, rendered as the same user turn (the authors': "** Simplified html **")
    placeholder: str = "(earlier observation omitted)"
