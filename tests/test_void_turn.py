"""SimpleTIR's void-turn filter (rollout/void_turns.py, rollout.void_turn_filter): which turns are void,
that the filtered trajectories leave the loss and its normalizers, config refusal, a short training run."""

import json

import pytest
import torch

from anabranch.algorithms.aggregation import batch_scale
from anabranch.algorithms.resolve import resolve_algorithm
from anabranch.config import AlgorithmConfig, ConfigError, ModelConfig, RolloutConfig
from anabranch.config_loading import load_config
from anabranch.models.loading import load_model
from anabranch.models.tiny import char_tokenizer
from anabranch.rollout.multi_turn import result_text, with_tools
from anabranch.rollout.tools import build_tools
from anabranch.rollout.void_turns import has_final_answer, is_void_turn, turns, void_rows
from anabranch.trainer.step import policy_update
from scripted_backend import TOOL_RESULT, Scripted

TOK = char_tokenizer()
EOS = TOK.eos_token_id
CALC = build_tools(["calculator"])


# ------------------------------------------------------------------------------------------- one turn
@pytest.mark.parametrize("text,void", [
    ("Let me compute <calculator>2+3</calculator>", False),   # ends in a complete call
    ("So the answer is 5.", False),                            # an "answer is" line
    ("Thus \\boxed{5}", False),                                # boxed
    ("<answer>5</answer>", False),                             # the answer tag
    ("Hmm, 2 plus 3 gives 5 I think", True),                   # a number is not a final answer
    ("", True),                                                # an EOS right after a tool result
    ("just 2+3</calculator>", True),                           # a closing tag alone: no call was made
    ("<python>print(1)</python>", True),                       # not one of this run's tools
])
def test_a_turn_is_void_without_a_complete_call_or_a_final_answer(text, void):
    assert is_void_turn(text, CALC) is void


def test_final_answer_ignores_the_last_number_fallback():
    assert not has_final_answer("I got 14 and 15")
    assert has_final_answer("Answer: 14")


def test_turns_are_the_runs_of_policy_tokens():
    assert turns([1, 2, 3, 4, 5, 6, 7], [1, 1, 0, 0, 1, 0, 1]) == [[1, 2], [5], [7]]
    assert turns([9, 9], [0, 0]) == []


# ------------------------------------------------------------------------------------------- whole rollouts
SCRIPTS = [
    ["I compute <calculator>2+3</calculator>", "So the answer is 5.<|im_end|>"],  # call, then answer: kept
    ["I compute <calculator>2+3</calculator>", "ok<|im_end|>"],                  # call, then a void turn
    ["The answer is 5.<|im_end|>"],                                               # one answering turn: kept
    ["hmm 5<|im_end|>"],                                                          # one void turn
]


def _rollout(max_new_tokens=120):
    cfg = RolloutConfig(tools=["calculator"], max_new_tokens=max_new_tokens, void_turn_filter=True)
    prompts = [f"Q{i}\n" for i in range(4)]  # row i plays SCRIPTS[i]
    mt = with_tools(Scripted(dict(zip(prompts, SCRIPTS)), TOOL_RESULT), TOK, cfg)
    return mt, mt.generate(prompts, 1)


def test_void_rows_and_the_filtered_loss_mask():
    mt, ro = _rollout()
    assert ro.completions[0] == "I compute <calculator>2+3</calculator>" + result_text("5") + "So the answer is 5."
    assert void_rows(ro, TOK, mt.tools).tolist() == [False, True, False, True]
    out, metrics = mt.filter_void_turns(ro)
    assert metrics == {"tools/void_turn_frac": 0.5}
    # the void rows have no trained token left; the others keep exactly their mask (tool outputs still 0)
    assert out.trained_mask[[1, 3]].sum() == 0
    assert torch.equal(out.loss_mask[[0, 2]], ro.loss_mask[[0, 2]])
    assert torch.equal(out.response_mask, ro.response_mask)  # the model still reads them (context)
    # the normalizers, by hand: tokens of rows 0 and 2 only, 2 sequences
    n0 = len("I compute <calculator>2+3</calculator>") + len("So the answer is 5.") + 1  # + EOS
    n2 = len("The answer is 5.") + 1
    scale = batch_scale(out.trained_mask, 120)
    assert scale.total_tokens == n0 + n2 and scale.total_seqs == 2.0


def test_a_turn_cut_by_the_budget_is_void():
    mt, ro = _rollout(max_new_tokens=10)  # row 2's "The answer is 5." is cut to "The answer"
    assert ro.truncated[2] and void_rows(ro, TOK, mt.tools)[2]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu"), trainable=True)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_filtered_rows_add_nothing_and_the_rest_train_as_a_batch_without_them(tiny, agg):
    """The update on the filtered batch has exactly the gradient of the batch holding only the kept
    rows: void rows add nothing and are not counted in the token / sequence normalizers."""
    mt, ro = _rollout()
    out, _ = mt.filter_void_turns(ro)
    algo = resolve_algorithm(AlgorithmConfig(name="grpo", loss_agg_mode=agg))
    adv = torch.tensor([1.0, -2.0, -0.5, 3.0])[:, None] * ro.response_mask  # void rows: large |Â|
    opt = torch.optim.SGD(tiny.parameters(), lr=0.0)

    def grads(r, a):
        tiny.zero_grad()
        policy_update(tiny, opt, r, a, torch.zeros(len(a)), algo, micro_batch_size=4, grad_clip=0.0,
                      temperature=1.0, max_response_len=120, zero_advantage_rows="train")
        return [p.grad.clone() for p in tiny.parameters()]

    keep = torch.tensor([0, 2])
    kept = type(ro)(prompt_ids=ro.prompt_ids[keep], prompt_mask=ro.prompt_mask[keep],
                    response_ids=ro.response_ids[keep], response_mask=ro.response_mask[keep],
                    group_index=torch.arange(2), prompts=[ro.prompts[0], ro.prompts[2]],
                    completions=[ro.completions[0], ro.completions[2]], truncated=ro.truncated[keep],
                    sample_log_probs=ro.sample_log_probs[keep], loss_mask=ro.loss_mask[keep])
    got, want, unfiltered = grads(out, adv), grads(kept, adv[keep]), grads(ro, adv)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    assert any(not torch.allclose(g, u, rtol=1e-3, atol=1e-6) for g, u in zip(got, unfiltered))
    tiny.zero_grad()


# ------------------------------------------------------------------------------------------- config and training
def test_the_filter_needs_tools():
    with pytest.raises(ConfigError, match=r"rollout.void_turn_filter.*needs rollout.tools"):
        load_config(None, ["rollout.void_turn_filter=true"])
    assert load_config(None, ["rollout.tools=[calculator]", "rollout.void_turn_filter=true"]).rollout.void_turn_filter
    assert load_config(None, []).rollout.void_turn_filter is False


def test_training_with_the_filter_logs_it_and_a_fully_void_batch_leaves_the_weights(tiny_model_dir, tmp_path,
                                                                                        write_jsonl):
    """The random tiny model never writes a call nor an answer marker: every trajectory is void, so every
    loss mask is emptied and the two updates leave the policy exactly as it was (without the filter it
    moves), with finite losses and tools/void_turn_frac = 1 logged each step."""
    from anabranch import train

    data = write_jsonl([{"prompt": "Q: 1+2?", "answer": "3"}] * 4)

    def run(name, filt):
        cfg = load_config(None, [
            f"model.path={tiny_model_dir}", "task.name=file", f"task.path={data}", "task.eval_size=0",
            "task.chat_template=false", "task.instruction=", "rollout.tools=[calculator]",
            f"rollout.void_turn_filter={filt}", "rollout.tool_instructions=false", "rollout.n=4",
            "rollout.prompts_per_step=2", "rollout.max_new_tokens=16", "trainer.steps=2", "trainer.lr=1e-2",
            f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.progress=false",
            "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_final=true",
            "reward.functions=[random]", "trainer.device=cpu"])
        res = train(cfg)
        state = load_model(ModelConfig(path=str(tmp_path / name / "final")), torch.device("cpu")).state_dict()
        return res.history, state

    base = load_model(ModelConfig(path=tiny_model_dir), torch.device("cpu")).state_dict()
    history, after = run("void", "true")
    assert [m["tools/void_turn_frac"] for m in history] == [1.0, 1.0]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in history)
    assert all(torch.equal(base[k], after[k]) for k in base)
    lines = [json.loads(x) for x in (tmp_path / "void" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert sum("tools/void_turn_frac" in x for x in lines) == 2
    history, moved = run("plain", "false")
    assert "tools/void_turn_frac" not in history[0]
    assert any(not torch.equal(base[k], moved[k]) for k in base)
