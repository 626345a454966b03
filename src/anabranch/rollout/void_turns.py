"""SimpleTIR's void-turn filter (``rollout.void_turn_filter``): multi-turn trajectories with a turn
that yields neither a tool call nor a final answer leave the policy loss.

Xue, Zheng, Liu, Li, Zheng, Ma, An 2025, "SimpleTIR: End-to-End Reinforcement Learning for Multi-Turn
Tool-Integrated Reasoning" (arXiv 2509.02479). Their diagnosis: a tool's output is out of the model's
distribution, so the tokens sampled after it are more often low-probability ones; the gradient of a
token's loss with respect to its logits grows as its probability shrinks, and these tokens compound
over turns into gradient-norm explosions. The turns where this shows are "void turns": a turn
"that yields neither a code block nor a final answer" (typically an end-of-sequence written early).
Their fix is to drop every trajectory that contains one from the policy update.

Mapping onto anabranch's turns (:mod:`anabranch.rollout.multi_turn`): a turn is a maximal run of
the policy's own tokens in a response (``Rollout.trained_mask`` = 1), between tool results. Turn k
of trajectory i is void when

    void(k) = not complete_call(k) and not final_answer(k)

* ``complete_call``: the turn's text holds ``<name>...</name>`` for one of ``rollout.tools`` (an
  opening tag before the closing one: a closing tag alone is answered with an error, no call). A
  turn that ends in a call always ends at its closing tag; a last turn past ``rollout.max_tool_calls``
  (tools off) that still writes a whole call also counts, since it yields a code block.
* ``final_answer``: :func:`anabranch.rewards.extract.extract_answer`'s explicit markers in the
  turn's own text: an ``<answer>...</answer>`` block, a ``\\boxed{...}``, or an "Answer: ..." /
  "answer is ..." line. Its last fallback, the last number in the text, is *not* counted: any turn
  that mentions a number would then be an answer, and a turn cut off mid-reasoning would never be void.
* A turn cut by ``rollout.max_new_tokens`` with neither is void too (the paper's definition does
  not depend on how the turn ended; our assumption, since the paper describes the premature EOS).

Trajectory i is filtered when any of its turns is void. Its loss mask is emptied after the
advantages are computed, as DAPO's overlong filter and HPT's switched groups are
(``trainer/hpt_step.py``): the row leaves every term of the update (policy gradient, KL, entropy,
auxiliary losses) and the loss normalizers (an empty row is not a token nor a sequence of the loss,
``algorithms/aggregation.batch_scale``), while its reward still counts in its group's mean and std.
The paper says the trajectories are removed "from the policy update", not from the reward
statistics; we read that as a loss mask (our assumption: the text we could read does not say
whether the group advantage is computed before or after the filter).

Metric: ``tools/void_turn_frac``, the fraction of the step's trajectories filtered.
"""

from __future__ import annotations

import dataclasses

import torch

from anabranch.rewards.extract import extract_answer_line, extract_answer_tag, extract_boxed
from anabranch.rollout.base import Rollout


def has_final_answer(text: str) -> bool:
    """Whether ``text`` states a final answer by an explicit marker (tag, boxed, answer line)."""
    return any(fn(text) for fn in (extract_answer_tag, extract_boxed, extract_answer_line))


def has_complete_call(text: str, tools) -> bool:
    """Whether ``text`` holds ``<name>...</name>`` for one of ``tools`` (opening tag first)."""
    for tool in tools:
        end = text.find(tool.close_tag)
        if end >= 0 and text.rfind(tool.open_tag, 0, end) >= 0:
            return True
    return False


def is_void_turn(text: str, tools) -> bool:
    """A turn that yields neither a complete tool call nor a final answer."""
    return not has_complete_call(text, tools) and not has_final_answer(text)


def turns(ids: list[int], trained: list[int]) -> list[list[int]]:
    """The maximal runs of ``ids`` where ``trained`` is 1: the policy's turns, split by tool results."""
    out: list[list[int]] = []
    inside = False
    for t, m in zip(ids, trained):
        if m:
            if not inside:
                out.append([])
            out[-1].append(t)
        inside = bool(m)
    return out


def void_rows(rollout: Rollout, tokenizer, tools) -> torch.Tensor:
    """[B] bool: the trajectories with at least one void turn."""
    mask = rollout.trained_mask
    flags = []
    for ids, m in zip(rollout.response_ids.tolist(), mask.tolist()):
        texts = [tokenizer.decode(t, skip_special_tokens=True) for t in turns(ids, m)]
        flags.append(any(is_void_turn(x, tools) for x in texts))
    return torch.tensor(flags, dtype=torch.bool)


def filter_void_turns(rollout: Rollout, tokenizer, tools) -> tuple[Rollout, dict]:
    """(``rollout`` with the void trajectories' loss masks emptied, ``{"tools/void_turn_frac": ...}``)."""
    void = void_rows(rollout, tokenizer, tools)
    metrics = {"tools/void_turn_frac": float(void.float().mean()) if len(void) else 0.0}
    if not bool(void.any()):
        return rollout, metrics
    keep = (~void).to(rollout.response_mask.dtype)[:, None]
    base = rollout.loss_mask if rollout.loss_mask is not None else torch.ones_like(rollout.response_mask)
    return dataclasses.replace(rollout, loss_mask=base.to(rollout.response_mask.dtype) * keep), metrics
