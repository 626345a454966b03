"""Recipes other than GRPO run on multi-turn rollouts (PPO's critic and GAE over the policy's tokens,
FlowRL's sequence sums, DAPO), and dynamic sampling's batches of several rounds keep the tool
outputs out of the loss."""

import json
import math
from pathlib import Path

import pytest
import torch

from anabranch import load_config, train

from anabranch.trainer.collect import ScoredBatch, concat_batches, select_groups

from test_dapo_batch import fake_rollout
from test_multi_turn import TOK, _memorized

CONFIGS = Path(__file__).parents[1] / "configs"


@pytest.fixture(scope="module")
def caller_dir(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("caller")
    model = _memorized(tiny_model_dir, "Q: 1+2?\n", "<calculator>1+2</calculator>")
    model.save_pretrained(str(folder))
    TOK.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("name", ["ppo", "flowrl", "dapo"])
def test_recipe_trains_on_rollouts_with_tool_outputs(name, caller_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                            for p, a in [("Q: 1+2?", "3"), ("Q: 1+2", "3"), ("Q: 2+1?", "3"), ("Q: 3?", "3")]))
    cfg = load_config(CONFIGS / f"{name}.yaml", [
        f"model.path={caller_dir}", "task.name=file", f"task.path={data}", "task.eval_size=0",
        "task.chat_template=false", "task.instruction=", "rollout.tools=[calculator]",
        "rollout.tool_instructions=false", "rollout.n=4", "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=48", "trainer.steps=2", "trainer.eval_before=false", "trainer.eval_after=false",
        "trainer.save_final=false", "trainer.tensorboard=false", f"trainer.output_dir={tmp_path}",
        "trainer.run_name=r", "trainer.progress=false", "reward.functions=[math_verify]", "trainer.device=cpu",
        "algorithm.max_sample_batches=2", f"algorithm.overlong_buffer={4 if name == 'dapo' else 0}"])
    history = train(cfg).history
    assert len(history) == 2
    for m in history:
        assert math.isfinite(m["loss"]) and m["skipped_updates"] == 0
        assert m["tools/calculator/calls"] > 0 and 0 < m["tools/output_token_frac"] < 1
    if name == "ppo":
        assert all(math.isfinite(m["critic/vf_loss"]) for m in history)


def test_rounds_joined_and_groups_selected_keep_the_loss_mask():
    with_tools = fake_rollout(2, 2, 3, 5)
    with_tools.loss_mask = torch.tensor([[1, 0, 0, 1, 1], [1, 1, 1, 1, 1], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    plain = fake_rollout(1, 2, 2, 3)  # a round where no response called a tool
    batches = [ScoredBatch(r, [{}] * len(r.completions), [0.0] * len(r.completions), {}) for r in (plain, with_tools)]
    joined = concat_batches(batches).rollout
    assert joined.loss_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]] + with_tools.loss_mask.tolist()
    assert joined.trained_mask.tolist()[2] == [1, 0, 0, 1, 1] and joined.trained_mask[:2].sum() == 6
    kept = select_groups(ScoredBatch(joined, [{}] * 6, [0.0] * 6, {}), [2]).rollout
    assert kept.loss_mask.tolist() == with_tools.loss_mask[2:].tolist()
