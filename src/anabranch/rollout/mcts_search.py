"""DeepSearch's Monte Carlo tree search inside a training round (``rollout.mcts.enabled``).

Wu, Xuan, Qi, Lu, Tu, Li, Choi 2025, "DeepSearch: Overcome the Bottleneck of Reinforcement Learning with
Verifiable Rewards via Monte Carlo Tree Search" (arXiv 2509.25454). Each prompt's ``rollout.n`` rows are the
root-to-leaf paths of one search tree; the advantage over them, the choice of which terminal to keep and the
solution cache are :mod:`anabranch.algorithms.deepsearch`.

The tree. A node is one *step*: ``step_tokens = rollout.max_new_tokens / rollout.mcts.max_depth`` tokens sampled
by the policy after its parent's path (``backend.continue_ids``), so a step is a fixed-size token chunk, not a
text segment. A node is terminal when its step wrote EOS or it sits at depth ``max_depth``. Each prompt's search
runs iterations, all prompts' in lock-step (one batched ``continue_ids`` per iteration):

1. expansion: the current node (first the root) gets ``width`` children (``rollout.mcts.width``, 0: n) at once;
   a current node already full re-offers its children not yet kept as the candidates instead;
2. evaluation: new terminal candidates are judged (+1 correct, −1 otherwise, by the correctness reward) and
   get the mean per-token entropy of their root-to-leaf path;
3. backup: the non-terminal candidates get a visit; of the terminal ones ONE is kept
   (:func:`anabranch.algorithms.deepsearch.pick_terminal`: a correct one if any, else an incorrect one, the
   lowest path entropy among them), becomes a row, and is backed up along its path (:func:`backup`);
4. selection: if no candidate was terminal, the current node moves to its child of highest UCT
   (:func:`select_child`); if all its children are terminal, or a terminal was kept this iteration, it jumps
   to the best frontier node of the whole tree (:func:`global_select`).

The search stops when n leaves are kept. Backup of a kept leaf ℓ at depth L with outcome v ∈ {+1, −1}, on
every node s on its path (root included) at depth d:

    N(s) += 1;   w = max((d + 1)/(L + 1), γ_min);   W(s) += w·v  when W(s)·v >= 0,
                 W(s) = w·v when W(s) < 0 < v (a correct path resets a negative node),
                 W(s) unchanged when v < 0 < W(s) (a wrong path does not lower a node that leads to a solution)

Q(s) = W(s)/N(s). UCT of a child: Q + c·sqrt(ln N(parent)/N(child)) (0 bonus while either count is 0;
``puct_c``). Frontier priority of a non-root, non-terminal node with fewer than ``width`` children:

    F(s) = λ1·tanh(Q(parent(s))) + λ2·H(s) + λ3·sqrt(depth(s)/max_depth)

with H(s) the mean token entropy of s's step (λ2 = ``entropy_weight``, 0 by default as the authors'
``involve_uncertainty_bonus=False``), first maximum in depth-first order. A row's per-token values: its path's
nodes (root excluded) each put tanh(W(s)/τ) on their step's tokens (``q_temperature`` τ; τ = 0: raw W), the
leaf its own W(ℓ) = v unclipped.

Confirmed from the authors' released code (github.com/smiles724/DeepSearch, ``deepsearch/utils/mcts.py`` and
``rollout/sglang_mcts_wrapper.py``, as we read it): fixed-size token steps response_length/max_depth;
expansion width = n by default (8 = n in their script); terminal at EOS or max depth; ±1 outcomes (their
``incomplete_score`` −1 for a truncated leaf without an answer: the same −1 here); one terminal kept per
iteration, correct first, lowest entropy; the backup rule and its γ = max((d+1)/(L+1), 0.1); the UCT
child choice (deterministic argmax, c = 2) when no terminal was reached; the global frontier choice otherwise
(their default ``backtrace_method=global``, ``force_to_frontier``) with λ1 = 0.4, λ3 = 0.01, sqrt depth bonus,
λ2 off; the search ending at n kept leaves; the rows' step values W (not Q) soft-clipped by tanh except the
leaf's. The paper (abstract and reviews of it) names the same parts: global frontier selection, entropy-based
guidance picking confident paths, Tree-GRPO with node-level q-values and soft clipping.

Differs / assumed: the path entropy is the full-vocabulary entropy of the policy at each path token
(one no-grad forward, ``models/chunked_logprobs.suffix_entropies``), the authors' code uses −mean log-prob of
the sampled tokens (a Monte Carlo estimate of the same). Their search would stop with an assertion when no
frontier node is left; here the root then gets one more child. Their λ4·tanh(Q(s)) term (0 by default) and
the dynamic-width schedule (off by default) are not implemented. A leaf is judged by this library's
correctness reward (≥ full credit), not their ``math_dapo`` scorer.

Metrics: ``mcts/iterations`` (the longest search of the round), ``mcts/nodes`` (per prompt searched),
``mcts/correct_frac`` (kept leaves that are correct), ``mcts/cached_frac`` (prompts answered from the cache),
``mcts/cache_size`` (problems in the cache).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from anabranch.rollout.base import (Rollout, cut_at_eos, field_of_all, leaves_rollout, left_padded, pad_id,
                                     right_padded_values)


class Node:
    """One step of a search tree: its tokens, its place, its backed-up W and visits N."""

    __slots__ = ("parent", "depth", "tokens", "children", "terminal", "ended", "value", "visits", "kept",
                 "outcome", "entropy", "step_entropy")

    def __init__(self, parent: "Node | None" = None, tokens: list[int] | None = None, ended: bool = False):
        self.parent, self.tokens, self.ended = parent, list(tokens or []), ended
        self.depth = 0 if parent is None else parent.depth + 1
        self.children: list[Node] = []
        self.terminal = ended
        self.value, self.visits, self.kept = 0.0, 0, False
        self.outcome: float | None = None       # +1 / −1 once a terminal is judged
        self.entropy: float | None = None       # mean token entropy of the root-to-node path (terminals)
        self.step_entropy: float | None = None  # mean token entropy of this step (the frontier's λ2 term)

    def add(self, tokens: list[int], ended: bool, max_depth: int) -> "Node":
        child = Node(self, tokens, ended)
        child.terminal = ended or child.depth >= max_depth
        self.children.append(child)
        return child

    def q(self) -> float:
        return self.value / self.visits if self.visits else 0.0

    def path_nodes(self) -> list["Node"]:
        """Root excluded, from the root's child down to this node."""
        out, cur = [], self
        while cur.parent is not None:
            out.append(cur)
            cur = cur.parent
        return out[::-1]

    def path(self) -> list[int]:
        return [t for s in self.path_nodes() for t in s.tokens]


def update(node: Node, v: float, leaf_depth: int, gamma_min: float) -> None:
    """One node's share of a backup of outcome ``v`` from a leaf at ``leaf_depth`` (the module's rule)."""
    node.visits += 1
    if v == 0:
        return
    w = max((node.depth + 1) / (leaf_depth + 1), gamma_min)
    if node.value * v >= 0:
        node.value += w * v
    elif v > 0:  # a correct path resets a node a wrong one had pushed below 0
        node.value = w * v
    # else v < 0 < W: kept, a node that leads to a solution is not lowered by a wrong path


def backup(leaf: Node, v: float, gamma_min: float) -> None:
    """:func:`update` on every node from ``leaf`` up to the root."""
    cur = leaf
    while cur is not None:
        update(cur, v, leaf.depth, gamma_min)
        cur = cur.parent


def uct(node: Node, c: float) -> float:
    """Q + c·sqrt(ln N(parent)/N(node)), without the bonus while either count is 0."""
    if node.parent is None:
        return 0.0
    if node.parent.visits == 0 or node.visits == 0:
        return node.q()
    return node.q() + c * math.sqrt(math.log(node.parent.visits) / node.visits)


def select_child(node: Node, c: float) -> Node | None:
    """The non-terminal child of highest UCT (first maximum), None when every child is terminal."""
    best, best_score = None, -math.inf
    for ch in node.children:
        if not ch.terminal and uct(ch, c) > best_score:
            best, best_score = ch, uct(ch, c)
    return best


def frontier_score(node: Node, max_depth: int, l1: float, l2: float, l3: float) -> float:
    """F(s) = λ1·tanh(Q(parent)) + λ2·H(s) + λ3·sqrt(depth/max_depth)."""
    h = node.step_entropy if (l2 and node.step_entropy is not None) else 0.0
    return l1 * math.tanh(node.parent.q()) + l2 * h + l3 * math.sqrt(node.depth / max_depth)


def global_select(root: Node, width: Callable[[Node], int], max_depth: int, l1: float, l2: float,
                  l3: float) -> Node | None:
    """The frontier node of highest :func:`frontier_score` (non-root, non-terminal, fewer than ``width(s)``
    children), the first maximum in depth-first pre-order; None when there is none."""
    best, best_score, stack = None, -math.inf, [root]
    while stack:
        node = stack.pop()
        if node.parent is not None and not node.terminal and len(node.children) < width(node):
            score = frontier_score(node, max_depth, l1, l2, l3)
            if score > best_score:
                best, best_score = node, score
        stack.extend(reversed(node.children))
    return best


def row_values(leaf: Node, temperature: float) -> list[float]:
    """Per response token of ``leaf``'s path: tanh(W/τ) of its step's node, the leaf's own W unclipped."""
    out = []
    for s in leaf.path_nodes():
        v = s.value if (s is leaf or temperature <= 0) else math.tanh(s.value / temperature)
        out += [v] * len(s.tokens)
    return out


class TreeSearch:
    """One prompt's search (the module's iteration), driven by :func:`run_searches`."""

    def __init__(self, n: int, width: int, max_depth: int, puct_c: float, gamma_min: float,
                 weights: tuple[float, float, float]):
        self.n, self.width, self.max_depth, self.puct_c, self.gamma_min = n, width, max_depth, puct_c, gamma_min
        self.weights = weights
        self.root = self.current = Node()
        self.root_width = width  # grows by one when no frontier node is left (see the module)
        self.kept: list[Node] = []
        self.candidates: list[Node] = []
        self.nodes = 1

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.n

    def width_of(self, node: Node) -> int:
        return self.root_width if node is self.root else self.width

    def asks(self) -> int:
        """Children to sample from the current node now; 0: it is full, its unkept children are re-offered."""
        k = self.width_of(self.current) - len(self.current.children)
        if k <= 0:
            self.candidates = [ch for ch in self.current.children if not ch.kept]
        return max(k, 0)

    def backup_and_select(self, pick: Callable[[list[Node]], Node]) -> None:
        """Step 3 and 4 of the module on this iteration's candidates (their terminals already judged)."""
        terms = [ch for ch in self.candidates if ch.terminal]
        for ch in self.candidates:
            if not ch.terminal:
                update(ch, 0.0, ch.depth, self.gamma_min)  # a visit, no value
        if terms:
            leaf = pick(terms)
            backup(leaf, leaf.outcome, self.gamma_min)
            leaf.kept = True
            self.kept.append(leaf)
        self.candidates = []
        if self.done:
            return
        nxt = None if terms else select_child(self.current, self.puct_c)
        if nxt is None:
            nxt = global_select(self.root, self.width_of, self.max_depth, *self.weights)
        if nxt is None:  # nothing left to expand: one more sample from the root
            nxt = self.root
            self.root_width = max(self.root_width, len(self.root.children) + 1)
        self.current = nxt


def run_searches(searches: list[TreeSearch], prompts: list[list[int]], continue_ids, eos: set, step_tokens: int,
                 judge: Callable[[list[int], list[list[int]]], list[float]],
                 entropies: Callable[[list[int], list[list[int]]], list[torch.Tensor]],
                 pick: Callable[[list[Node]], Node], max_iterations: int = 100000) -> int:
    """Grow every search until it kept its n leaves; returns the iterations run. ``continue_ids`` is the backend's;
    ``judge(groups, paths)`` the ±1 outcomes of terminal paths, ``entropies(groups, paths)`` their per-token
    entropies; ``pick`` the terminal to keep among an iteration's (the entropy-guided choice)."""
    it = 0
    while not all(s.done for s in searches):
        it += 1
        if it > max_iterations:
            raise RuntimeError(f"rollout.mcts: the search did not finish in {max_iterations} iterations")
        asks = [(g, s.current) for g, s in enumerate(searches) if not s.done for _ in range(s.asks())]
        if asks:
            outs = continue_ids([prompts[g] + node.path() for g, node in asks], [step_tokens] * len(asks))
            for (g, node), (cont, _) in zip(asks, outs):
                kept, ended = cut_at_eos(list(cont), eos)
                searches[g].candidates.append(node.add(kept, ended, searches[g].max_depth))
                searches[g].nodes += 1
        new = [(g, ch) for g, s in enumerate(searches) for ch in s.candidates if ch.outcome is None]
        if any(s.weights[1] for s in searches) and new:  # λ2: each new step's mean entropy
            ents = entropies([g for g, _ in new], [ch.path() for _, ch in new])
            for (_, ch), h in zip(new, ents):
                ch.step_entropy = float(h[-len(ch.tokens):].mean()) if ch.tokens else 0.0
        ends = [(g, ch) for g, ch in new if ch.terminal]
        if ends:
            groups, paths = [g for g, _ in ends], [ch.path() for _, ch in ends]
            for (_, ch), v, h in zip(ends, judge(groups, paths), entropies(groups, paths)):
                ch.outcome = 1.0 if v > 0 else -1.0
                ch.entropy = float(h.mean()) if h.numel() else 0.0
        for s in searches:
            if not s.done:
                s.backup_and_select(pick)
    return it


def as_rollout(prompt_tokens: list[list[int]], prompts: list[str],
               rows: list[list[tuple[list[int], bool, list[float]]]], tokenizer) -> Rollout:
    """Rows in the backends' layout (prompt g's rows adjacent), with ``mcts_values`` [B, R]: ``rows[g]`` holds
    prompt g's (response tokens, ended, per-token values)."""
    flat = [(g, r) for g, rs in enumerate(rows) for r in rs]
    return flat_rollout(prompt_tokens, prompts, [g for g, _ in flat], [r for _, r in flat], tokenizer)


def flat_rollout(prompt_tokens: list[list[int]], prompts: list[str], groups: list[int],
                 rows: list[tuple[list[int], bool, list[float]]], tokenizer) -> Rollout:
    """Row i answers prompt ``groups[i]`` with ``rows[i]`` = (response tokens, ended, per-token values; the values
    may be shorter than the response, the rest is 0)."""
    p_ids, p_mask = left_padded([prompt_tokens[g] for g in groups], pad_id(tokenizer, 0))
    out = leaves_rollout(tokenizer, p_ids, p_mask, torch.tensor(groups, dtype=torch.long), [r[0] for r in rows],
                         [r[1] for r in rows], prompts)
    out.mcts_values = right_padded_values([r[2] for r in rows], out.response_ids.shape[1])
    return out


def concat_values(rollouts: list[Rollout]) -> torch.Tensor | None:
    """The rounds' ``mcts_values`` re-right-padded (collect.concat_batches); None when no round has them. A mix
    is an error: rows without tree values would get no advantage."""
    values = field_of_all([r.mcts_values for r in rollouts],
                          "some rounds are DeepSearch trees (Rollout.mcts_values) and others not")
    if values is None:
        return None
    from anabranch.trainer.collect import pad_concat

    return pad_concat(values, left=False)


def mcts_round(c, prompts: list[str], cfg, idx: list[int]) -> Rollout:
    """The hook trainer/collect.generate_scored calls for a training round with ``rollout.mcts.enabled``."""
    return c.deepsearch.round(c, prompts, cfg, idx)


def check_config(cfg) -> None:
    """Key ranges and refused combinations of ``rollout.mcts`` (config_checks, when enabled); the restrictions it
    shares with the other round builders come from trainer/round_builders.py."""
    m, r = cfg.rollout.mcts, cfg.rollout
    if not m.enabled:
        return
    from anabranch.config import ConfigError
    from anabranch.range_checks import first_failed_key, is_count, is_number
    from anabranch.trainer.method_sets import refuse_row_generators
    from anabranch.trainer.round_builders import branching_rollout_refusals

    from anabranch.rewards.configured import has_correctness_reward

    if not has_correctness_reward(cfg.reward.functions):
        raise ConfigError("rollout.mcts.enabled judges each tree leaf right or wrong with the correctness reward, and "
                          "reward.functions has none: add a verifier (math_verify, code_tests, reasoning_gym, ...; "
                          "weight 0 keeps it out of the reward)")
    depth_ok = is_count(m.max_depth) and m.max_depth >= 1
    checks = [
        (depth_ok, "rollout.mcts.max_depth", "must be an integer >= 1 (steps per path)"),
        (not (depth_ok and is_count(r.max_new_tokens)) or r.max_new_tokens % m.max_depth == 0,
         "rollout.mcts.max_depth",
         f"must divide rollout.max_new_tokens={r.max_new_tokens} (a step is max_new_tokens/max_depth tokens)"),
        (is_count(m.width) and (m.width == 0 or m.width >= 2), "rollout.mcts.width",
         "must be 0 (rollout.n) or an integer >= 2 (children per expansion)"),
        (is_number(m.puct_c) and m.puct_c >= 0, "rollout.mcts.puct_c", "must be a finite number >= 0"),
        (is_number(m.gamma_min) and 0 < m.gamma_min <= 1, "rollout.mcts.gamma_min", "must be a number in (0, 1]"),
        (is_number(m.parent_q_weight), "rollout.mcts.parent_q_weight", "must be a finite number (λ1)"),
        (is_number(m.entropy_weight), "rollout.mcts.entropy_weight", "must be a finite number (λ2)"),
        (is_number(m.depth_weight), "rollout.mcts.depth_weight", "must be a finite number (λ3)"),
        (is_number(m.q_temperature) and m.q_temperature >= 0, "rollout.mcts.q_temperature",
         "must be a finite number >= 0 (0: no tanh clipping)"),
        (is_number(m.cache_max_accuracy) and 0 < m.cache_max_accuracy <= 1, "rollout.mcts.cache_max_accuracy",
         "must be a number in (0, 1]"),
        (is_count(r.n) and r.n >= 2, "rollout.n", "must be >= 2 with rollout.mcts.enabled (n kept leaves per tree)"),
        (cfg.algorithm.advantage == "deepsearch", "algorithm.advantage",
         "must be deepsearch with rollout.mcts.enabled: the tree's rows carry node values, not i.i.d. outcomes"),
        (cfg.algorithm.overlong_buffer == 0, "algorithm.overlong_buffer",
         "must be 0 with rollout.mcts.enabled: DeepSearch's advantages read the tree's ±1 values, not the reward "
         "total the overlong penalty is added to"),
    ]
    error = first_failed_key(checks, cfg) or branching_rollout_refusals(
        cfg, "rollout.mcts.enabled",
        "but a tree's leaves share prefixes chosen by the search, so they are not such draws",
        why={"backend": "the search samples each step with the hf backend's continue_ids and is tested with it only",
             "retry_turns": "a retry episode is not a single response to search",
             "temperature_schedule": "EAD's per-position temperatures on tree steps are not tested"})
    if error is not None:
        raise ConfigError(error)
    refuse_row_generators(cfg, "rollout.mcts.enabled", "the search tree", allow=("algorithm.agent_rlvr.enabled",))
