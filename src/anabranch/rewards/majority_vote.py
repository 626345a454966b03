"""TTRL majority-vote reward (label-free).

Zuo et al. 2025, "TTRL: Test-Time Reinforcement Learning". For the n completions y_1..y_n of one
prompt, with extracted answers a_i (``rewards/extract.py``; completions without one do not vote):
the answers are grouped into classes of mathematical equivalence (``math-verify``), the largest
class (first seen on ties) gives the pseudo-label â, and

  r_i = 1  if a_i ≡ â,  else 0.

Metrics (when the rows carry true answers, which the reward itself never uses):
``label_accuracy`` — fraction of prompts whose pseudo-label is right; ``reward_accuracy`` —
fraction of completions whose pseudo-reward equals their true correctness; ``true_accuracy`` —
mean true correctness, the number whose rise-then-fall label-free training is known for;
``majority_ratio`` — mean share of the vote held by the pseudo-label.
"""

from __future__ import annotations

from collections import defaultdict

from anabranch.rewards.extract import extract_answer
from anabranch.rewards.guard import RewardOutput
from anabranch.rewards.math_answer import answers_equivalent, is_equivalent
from anabranch.rewards.registry import REWARDS


def vote(answers: list[str | None]) -> tuple[str | None, list[bool]]:
    """(pseudo-label, whether each answer agrees with it) by equivalence classes."""
    reps: list[str] = []
    members: list[list[int]] = []
    for i, a in enumerate(answers):
        if a is None:
            continue
        for k, rep in enumerate(reps):
            if answers_equivalent(rep, a):
                members[k].append(i)
                break
        else:
            reps.append(a)
            members.append([i])
    if not reps:
        return None, [False] * len(answers)
    best = max(range(len(reps)), key=lambda k: (len(members[k]), -k))
    chosen = set(members[best])
    return reps[best], [i in chosen for i in range(len(answers))]


@REWARDS.register("majority_vote", needs_fields=("group_index",))
def majority_vote_reward(prompts, completions, group_index=None, answer=None, **_):
    if group_index is None:
        raise ValueError("majority_vote needs group_index (the trainer passes it)")
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_index):
        groups[g].append(i)
    rewards = [0.0] * len(completions)
    extracted = [extract_answer(c) for c in completions]
    label_right, reward_right, truth, ratio = [], [], [], []
    for idx in groups.values():
        label, agree = vote([extracted[i] for i in idx])
        voters = sum(extracted[i] is not None for i in idx)
        ratio.append(sum(agree) / voters if voters else 0.0)
        for i, ok in zip(idx, agree):
            rewards[i] = float(ok)
        if answer is not None and answer[idx[0]] is not None:
            gold = str(answer[idx[0]])
            label_right.append(label is not None and answers_equivalent(label, gold))
            for i in idx:
                correct = is_equivalent(completions[i], gold)
                truth.append(correct)
                reward_right.append(correct == (rewards[i] == 1.0))
    metrics = {"majority_ratio": sum(ratio) / max(len(ratio), 1)}
    if label_right:
        metrics.update(label_accuracy=sum(label_right) / len(label_right),
                       reward_accuracy=sum(reward_right) / len(reward_right),
                       true_accuracy=sum(truth) / len(truth))
    return RewardOutput(rewards, metrics)
