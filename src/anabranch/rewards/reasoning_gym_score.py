"""reasoning-gym's own scorer as a reward.

reasoning-gym tasks (``anabranch.data.tasks``) keep the generator's entry (``rg_entry``) and the
dataset object (``rg_dataset``) in every row; the reward is ``dataset.score_answer(answer, entry)``
in [0, 1], where ``answer`` is extracted from the completion by the shared
:func:`~anabranch.rewards.extract.extract_answer` (``<answer>`` tag, ``\\boxed{}``, "Answer:"
line, else the last number), the same order as every other reward and the eval. Tasks whose
answers are not numbers (countdown expressions, words) rely on the first three forms.
"""

from __future__ import annotations

from anabranch.rewards.extract import extract_answer
from anabranch.rewards.registry import REWARDS


@REWARDS.register("reasoning_gym", correctness=True, row_fields=("rg_entry", "rg_dataset"))
def reasoning_gym_reward(prompts, completions, rg_entry=None, rg_dataset=None, **_):
    if rg_entry is None or rg_dataset is None:
        raise ValueError("the reasoning_gym reward needs a reasoning-gym task (rows with rg_entry/rg_dataset); "
                         "use task.name=<a reasoning-gym dataset> or another reward")
    out = []
    for completion, entry, dataset in zip(completions, rg_entry, rg_dataset):
        answer = extract_answer(completion)
        out.append(0.0 if answer is None else float(dataset.score_answer(answer, entry)))
    return out
